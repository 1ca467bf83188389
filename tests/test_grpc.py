"""The gRPC server on loopback with a real grpc client: every request type, errors, saved voices, cancel."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import soundfile as sf
import torch
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from waiting import free_port, until

from cosyvoice.encoding import to_pcm16
from cosyvoice.owners import Owners
from cosyvoice.server.grpc import MAX_AUDIO_MESSAGE_BYTES, SERVICE_NAME, GrpcServer, audio_messages, synthesis_request
from cosyvoice.server.proto import cosyvoice_pb2 as pb
from cosyvoice.server.proto import cosyvoice_pb2_grpc as pb_grpc
from cosyvoice.server.rest import create_app
from cosyvoice.service import Outcome, TTSService
from cosyvoice.settings import Limits, ServerSettings
from cosyvoice.voices import VoiceLibrary
from tests.test_rest import Server

TEXT = "Hi there."
LONG_TEXT = "Hello there, my friend, how are you today? I hope all is well."
TRANSCRIPT = "Hello, this is a short prompt for testing."


@pytest.fixture(scope="module")
def service(tts, tmp_path_factory: pytest.TempPathFactory) -> TTSService:
    library = VoiceLibrary(tmp_path_factory.mktemp("voices"), tts.frontend, model_dir=tts.model_dir)
    return TTSService(tts.model, library, Limits(max_sessions=4, max_queued_requests=4, queue_timeout_seconds=30))


@pytest.fixture(scope="module")
def server(service: TTSService) -> Iterator[GrpcServer]:
    srv = GrpcServer("127.0.0.1", 0, max_streams=8)
    srv.serve(service)
    yield srv
    srv.stop(0)


@pytest.fixture(scope="module")
def channel(server: GrpcServer) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.CosyVoiceStub:
    return pb_grpc.CosyVoiceStub(channel)


@pytest.fixture(scope="module")
def prompt_pcm16(short_prompt_wav: Path) -> bytes:
    """The prompt as the official client sends it: 16 kHz mono, ``(x * 2**15).astype(int16)`` bytes."""
    wav, sr = sf.read(short_prompt_wav, dtype="float32")
    assert sr == 16000
    return (wav * 2**15).astype(np.int16).tobytes()


@pytest.fixture(scope="module")
def saved_voice(service: TTSService, short_prompt_wav: Path):
    """A voice saved through the shared library (as REST ``POST /v1/voices`` and the web UI do)."""
    return service.create_voice("Grpc Tester", short_prompt_wav.read_bytes(), TRANSCRIPT)


def _pcm(responses) -> bytes:
    return b"".join(r.tts_audio for r in responses)


def _wait_idle(service: TTSService, seconds: float = 10.0) -> None:
    until(lambda: service.status().active_sessions == 0 and service.model.engine.active_sessions == 0, seconds,
          "no session left in the service and the engine")


def _requests(prompt_pcm16: bytes, voice) -> dict[str, pb.Request]:
    """Every request type: the official client's four shapes (fields and values as it sets them, plus a
    seed), and the proto's additions."""
    return {
        "sft": pb.Request(sft_request=pb.sftRequest(spk_id=voice.name, tts_text=TEXT), seed=3),
        "zero_shot": pb.Request(zero_shot_request=pb.zeroshotRequest(
            tts_text=TEXT, prompt_text=TRANSCRIPT, prompt_audio=prompt_pcm16), seed=3),
        "cross_lingual": pb.Request(cross_lingual_request=pb.crosslingualRequest(
            tts_text=TEXT, prompt_audio=prompt_pcm16), seed=3),
        "instruct": pb.Request(instruct_request=pb.instructRequest(
            tts_text=TEXT, spk_id=voice.name, instruct_text="Speak slowly."), seed=3),
        "instruct2_prompt_audio": pb.Request(instruct_request=pb.instructRequest(
            tts_text=TEXT, instruct_text="Speak slowly.", prompt_audio=prompt_pcm16), seed=3),
        "zero_shot_voice_id": pb.Request(zero_shot_request=pb.zeroshotRequest(tts_text=TEXT, voice_id=voice.id),
                                         seed=3, stream=False),
        "cross_lingual_voice_name": pb.Request(cross_lingual_request=pb.crosslingualRequest(
            tts_text=TEXT, voice_id=voice.name), seed=3, speed=1.5),
        "sft_chunk_schedule": pb.Request(sft_request=pb.sftRequest(spk_id=voice.name, tts_text=TEXT), seed=3,
                                         final="chunked", first_hop=8),
    }


