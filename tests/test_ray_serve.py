"""A local Ray Serve app with 2 CPU replicas on loopback (tiny bundle): concurrent requests get decodable MP3.

One module-scoped app: starting Ray and the replicas costs ~15 s on 2 cores, the requests much less.
"""

from __future__ import annotations

import base64
import io
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import httpx
import pytest
import ray
from ray import serve

from cosyvoice.server.ray_serve import ROUTE_PREFIX, ServeArgs, app_builder, deployment_options
from cosyvoice.service import TTSService
from cosyvoice.voices import VoiceLibrary

TEXT = "Hi there."
TRANSCRIPT = "Hello, this is a short prompt for testing."
APP = "cosyvoice-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(tts, tiny_bundle_dir: Path, short_prompt_wav: Path, tmp_path_factory: pytest.TempPathFactory):
    """(base URL, the voice saved in the library before the replicas started)."""
    voice_dir = tmp_path_factory.mktemp("ray_voices")
    library = VoiceLibrary(voice_dir, tts.frontend, model_dir=tts.model_dir)
    saved = TTSService(tts.model, library).create_voice("Ray Voice", short_prompt_wav.read_bytes(), TRANSCRIPT)
    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = ServeArgs(model_dir=str(tiny_bundle_dir), voice_dir=str(voice_dir), device="cpu", num_gpus=0,
                         num_cpus=0.5, num_replicas=2, limits={"max_sessions": 4}, max_body_bytes=500_000)
        serve.run(app_builder(args), name=APP, route_prefix="/")
        yield f"http://127.0.0.1:{port}{ROUTE_PREFIX}", saved
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference_b64(short_prompt_wav: Path) -> str:
    return base64.b64encode(short_prompt_wav.read_bytes()).decode()


def _decode_mp3(data: bytes) -> tuple[int, int]:
    """(samples, sample rate) of an MP3 file; raises if it is not one."""
    with av.open(io.BytesIO(data), format="mp3") as container:
        samples = rate = 0
        for frame in container.decode(audio=0):
            samples += frame.samples
            rate = frame.sample_rate
    return samples, rate


def test_two_cpu_replicas_answer_concurrent_requests_with_mp3(app, reference_b64: str) -> None:
    url, saved = app
    replicas = serve.status().applications[APP].deployments["CosyVoice3"].replica_states
    assert replicas.get("RUNNING") == 2, replicas
    bodies = [
        ("tts", {"text": TEXT, "voice_type": saved.name, "seed": 1}),
        ("tts", {"text": TEXT, "voice_type": saved.id, "stream": True}),
        ("zero_shot", {"text": TEXT, "reference_audio": reference_b64, "reference_text": TRANSCRIPT}),
        ("zero_shot", {"text": TEXT, "reference_audio": reference_b64, "reference_text": TRANSCRIPT, "stream": True}),
        ("cross_lingual", {"text": TEXT, "reference_audio": reference_b64, "speed": 1.2}),
        ("instruct", {"text": TEXT, "voice_type": saved.name, "instruction": "Speak slowly.", "stream": True}),
    ]

    def call(route_body: tuple[str, dict]) -> httpx.Response:
        route, body = route_body
        return httpx.post(f"{url}/{route}", json=body, timeout=120)

    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(call, bodies))
    for (route, body), response in zip(bodies, responses, strict=True):
        assert response.status_code == 200, (route, response.text)
        assert response.headers["content-type"] == "audio/mpeg"
        samples, rate = _decode_mp3(response.content)
        assert rate == 24000 and samples > 2400, (route, body.get("stream"), samples)


def test_stream_sends_mp3_chunk_by_chunk(app) -> None:
    url, saved = app
    body = {"text": "Hello there, my friend, how are you today?", "voice_type": saved.id, "stream": True}
    with httpx.stream("POST", f"{url}/tts", json=body, timeout=120) as response:
        assert response.status_code == 200
        parts = [part for part in response.iter_raw() if part]
    assert len(parts) >= 2, "a streamed answer arrives in pieces as the model speaks"
    assert _decode_mp3(b"".join(parts))[0] > 0
    assert _decode_mp3(parts[0])[0] > 0, "the first piece already plays"


def test_healthcheck_and_errors_name_the_field(app, reference_b64: str) -> None:
    url, _ = app
    health = httpx.get(f"{url}/healthcheck", timeout=30)
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["device"] == "cpu"
    cases = [
        ("tts", {"text": "", "reference_audio": reference_b64}, 400, "text"),
        ("cross_lingual", {"text": TEXT, "reference_audio": "not base64!"}, 400, "reference_audio"),
        ("cross_lingual", {"text": TEXT, "reference_audio": base64.b64encode(b"garbage" * 50).decode()}, 400,
         "reference_audio"),
        ("zero_shot", {"text": TEXT, "reference_audio": reference_b64}, 400, "reference_text"),
        ("instruct", {"text": TEXT, "reference_audio": reference_b64}, 400, "instruction"),
        ("tts", {"text": TEXT, "voice_type": "nobody"}, 404, "voice_type"),
        ("tts", {"text": TEXT, "voice": "x"}, 400, "voice"),
        ("tts", {"text": TEXT, "voice_type": "Ray Voice", "speed": "fast"}, 400, "speed"),
    ]
    for route, body, status, field in cases:
        response = httpx.post(f"{url}/{route}", json=body, timeout=60)
        assert (response.status_code, response.json()["error"]["field"]) == (status, field), response.text
    bad_json = httpx.post(f"{url}/tts", content=b"{not json", timeout=30)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["field"] == "body"
    huge = httpx.post(f"{url}/tts", json={"text": "a" * 600_000, "voice_type": "Ray Voice"}, timeout=30)
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "payload_too_large"


def test_replicas_follow_the_cluster_gpus() -> None:
    """One replica per GPU by default; CPU replicas without GPUs; a fixed count when asked."""
    gpu = deployment_options(ServeArgs(), cluster_gpus=4)
    assert gpu["ray_actor_options"]["num_gpus"] == 1 and gpu["autoscaling_config"]["max_replicas"] == 4
    half = deployment_options(ServeArgs(num_gpus=0.5, min_replicas=2), cluster_gpus=2)
    assert half["autoscaling_config"]["max_replicas"] == 4 and half["autoscaling_config"]["min_replicas"] == 2
    cpu = deployment_options(ServeArgs(limits={"max_sessions": 3, "max_queued_requests": 5}), cluster_gpus=0)
    assert cpu["ray_actor_options"]["num_gpus"] == 0 and cpu["autoscaling_config"]["max_replicas"] == 1
    assert cpu["max_ongoing_requests"] == 8 and cpu["autoscaling_config"]["target_ongoing_requests"] == 3
    fixed = deployment_options(ServeArgs(num_replicas=3, num_gpus=0), cluster_gpus=8)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    with pytest.raises(ValueError, match="unknown limit"):
        app_builder({"limits": {"max_sesions": 2}})
