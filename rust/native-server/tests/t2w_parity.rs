//! Token to wave end to end with fixed tokens, against the official streaming run (golden `t2w.safetensors`):
//! every chunk's boundaries, the mel it hands the vocoder and its PCM, with the flow noise and the vocoder's
//! buffers made in Rust (nothing injected).

mod common;

use candle_core::Tensor;
use cosyvoice_native::rng::cfm_noise;
use cosyvoice_native::t2w::{stream_all, FlowPrompt};
use cosyvoice_native::Bundle;

// cosyvoice/tools/parity/tolerances.py: the mel feeding the vocoder, the vocoder on the reference's mel, and
// end-to-end PCM (the vocoder's running phase amplifies rounding-level mel differences)
const MEL_ATOL: f64 = 1e-5;
const VOCODER_ATOL: f64 = 2e-4;
const PCM_ATOL: f64 = 5e-3;

#[test]
fn streamed_token2wav_matches_reference() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "t2w.safetensors");
    let f = common::load(&dir, "flow.safetensors");
    let bundle = Bundle::open(&dir.join("tiny_bundle")).unwrap();
    let (flow, hift) = (bundle.flow(cfm_noise().unwrap()).unwrap(), bundle.hift().unwrap());
    let prompt = FlowPrompt {
        tokens: common::ids(&f["prompt_token"]),
        feat: f["prompt_feat"].clone(),
        embedding: f["embedding"].clone(),
    };
    let chunks = stream_all(&flow, &hift, &prompt, &common::ids(&g["token"])).unwrap();
    let expected = common::scalar(&dir, "t2w.safetensors", "chunks");
    let expected = expected.as_array().unwrap();
    assert_eq!(chunks.len(), expected.len(), "chunk count");

    let mut report = Vec::new();
    let mut ref_mels = Vec::new();
    for (i, (chunk, want)) in chunks.iter().zip(expected).enumerate() {
        assert_eq!(chunk.tokens.0 as u64, want["token_offset"].as_u64().unwrap(), "chunk {i} offset");
        assert_eq!(chunk.pcm.dim(1).unwrap() as u64, want["n_samples"].as_u64().unwrap(), "chunk {i} samples");
        let ref_mel = &g[&format!("chunk{i}_flow_mel_used")];
        let mel_err = common::max_abs_diff(&chunk.mel, ref_mel);
        assert!(mel_err <= MEL_ATOL, "chunk {i} mel max abs {mel_err}");
        let pcm_err = common::max_abs_diff(&chunk.pcm, &g[&format!("chunk{i}_pcm")]);
        assert!(pcm_err <= PCM_ATOL, "chunk {i} pcm max abs {pcm_err}");
        ref_mels.push(ref_mel.clone());
        // the vocoder alone, on the reference's mel so far: every flow difference taken out
        let last = i + 1 == chunks.len();
        let speech = hift.inference(&Tensor::cat(&ref_mels, 2).unwrap(), last).unwrap().0;
        let before = want["speech_offset_before"].as_u64().unwrap() as usize;
        let ours = speech.narrow(1, before, speech.dim(1).unwrap() - before).unwrap();
        let vocoder_err = common::max_abs_diff(&ours, &g[&format!("chunk{i}_pcm")]);
        assert!(vocoder_err <= VOCODER_ATOL, "chunk {i} vocoder on the reference mel max abs {vocoder_err}");
        report.push(format!("chunk{i} mel {mel_err:.2e} vocoder {vocoder_err:.2e} pcm {pcm_err:.2e}"));
    }
    println!("parity t2w: {}", report.join("; "));
}
