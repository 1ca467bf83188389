//! The causal HiFT vocoder of CosyVoice3 (`CausalHiFTGenerator`, weights = hift.pt), as
//! `cosyvoice/hifigan/generator.py` computes it: mel [1, 80, T] -> waveform [1, T * 480] at 24 kHz.
//!
//! 1. F0 per mel frame (float64 predictor), held for 480 samples, turned into a harmonic excitation;
//! 2. the mel through a look-ahead `conv_pre` and upsampling stages (nearest + causal conv), each adding the
//!    excitation's STFT downsampled to its rate and averaging Snake residual blocks;
//! 3. `conv_post` predicts log-magnitude and phase of a small STFT; its inverse is the waveform, clipped.
//!
//! Streaming (`finalize` false): the last 3 frames only serve the F0 look-ahead, the 4 before them only
//! `conv_pre`'s, and the last frame's samples are withheld; a later call on the grown mel reproduces them.

use candle_core::{DType, Tensor};

use crate::checkpoint::Checkpoint;
use crate::config::HiftConfig;
use crate::error::{Error, Result};
use crate::nn::{pad_zeros, repeat_frames, Conv1d};
use crate::rng::SineGenNoise;
use crate::source::{F0Predictor, Source, F0_LOOKAHEAD};
use crate::stft::Stft;

const POST_KERNEL: usize = 7;
const SNAKE_EPS: f64 = 1e-9;

/// Per dilation: Snake -> dilated causal conv -> Snake -> causal conv, added back to the input.
struct ResBlock {
    convs: Vec<(Conv1d, Conv1d)>,
    alphas: Vec<(Tensor, Tensor)>,
}

impl ResBlock {
    fn load(ckpt: &Checkpoint, prefix: &str, channels: usize, kernel: usize, dilations: &[usize]) -> Result<Self> {
        let shape = [channels, channels, kernel];
        let mut convs = Vec::new();
        let mut alphas = Vec::new();
        for (j, &d) in dilations.iter().enumerate() {
            let conv1 = Conv1d::weight_normed(ckpt, &format!("{prefix}.convs1.{j}"), shape, DType::F32)?;
            let conv2 = Conv1d::weight_normed(ckpt, &format!("{prefix}.convs2.{j}"), shape, DType::F32)?;
            convs.push((conv1.with_dilation(d), conv2));
            let alpha = |i: usize| ckpt.get_shaped(&format!("{prefix}.activations{i}.{j}.alpha"), &[channels]);
            alphas.push((alpha(1)?.reshape((1, channels, 1))?, alpha(2)?.reshape((1, channels, 1))?));
        }
        Ok(Self { convs, alphas })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for ((conv1, conv2), (a1, a2)) in self.convs.iter().zip(&self.alphas) {
            let h = causal(conv1, &snake(&x, a1)?)?;
            x = (causal(conv2, &snake(&h, a2)?)? + x)?;
        }
        Ok(x)
    }
}

/// `x + sin(alpha x)^2 / alpha`, a learned frequency per channel.
fn snake(x: &Tensor, alpha: &Tensor) -> Result<Tensor> {
    let sin2 = x.broadcast_mul(alpha)?.sin()?.sqr()?;
    Ok((x + sin2.broadcast_mul(&(alpha + SNAKE_EPS)?.recip()?)?)?)
}

/// A convolution left-padded so that output length equals input length.
fn causal(conv: &Conv1d, x: &Tensor) -> Result<Tensor> {
    conv.forward(&pad_zeros(x, conv.context(), 0)?)
}

/// The vocoder of `hift.pt` with SineGen2's fixed buffers.
pub struct Hift {
    pub f0_predictor: F0Predictor,
    pub source: Source,
    conv_pre: Conv1d,
    ups: Vec<Conv1d>,
    /// each stage's excitation downsampler and its left padding
    source_downs: Vec<(Conv1d, usize)>,
    source_resblocks: Vec<ResBlock>,
    resblocks: Vec<ResBlock>,
    conv_post: Conv1d,
    stft: Stft,
    cfg: HiftConfig,
}

