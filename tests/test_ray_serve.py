"""A local Ray Serve app with 2 CPU replicas on loopback (tiny bundle): concurrent requests get decodable MP3.

One module-scoped app: starting Ray and the replicas costs ~15 s on 2 cores, the requests much less.
"""

from __future__ import annotations

import base64
import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av
import httpx
import pytest
import ray
from ray import serve
from waiting import free_port, until

from cosyvoice.server.ray_serve import ROUTE_PREFIX, ServeArgs, app_builder, deployment_options
from cosyvoice.service import TTSService
from cosyvoice.voices import VoiceLibrary

TEXT = "Hi there."
TRANSCRIPT = "Hello, this is a short prompt for testing."
APP = "cosyvoice-test"
ORIGIN = "https://app.example"



@pytest.fixture(scope="module")
def app(tts, tiny_bundle_dir: Path, short_prompt_wav: Path, tmp_path_factory: pytest.TempPathFactory):
    """(base URL, the voice saved in the library before the replicas started)."""
    voice_dir = tmp_path_factory.mktemp("ray_voices")
    library = VoiceLibrary(voice_dir, tts.frontend, model_dir=tts.model_dir)
    saved = TTSService(tts.model, library).create_voice("Ray Voice", short_prompt_wav.read_bytes(), TRANSCRIPT)
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        audio_dir = tmp_path_factory.mktemp("ray_audio")
        (audio_dir / "prompt.wav").write_bytes(short_prompt_wav.read_bytes())
        args = ServeArgs(model_dir=str(tiny_bundle_dir), voice_dir=str(voice_dir), device="cpu", num_gpus=0,
                         num_cpus=0.5, num_replicas=2, limits={"max_sessions": 4}, max_body_bytes=500_000,
                         allowed_audio_dir=str(audio_dir), cors_origins=[ORIGIN])
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
    for method in ("GET", "POST"):  # the seed contract: POST, and GET for probes
        health = httpx.request(method, f"{url}/healthcheck", timeout=30)
        assert health.status_code == 200 and health.json() == {"status": "healthy"}
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
        ("tts", {"text": TEXT, "voice_type": "Ray Voice", "final": "half"}, 400, "final"),
        ("tts", {"text": TEXT, "voice_type": "Ray Voice", "first_hop": 0}, 400, "first_hop"),
    ]
    for route, body, status, field in cases:
        response = httpx.post(f"{url}/{route}", json=body, timeout=60)
        assert (response.status_code, response.json()["error"]["field"]) == (status, field), response.text
    bad_json = httpx.post(f"{url}/tts", content=b"{not json", timeout=30)
    assert bad_json.status_code == 400 and bad_json.json()["error"]["field"] == "body"
    huge = httpx.post(f"{url}/tts", json={"text": "a" * 600_000, "voice_type": "Ray Voice"}, timeout=30)
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "payload_too_large"


def test_seed_contract_default_voice_paths_uploads_and_cors(app, short_prompt_wav: Path) -> None:
    """``voice_type`` optional (the default voice; ``"qwen"`` its alias), ``reference_audio`` as a path in the
    allowed folder or as a multipart upload, CORS for the configured origin."""
    url, _ = app
    for body in ({"text": TEXT}, {"text": TEXT, "voice_type": "qwen"},
                 {"text": TEXT, "reference_audio": "prompt.wav"},
                 {"text": TEXT, "reference_audio": "prompt.wav", "reference_text": TRANSCRIPT}):
        response = httpx.post(f"{url}/tts", json=body, timeout=120)
        assert response.status_code == 200, (body, response.text)
        assert _decode_mp3(response.content)[0] > 0
    upload = httpx.post(f"{url}/zero_shot", data={"text": TEXT, "reference_text": TRANSCRIPT, "speed": "1.1",
                                                  "stream": "true"},
                        files={"reference_audio": ("p.wav", short_prompt_wav.read_bytes(), "audio/wav")}, timeout=120)
    assert upload.status_code == 200, upload.text
    assert _decode_mp3(upload.content)[0] > 0
    bad = httpx.post(f"{url}/tts", json={"text": TEXT, "reference_audio": "../../etc/passwd"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "reference_audio"
    assert "/etc" not in bad.json()["error"]["message"].replace("../../etc/passwd", "")
    bad_form = httpx.post(f"{url}/tts", data={"text": TEXT, "speed": "fast"}, timeout=30)
    assert bad_form.status_code == 400 and bad_form.json()["error"]["field"] == "speed"
    preflight = httpx.options(f"{url}/tts", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{url}/tts", headers={"Origin": "https://evil.example",
                                                 "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers


def test_long_form_progress_and_cancel_answer_alike_on_every_replica(app) -> None:
    """The long-form router is mounted in each replica over the shared data folder; its job state is in the
    shared database, so whichever replica a poll or a cancel reaches sees and stops the render."""
    url, saved = app
    base = url.removesuffix(ROUTE_PREFIX) + "/v1/longform/projects"
    text = "\n\n".join(f"Paragraph number {i} is here." for i in range(30))
    with httpx.Client(timeout=60) as client:
        r = client.post(base, json={"text": text, "voice": saved.name})
        assert r.status_code == 201, r.text
        pid = r.json()["id"]
        assert client.post(f"{base}/{pid}/generate").status_code == 200
        until(lambda: client.get(f"{base}/{pid}/progress").json()["done"] >= 1, 120, "a first take")
        answers = [client.get(f"{base}/{pid}/progress").json() for _ in range(12)]
        assert all(a["running"] and a["current"] for a in answers), answers
        assert client.post(f"{base}/{pid}/cancel").status_code == 200
        until(lambda: not any(client.get(f"{base}/{pid}/progress").json()["running"] for _ in range(6)), 15,
              "the cancel reaching the replica that renders")
        ended = client.get(f"{base}/{pid}/progress").json()
        assert ended["state"] == "cancelled" and ended["done"] < 30
        assert client.delete(f"{base}/{pid}").status_code == 200


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
