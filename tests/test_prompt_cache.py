"""The per-voice flow prefix (cosyvoice/flow/prompt_cache.py) and the ``steps`` knob: same mel, bounds, restart."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_flow import RATIO, inputs, make_noise, small_config

from cosyvoice.errors import InvalidInputError
from cosyvoice.flow import CausalMaskedDiffWithDiT
from cosyvoice.flow.cfm import guidance_batch, solve_euler_cfg, time_grid
from cosyvoice.flow.model import FlowStream
from cosyvoice.flow.prompt_cache import FOLDER, PromptCache
from cosyvoice.hifigan import HiFTStream
from cosyvoice.service import SynthesisRequest, TTSService
from cosyvoice.settings import Limits
from cosyvoice.voices import VoiceLibrary

MEL_ATOL = 1e-5
N_PROMPT = 14  # tokens: (14 - 3 look-ahead) * 2 = 22 voice-only frames, so 20 (two chunks of 10) are cached
TRANSCRIPT = "Hello, this is a short prompt for testing."


@pytest.fixture(scope="module")
def flow() -> CausalMaskedDiffWithDiT:
    torch.manual_seed(0)  # test-only initialisation of random weights
    return CausalMaskedDiffWithDiT(small_config(), noise=make_noise(1)).eval()


def _streamed(stream: FlowStream, token: torch.Tensor, calls: tuple[tuple[int, bool, bool], ...]) -> torch.Tensor:
    """The stream's mel over ``calls`` of (tokens so far, streaming, finalize), concatenated."""
    out, fed = [], 0
    for n, streaming, finalize in calls:
        out.append(stream.inference(token[:, fed:n], finalize, streaming))
        fed = n
    return torch.cat(out, dim=2)


STREAMED = ((9, True, False), (17, True, False), (31, True, False), (40, False, True))
WHOLE = ((40, True, True),)  # the whole utterance in one chunk-masked call


@pytest.mark.parametrize("calls", [STREAMED, WHOLE], ids=["streamed", "whole"])
def test_prefix_gives_the_same_mel_as_no_cache(flow: CausalMaskedDiffWithDiT, calls) -> None:
    x = inputs(40, n_prompt=N_PROMPT)
    voice = (flow, x["prompt_token"], x["prompt_feat"], x["embedding"])
    expected = _streamed(FlowStream(*voice), x["token"], calls)
    cache = PromptCache(1 << 30)
    first = cache.stream(*voice)  # a miss: computes the prefix, then continues from it
    assert first.finished_frames == flow.voice_frames(N_PROMPT, N_PROMPT * RATIO) == 20
    again = cache.stream(*voice)  # a hit: the first DiT call runs over the frames after the prefix only
    assert (cache.misses, cache.hits) == (1, 1) and again.finished_frames == 20
    for stream in (first, again):
        got = _streamed(stream, x["token"], calls)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=MEL_ATOL, rtol=0)


def test_prefix_never_reads_a_generated_token(flow: CausalMaskedDiffWithDiT) -> None:
    """Two requests of one voice with different first tokens share the prefix and still match their own recompute:
    the prefix stops before the look-ahead of the last prompt tokens reaches them."""
    cache = PromptCache(1 << 30)
    x = inputs(24, n_prompt=N_PROMPT)
    for seed in (1, 2):
        token = inputs(24, n_prompt=N_PROMPT, seed=seed)["token"]
        voice = (flow, x["prompt_token"], x["prompt_feat"], x["embedding"])
        expected = _streamed(FlowStream(*voice), token, ((12, True, False), (24, True, False)))
        got = _streamed(cache.stream(*voice), token, ((12, True, False), (24, True, False)))
        torch.testing.assert_close(got, expected, atol=MEL_ATOL, rtol=0)
    assert (cache.misses, cache.hits) == (1, 1)


