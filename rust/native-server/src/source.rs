//! The vocoder's excitation: the causal F0 predictor (in float64, as the reference evaluates it) and the
//! harmonic source (SineGen2 + the neural-source-filter merge), as `cosyvoice/hifigan/f0_predictor.py` and
//! `source.py` compute them.
//!
//! The phase is accumulated per mel frame and reaches 1e4-1e5 rad on long inputs, so the float32 operations
//! below keep the reference's order: that is what matches it to ~1e-5 instead of ~1e-2.

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;

use crate::checkpoint::Checkpoint;
use crate::config::HiftConfig;
use crate::error::Result;
use crate::nn::{linear, pad_zeros, Conv1d};
use crate::rng::SineGenNoise;

/// Mel frames the F0 predictor's first convolution looks ahead.
pub const F0_LOOKAHEAD: usize = 3;
const CAUSAL_KERNEL: usize = 3;

/// Five weight-normed convolutions with ELU, then a linear head whose absolute value is the pitch in Hz.
pub struct F0Predictor {
    convs: Vec<Conv1d>,
    head: Linear,
}

impl F0Predictor {
    pub fn load(ckpt: &Checkpoint, cfg: &HiftConfig) -> Result<Self> {
        let (c, f0) = (cfg.f0_predictor.cond_channels, &cfg.f0_predictor);
        let mut convs = vec![Conv1d::weight_normed(
            ckpt,
            "f0_predictor.condnet.0",
            [c, f0.in_channels, F0_LOOKAHEAD + 1],
            DType::F64,
        )?];
        for i in 1..5 {
            let prefix = format!("f0_predictor.condnet.{}", 2 * i); // ELUs at the odd indices
            convs.push(Conv1d::weight_normed(ckpt, &prefix, [c, c, CAUSAL_KERNEL], DType::F64)?);
        }
        let head = linear(ckpt, "f0_predictor.classifier", [f0.num_class, c], true)?;
        let head =
            Linear::new(head.weight().to_dtype(DType::F64)?, head.bias().map(|b| b.to_dtype(DType::F64)).transpose()?);
        Ok(Self { convs, head })
    }

    /// F0 in Hz, float64 [1, T] for a mel [1, mels, T] ([1, T - 3] unless `finalize`: the last frames are
    /// look-ahead only).
    pub fn forward(&self, mel: &Tensor, finalize: bool) -> Result<Tensor> {
        let mut x = mel.to_dtype(DType::F64)?;
        for (i, conv) in self.convs.iter().enumerate() {
            x = if i > 0 {
                pad_zeros(&x, CAUSAL_KERNEL - 1, 0)?
            } else if finalize {
                pad_zeros(&x, 0, F0_LOOKAHEAD)? // zeros stand in for the future frames
            } else {
                x
            };
            x = conv.forward(&x)?.elu(1.0)?;
        }
        Ok(self.head.forward(&x.transpose(1, 2)?)?.squeeze(2)?.abs()?)
    }
}

/// SineGen2 and the merge of its harmonics into one excitation channel (`m_source`).
pub struct Source {
    merge: Linear,
    noise: SineGenNoise,
    harmonics: usize,
    sampling_rate: f32,
    upsample_scale: usize,
    sine_amp: f32,
    noise_std: f32,
    voiced_threshold: f32,
}

impl Source {
    pub fn load(ckpt: &Checkpoint, cfg: &HiftConfig, noise: SineGenNoise) -> Result<Self> {
        let harmonics = cfg.nb_harmonics + 1;
        Ok(Self {
            merge: linear(ckpt, "m_source.l_linear", [1, harmonics], true)?,
            noise,
            harmonics,
            sampling_rate: cfg.sampling_rate as f32,
            upsample_scale: cfg.upsample_scale(),
            sine_amp: cfg.nsf_alpha as f32,
            noise_std: cfg.nsf_sigma as f32,
            voiced_threshold: cfg.nsf_voiced_threshold as f32,
        })
    }

    /// The excitation [1, 1, T * upsample_scale] for float32 F0 per mel frame (`f0`, T values, each held for
    /// `upsample_scale` samples).
    pub fn forward(&self, f0: &[f32]) -> Result<Tensor> {
        let (h, scale) = (self.harmonics, self.upsample_scale);
        let n = f0.len() * scale;
        // cycles per sample of each harmonic, integer part dropped; the initial phases join sample 0 only
        let cycles = |frame: usize| -> Vec<f32> {
            (0..h).map(|k| (f0[frame] * (k + 1) as f32 / self.sampling_rate) % 1.0).collect()
        };
        let sample = |s: usize, per_frame: &[Vec<f32>], k: usize| -> f32 {
            per_frame[s / scale][k] + if s == 0 { self.noise.rand_ini[k] } else { 0.0 }
        };
        let per_sample: Vec<Vec<f32>> = (0..f0.len()).map(cycles).collect();
        // the reference integrates per frame: linear down-sampling (torch's half-pixel rule) of the
        // per-sample cycles, then a float64 running sum
        let mut sums = vec![0f64; h];
        let mut phase = vec![0f32; f0.len() * h];
        for i in 0..f0.len() {
            let src = (scale as f32 * (i as f32 + 0.5) - 0.5).max(0.0);
            let i0 = src.floor() as usize;
            let i1 = if i0 < n - 1 { i0 + 1 } else { i0 };
            let l1 = (src - i0 as f32).clamp(0.0, 1.0);
            for k in 0..h {
                let down = (1.0 - l1) * sample(i0, &per_sample, k) + l1 * sample(i1, &per_sample, k);
                sums[k] += down as f64;
                phase[i * h + k] = sums[k] as f32 * 2.0 * std::f32::consts::PI * scale as f32;
            }
        }
        let uniform = self.noise.sine_waves(n);
        let weight = self.merge.weight().flatten_all()?.to_vec1::<f32>()?;
        let bias = self.merge.bias().map(|b| b.to_vec1::<f32>()).transpose()?.map_or(0.0, |b| b[0]);
        let mut out = Vec::with_capacity(n);
        for s in 0..n {
            let frame = s / scale;
            let voiced = if f0[frame] > self.voiced_threshold { 1.0f32 } else { 0.0 };
            let noise_amp = voiced * self.noise_std + (1.0 - voiced) * self.sine_amp / 3.0;
            let mut acc = 0f32;
            for k in 0..h {
                let sine = phase[frame * h + k].sin() * self.sine_amp;
                acc += weight[k] * (sine * voiced + noise_amp * uniform[s * h + k]);
            }
            out.push((acc + bias).tanh());
        }
        Ok(Tensor::from_vec(out, (1, 1, n), &Device::Cpu)?)
    }
}
