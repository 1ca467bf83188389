//! The prompt-audio networks through ONNX Runtime against the official frontend's outputs
//! (`frontend.safetensors`): speech tokens exactly, the CAM++ embedding to 1e-4, both from the stored
//! network inputs and from the 16 kHz prompt through our own features; then the whole prompt (24 kHz WAV
//! file -> aligned mel, tokens, embedding) against the official zero-shot frontend. ONNX Runtime comes from
//! `ORT_DYLIB_PATH` or the project's venv (scripts/build_rust.sh sets it).

mod common;

use cosyvoice_native::onnx::{CampPlus, SpeechTokenizer};
use cosyvoice_native::prompt::PromptAudio;
use cosyvoice_native::Bundle;

#[test]
fn speech_tokens_and_speaker_embedding_equal_the_official_frontend() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "frontend.safetensors");
    let bundle = dir.join("tiny_bundle");
    let tokenizer = SpeechTokenizer::open(&bundle.join(SpeechTokenizer::FILENAME)).unwrap();
    let campplus = CampPlus::open(&bundle.join(CampPlus::FILENAME)).unwrap();
    let expected_tokens = common::ids(&g["speech_tokens"]);
    assert_eq!(tokenizer.tokenize_log_mel(&g["whisper_logmel128"]).unwrap(), expected_tokens);
    let wav_16k = g["wav_16k"].flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(tokenizer.tokens(&wav_16k).unwrap(), expected_tokens, "tokens from our whisper log-mel");

    let fbank = &g["kaldi_fbank80_raw"];
    let normalised = fbank.broadcast_sub(&fbank.mean_keepdim(0).unwrap()).unwrap();
    let expected = &g["campplus_embedding"];
    let stored = common::max_abs_diff(&campplus.embed_fbank(&normalised).unwrap(), expected);
    let ours = common::max_abs_diff(&campplus.embed(&wav_16k).unwrap(), expected);
    assert!(stored < 1e-4 && ours < 1e-4, "embedding: {stored:e} from the stored fbank, {ours:e} from ours");
    println!("parity onnx: {} tokens equal; embedding max diff {stored:.2e} / {ours:.2e}", expected_tokens.len());
}

#[test]
fn a_prompt_file_gives_the_official_zero_shot_features() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "frontend.safetensors");
    let bundle = Bundle::open(&dir.join("tiny_bundle")).unwrap();
    let prompt = PromptAudio::open(&bundle).unwrap();
    let wav = std::fs::read(dir.join("prompt_24k.wav")).unwrap();
    let features = prompt.features(&cosyvoice_native::audio::decode_wav(&wav).unwrap()).unwrap();
    assert_eq!(features.tokens, common::ids(&g["zs_flow_prompt_speech_token"]));
    let mel = common::max_abs_diff(&features.feat, &g["zs_prompt_speech_feat"]);
    let embedding = common::max_abs_diff(&features.embedding, &g["zs_llm_embedding"]);
    // the mel is a log of float32 FFT spectra: features_parity.rs's LOG_SPECTRUM_ATOL (1e-3) and why
    assert!(mel < 1e-3 && embedding < 1e-4, "mel {mel:e}, embedding {embedding:e}");
    println!(
        "parity prompt: {} tokens equal; mel max diff {mel:.2e}, embedding {embedding:.2e}",
        features.tokens.len()
    );
}
