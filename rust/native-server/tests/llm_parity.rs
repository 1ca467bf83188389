//! The LLM against the official reference (golden `llm.safetensors`): the prompt embedding, teacher-forced
//! hidden states and log-probs on the step-by-step KV-cache path and the whole-sequence path, greedy tokens.

mod common;

use candle_core::{IndexOp, Tensor};
use cosyvoice_native::llm::{CosyVoice3Lm, KvCache};
use cosyvoice_native::Bundle;

// golden README section 9 / cosyvoice/tools/parity/tolerances.py
const HIDDEN_ATOL: f64 = 1e-4;
const LOGP_ATOL: f64 = 2e-4;

/// Hidden states [N, H] of the reference's forced tokens fed one at a time after the prompt.
fn kv_path(lm: &CosyVoice3Lm, lm_input: &Tensor, forced: &[u32]) -> Tensor {
    let mut cache = KvCache::default();
    let prompt = lm.forward(lm_input, &mut cache).unwrap();
    let mut rows = vec![prompt.i(prompt.dim(0).unwrap() - 1).unwrap().unsqueeze(0).unwrap()];
    for token in &forced[..forced.len() - 1] {
        rows.push(lm.forward(&lm.speech_embeddings(&[*token]).unwrap(), &mut cache).unwrap());
    }
    Tensor::cat(&rows, 0).unwrap()
}

#[test]
fn llm_matches_reference_teacher_forced() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "llm.safetensors");
    let lm = Bundle::open(&dir.join("tiny_bundle")).unwrap().llm().unwrap();
    let (text, prompt_text, prompt_speech) = (
        common::ids(&g["text_tokens"]),
        common::ids(&g["prompt_text_tokens"]),
        common::ids(&g["prompt_speech_tokens"]),
    );
    let forced = common::ids(&g["forced_tokens"]);

    let lm_input = lm.lm_input(&text, &prompt_text, &prompt_speech).unwrap();
    assert_eq!(common::max_abs_diff(&lm_input, &g["lm_input"].squeeze(0).unwrap()), 0.0, "prompt rows differ");
    let (min_len, max_len) = CosyVoice3Lm::length_limits(text.len());
    assert_eq!(min_len as u64, common::scalar(&dir, "llm.safetensors", "min_len").as_u64().unwrap());
    assert_eq!(max_len as u64, common::scalar(&dir, "llm.safetensors", "max_len").as_u64().unwrap());

    let hidden = kv_path(&lm, &lm_input, &forced);
    let hidden_err = common::max_abs_diff(&hidden, &g["hidden_kv"]);
    assert!(hidden_err <= HIDDEN_ATOL, "KV-path hidden max abs {hidden_err}");

    // the sampler's input at the first steps: sos masked before min_len, every other entry compared
    let logp = lm.log_probs(&hidden).unwrap();
    let head = g["logp_kv_head"].clone();
    let sos = lm.sos() as usize;
    let ours_head = logp.narrow(0, 0, head.dim(0).unwrap()).unwrap();
    let finite = |t: &Tensor| {
        Tensor::cat(&[t.narrow(1, 0, sos).unwrap(), t.narrow(1, sos + 1, t.dim(1).unwrap() - sos - 1).unwrap()], 1)
            .unwrap()
    };
    let head_err = common::max_abs_diff(&finite(&ours_head), &finite(&head));
    assert!(head_err <= LOGP_ATOL, "log-probs (12 steps, all ids) max abs {head_err}");
    let sos_column = head.narrow(1, sos, 1).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert!(sos_column.iter().all(|v| *v == f32::NEG_INFINITY), "the reference masks sos before min_len");

    // every step: the reference's top-32 log-probs, and the greedy token
    let top_idx = g["logp_kv_top32_indices"].clone();
    let top_val = g["logp_kv_top32_values"].clone();
    let ours_at_top = logp.gather(&top_idx.to_dtype(candle_core::DType::U32).unwrap(), 1).unwrap();
    let top_err = common::max_abs_diff(&ours_at_top, &top_val);
    assert!(top_err <= LOGP_ATOL, "top-32 log-probs max abs {top_err}");
    let greedy = common::ids(&logp.argmax(1).unwrap());
    let expected = common::ids(&top_idx.narrow(1, 0, 1).unwrap());
    let values = top_val.to_vec2::<f32>().unwrap();
    for (step, (ours, theirs)) in greedy.iter().zip(&expected).enumerate() {
        let near_tie = values[step][0] - values[step][1] < LOGP_ATOL as f32;
        assert!(ours == theirs || near_tie, "step {step}: greedy token {ours}, reference {theirs}");
    }

    // the whole teacher-forced sequence in one call
    let fed = lm.speech_embeddings(&forced[..forced.len() - 1]).unwrap();
    let full = lm.forward(&Tensor::cat(&[&lm_input, &fed], 0).unwrap(), &mut KvCache::default()).unwrap();
    let full_err = common::max_abs_diff(&full, &g["hidden_full"]);
    assert!(full_err <= HIDDEN_ATOL, "full-forward hidden max abs {full_err}");
    println!(
        "parity llm: hidden (KV) {hidden_err:.2e}, hidden (full) {full_err:.2e}, logp head {head_err:.2e}, \
         top-32 logp {top_err:.2e}, greedy tokens equal at {} steps",
        greedy.len()
    );
}
