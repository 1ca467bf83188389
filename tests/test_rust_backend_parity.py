"""The Rust engine (rust/native-server, through the PyO3 module ``cosyvoice_rust_backend``) stage by stage against
our Python engine and the official golden fixtures, at the tolerances of our parity tool
(cosyvoice/tools/parity/tolerances.py): tokenizer, audio features, LLM (teacher-forced log-probs, greedy and
seeded decoding), vocoder, and token-to-wave end to end from fixed tokens. The flow has its own file,
tests/verify_flow_rust.py. Run with ``-s`` to see the rows (the README's parity table).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import pytest
import torch

from cosyvoice.config import load_config
from cosyvoice.frontend.audio import decode_audio, downmix, resample
from cosyvoice.frontend.features import WHISPER_SAMPLE_RATE, MelParams, kaldi_fbank, prompt_mel, whisper_log_mel
from cosyvoice.frontend.tokenizer import CosyVoice3Tokenizer
from cosyvoice.llm import CosyVoice3LM
from cosyvoice.tools.parity.common import Golden, Result, compare, compare_exact
from cosyvoice.tools.parity.frontend import prompt_wav_path
from cosyvoice.tools.parity.hift import HIFT_FILE, build_vocoder
from cosyvoice.tools.parity.t2w import build_engine, model_input
from cosyvoice.tools.parity.tolerances import (
    FEATURE_ATOL,
    FEATURE_RTOL,
    HIFT_AUDIO_ATOL,
    LLM_HIDDEN_ATOL,
    LLM_LOGP_ATOL,
    LOG_SPECTRUM_FLOAT64_ATOL,
    T2W_PCM_ATOL,
)
from cosyvoice.weights import load_weights
from tests.rust_parity import assert_rows


@pytest.fixture(scope="module")
def python_lm(golden: Golden) -> CosyVoice3LM:
    model = CosyVoice3LM(load_config(golden.bundle_dir).llm)
    load_weights(model, golden.bundle_dir / "llm.pt")
    return model.eval()


def test_tokenization_is_identical(golden: Golden, rust_model: object) -> None:
    """Every text of the text-frontend fixture (raw and normalised) and every special token: Rust ids = Python
    ids = the reference's."""
    python = CosyVoice3Tokenizer.from_model_dir(golden.bundle_dir)
    fixture = golden.json("text_frontend.json")
    texts = [(c["input"], c["raw_token_ids"]) for c in fixture["cases"]]
    texts += [(c["split_false"], c["split_false_token_ids"]) for c in fixture["cases"]]
    texts += list(fixture["special_token_ids"].items())
    rust_wrong = [text for text, ids in texts if rust_model.tokenize(text) != ids]
    python_wrong = [text for text, ids in texts if python.encode(text) != ids]
    n = len(texts)
    assert_rows([Result("text", f"token ids rust~reference ({n} texts)", len(rust_wrong), len(rust_wrong) / n, 0.0,
                        not rust_wrong, str(rust_wrong[:3])),
                 Result("text", f"token ids python~reference ({n} texts)", len(python_wrong), len(python_wrong) / n,
                        0.0, not python_wrong, str(python_wrong[:3]))])


def test_audio_features(golden: Golden, rust_backend: ModuleType) -> None:
    """The golden prompt wav decoded and resampled to 16 kHz, then each feature on the reference's own input
    (the 24 kHz wav, the reference's 16 kHz one), in Rust and in our Python frontend, against the reference."""
    ref = golden.arrays("frontend.safetensors")
    wav, sample_rate = rust_backend.decode_wav(prompt_wav_path(golden).read_bytes())
    py_samples, py_rate = decode_audio(prompt_wav_path(golden))
    py_wav = downmix(py_samples)
    mel = MelParams.from_model_dir(golden.bundle_dir)
    assert sample_rate == py_rate == mel.sample_rate  # the prompt mel is taken of the file's own samples
    ref_16k = ref["wav_16k"].reshape(-1)
    t_16k = torch.from_numpy(ref_16k)
    with torch.inference_mode():
        python = {"wav_16k": resample(py_wav, py_rate, WHISPER_SAMPLE_RATE),
                  "speech_feat_mel80": prompt_mel(py_wav, mel).transpose(1, 2),
                  "whisper_logmel128": whisper_log_mel(t_16k, n_mels=128),
                  "kaldi_fbank80_raw": kaldi_fbank(t_16k, num_mel_bins=80)}
    rust = {"wav_16k": rust_backend.resample(wav, sample_rate, WHISPER_SAMPLE_RATE),
            "speech_feat_mel80": rust_backend.prompt_mel(wav, sample_rate, mel.n_fft, mel.hop_size, mel.num_mels)
            .transpose(0, 2, 1),
            "whisper_logmel128": rust_backend.whisper_log_mel(ref_16k, 128),
            "kaldi_fbank80_raw": rust_backend.kaldi_fbank(ref_16k, 80)}
    results = [compare("features", "decoded wav rust~python", wav, py_wav.reshape(-1), 0.0)]
    for name, ours in rust.items():
        atol = LOG_SPECTRUM_FLOAT64_ATOL if name in ("speech_feat_mel80", "kaldi_fbank80_raw") else FEATURE_ATOL
        expected = ref[name].reshape(ours.shape)
        results.append(compare("features", f"{name} rust~reference", ours, expected, atol, FEATURE_RTOL))
        results.append(compare("features", f"{name} rust~python", ours, python[name].reshape(ours.shape), atol,
                               FEATURE_RTOL))
    assert_rows(results)


