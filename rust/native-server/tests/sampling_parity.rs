//! The sampler and the decoding loop: the official nucleus (golden `sampling.safetensors`), our Python
//! engine's seeded draws (`cosyvoice.llm.sampling.SeededSampler`, same seed -> same tokens), and the official
//! loop's rules driven with the reference's forced tokens (golden `llm.safetensors`).

mod common;

use cosyvoice_native::llm::CosyVoice3Lm;
use cosyvoice_native::sampling::{nucleus, uniform, Sampler, SeededSampler};
use cosyvoice_native::Bundle;

const PROB_ATOL: f64 = 1e-5; // cosyvoice/tools/parity/tolerances.py SAMPLING_PROB_ATOL
const LOGP_ATOL: f32 = 2e-4;

fn scores(g: &std::collections::HashMap<String, candle_core::Tensor>, case: &str) -> Vec<f32> {
    g[&format!("{case}_logp")].to_vec1::<f32>().unwrap()
}

#[test]
fn nucleus_matches_reference() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "sampling.safetensors");
    let cfg = Bundle::open(&dir.join("tiny_bundle")).unwrap().config.llm.sampling;
    for case in ["llm_step0", "llm_step7", "flat", "peaky", "ties"] {
        let (ids, probs) = nucleus(&scores(&g, case), cfg.top_p, cfg.top_k);
        assert_eq!(ids, common::ids(&g[&format!("{case}_candidates")]), "{case} candidates");
        let theirs = g[&format!("{case}_candidate_probs")].to_vec1::<f32>().unwrap();
        let err = probs.iter().zip(&theirs).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
        assert!(err <= PROB_ATOL, "{case} probabilities max abs {err}");
    }
}

#[test]
fn seeded_draws_equal_the_python_engine() {
    let Some(dir) = common::golden_dir() else { return };
    // cosyvoice.llm.sampling.uniforms(seeds, counters) for these pairs
    let pairs = [(0, 0), (0, 1), (123, 5), ((1u64 << 40) + 7, 99)];
    let python = [0.37574453539233477, 0.19753659687325842, 0.5566401782748548, 0.5546367729247282];
    for ((seed, counter), expected) in pairs.iter().zip(python) {
        assert_eq!(uniform(*seed, *counter), expected, "uniform({seed}, {counter})");
    }
    // SeededSampler(seed) called six times on one score vector, each token appended to the history: the
    // peaky and ties runs exercise the repetition fallback
    let g = common::load(&dir, "sampling.safetensors");
    let cfg = Bundle::open(&dir.join("tiny_bundle")).unwrap().config.llm.sampling;
    let runs: [(&str, u64, [u32; 6]); 5] = [
        ("llm_step0", 0, [5419, 4251, 2306, 1496, 2393, 5333]),
        ("llm_step0", 1, [5333, 2104, 5419, 5308, 2306, 5100]),
        ("llm_step0", 42, [5583, 2393, 5419, 6341, 5552, 5100]),
        ("peaky", 7, [2217, 340, 1132, 5989, 4059, 4059]),
        ("ties", 7, [10, 40, 20, 30, 2893, 2933]),
    ];
    for (case, seed, expected) in runs {
        let mut sampler = SeededSampler::new(seed, cfg.clone());
        let mut history = Vec::new();
        for _ in 0..6 {
            let token = sampler.sample(&scores(&g, case), &history);
            history.push(token);
        }
        assert_eq!(history, expected, "{case}, seed {seed}");
    }
}

/// Hands back the reference's forced tokens and keeps the scores it was given.
struct Forced {
    tokens: Vec<u32>,
    seen: Vec<Vec<f32>>,
}

impl Sampler for Forced {
    fn sample(&mut self, scores: &[f32], _history: &[u32]) -> u32 {
        self.seen.push(scores.to_vec());
        self.tokens[self.seen.len() - 1]
    }
}

#[test]
fn decoding_loop_follows_the_reference() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "llm.safetensors");
    let lm = Bundle::open(&dir.join("tiny_bundle")).unwrap().llm().unwrap();
    let text = common::ids(&g["text_tokens"]);
    let lm_input =
        lm.lm_input(&text, &common::ids(&g["prompt_text_tokens"]), &common::ids(&g["prompt_speech_tokens"])).unwrap();
    let (min_len, max_len) = CosyVoice3Lm::length_limits(text.len());
    let forced = common::ids(&g["forced_tokens"]);
    let mut sampler = Forced { tokens: forced.clone(), seen: Vec::new() };
    let yielded = lm.generate(&lm_input, min_len, max_len, &mut sampler).unwrap();
    assert_eq!(yielded, forced[..forced.len() - 1], "the tokens before EOS, EOS not passed on");
    // the sampler's input at the first steps, sos banned before min_len exactly as the reference
    for (step, row) in g["logp_kv_head"].to_vec2::<f32>().unwrap().iter().enumerate() {
        for (id, (ours, theirs)) in sampler.seen[step].iter().zip(row).enumerate() {
            let same = if theirs.is_finite() { (ours - theirs).abs() <= LOGP_ATOL } else { ours == theirs };
            assert!(same, "step {step}, id {id}: {ours} vs {theirs}");
        }
    }
}