@pytest.mark.parametrize("kind", ["sft", "zero_shot", "cross_lingual", "instruct", "instruct2_prompt_audio",
                                  "zero_shot_voice_id", "cross_lingual_voice_name", "sft_chunk_schedule"])
def test_every_request_type_streams_the_service_audio(stub, service: TTSService, prompt_pcm16: bytes, saved_voice,
                                                      kind: str) -> None:
    request = _requests(prompt_pcm16, saved_voice)[kind]
    if kind == "sft_chunk_schedule":
        assert (synthesis_request(request).final, synthesis_request(request).first_hop) == ("chunked", 8)
    responses = list(stub.Inference(request, timeout=120))
    audio = _pcm(responses)
    # the same request through the service directly: the wire carries exactly the engine's samples
    with service.synthesize(synthesis_request(request)) as session:
        chunks = [c.pcm for c in session]
    expected = to_pcm16(torch.cat(chunks)).tobytes()
    assert len(audio) == len(expected) > 0 and audio == expected
    streaming = not (request.HasField("stream") and not request.stream) and not request.HasField("speed")
    assert len(responses) == sum(c.numel() > 0 for c in chunks)
    if streaming:
        assert len(responses) >= 2, "a streamed request answers chunk by chunk"
    _wait_idle(service)


def test_health_serving_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE_NAME):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # what grpcurl does without a .proto file: list the services, then fetch the request type by reflection
    reflected = ProtoReflectionDescriptorDatabase(channel)
    assert SERVICE_NAME in reflected.get_services()
    request = DescriptorPool(reflected).FindMessageTypeByName("cosyvoice.Request")
    assert request.fields_by_name["zero_shot_request"].number == 2 and request.fields_by_name["seed"].number == 5


def test_not_serving_until_the_model_is_loaded() -> None:
    srv = GrpcServer("127.0.0.1", 0)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.CosyVoiceStub(ch).Inference(pb.Request(sft_request=pb.sftRequest(tts_text=TEXT))))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop(0)


def _error(stub, request: pb.Request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Inference(request, timeout=60))
    return err.value


def test_bad_requests_get_status_codes_naming_the_field(stub, service: TTSService, prompt_pcm16: bytes,
                                                        saved_voice) -> None:
    cases = [
        (pb.Request(zero_shot_request=pb.zeroshotRequest(tts_text="", prompt_text=TRANSCRIPT,
                                                         prompt_audio=prompt_pcm16)),
         grpc.StatusCode.INVALID_ARGUMENT, "zero_shot_request.tts_text"),
        (pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.name, tts_text="   ")),
         grpc.StatusCode.INVALID_ARGUMENT, "sft_request.tts_text"),
        (pb.Request(cross_lingual_request=pb.crosslingualRequest(tts_text=TEXT, prompt_audio=prompt_pcm16[:-1])),
         grpc.StatusCode.INVALID_ARGUMENT, "cross_lingual_request.prompt_audio"),
        (pb.Request(cross_lingual_request=pb.crosslingualRequest(tts_text=TEXT, prompt_audio=b"\x00\x01" * 100)),
         grpc.StatusCode.INVALID_ARGUMENT, "cross_lingual_request.prompt_audio"),  # 6 ms: too short a prompt
        (pb.Request(zero_shot_request=pb.zeroshotRequest(tts_text=TEXT, prompt_audio=prompt_pcm16)),
         grpc.StatusCode.INVALID_ARGUMENT, "zero_shot_request.prompt_text"),
        (pb.Request(instruct_request=pb.instructRequest(tts_text=TEXT, spk_id=saved_voice.id)),
         grpc.StatusCode.INVALID_ARGUMENT, "instruct_request.instruct_text"),
        (pb.Request(sft_request=pb.sftRequest(spk_id="nobody", tts_text=TEXT)),
         grpc.StatusCode.NOT_FOUND, "sft_request.spk_id"),
        (pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text=TEXT), speed=9.0),
         grpc.StatusCode.INVALID_ARGUMENT, "speed"),
        (pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text=TEXT), final="half"),
         grpc.StatusCode.INVALID_ARGUMENT, "final"),
        (pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text=TEXT), first_hop=26),
         grpc.StatusCode.INVALID_ARGUMENT, "first_hop"),
        (pb.Request(), grpc.StatusCode.INVALID_ARGUMENT, "sft_request"),
    ]
    for request, code, field in cases:
        err = _error(stub, request)
        assert (err.code(), field) == (code, field) and field in err.details(), err.details()
        assert "Traceback" not in err.details()
    _wait_idle(service)


