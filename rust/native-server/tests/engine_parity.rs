//! The native engine end to end against our Python engine: a seed decodes the same speech tokens in both
//! (the whole 200-token generation, `data/python_engine_tokens.json`), and its first 60 become audio of the
//! expected length and level through the streamed token to wave.

mod common;

use cosyvoice_native::llm::CosyVoice3Lm;
use cosyvoice_native::rng::cfm_noise;
use cosyvoice_native::sampling::SeededSampler;
use cosyvoice_native::t2w::{stream_all, FlowPrompt};
use cosyvoice_native::Bundle;

#[test]
fn seeded_synthesis_equals_the_python_engine() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "llm.safetensors");
    let bundle = Bundle::open(&dir.join("tiny_bundle")).unwrap();
    let lm = bundle.llm().unwrap();
    let text = common::ids(&g["text_tokens"]);
    let lm_input =
        lm.lm_input(&text, &common::ids(&g["prompt_text_tokens"]), &common::ids(&g["prompt_speech_tokens"])).unwrap();
    let (min_len, max_len) = CosyVoice3Lm::length_limits(text.len());
    let python = common::json(std::path::Path::new(env!("CARGO_MANIFEST_DIR")), "tests/data/python_engine_tokens.json");
    let mut tokens = Vec::new();
    for (seed, expected) in python["tokens"].as_object().unwrap() {
        let mut sampler = SeededSampler::new(seed.parse().unwrap(), bundle.config.llm.sampling.clone());
        tokens = lm.generate(&lm_input, min_len, max_len, &mut sampler).unwrap();
        let expected: Vec<u32> = expected.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
        assert_eq!(tokens, expected, "seed {seed}");
    }

    let f = common::load(&dir, "flow.safetensors");
    let prompt = FlowPrompt {
        tokens: common::ids(&f["prompt_token"]),
        feat: f["prompt_feat"].clone(),
        embedding: f["embedding"].clone(),
    };
    let (flow, hift) = (bundle.flow(cfm_noise().unwrap()).unwrap(), bundle.hift().unwrap());
    let tokens = &tokens[..60]; // a streamed chunk and the last: enough, and quick
    let chunks = stream_all(&flow, &hift, &prompt, tokens).unwrap();
    let pcm: Vec<f32> = chunks.iter().flat_map(|c| c.pcm.flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
    let samples_per_token = bundle.config.flow.token_mel_ratio * bundle.config.hift.upsample_scale();
    assert_eq!(pcm.len(), tokens.len() * samples_per_token, "audio length");
    let limit = bundle.config.hift.audio_limit as f32;
    assert!(pcm.iter().all(|x| x.is_finite() && x.abs() <= limit), "audio finite and within the clip level");
    let rms = (pcm.iter().map(|x| x * x).sum::<f32>() / pcm.len() as f32).sqrt();
    assert!(rms > 1e-3, "audio is not silent (rms {rms})");
    println!(
        "parity engine: {} seeds' tokens equal the Python engine's; {} chunks, {} samples",
        2,
        chunks.len(),
        pcm.len()
    );
}
