//! The flow against the official reference (golden `flow.safetensors`): token features, speaker vector, the
//! first DiT call, and the mel of every call token2wav issues (full attention, chunk-causal, look-ahead).

mod common;

use candle_core::{Device, Tensor};
use cosyvoice_native::Bundle;

const FLOW_MEL_ATOL: f64 = 1e-3; // golden README section 9 / cosyvoice/tools/parity/tolerances.py

#[test]
fn flow_matches_reference() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "flow.safetensors");
    let flow = Bundle::open(&dir.join("tiny_bundle")).unwrap().flow(g["rand_noise_prefix"].clone()).unwrap();
    let (token, prompt_token) = (common::ids(&g["token"]), common::ids(&g["prompt_token"]));
    let (prompt_feat, embedding) = (&g["prompt_feat"], &g["embedding"]);
    let mut report = Vec::new();
    let mut check = |name: &str, ours: &Tensor, theirs: &Tensor| {
        let err = common::max_abs_diff(ours, theirs);
        assert!(err <= FLOW_MEL_ATOL, "{name}: max abs {err}");
        report.push(format!("{name} {err:.2e}"));
    };

    let all: Vec<u32> = prompt_token.iter().chain(&token).copied().collect();
    let mu = flow.token_condition(&all, true).unwrap().transpose(1, 2).unwrap();
    check("mu", &mu, &g["nonstream_mu"]);
    let spks = flow.speaker_condition(embedding).unwrap();
    check("spks", &spks, &g["nonstream_spks"]);

    // the first estimator call of the non-streaming solve: x = [z, z] at t = 0, conditions over zeros
    let n = mu.dim(2).unwrap();
    let z = g["rand_noise_prefix"].narrow(2, 0, n).unwrap();
    let cond = prompt_feat.transpose(1, 2).unwrap().pad_with_zeros(2, 0, n - prompt_feat.dim(1).unwrap()).unwrap();
    let guided = |c: &Tensor| Tensor::cat(&[c, &c.zeros_like().unwrap()], 0).unwrap();
    let t0 = Tensor::new(&[0f32, 0.0], &Device::Cpu).unwrap();
    let est0 = flow
        .dit()
        .forward(&Tensor::cat(&[&z, &z], 0).unwrap(), &guided(&mu), &t0, &guided(&spks), &guided(&cond), false)
        .unwrap();
    check("est0_out", &est0, &g["nonstream_est0_out"]);

    let mel = |tokens: usize, streaming: bool, finalize: bool| {
        flow.inference(&token[..tokens], &prompt_token, prompt_feat, embedding, streaming, finalize).unwrap()
    };
    check("nonstream_mel", &mel(50, false, true), &g["nonstream_mel"]);
    check("chunkmask_final_mel", &mel(50, true, true), &g["chunkmask_final_mel"]);
    check("stream0_mel", &mel(30, true, false), &g["stream0_mel"]);
    check("stream1_mel", &mel(50, false, true), &g["stream1_mel"]);
    println!("parity flow: {}", report.join(", "));
}