impl Hift {
    /// Builds the vocoder from `hift.pt`'s state dict (keys with `generator.` already removed).
    pub fn load(ckpt: &Checkpoint, cfg: &HiftConfig, noise: SineGenNoise) -> Result<Self> {
        let base = cfg.base_channels;
        let wn = |prefix: &str, shape: [usize; 3]| Conv1d::weight_normed(ckpt, prefix, shape, DType::F32);
        let spec = cfg.n_fft + 2;
        let mut ups = Vec::new();
        let (mut source_downs, mut source_resblocks, mut resblocks) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &kernel) in cfg.upsample_kernel_sizes.iter().enumerate() {
            let ch = base >> (i + 1);
            ups.push(wn(&format!("ups.{i}"), [ch, base >> i, kernel])?);
            // stage i runs at prod(rates[..=i]) STFT frames per mel frame: the excitation is downsampled by the rest
            let rate: usize = cfg.upsample_rates[i + 1..].iter().product();
            let down =
                Conv1d::load(ckpt, &format!("source_downs.{i}"), [ch, spec, if rate == 1 { 1 } else { 2 * rate }], 1)?;
            source_downs.push((down.with_stride(rate), if rate == 1 { 0 } else { rate - 1 }));
            if let (Some(&k), Some(d)) =
                (cfg.source_resblock_kernel_sizes.get(i), cfg.source_resblock_dilation_sizes.get(i))
            {
                source_resblocks.push(ResBlock::load(ckpt, &format!("source_resblocks.{i}"), ch, k, d)?);
            }
            for (j, (&k, d)) in cfg.resblock_kernel_sizes.iter().zip(&cfg.resblock_dilation_sizes).enumerate() {
                let index = i * cfg.resblock_kernel_sizes.len() + j;
                resblocks.push(ResBlock::load(ckpt, &format!("resblocks.{index}"), ch, k, d)?);
            }
        }
        if source_resblocks.len() != ups.len() {
            return Err(Error::Input("hift: every upsampling stage needs a source resblock".into()));
        }
        let last = base >> ups.len();
        Ok(Self {
            f0_predictor: F0Predictor::load(ckpt, cfg)?,
            source: Source::load(ckpt, cfg, noise)?,
            conv_pre: wn("conv_pre", [base, cfg.in_channels, cfg.conv_pre_look_right + 1])?,
            ups,
            source_downs,
            source_resblocks,
            resblocks,
            conv_post: wn("conv_post", [spec, last, POST_KERNEL])?,
            stft: Stft::new(cfg.n_fft, cfg.hop_len),
            cfg: cfg.clone(),
        })
    }

    /// Shortest mel [`Hift::inference`] accepts (look-ahead frames give no output while streaming).
    pub fn min_frames(&self, finalize: bool) -> usize {
        if finalize {
            1
        } else {
            F0_LOOKAHEAD + self.cfg.conv_pre_look_right + 1
        }
    }

    /// Waveform [1, N] and excitation [1, 1, N_source] of a mel [1, 80, T]: N = T * 480 when `finalize`,
    /// else (T - 3 - conv_pre_look_right - 1) * 480.
    pub fn inference(&self, mel: &Tensor, finalize: bool) -> Result<(Tensor, Tensor)> {
        let t = mel.dim(2)?;
        if t < self.min_frames(finalize) {
            return Err(Error::Input(format!("the vocoder needs at least {} mel frames", self.min_frames(finalize))));
        }
        let f0 = self.f0_predictor.forward(mel, finalize)?.to_dtype(DType::F32)?;
        let source = self.source.forward(&f0.flatten_all()?.to_vec1::<f32>()?)?;
        let (mel, scale) = if finalize {
            (pad_zeros(mel, 0, self.conv_pre.context())?, 0) // zeros stand in for conv_pre's future frames
        } else {
            (mel.narrow(2, 0, t - F0_LOOKAHEAD)?, self.cfg.upsample_scale())
        };
        let wav = self.decode(&mel, &source)?;
        let keep = wav.dim(1)? - scale; // while streaming the last frame still depends on future frames
        Ok((wav.narrow(1, 0, keep)?, source))
    }

    /// Mel [1, 80, T + look-ahead] (conv_pre's future frames included) and excitation [1, 1, N] -> the
    /// clipped waveform of the first T frames [1, T * 480].
    fn decode(&self, mel: &Tensor, source: &Tensor) -> Result<Tensor> {
        let mut x = self.conv_pre.forward(mel)?;
        // STFT frames beyond conv_pre's output belong to its look-ahead frames: dropped
        let keep = x.dim(2)? * self.cfg.upsample_rates.iter().product::<usize>() + 1;
        let (re, im) = self.stft.forward(&source.flatten_all()?.to_vec1::<f32>()?)?;
        let spec = Tensor::cat(&[re.narrow(2, 0, keep)?, im.narrow(2, 0, keep)?], 1)?;
        let per_stage = self.cfg.resblock_kernel_sizes.len();
        for (i, up) in self.ups.iter().enumerate() {
            let rate = self.cfg.upsample_rates[i];
            x = causal(up, &repeat_frames(&candle_nn::ops::leaky_relu(&x, self.cfg.lrelu_slope)?, rate)?)?;
            if i == self.ups.len() - 1 {
                x = Tensor::cat(&[&x.narrow(2, 1, 1)?, &x], 2)?; // reflect pad 1: STFT frames = samples / hop + 1
            }
            let (down, pad) = &self.source_downs[i];
            let excitation = down.forward(&pad_zeros(&spec, *pad, 0)?)?;
            x = (x + self.source_resblocks[i].forward(&excitation)?)?;
            let blocks = &self.resblocks[i * per_stage..(i + 1) * per_stage];
            let mut sum = blocks[0].forward(&x)?;
            for block in &blocks[1..] {
                sum = (sum + block.forward(&x)?)?;
            }
            x = (sum / per_stage as f64)?;
        }
        // the reference's quirks: torch's default slope 0.01 here, and sin() of the predicted phase
        let x = causal(&self.conv_post, &candle_nn::ops::leaky_relu(&x, 0.01)?)?;
        let bins = self.cfg.n_fft / 2 + 1;
        let magnitude = x.narrow(1, 0, bins)?.exp()?.minimum(1e2)?;
        let phase = x.narrow(1, bins, bins)?.sin()?;
        let wav = self.stft.inverse(&(&magnitude * phase.cos()?)?, &(&magnitude * phase.sin()?)?)?;
        let limit = self.cfg.audio_limit;
        Ok(wav.clamp(-limit, limit)?)
    }
}