def test_steps_reach_the_solver_and_the_cache_key(flow: CausalMaskedDiffWithDiT) -> None:
    x = inputs(20, n_prompt=N_PROMPT)
    args = (x["token"], 20, x["prompt_token"], N_PROMPT, x["prompt_feat"], N_PROMPT * RATIO, x["embedding"])
    default, six = (flow.inference(*args, streaming=False, finalize=True, n_steps=n) for n in (None, 6))
    assert not torch.allclose(default, six, atol=1e-3)
    # the same solve by hand: the solver over a 6-step grid
    tokens = torch.cat((x["prompt_token"], x["token"]), dim=1)
    mu = flow.token_condition(tokens, finalize=True).transpose(1, 2)
    cond = flow.prompt_condition(x["prompt_feat"], mu.shape[2])
    mu_in, spks_in, cond_in = guidance_batch(mu, flow.speaker_condition(x["embedding"]), cond)
    estimator = flow.decoder.estimator
    by_hand = solve_euler_cfg(lambda x_in, t_in, _: estimator(x_in, mu_in, t_in, spks_in, cond_in),
                              flow.decoder.start_noise(0, mu.shape[2], mu), time_grid(6, "cosine", mu.device, mu.dtype),
                              flow.decoder.cfg_rate)
    torch.testing.assert_close(six, by_hand[:, :, N_PROMPT * RATIO:], atol=1e-6, rtol=0)
    # a stream of 6 steps: its own prefix (another key), the mel of the 6-step recompute
    cache = PromptCache(1 << 30)
    voice = (flow, x["prompt_token"], x["prompt_feat"], x["embedding"])
    cache.stream(*voice)
    stream = cache.stream(*voice, steps=6)
    assert (cache.misses, cache.hits) == (2, 0) and stream.steps == 6
    expected = flow.inference(x["token"][:, :12], 12, *args[2:], streaming=True, finalize=False, n_steps=6)
    torch.testing.assert_close(stream.inference(x["token"][:, :12], finalize=False), expected, atol=MEL_ATOL, rtol=0)


def test_memory_and_disk_stay_within_their_bounds(flow: CausalMaskedDiffWithDiT, tmp_path: Path) -> None:
    voices = [inputs(0, n_prompt=N_PROMPT, seed=s) for s in range(3)]
    size = PromptCache(1 << 30)
    size.stream(flow, voices[0]["prompt_token"], voices[0]["prompt_feat"], voices[0]["embedding"])
    prefix_bytes = size.memory_bytes
    assert prefix_bytes > 0
    cache = PromptCache(int(prefix_bytes * 1.5))  # room for one prefix
    cache.persist(tmp_path, int(prefix_bytes * 2.5))  # files carry a little more than the tensors: two fit
    for v in voices:
        cache.stream(flow, v["prompt_token"], v["prompt_feat"], v["embedding"])
        cache.flush()
    assert cache.memory_bytes == prefix_bytes
    assert len(list(tmp_path.glob("*.safetensors"))) == 2  # the oldest file went
    cache.stream(flow, voices[0]["prompt_token"], voices[0]["prompt_feat"], voices[0]["embedding"])
    cache.flush()
    assert cache.misses == 4  # evicted from memory and disk: computed again
    # its file pushed out the least recently used one (the second voice's); the third's is still on disk
    cache.stream(flow, voices[2]["prompt_token"], voices[2]["prompt_feat"], voices[2]["embedding"])
    assert (cache.disk_hits, cache.misses) == (1, 4)
    cache.stream(flow, voices[1]["prompt_token"], voices[1]["prompt_feat"], voices[1]["embedding"])
    assert (cache.disk_hits, cache.misses) == (1, 5)


def test_disk_entries_survive_and_follow_the_model(flow: CausalMaskedDiffWithDiT, tmp_path: Path) -> None:
    x = inputs(24, n_prompt=N_PROMPT)
    voice = (flow, x["prompt_token"], x["prompt_feat"], x["embedding"])
    calls = ((12, True, False), (24, True, False))
    expected = _streamed(FlowStream(*voice), x["token"], calls)
    writer = PromptCache(1 << 30, lambda: "model A")
    writer.persist(tmp_path, 1 << 30)
    writer.stream(*voice)
    writer.close()
    reader = PromptCache(1 << 30, lambda: "model A")  # another process: nothing in memory
    reader.persist(tmp_path, 1 << 30)
    torch.testing.assert_close(_streamed(reader.stream(*voice), x["token"], calls), expected, atol=MEL_ATOL, rtol=0)
    assert (reader.disk_hits, reader.misses) == (1, 0)
    other = PromptCache(1 << 30, lambda: "model B")  # other weights: the entry is not theirs
    other.persist(tmp_path, 1 << 30)
    other.stream(*voice)
    assert (other.disk_hits, other.misses) == (0, 1)
    # a damaged file is dropped and recomputed, never used
    for path in tmp_path.glob("*.safetensors"):
        path.write_bytes(path.read_bytes()[:100])
    damaged = PromptCache(1 << 30, lambda: "model A")
    damaged.persist(tmp_path, 1 << 30)
    torch.testing.assert_close(_streamed(damaged.stream(*voice), x["token"], calls), expected, atol=MEL_ATOL, rtol=0)
    assert (damaged.disk_hits, damaged.misses) == (0, 1)