def _llm_inputs(golden: Golden) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    arrays = golden.arrays("llm.safetensors")
    return (arrays["text_tokens"], arrays["prompt_text_tokens"], arrays["prompt_speech_tokens"],
            arrays["forced_tokens"])


def _python_teacher_forced(model: CosyVoice3LM, text: np.ndarray, prompt_text: np.ndarray, prompt_speech: np.ndarray,
                           forced: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Our Python LM's hidden states and log-probs at each forced decision (one causal pass)."""
    ids = [torch.from_numpy(a.reshape(-1)).long() for a in (text, prompt_text, prompt_speech, forced)]
    with torch.inference_mode():
        lm_input = model.build_lm_input(ids[0], ids[1], ids[2])
        fed = model.speech_embedding(ids[3][:-1])[None]
        hidden = model.llm(torch.cat([lm_input, fed], dim=1))[0, lm_input.shape[1] - 1:]
        return hidden, model.log_probs(hidden)


def test_llm_teacher_forced(golden: Golden, rust_model: object, python_lm: CosyVoice3LM) -> None:
    """Hidden states and log-probs of the reference's forced decoding (KV-cache path and one full pass), and the
    greedy token at every step, against the reference (llm.safetensors) and our Python LM."""
    arrays = golden.arrays("llm.safetensors")
    text, prompt_text, prompt_speech, forced = _llm_inputs(golden)
    lm_input = rust_model.lm_input(text, prompt_text, prompt_speech)
    hidden, logp = rust_model.teacher_forced(text, prompt_text, prompt_speech, forced)
    full_hidden, _ = rust_model.teacher_forced(text, prompt_text, prompt_speech, forced, kv_cache=False)
    py_hidden, py_logp = _python_teacher_forced(python_lm, text, prompt_text, prompt_speech, forced)
    top_ids = arrays["logp_kv_top32_indices"]
    logits = torch.from_numpy(hidden) @ python_lm.llm_decoder.weight.detach().T
    results = [
        compare("llm", "lm_input rust~reference", lm_input[None], arrays["lm_input"], 0.0),
        compare("llm", "hidden (KV) rust~reference", hidden, arrays["hidden_kv"], LLM_HIDDEN_ATOL),
        compare("llm", "hidden (full) rust~reference", full_hidden, arrays["hidden_kv"], LLM_HIDDEN_ATOL),
        compare("llm", "hidden (KV) rust~python", hidden, py_hidden, LLM_HIDDEN_ATOL),
        compare("llm", "logp (KV) rust~python, all ids", logp, py_logp, LLM_LOGP_ATOL),
        compare("llm", "logp top-32 rust~reference", np.take_along_axis(logp, top_ids, 1),
                arrays["logp_kv_top32_values"], LLM_LOGP_ATOL),
        compare("llm", "logsumexp rust~reference", logits.logsumexp(-1), arrays["logp_kv_logsumexp"], LLM_LOGP_ATOL),
        compare_exact("llm", "greedy tokens rust~reference", logp.argmax(1), top_ids[:, 0]),
        compare_exact("llm", "greedy tokens rust~python", logp.argmax(1), py_logp.argmax(1).numpy()),
    ]
    head = arrays["logp_kv_head"]
    finite = np.isfinite(head)
    results.append(compare("llm", "logp head (12 steps, unmasked ids) rust~reference", logp[: len(head)][finite],
                           head[finite], LLM_LOGP_ATOL))
    assert_rows(results)


def test_llm_decoding(golden: Golden, rust_model: object, python_lm: CosyVoice3LM) -> None:
    """Whole decoding loops from the zero-shot prompt: greedy, and seeded repetition-aware sampling (the engines
    share the counter-based random stream), give the same tokens in Rust and Python."""
    text, prompt_text, prompt_speech, _ = _llm_inputs(golden)
    ids = [torch.from_numpy(a.reshape(-1)).long() for a in (text, prompt_text, prompt_speech)]

    def greedy(scores: torch.Tensor, decoded: object) -> int:
        return int(scores.argmax())

    with torch.inference_mode():
        py_greedy = list(python_lm.generate(*ids, 0, sampler=greedy))
        py_seeded = {seed: list(python_lm.generate(*ids, seed)) for seed in (0, 7)}
    rust_greedy = rust_model.generate(text, prompt_text, prompt_speech)
    results = [compare_exact("llm", f"greedy decoding rust~python ({len(py_greedy)} tokens)", np.array(rust_greedy),
                             np.array(py_greedy))]
    for seed, tokens in py_seeded.items():
        rust = rust_model.generate(text, prompt_text, prompt_speech, seed=seed)
        results.append(compare_exact("llm", f"seed {seed} sampling rust~python ({len(tokens)} tokens)",
                                     np.array(rust), np.array(tokens)))
    assert py_seeded[0] != py_seeded[7] and len(py_greedy) > 0
    assert_rows(results)


def test_vocoder(golden: Golden, rust_model: object) -> None:
    """HiFT on the fixture's mel, whole and in the two streaming calls, against the reference and our Python
    vocoder (both on the official SineGen buffers)."""
    arrays = golden.arrays(HIFT_FILE)
    python, _ = build_vocoder(golden)
    mel = arrays["mel"]
    speech, source = rust_model.hift(mel)
    with torch.inference_mode():
        py_speech, _ = python.inference(torch.from_numpy(mel), finalize=True)
    results = [
        compare("hift", "speech rust~reference", speech, arrays["full_speech"], HIFT_AUDIO_ATOL),
        compare("hift", "speech rust~python", speech, py_speech, HIFT_AUDIO_ATOL),
        compare("hift", "source rust~reference", source.transpose(0, 2, 1), arrays["full_source"], HIFT_AUDIO_ATOL),
    ]
    for i, call in enumerate(golden.scalar(HIFT_FILE, "stream_calls")):
        raw, _ = rust_model.hift(mel[:, :, : call["mel_prefix"]], finalize=bool(call["finalize"]))
        results.append(compare("hift", f"stream{i} raw speech rust~reference", raw, arrays[f"stream{i}_raw_speech"],
                               HIFT_AUDIO_ATOL))
    assert_rows(results)


def test_token_to_wave_end_to_end(golden: Golden, rust_model: object) -> None:
    """Fixed speech tokens to audio in the prompt's voice: the streamed chunks against the reference's
    (t2w.safetensors) and our Python engine's, and the whole utterance at once against the Python engine's."""
    t2w, flow = golden.arrays("t2w.safetensors"), golden.arrays("flow.safetensors")
    prompt = (flow["prompt_token"], flow["prompt_feat"], flow["embedding"])
    engine = build_engine(golden)
    try:
        tokens = torch.from_numpy(t2w["token"]).reshape(-1)
        py_stream = [c.pcm.reshape(-1) for c in engine.vocode(tokens, model_input(golden), stream=True)]
        py_whole = torch.cat([c.pcm.reshape(-1) for c in engine.vocode(tokens, model_input(golden), stream=False)])
    finally:
        engine.close()
    chunks = rust_model.token2wav(t2w["token"], *prompt, stream=True)
    (whole,) = rust_model.token2wav(t2w["token"], *prompt)
    results = [compare_exact("t2w", "chunk count rust~reference", len(chunks),
                             len(golden.scalar("t2w.safetensors", "chunks")))]
    for i, chunk in enumerate(chunks):
        results.append(compare("t2w", f"chunk{i} pcm rust~reference", chunk, t2w[f"chunk{i}_pcm"].reshape(-1),
                               T2W_PCM_ATOL))
        results.append(compare("t2w", f"chunk{i} pcm rust~python", chunk, py_stream[i], T2W_PCM_ATOL))
    results.append(compare_exact("t2w", "whole-utterance samples rust~reference", len(whole),
                                 golden.scalar("t2w.safetensors", "nonstream_pcm_len")))
    results.append(compare("t2w", "whole-utterance pcm rust~python", whole, py_whole, T2W_PCM_ATOL))
    assert_rows(results)
