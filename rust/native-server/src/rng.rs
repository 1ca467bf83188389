//! The official model's fixed random buffers, replayed bit for bit from torch's CPU generator, so the native
//! engine needs neither Python nor a file of noise (`cosyvoice/rng.py` does the same with torch).
//!
//! The official constructors reseed torch's global generator with 0, draw the flow's start noise
//! `randn(1, 80, 15000)`, let the modules built next consume their random initialisation (flow embedding and
//! speaker projection, the F0 predictor's convolutions and head), then draw SineGen2's `rand_ini` and its
//! uniform noise buffer. Only the number and kind of the draws in between matter.

use candle_core::{Device, Tensor};

use crate::config::ModelConfig;
use crate::error::Result;

const OFFICIAL_SEED: u32 = 0;
const CFM_NOISE_CHANNELS: usize = 80; // the reference hard-codes 80 channels and 300 s at 50 frames/s
const CFM_NOISE_FRAMES: usize = 50 * 300;
const F0_PREDICTOR_KERNELS: [usize; 5] = [4, 3, 3, 3, 3];

/// torch's CPU generator: a 32-bit Mersenne Twister (mt19937) seeded as `torch.manual_seed` seeds it.
#[derive(Clone)]
pub struct TorchGenerator {
    state: [u32; 624],
    index: usize,
}

impl TorchGenerator {
    pub fn new(seed: u32) -> Self {
        let mut state = [0u32; 624];
        state[0] = seed;
        for i in 1..624 {
            state[i] = 1_812_433_253u32.wrapping_mul(state[i - 1] ^ (state[i - 1] >> 30)).wrapping_add(i as u32);
        }
        Self { state, index: 624 }
    }

    fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            for i in 0..624 {
                let y = (self.state[i] & 0x8000_0000) | (self.state[(i + 1) % 624] & 0x7fff_ffff);
                let mut next = self.state[(i + 397) % 624] ^ (y >> 1);
                if y & 1 != 0 {
                    next ^= 0x9908_b0df;
                }
                self.state[i] = next;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `n` float32 draws of `uniform_(0, 1)` / `rand`: the low 24 bits of one 32-bit draw each, over 2^24.
    pub fn uniform(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| (self.next_u32() & 0xff_ffff) as f32 / (1u32 << 24) as f32).collect()
    }

    /// Advances past `n` draws (an initialiser's `uniform_` on a tensor of `n` floats).
    pub fn skip(&mut self, n: usize) {
        (0..n).for_each(|_| {
            self.next_u32();
        });
    }

    /// `n` (at least 16) float32 draws of `normal_` / `randn`: torch fills the tensor with uniforms, then turns
    /// each block of 16 into normals by Box-Muller (u1 = 1 - data[j], u2 = data[j + 8]); a ragged tail is
    /// redrawn as one more block over the last 16 elements.
    pub fn normal(&mut self, n: usize) -> Vec<f32> {
        assert!(n >= 16, "torch draws fewer than 16 normals another way");
        let mut data = self.uniform(n);
        for start in (0..=n - 16).step_by(16) {
            box_muller_16(&mut data[start..start + 16]);
        }
        if !n.is_multiple_of(16) {
            let tail = n - 16;
            data[tail..].copy_from_slice(&self.uniform(16));
            box_muller_16(&mut data[tail..]);
        }
        data
    }
}

fn box_muller_16(data: &mut [f32]) {
    for j in 0..8 {
        let u1 = 1.0 - data[j];
        let u2 = data[j + 8];
        let radius = (-2.0 * u1.ln()).sqrt();
        let theta = (2.0 * std::f64::consts::PI * u2 as f64) as f32;
        data[j] = radius * theta.cos();
        data[j + 8] = radius * theta.sin();
    }
}

/// The flow's start noise [1, 80, 15000]: the first draw after the official reseed.
pub fn cfm_noise() -> Result<Tensor> {
    let mut generator = TorchGenerator::new(OFFICIAL_SEED);
    cfm_noise_from(&mut generator)
}

fn cfm_noise_from(generator: &mut TorchGenerator) -> Result<Tensor> {
    let values = generator.normal(CFM_NOISE_CHANNELS * CFM_NOISE_FRAMES);
    Ok(Tensor::from_vec(values, (1, CFM_NOISE_CHANNELS, CFM_NOISE_FRAMES), &Device::Cpu)?)
}

/// SineGen2's fixed buffers: the initial phases and the uniform noise, read from sample 0 on every call.
#[derive(Clone)]
pub struct SineGenNoise {
    /// [harmonics], entry 0 (the fundamental) is 0.
    pub rand_ini: Vec<f32>,
    harmonics: usize,
    at_sine_waves: TorchGenerator,
}

impl SineGenNoise {
    /// Replays every draw from the reseed to `rand_ini` for the bundle's dims (flow vocabulary, mel and
    /// speaker sizes; F0 predictor channels; harmonics).
    pub fn for_model(cfg: &ModelConfig) -> Result<Self> {
        let mut g = TorchGenerator::new(OFFICIAL_SEED);
        cfm_noise_from(&mut g)?;
        let (flow, f0) = (&cfg.flow, &cfg.hift.f0_predictor);
        g.normal(flow.vocab_size * flow.input_size); // nn.Embedding
        skip_affine(&mut g, flow.output_size, flow.spk_embed_dim); // nn.Linear
        let mut in_channels = f0.in_channels;
        for kernel in F0_PREDICTOR_KERNELS {
            skip_affine(&mut g, f0.cond_channels, in_channels * kernel);
            in_channels = f0.cond_channels;
        }
        skip_affine(&mut g, f0.num_class, f0.cond_channels);
        let harmonics = cfg.hift.nb_harmonics + 1;
        let mut rand_ini = g.uniform(harmonics);
        rand_ini[0] = 0.0;
        Ok(Self { rand_ini, harmonics, at_sine_waves: g })
    }

    /// `sine_waves[0, :n_samples, :]`, sample-major ([n_samples * harmonics]).
    pub fn sine_waves(&self, n_samples: usize) -> Vec<f32> {
        self.at_sine_waves.clone().uniform(n_samples * self.harmonics)
    }
}

/// `reset_parameters` of a Linear / Conv1d: a kaiming-uniform weight, then a uniform bias (one draw per float).
fn skip_affine(g: &mut TorchGenerator, out: usize, fan_in: usize) {
    g.skip(out * fan_in + out);
}
