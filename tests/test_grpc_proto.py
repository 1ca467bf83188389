"""The gRPC wire format: official messages unchanged, additions on new numbers, stubs up to date."""

from __future__ import annotations

from pathlib import Path

import pytest

from cosyvoice.server.proto import cosyvoice_pb2 as pb
from cosyvoice.server.proto.generate import GENERATED, PROTO, generate

# runtime/python/grpc/cosyvoice.proto of the official repository: message -> {field: (number, type)}
_B, _S, _M = "bytes", "string", "message"
OFFICIAL = {
    "Request": {"sft_request": (1, _M), "zero_shot_request": (2, _M), "cross_lingual_request": (3, _M),
                "instruct_request": (4, _M)},
    "sftRequest": {"spk_id": (1, _S), "tts_text": (2, _S)},
    "zeroshotRequest": {"tts_text": (1, _S), "prompt_text": (2, _S), "prompt_audio": (3, _B)},
    "crosslingualRequest": {"tts_text": (1, _S), "prompt_audio": (2, _B)},
    "instructRequest": {"tts_text": (1, _S), "spk_id": (2, _S), "instruct_text": (3, _S)},
    "Response": {"tts_audio": (1, _B)},
}
_TYPES = {9: _S, 12: _B, 11: _M}  # FieldDescriptor.TYPE_STRING / TYPE_BYTES / TYPE_MESSAGE


def test_official_wire_format_is_kept() -> None:
    assert pb.DESCRIPTOR.package == "cosyvoice"
    service = pb.DESCRIPTOR.services_by_name["CosyVoice"]
    method = service.methods_by_name["Inference"]
    assert method.full_name == "cosyvoice.CosyVoice.Inference"
    assert method.input_type.name == "Request" and method.output_type.name == "Response"
    assert method.server_streaming and not method.client_streaming
    for message, fields in OFFICIAL.items():
        desc = pb.DESCRIPTOR.message_types_by_name[message]
        for name, (number, kind) in fields.items():
            field = desc.fields_by_name[name]
            assert (field.number, _TYPES.get(field.type)) == (number, kind), f"{message}.{name}"
    oneof = pb.Request.DESCRIPTOR.oneofs_by_name["RequestPayload"]
    assert [f.name for f in oneof.fields] == list(OFFICIAL["Request"])


def test_official_bytes_decode_with_extensions_unset() -> None:
    """A message serialised by an official stub is the same bytes; our extra fields read as unset."""
    request = pb.Request(zero_shot_request=pb.zeroshotRequest(tts_text="hi", prompt_text="p", prompt_audio=b"\1\0"))
    # hand-encoded official wire bytes: field 2 (message) { 1: "hi", 2: "p", 3: b"\1\0" }
    wire = b"\x12\x0b" + b"\x0a\x02hi" + b"\x12\x01p" + b"\x1a\x02\x01\x00"
    assert request.SerializeToString() == wire
    parsed = pb.Request.FromString(wire)
    assert parsed.WhichOneof("RequestPayload") == "zero_shot_request"
    assert not parsed.HasField("seed") and not parsed.HasField("speed") and not parsed.HasField("stream")
    assert parsed.zero_shot_request.voice_id == ""


def test_stubs_are_generated_from_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    fresh = generate(tmp_path)
    for path in fresh:
        committed = PROTO.with_name(path.name)
        assert path.name in GENERATED
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed} is stale: run python -m cosyvoice.server.proto.generate and commit the result")
