"""A reference to another owner's object is the same "not found" as a direct read, on every route that takes one
(issue 31): key B naming key A's unsaved upload (its id) gets the 404 an id never made gets, from the voices API,
the OpenAI and official endpoints and long-form, the WebSocket's error naming ``voice``, and gRPC's NOT_FOUND
naming the proto field; key A uses it everywhere. A real REST server and a real gRPC server on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import numpy as np
import pytest
from test_rest import Server, _ws_url

from cosyvoice.owners import Owners, key_owner
from cosyvoice.server.grpc import GrpcServer
from cosyvoice.server.proto import cosyvoice_pb2 as pb
from cosyvoice.server.proto import cosyvoice_pb2_grpc as pb_grpc
from cosyvoice.server.rest import create_app
from cosyvoice.service import TTSService
from cosyvoice.settings import ServerSettings
from cosyvoice.voices import VoiceLibrary

KEY_A, KEY_B = "references-key-a", "references-key-b"


@pytest.fixture(scope="module")
def service(tts, tmp_path_factory: pytest.TempPathFactory) -> TTSService:
    root = tmp_path_factory.mktemp("references")
    return TTSService(tts.model, VoiceLibrary(root / "voices", tts.frontend, model_dir=tts.model_dir))


@pytest.fixture(scope="module")
def upload(service: TTSService) -> str:
    """Key A's unsaved upload (a recording it sent once, as every cloning request does): its id."""
    t = np.arange(int(1.5 * 16000)) / 16000
    vowel = sum(np.sin(2 * np.pi * k * 180 * t) / k for k in range(1, 6)) * (1 - np.cos(2 * np.pi * 2 * t))
    voice_id, _ = service.voices.get_or_create(((0.1 * vowel).astype(np.float32), 16000), "Hello there.",
                                               owner=key_owner(KEY_A))
    return voice_id


@pytest.fixture(scope="module")
def url(service: TTSService) -> Iterator[str]:
    server = Server(create_app(ServerSettings(voice_dir=str(service.voices.dir), api_keys=(KEY_A, KEY_B)), service))
    yield server.url
    server.stop()


def _client(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def _routes(upload: str) -> list[tuple[str, str, dict]]:
    """(method, path, httpx keywords) of every HTTP route that names a voice."""
    return [("GET", f"/v1/voices/{upload}", {}),
            ("POST", "/v1/audio/speech", {"json": {"input": "Hi there.", "voice": upload}}),
            ("POST", "/inference_sft", {"data": {"tts_text": "Hi there.", "spk_id": upload}}),
            ("POST", "/inference_instruct", {"data": {"tts_text": "Hi there.", "spk_id": upload,
                                                      "instruct_text": "Speak slowly."}}),
            ("POST", "/v1/longform/projects", {"json": {"text": "Hi there.", "voice": upload}}),
            ("DELETE", f"/v1/voices/{upload}", {})]


def test_another_owners_upload_is_not_found_on_every_http_route(url: str, upload: str) -> None:
    """B's answer naming A's upload is, word for word, its answer naming an id that was never made."""
    never = "0" * len(upload)
    with _client(url, KEY_B) as b:
        for (method, path, keywords), (_, other, absent) in zip(_routes(upload), _routes(never), strict=True):
            refused, missing = b.request(method, path, **keywords), b.request(method, other, **absent)
            assert refused.status_code == missing.status_code == 404, (path, refused.status_code, refused.text)
            error = refused.json()["error"]
            assert upload in error["message"], (path, error)
            assert {**error, "message": error["message"].replace(upload, never)} == missing.json()["error"], path
    with _client(url, KEY_A) as a:  # its owner uses it on each (and deletes it last)
        for method, path, keywords in _routes(upload):
            used = a.request(method, path, **keywords)
            assert used.status_code in (200, 201), (method, path, used.status_code, used.text[:300])
    with _client(url, KEY_A) as a:
        assert a.get(f"/v1/voices/{upload}").status_code == 404  # deleted by its owner, not by B


def test_another_owners_upload_is_an_error_naming_voice_on_the_websocket(url: str, service: TTSService) -> None:
    from websockets.sync.client import connect

    t = np.arange(int(1.5 * 16000)) / 16000
    theirs, _ = service.voices.get_or_create(((0.1 * np.sin(2 * np.pi * 150 * t)).astype(np.float32), 16000),
                                             "Hello there.", owner=key_owner(KEY_A))
    answers = {}
    for key in (KEY_B, KEY_A):
        with connect(f"{_ws_url(url)}?api_key={key}") as ws:
            ws.send(json.dumps({"type": "start", "voice": theirs}))
            answers[key] = json.loads(ws.recv(timeout=60))
    assert answers[KEY_B]["type"] == "error" and answers[KEY_B]["error"]["field"] == "voice", answers[KEY_B]
    assert f"unknown voice '{theirs}'" in answers[KEY_B]["error"]["message"]
    assert answers[KEY_A]["type"] == "started" and answers[KEY_A]["voice"] == theirs, answers[KEY_A]


def test_another_owners_upload_is_not_found_over_grpc(service: TTSService) -> None:
    t = np.arange(int(1.5 * 16000)) / 16000
    theirs, _ = service.voices.get_or_create(((0.1 * np.sin(2 * np.pi * 130 * t)).astype(np.float32), 16000),
                                             "Hello there.", owner=key_owner(KEY_A))
    server = GrpcServer("127.0.0.1", 0, max_streams=2, owners=Owners((KEY_A, KEY_B)))
    server.serve(service)
    requests = {"sft_request.spk_id": pb.Request(sft_request=pb.sftRequest(spk_id=theirs, tts_text="Hi."), seed=1),
                "zero_shot_request.voice_id": pb.Request(zero_shot_request=pb.zeroshotRequest(
                    voice_id=theirs, tts_text="Hi."), seed=1),
                "cross_lingual_request.voice_id": pb.Request(cross_lingual_request=pb.crosslingualRequest(
                    voice_id=theirs, tts_text="Hi."), seed=1)}
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.CosyVoiceStub(channel)
            for field, request in requests.items():
                with pytest.raises(grpc.RpcError) as refused:
                    list(stub.Inference(request, metadata=(("authorization", f"Bearer {KEY_B}"),), timeout=60))
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND, (field, refused.value)
                assert refused.value.details().startswith(f"{field}: unknown voice '{theirs}'"), field
                never = pb.Request.FromString(request.SerializeToString().replace(theirs.encode(), b"0" * 32))
                with pytest.raises(grpc.RpcError) as missing:
                    list(stub.Inference(never, metadata=(("authorization", f"Bearer {KEY_B}"),), timeout=60))
                assert refused.value.details().replace(theirs, "0" * 32) == missing.value.details()
                made = list(stub.Inference(request, metadata=(("authorization", f"Bearer {KEY_A}"),), timeout=120))
                assert sum(len(m.tts_audio) for m in made) > 0, field
    finally:
        server.stop(0)
