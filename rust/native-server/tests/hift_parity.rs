//! The vocoder against the official reference (golden `hift.safetensors`, `real_config_rng.safetensors`):
//! the replayed fixed buffers, F0, the harmonic source, its STFT, and the waveform of a whole call and of
//! token2wav's streaming calls.

mod common;

use candle_core::{DType, Tensor};
use cosyvoice_native::rng::{cfm_noise, SineGenNoise};
use cosyvoice_native::stft::Stft;
use cosyvoice_native::Bundle;

// golden README section 9 / cosyvoice/tools/parity/tolerances.py
const AUDIO_ATOL: f64 = 2e-4;
const F0_RTOL: f64 = 1e-6;
// the flow noise goes through log/cos/sin, whose float32 results may differ from torch's vector code by an ulp
const NOISE_ATOL: f64 = 1e-5;

fn vector(t: &Tensor) -> Tensor {
    t.flatten_all().unwrap()
}

#[test]
fn fixed_buffers_replay_the_reference() {
    let Some(dir) = common::golden_dir() else { return };
    let bundle = Bundle::open(&dir.join("tiny_bundle")).unwrap();
    let flow = common::load(&dir, "flow.safetensors");
    let hift = common::load(&dir, "hift.safetensors");
    let real = common::load(&dir, "real_config_rng.safetensors");

    let noise = cfm_noise().unwrap();
    let prefix = &flow["rand_noise_prefix"];
    let noise_err = common::max_abs_diff(&noise.narrow(2, 0, prefix.dim(2).unwrap()).unwrap(), prefix);
    assert!(noise_err <= NOISE_ATOL, "flow noise max abs {noise_err}");
    let real_head = &real["rand_noise_head"];
    let head_err = common::max_abs_diff(&noise.narrow(2, 0, real_head.dim(2).unwrap()).unwrap(), real_head);
    assert!(head_err <= NOISE_ATOL, "flow noise (real config) max abs {head_err}");

    let check = |sine: &SineGenNoise, rand_ini: &Tensor, head: &Tensor| {
        let ini = Tensor::new(sine.rand_ini.as_slice(), &candle_core::Device::Cpu).unwrap();
        assert_eq!(common::max_abs_diff(&ini, &vector(rand_ini)), 0.0, "rand_ini");
        let n = head.dim(0).unwrap();
        let waves = Tensor::from_vec(sine.sine_waves(n), head.dims(), &candle_core::Device::Cpu).unwrap();
        assert_eq!(common::max_abs_diff(&waves, head), 0.0, "sine_waves");
    };
    check(
        &SineGenNoise::for_model(&bundle.config).unwrap(),
        &hift["sinegen_rand_ini"],
        &hift["sinegen_sine_waves_head"],
    );
    let mut released = bundle.config.clone();
    released.hift.f0_predictor.cond_channels = 512; // the released model's F0 predictor width
    check(&SineGenNoise::for_model(&released).unwrap(), &real["rand_ini"], &real["sine_waves_head"]);
    println!("parity rng: flow noise {noise_err:.2e}, rand_ini and sine_waves exact (tiny and released dims)");
}

#[test]
fn hift_matches_reference() {
    let Some(dir) = common::golden_dir() else { return };
    let g = common::load(&dir, "hift.safetensors");
    let hift = Bundle::open(&dir.join("tiny_bundle")).unwrap().hift().unwrap();
    let mel = &g["mel"];
    let mut report = Vec::new();
    let mut audio = |name: &str, ours: &Tensor, theirs: &Tensor| {
        let err = common::max_abs_diff(&vector(ours), &vector(theirs));
        assert!(err <= AUDIO_ATOL, "{name}: max abs {err}");
        report.push(format!("{name} {err:.2e}"));
    };

    let f0_check = |ours: &Tensor, theirs: &Tensor| {
        let rel = ((ours - theirs).unwrap().abs().unwrap() / theirs.abs().unwrap()).unwrap();
        let rel = rel.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
        assert!(rel <= F0_RTOL, "f0 max rel {rel}");
        rel
    };
    let f0 = hift.f0_predictor.forward(mel, true).unwrap();
    let f0_rel = f0_check(&f0, &g["full_f0"]);
    let source =
        hift.source.forward(&f0.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1().unwrap()).unwrap();
    audio("source", &source, &g["full_source"]);
    let (re, im) = Stft::new(16, 4).forward(&vector(&source).to_vec1().unwrap()).unwrap();
    audio("stft_re", &re.narrow(2, 0, 512).unwrap(), &g["full_stft_re_head"]);
    audio("stft_im", &im.narrow(2, 0, 512).unwrap(), &g["full_stft_im_head"]);

    audio("full_speech", &hift.inference(mel, true).unwrap().0, &g["full_speech"]);
    let head = mel.narrow(2, 0, 36).unwrap();
    f0_check(&hift.f0_predictor.forward(&head, false).unwrap(), &g["stream0_f0"]);
    audio("stream0_raw_speech", &hift.inference(&head, false).unwrap().0, &g["stream0_raw_speech"]);
    audio("stream1_raw_speech", &hift.inference(mel, true).unwrap().0, &g["stream1_raw_speech"]);
    println!("parity hift: f0 rel {f0_rel:.2e}, {}", report.join(", "));
}