def test_cancel_mid_stream_frees_the_session(stub, service: TTSService, saved_voice) -> None:
    outcomes: list[Outcome] = []
    service.add_listener(outcomes.append)
    call = stub.Inference(pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text=LONG_TEXT), seed=1))
    first = next(call)
    assert first.tts_audio
    assert service.status().active_sessions == 1
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    _wait_idle(service)
    service._listeners.remove(outcomes.append)
    assert [o.reason for o in outcomes] == ["cancelled"]  # stopped early, not run to its end


def test_busy_is_resource_exhausted(tts, service: TTSService, saved_voice) -> None:
    busy = TTSService(tts.model, service.voices, Limits(max_sessions=1, max_queued_requests=0))
    srv = GrpcServer("127.0.0.1", 0, max_streams=2)
    srv.serve(busy)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.CosyVoiceStub(ch)
            request = pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text=LONG_TEXT))
            running = stub.Inference(request)
            next(running)  # admitted and streaming
            err = _error(stub, request)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "busy" in err.details()
            running.cancel()
            _wait_idle(busy)
            assert _pcm(stub.Inference(pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text=TEXT))))
    finally:
        srv.stop(0)


def test_stop_returns_once_the_engine_let_go_of_the_cancelled_streams(tts, service: TTSService, saved_voice) -> None:
    """A process exits after ``stop``: the engine must not still compute a cancelled stream's chunk then, nor
    grpc's serving thread still free its C++ objects (an exit then aborts the process)."""
    srv = GrpcServer("127.0.0.1", 0, max_streams=2)
    srv.serve(service)
    with grpc.insecure_channel(srv.address) as ch:
        request = pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text=LONG_TEXT * 4))
        running = pb_grpc.CosyVoiceStub(ch).Inference(request)
        next(running)  # streaming
        srv.stop(0)
        assert tts.engine.active_sessions == 0
        assert srv._serving and not any(thread.is_alive() for thread in srv._serving)


def test_api_keys_are_required_when_configured(service: TTSService, saved_voice) -> None:
    srv = GrpcServer("127.0.0.1", 0, owners=Owners(("s3cret",)))
    srv.serve(service)
    request = pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text=TEXT))
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.CosyVoiceStub(ch)
            assert _error(stub, request).code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Inference(request, metadata=[("authorization", "Bearer wrong")]))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _pcm(stub.Inference(request, metadata=[("authorization", "Bearer s3cret")]))
    finally:
        srv.stop(0)


