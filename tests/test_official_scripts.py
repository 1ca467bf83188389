"""The official scripts' call patterns against our package on the tiny bundle (issue 7 acceptance).

Each test repeats what one official script does — its imports from ``cosyvoice``, its constructor
arguments and calls, its handling of the outputs — as written in the FunAudioLLM/CosyVoice repository:
``example.py`` (CosyVoice2/3 examples), ``webui.py``, ``vllm_example.py``, ``runtime/python/fastapi``
(server on loopback, client requests) and ``runtime/python/grpc`` (the server's and client's audio
conversions). Not repeated: imports of third-party packages we do not ship (``torchaudio``, ``vllm``,
the gRPC stubs); files are written with soundfile where the scripts call ``torchaudio.save``.
"""

import shutil
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from waiting import until

from cosyvoice.spkinfo import SPKINFO_FILE

SYSTEM = "You are a helpful assistant.<|endofprompt|>"
PROMPT_TRANSCRIPT = SYSTEM + "Hello, this is a short prompt for testing."


@pytest.fixture
def model_dir(tiny_bundle_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A private copy of the tiny bundle (the scripts save spk2info.pt); voices go to a temporary library."""
    monkeypatch.setenv("COSYVOICE_VOICE_DIR", str(tmp_path / "voices"))
    return str(shutil.copytree(tiny_bundle_dir, tmp_path / "Fun-CosyVoice3-0.5B",
                               ignore=shutil.ignore_patterns(SPKINFO_FILE)))


def test_example_py(model_dir: str, short_prompt_wav: Path, tmp_path: Path) -> None:
    from cosyvoice.cli.cosyvoice import AutoModel

    cosyvoice = AutoModel(model_dir=model_dir)
    prompt = str(short_prompt_wav)
    calls = {
        "zero_shot": lambda: cosyvoice.inference_zero_shot("八百标兵奔北坡。", PROMPT_TRANSCRIPT, prompt, stream=False),
        "fine_grained_control": lambda: cosyvoice.inference_cross_lingual(
            SYSTEM + "[breath]因为他们那一辈人[breath]。", prompt, stream=False),
        "instruct": lambda: cosyvoice.inference_instruct2(
            "好少咯。", "You are a helpful assistant. 请用广东话表达。<|endofprompt|>", prompt, stream=False),
        "hotfix": lambda: cosyvoice.inference_zero_shot("对报道[j][ǐ]予好评。", PROMPT_TRANSCRIPT, prompt,
                                                        stream=False),
    }
    for name, call in calls.items():
        for i, j in enumerate(call()):
            assert j["tts_speech"].shape[0] == 1
            sf.write(tmp_path / f"{name}_{i}.wav", j["tts_speech"][0].numpy(), cosyvoice.sample_rate)
        assert (tmp_path / f"{name}_0.wav").stat().st_size > 44

    # the CosyVoice2 example's saved speaker and text-generator calls, with CosyVoice3 prompts
    assert cosyvoice.add_zero_shot_spk(PROMPT_TRANSCRIPT, prompt, "my_zero_shot_spk") is True
    saved = list(cosyvoice.inference_zero_shot("收到好友的礼物。", "", "", zero_shot_spk_id="my_zero_shot_spk"))
    assert saved and saved[0]["tts_speech"].numel() > 0
    cosyvoice.save_spkinfo()
    assert "my_zero_shot_spk" in torch.load(Path(model_dir) / SPKINFO_FILE, weights_only=True)

    def text_generator():
        yield "收到好友"  # short: the tiny random model speaks up to 20 tokens per text token
        yield "的礼物。"

    outs = list(cosyvoice.inference_zero_shot(text_generator(), PROMPT_TRANSCRIPT, prompt, stream=False))
    assert len(outs) == 1 and outs[0]["tts_speech"].numel() > 0


def test_webui_py(model_dir: str, short_prompt_wav: Path) -> None:
    from cosyvoice.cli.cosyvoice import AutoModel
    from cosyvoice.utils.common import set_all_random_seed
    from cosyvoice.utils.file_utils import logging

    cosyvoice = AutoModel(model_dir=model_dir)
    cosyvoice.add_zero_shot_spk(PROMPT_TRANSCRIPT, str(short_prompt_wav), "speaker")  # so the SFT list is not empty
    sft_spk = cosyvoice.list_available_spks()
    assert sft_spk == ["speaker"]
    prompt_wav = str(short_prompt_wav)  # gr.Audio(type='filepath')

    def generate_audio(mode: str, seed: float, stream: bool, speed: float) -> np.ndarray:
        logging.info("get %s inference request", mode)
        set_all_random_seed(seed)
        if mode == "sft":
            outputs = cosyvoice.inference_sft("Hello there.", sft_spk[0], stream=stream, speed=speed)
        elif mode == "zero_shot":
            outputs = cosyvoice.inference_zero_shot("Hello there.", PROMPT_TRANSCRIPT, prompt_wav, stream=stream,
                                                    speed=speed)
        elif mode == "cross_lingual":
            outputs = cosyvoice.inference_cross_lingual(SYSTEM + "Hello there.", prompt_wav, stream=stream, speed=speed)
        else:
            outputs = cosyvoice.inference_instruct("Hello there.", sft_spk[0], "Speak happily.", stream=stream,
                                                   speed=speed)
        return np.concatenate([i["tts_speech"].numpy().flatten() for i in outputs])

    for mode in ("sft", "zero_shot", "cross_lingual", "instruct"):
        assert generate_audio(mode, 0.0, False, 1.0).size > 0  # gr.Number gives floats
    first = generate_audio("zero_shot", 42.0, True, 1.5)
    assert np.array_equal(first, generate_audio("zero_shot", 42.0, True, 1.5))  # same seed, same audio
    other = generate_audio("zero_shot", 43.0, True, 1.5)
    assert first.shape != other.shape or not np.array_equal(first, other)


def test_vllm_example_py(model_dir: str, short_prompt_wav: Path) -> None:
    from cosyvoice.cli.cosyvoice import AutoModel
    from cosyvoice.utils.common import set_all_random_seed

    cosyvoice = AutoModel(model_dir=model_dir, load_trt=True, load_vllm=True, fp16=False)
    audio = []
    for i in range(3):
        set_all_random_seed(i)
        audio.append(torch.cat([j["tts_speech"] for _, j in enumerate(cosyvoice.inference_zero_shot(
            "收到好友的礼物。", PROMPT_TRANSCRIPT, str(short_prompt_wav), stream=False))], dim=1))
    set_all_random_seed(1)
    again = torch.cat([j["tts_speech"] for j in cosyvoice.inference_zero_shot(
        "收到好友的礼物。", PROMPT_TRANSCRIPT, str(short_prompt_wav), stream=False)], dim=1)
    assert torch.equal(again, audio[1])
    assert not all(a.shape == audio[0].shape and torch.equal(a, audio[0]) for a in audio[1:])


def _fastapi_server_app(cosyvoice):
    """The official FastAPI server's endpoints and calls (runtime/python/fastapi/server.py); no postponed
    annotations in this file, so FastAPI resolves the locally imported types."""
    from fastapi import FastAPI, File, Form, UploadFile
    from fastapi.responses import StreamingResponse

    from cosyvoice.utils.file_utils import load_wav

    app = FastAPI()

    def generate_data(model_output):
        for i in model_output:
            yield (i["tts_speech"].numpy() * (2 ** 15)).astype(np.int16).tobytes()

    @app.post("/inference_sft")
    async def inference_sft(tts_text: str = Form(), spk_id: str = Form()):
        return StreamingResponse(generate_data(cosyvoice.inference_sft(tts_text, spk_id)))

    @app.post("/inference_zero_shot")
    async def inference_zero_shot(tts_text: str = Form(), prompt_text: str = Form(), prompt_wav: UploadFile = File()):  # noqa: B008
        prompt_speech_16k = load_wav(prompt_wav.file, 16000)
        return StreamingResponse(generate_data(cosyvoice.inference_zero_shot(tts_text, prompt_text,
                                                                             prompt_speech_16k)))

    @app.post("/inference_cross_lingual")
    async def inference_cross_lingual(tts_text: str = Form(), prompt_wav: UploadFile = File()):  # noqa: B008
        prompt_speech_16k = load_wav(prompt_wav.file, 16000)
        return StreamingResponse(generate_data(cosyvoice.inference_cross_lingual(tts_text, prompt_speech_16k)))

    @app.post("/inference_instruct")
    async def inference_instruct(tts_text: str = Form(), spk_id: str = Form(), instruct_text: str = Form()):
        return StreamingResponse(generate_data(cosyvoice.inference_instruct(tts_text, spk_id, instruct_text)))

    @app.post("/inference_instruct2")
    async def inference_instruct2(tts_text: str = Form(), instruct_text: str = Form(), prompt_wav: UploadFile = File()):  # noqa: B008
        prompt_speech_16k = load_wav(prompt_wav.file, 16000)
        return StreamingResponse(generate_data(cosyvoice.inference_instruct2(tts_text, instruct_text,
                                                                             prompt_speech_16k)))

    return app


def test_fastapi_server_and_client(model_dir: str, short_prompt_wav: Path) -> None:
    import httpx
    import uvicorn

    from cosyvoice.cli.cosyvoice import AutoModel

    cosyvoice = AutoModel(model_dir=model_dir)
    cosyvoice.add_zero_shot_spk(PROMPT_TRANSCRIPT, str(short_prompt_wav), "speaker")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_fastapi_server_app(cosyvoice), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        until(lambda: server.started, 30, "the server's start")
        url = "http://127.0.0.1:{}/{}".format(sock.getsockname()[1], "{}")

        def request(endpoint: str, payload: dict, with_prompt: bool) -> np.ndarray:
            files = [("prompt_wav", ("prompt_wav", short_prompt_wav.read_bytes(), "application/octet-stream"))]
            response = httpx.post(url.format(endpoint), data=payload, files=files if with_prompt else None,
                                  timeout=120)
            assert response.status_code == 200
            tts_speech = torch.from_numpy(np.array(np.frombuffer(response.content, dtype=np.int16))).unsqueeze(dim=0)
            assert tts_speech.shape[1] > 0
            return tts_speech.numpy()

        request("inference_sft", {"tts_text": "Hello there.", "spk_id": "speaker"}, False)
        request("inference_cross_lingual", {"tts_text": SYSTEM + "Hello there."}, True)
        request("inference_instruct", {"tts_text": "Hello.", "spk_id": "speaker", "instruct_text": "Be calm."}, False)
        request("inference_instruct2", {"tts_text": "Hello.",
                                        "instruct_text": "You are a helpful assistant. Be calm.<|endofprompt|>"}, True)
        zero_shot = {"tts_text": "Hello there.", "prompt_text": PROMPT_TRANSCRIPT}
        torch.manual_seed(5)
        first = request("inference_zero_shot", zero_shot, True)
        torch.manual_seed(5)  # the server draws each request's seed from the global generator
        assert np.array_equal(first, request("inference_zero_shot", zero_shot, True))
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_grpc_server_and_client_conversions(model_dir: str, short_prompt_wav: Path) -> None:
    from cosyvoice.cli.cosyvoice import AutoModel
    from cosyvoice.utils.file_utils import load_wav

    cosyvoice = AutoModel(model_dir=model_dir)
    cosyvoice.add_zero_shot_spk(PROMPT_TRANSCRIPT, str(short_prompt_wav), "speaker")
    # client: 16 kHz int16 bytes of the prompt; server: back to a float tensor [1, N]
    prompt_speech = load_wav(str(short_prompt_wav), 16000)
    prompt_audio = (prompt_speech.numpy() * (2**15)).astype(np.int16).tobytes()
    prompt_speech_16k = torch.from_numpy(np.array(np.frombuffer(prompt_audio, dtype=np.int16))).unsqueeze(dim=0)
    prompt_speech_16k = prompt_speech_16k.float() / (2**15)
    outputs = [
        cosyvoice.inference_sft("Hello there.", "speaker"),
        cosyvoice.inference_zero_shot("Hello there.", PROMPT_TRANSCRIPT, prompt_speech_16k),
        cosyvoice.inference_cross_lingual(SYSTEM + "Hello there.", prompt_speech_16k),
        cosyvoice.inference_instruct("Hello there.", "speaker", "Speak slowly."),
    ]
    for model_output in outputs:
        tts_audio = b"".join((i["tts_speech"].numpy() * (2 ** 15)).astype(np.int16).tobytes() for i in model_output)
        assert len(tts_audio) > 0