# ----------------------------------------------------------------------------- through the service


def _service(bundle: Path, voice_dir: Path, prompt_cache: bool = True) -> TTSService:
    from cosyvoice.pipeline import Model

    limits = Limits(max_sessions=2)
    model = Model.load(bundle, device="cpu", limits=limits, prompt_cache=prompt_cache)
    library = VoiceLibrary(voice_dir, model.frontend, model_dir=model.model_dir)
    return TTSService(model, library, limits, prompt_cache_dir=library.dir / FOLDER)


def _speak(service: TTSService, prompt_wav: Path, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The mel chunks a streamed request hands its vocoder (the random tiny vocoder turns the mel's 1e-6 rounding
    into audible differences, so the flow's output is what is compared)."""
    mels: list[torch.Tensor] = []
    vocode = HiFTStream.inference

    def recording(stream: HiFTStream, mel: torch.Tensor, finalize: bool = True):
        mels.append(mel.clone())
        return vocode(stream, mel, finalize=finalize)

    monkeypatch.setattr(HiFTStream, "inference", recording)
    request = SynthesisRequest("Hello there, my friend, how are you today?", prompt_audio=prompt_wav,
                               transcript=TRANSCRIPT, seed=3, stream=True)
    assert sum(c.pcm.numel() for c in service.synthesize(request)) > 0
    monkeypatch.undo()
    if service.model.engine.prompt_cache is not None:
        service.model.engine.prompt_cache.flush()
    return mels


def _same_mel(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected) > 2
    for a, b in zip(got, expected, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=MEL_ATOL, rtol=0)


def test_services_share_prefixes_on_disk_until_the_model_changes(tiny_bundle_dir: Path, prompt_wav: Path,
                                                                 tmp_path: Path, monkeypatch) -> None:
    """A restarted service reads the voice's prefix from the voice folder; other flow weights recompute it; the mel
    is a service's without the cache."""
    voices = tmp_path / "voices"
    first = _service(tiny_bundle_dir, voices)
    mel = _speak(first, prompt_wav, monkeypatch)
    assert first.model.engine.prompt_cache.misses == 1
    assert list((first.voices.dir / FOLDER).glob("*.safetensors"))
    first.model.close()
    plain = _service(tiny_bundle_dir, tmp_path / "plain", prompt_cache=False)
    assert plain.model.engine.prompt_cache is None
    _same_mel(mel, _speak(plain, prompt_wav, monkeypatch))
    plain.model.close()
    restarted = _service(tiny_bundle_dir, voices)
    _same_mel(_speak(restarted, prompt_wav, monkeypatch), mel)
    cache = restarted.model.engine.prompt_cache
    assert (cache.disk_hits, cache.misses) == (1, 0)
    restarted.model.close()

    changed = tmp_path / "changed"
    shutil.copytree(tiny_bundle_dir, changed)
    weights = torch.load(changed / "flow.pt", weights_only=True)
    key = "decoder.estimator.proj_out.bias"
    weights[key] = weights[key] + 0.1
    torch.save(weights, changed / "flow.pt")
    other = _service(changed, voices)
    assert other.voices.dir == restarted.voices.dir  # the voice folder does not follow the .pt weights ...
    _speak(other, prompt_wav, monkeypatch)
    cache = other.model.engine.prompt_cache
    assert (cache.disk_hits, cache.misses) == (0, 1)  # ... the prefix does
    other.model.close()


def test_steps_are_validated_once_and_reach_the_engine(tts, short_prompt_wav: Path, tmp_path: Path) -> None:
    library = VoiceLibrary(tmp_path, tts.frontend, model_dir=tts.model_dir)
    service = TTSService(tts.model, library, Limits(max_sessions=2))
    for bad in (0, 33, 2.5, True, "6"):
        with pytest.raises(InvalidInputError) as caught:
            service.prepare(SynthesisRequest("Hi.", prompt_audio=short_prompt_wav, transcript=TRANSCRIPT, steps=bad))
        assert caught.value.field == "steps"
    request = SynthesisRequest("Hi there.", prompt_audio=short_prompt_wav, transcript=TRANSCRIPT, seed=1, stream=False)
    assert service.prepare(request).steps == tts.engine.default_steps == 10
    prepared = service.prepare(SynthesisRequest(**{**request.__dict__, "steps": 6}))
    assert prepared.steps == 6

    def speak(steps: int | None) -> torch.Tensor:
        return torch.cat([c.pcm for c in service.synthesize(SynthesisRequest(**{**request.__dict__, "steps": steps}))])

    six = speak(6)
    assert not torch.allclose(six, speak(None), atol=1e-3)
    [(inp, seed)] = prepared.plan.inputs(tts.frontend)
    direct = torch.cat([c.pcm for c in tts.engine.synthesize(inp, seed=seed, steps=6)])
    assert torch.equal(six, direct)


def test_a_batch_steps_column_reaches_the_take_and_its_provenance(tts, tmp_path: Path) -> None:
    """The listening test's A/B of 10 against 6 steps: a CSV with a steps column, its takes recorded with them."""
    from cosyvoice.takes.export import takes_csv_rows
    from cosyvoice.takes.store import TakeStore
    from cosyvoice.workbench.batch import parse_rows, run_batch

    library = VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir,
                           builtin_dir=Path(__file__).resolve().parents[1] / "assets" / "voices")
    service = TTSService(tts.model, library, Limits(max_sessions=2))
    store = TakeStore(tmp_path / "data")
    rows = parse_rows("text,voice,seed,steps,label\nHello there.,en-allison,11,,ten\nHello there.,en-allison,11,6,six\n"
                      "Hello there.,en-allison,11,six,bad\n")
    result = run_batch(service, store, rows)
    assert [(e.row, e.field) for e in result.errors] == [(3, "steps")]
    ten, six = result.takes
    assert (ten.provenance["steps"], six.provenance["steps"]) == (10, 6)
    assert [r["steps"] for r in takes_csv_rows(store.takes())] == [10, 6]
    assert store.take(ten.id).provenance["steps"] == 10  # as stored
    a, b = (store.audio_path(t).read_bytes() for t in (ten, six))
    assert a != b


def test_a_long_form_project_speaks_at_its_steps(tts, short_prompt_wav: Path, tmp_path: Path, monkeypatch) -> None:
    """A project's ``steps`` setting is checked where it is set and goes with every take's request."""
    from cosyvoice.context import StudioContext

    service = TTSService(tts.model, VoiceLibrary(tmp_path / "voices", tts.frontend, model_dir=tts.model_dir),
                         Limits(max_sessions=2))
    service.create_voice("Ann", short_prompt_wav, TRANSCRIPT)
    asked: list[int] = []
    synthesize = service.synthesize

    def recording(request: SynthesisRequest, **kwargs):
        session = synthesize(request, **kwargs)
        asked.append(session.prepared.steps)
        return session

    monkeypatch.setattr(service, "synthesize", recording)
    context = StudioContext(service=service, data_dir=tmp_path / "data")
    studio = context.studio()
    try:
        with pytest.raises(InvalidInputError) as caught:
            studio.editor.create("Bad", "Hi there.", voice="Ann", steps=0)
        assert caught.value.field == "steps"
        project = studio.editor.create("Six", "Hi there.", voice="Ann", steps=6)
        assert project.settings["steps"] == 6
        studio.renders.generate(project.id)
        assert studio.renders.wait(project.id, 300)["done"] == 1
        project = studio.editor.update_settings(project.id, steps=None)  # back to the model's
        studio.renders.regenerate(project.id, studio.segments(project.id)[0].id)
        studio.renders.wait(project.id, 300)
        assert asked == [6, tts.engine.default_steps]
    finally:
        context.close()


def test_the_pages_flow_steps_reach_the_take_and_come_back_with_it(tts, short_prompt_wav: Path,
                                                                   tmp_path: Path) -> None:
    """The web UI's advanced setting: a take made at 6 steps records them; "Use these settings" puts them back."""
    from test_webui import studio_over

    studio = studio_over(TTSService(tts.model, VoiceLibrary(tmp_path / "voices", tts.frontend,
                                                             model_dir=tts.model_dir)))
    list(studio.generate("take-steps", "zero_shot", "Hi there.", str(short_prompt_wav), TRANSCRIPT, "", None, 5, 1.0,
                         False, "wav", None, 6.0))
    (take,) = studio.store.takes()
    assert take.provenance["steps"] == 6
    text, *_, steps, stream, final, first_hop = studio.open_take(take.id)
    assert (text, steps, stream, final, first_hop) == ("Hi there.", 6, False, "full", None)