def _counter(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0 if want else float("nan")


def test_metrics_count_success_and_failure(server: GrpcServer, stub, saved_voice) -> None:
    port = server.serve_metrics("127.0.0.1", 0)

    def scrape() -> str:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text

    before = scrape()
    assert _pcm(stub.Inference(pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text=TEXT))))
    _error(stub, pb.Request(sft_request=pb.sftRequest(spk_id=saved_voice.id, tts_text="")))
    _error(stub, pb.Request(cross_lingual_request=pb.crosslingualRequest(tts_text=TEXT, prompt_audio=b"\x01")))
    after = scrape()
    assert _counter(after, "tts_requests_success_total", mode="sft") == \
        _counter(before, "tts_requests_success_total", mode="sft") + 1
    assert _counter(after, "tts_requests_error_total", mode="sft", reason="invalid_input") == \
        _counter(before, "tts_requests_error_total", mode="sft", reason="invalid_input") + 1
    assert _counter(after, "tts_requests_error_total", mode="cross_lingual", reason="invalid_input") == \
        _counter(before, "tts_requests_error_total", mode="cross_lingual", reason="invalid_input") + 1


def test_metrics_port_needs_the_key_when_keys_are_set(service: TTSService) -> None:
    srv = GrpcServer("127.0.0.1", 0, owners=Owners(("s3cret",)))
    srv.serve(service)
    try:
        url = f"http://127.0.0.1:{srv.serve_metrics('127.0.0.1', 0)}/metrics"
        assert httpx.get(url, timeout=10).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
        scraped = httpx.get(url, headers={"Authorization": "Bearer s3cret"}, timeout=10)
        assert scraped.status_code == 200 and "tts_requests_success" in scraped.text
    finally:
        srv.stop(0)


def test_voice_registered_over_rest_is_usable_over_grpc(service: TTSService, stub, prompt_wav: Path) -> None:
    """One voice library behind both servers: POST /v1/voices, then speak it over gRPC by id and by name."""
    rest = Server(create_app(ServerSettings(), service))
    try:
        created = httpx.post(f"{rest.url}/v1/voices", data={"name": "From Rest", "transcript": TRANSCRIPT},
                             files={"audio": ("v.wav", prompt_wav.read_bytes(), "audio/wav")}, timeout=60)
        assert created.status_code == 201, created.text
        voice = created.json()
    finally:
        rest.stop()
    by_id = pb.Request(sft_request=pb.sftRequest(spk_id=voice["id"], tts_text=TEXT), seed=5)
    by_name = pb.Request(zero_shot_request=pb.zeroshotRequest(tts_text=TEXT, voice_id="From Rest"), seed=5)
    assert _pcm(stub.Inference(by_id, timeout=60)) == _pcm(stub.Inference(by_name, timeout=60)) != b""


def test_command_line_serves_then_stops_on_sigterm(tiny_bundle_dir: Path, tmp_path: Path, prompt_pcm16: bytes) -> None:
    """``python -m cosyvoice.server.grpc`` with the official flags: SERVING once loaded, a call, clean exit."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COSYVOICE_DEVICE": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "cosyvoice.server.grpc", "--model_dir", str(tiny_bundle_dir),
                             "--port", str(port), "--voice-dir", str(tmp_path / "voices"), "--max_conc", "2"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            def serving() -> bool:
                assert proc.poll() is None, "the server exited"
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2)
                except grpc.RpcError:  # not listening yet
                    return False
                return reply.status == health_pb2.HealthCheckResponse.SERVING

            until(serving, 90, "the server's SERVING")
            request = pb.Request(cross_lingual_request=pb.crosslingualRequest(tts_text=TEXT,
                                                                              prompt_audio=prompt_pcm16))
            assert len(_pcm(pb_grpc.CosyVoiceStub(ch).Inference(request, timeout=60))) > 0
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"no exit 60 s after SIGTERM; output:\n{proc.communicate()[0]}") from None
        assert proc.returncode == 0, output
        assert "2 concurrent streams" in output and "Traceback" not in output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_long_chunks_are_split_below_the_message_limit() -> None:
    """A 60 s non-streamed sentence becomes several messages, none near gRPC's default 4 MiB limit."""
    pcm = torch.linspace(-1, 1, 60 * 24000)
    messages = list(audio_messages(pcm))
    assert len(messages) == 3 and all(len(m.tts_audio) <= MAX_AUDIO_MESSAGE_BYTES for m in messages)
    assert b"".join(m.tts_audio for m in messages) == to_pcm16(pcm).tobytes()
    assert list(audio_messages(torch.zeros(0))) == []
