//! Speech tokens -> mel: the CosyVoice3 flow (`CausalMaskedDiffWithDiT`, weights = flow.pt), as
//! `cosyvoice/flow/model.py` and `cfm.py` compute it:
//!
//! 1. prompt tokens ++ new tokens -> embedding -> look-ahead convs (each token sees the next
//!    `pre_lookahead_len`) -> repeated `token_mel_ratio` times = `mu`, one row per mel frame;
//! 2. `spks` = Linear(L2-normalised speaker embedding); `cond` = the prompt mel, zeros after it;
//! 3. Euler steps on a cosine time grid from the fixed noise, each one DiT call on a batch of two (the
//!    conditions, then the same frames with the conditions zeroed), guided v = (1 + w) v_cond - w v_uncond;
//! 4. the frames after the prompt are the output.

use std::sync::atomic::{AtomicBool, Ordering};

use candle_core::{Device, Module, Tensor};
use candle_nn::Linear;

use crate::checkpoint::Checkpoint;
use crate::config::FlowConfig;
use crate::dit::Dit;
use crate::error::{Error, Result};
use crate::nn::{linear, pad_zeros, repeat_frames, Conv1d};

/// The flow model of `flow.pt` with its start noise.
pub struct Flow {
    embedding: Tensor,
    spk_affine: Linear,
    lookahead_convs: [Conv1d; 2],
    dit: Dit,
    noise: Tensor,
    cfg: FlowConfig,
}

impl Flow {
    /// Builds the flow from `flow.pt`'s state dict. `noise` [1, mel, L] is the CFM's fixed start noise
    /// (frame i of every utterance starts from column i): the reference's buffer, not in any checkpoint.
    pub fn load(ckpt: &Checkpoint, cfg: &FlowConfig, noise: Tensor) -> Result<Self> {
        let (mel, c, la) = (cfg.input_size, cfg.pre_lookahead_channels, cfg.pre_lookahead_len);
        if noise.dims().len() != 3 || noise.dim(1)? != cfg.output_size {
            return Err(Error::Input(format!(
                "flow noise must be [1, {}, L], got {:?}",
                cfg.output_size,
                noise.dims()
            )));
        }
        Ok(Self {
            embedding: ckpt.get_shaped("input_embedding.weight", &[cfg.vocab_size, mel])?,
            spk_affine: linear(ckpt, "spk_embed_affine_layer", [cfg.output_size, cfg.spk_embed_dim], true)?,
            lookahead_convs: [
                Conv1d::load(ckpt, "pre_lookahead_layer.conv1", [c, mel, la + 1], 1)?,
                Conv1d::load(ckpt, "pre_lookahead_layer.conv2", [mel, c, 3], 1)?,
            ],
            dit: Dit::load(ckpt, "decoder.estimator", &cfg.dit)?,
            noise,
            cfg: cfg.clone(),
        })
    }

    /// `mu` [1, frames, mel] for `tokens` (prompt ++ new). With `finalize` false the last `pre_lookahead_len`
    /// tokens are look-ahead only, so frames = (T - pre_lookahead_len) * token_mel_ratio.
    pub fn token_condition(&self, tokens: &[u32], finalize: bool) -> Result<Tensor> {
        let la = self.cfg.pre_lookahead_len;
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::Input(format!("speech token {bad} outside 0..{}", self.cfg.vocab_size - 1)));
        }
        if !finalize && tokens.len() < la {
            return Err(Error::Input(format!("finalize=false needs at least {la} tokens of look-ahead")));
        }
        let ids = Tensor::new(tokens, &Device::Cpu)?;
        let x = self.embedding.index_select(&ids, 0)?.t()?.unsqueeze(0)?; // [1, mel, T]
        let (x, padded) =
            if finalize { (x.clone(), pad_zeros(&x, 0, la)?) } else { (x.narrow(2, 0, tokens.len() - la)?, x) };
        let [conv1, conv2] = &self.lookahead_convs;
        let h = candle_nn::ops::leaky_relu(&conv1.forward(&padded)?, 0.01)?;
        let h = (conv2.forward(&pad_zeros(&h, conv2.context(), 0)?)? + x)?;
        Ok(repeat_frames(&h, self.cfg.token_mel_ratio)?.transpose(1, 2)?)
    }

    /// Tokens after a chunk that the look-ahead layer reads (`pre_lookahead_len`).
    pub fn lookahead(&self) -> usize {
        self.cfg.pre_lookahead_len
    }

    /// Mel frames per speech token.
    pub fn token_mel_ratio(&self) -> usize {
        self.cfg.token_mel_ratio
    }

    /// The velocity estimator.
    pub fn dit(&self) -> &Dit {
        &self.dit
    }

    /// `spks` [1, mel] of a speaker embedding [1, spk_embed_dim] (its direction only: L2-normalised).
    pub fn speaker_condition(&self, embedding: &Tensor) -> Result<Tensor> {
        let norm = embedding.sqr()?.sum_keepdim(1)?.sqrt()?.maximum(1e-12)?;
        Ok(self.spk_affine.forward(&embedding.broadcast_div(&norm)?)?)
    }

    /// Mel [1, mel, T_out] after the prompt for `token` after `prompt_token`, the prompt's mel `prompt_feat`
    /// [1, F, mel] and the speaker `embedding` [1, spk_embed_dim]; chunk-causal attention when `streaming`,
    /// the last `pre_lookahead_len` tokens as look-ahead only unless `finalize`.
    pub fn inference(
        &self,
        token: &[u32],
        prompt_token: &[u32],
        prompt_feat: &Tensor,
        embedding: &Tensor,
        streaming: bool,
        finalize: bool,
    ) -> Result<Tensor> {
        let never = AtomicBool::new(false);
        self.inference_until(token, prompt_token, prompt_feat, embedding, (streaming, finalize), &never)
    }

    /// [`Flow::inference`] (`mode` = (streaming, finalize)) that stops with [`Error::Cancelled`] at the next
    /// Euler step once `cancel` is set: a long utterance's flow takes seconds.
    pub fn inference_until(
        &self,
        token: &[u32],
        prompt_token: &[u32],
        prompt_feat: &Tensor,
        embedding: &Tensor,
        (streaming, finalize): (bool, bool),
        cancel: &AtomicBool,
    ) -> Result<Tensor> {
        let tokens: Vec<u32> = prompt_token.iter().chain(token).copied().collect();
        let mu = self.token_condition(&tokens, finalize)?.transpose(1, 2)?; // [1, mel, N]
        let n = mu.dim(2)?;
        let n_prompt = prompt_feat.dim(1)?;
        if n <= n_prompt {
            return Ok(Tensor::zeros((1, self.cfg.output_size, 0), candle_core::DType::F32, &Device::Cpu)?);
        }
        if n > self.noise.dim(2)? {
            return Err(Error::Input(format!(
                "the flow's fixed noise covers {} mel frames; this utterance needs {n}",
                self.noise.dim(2)?
            )));
        }
        let spks = self.speaker_condition(embedding)?;
        let cond = pad_zeros(&prompt_feat.transpose(1, 2)?, 0, n - n_prompt)?;
        let mel = self.solve(&self.noise.narrow(2, 0, n)?, (&mu, &spks, &cond), streaming, cancel)?;
        Ok(mel.narrow(2, n_prompt, n - n_prompt)?)
    }

    /// Euler-integrates from `z` with classifier-free guidance; the unconditional row has every condition zeroed.
    fn solve(
        &self,
        z: &Tensor,
        conditions: (&Tensor, &Tensor, &Tensor),
        streaming: bool,
        cancel: &AtomicBool,
    ) -> Result<Tensor> {
        let (mu, spks, cond) = conditions;
        let guided = |c: &Tensor| -> Result<Tensor> { Ok(Tensor::cat(&[c, &c.zeros_like()?], 0)?) };
        let (mu, spks, cond) = (guided(mu)?, guided(spks)?, guided(cond)?);
        let w = self.cfg.cfg_rate as f32;
        let grid = cosine_time_grid(self.cfg.n_timesteps);
        let mut x = z.clone();
        let (mut t, mut dt) = (grid[0], grid[1] - grid[0]);
        for step in 0..self.cfg.n_timesteps {
            if cancel.load(Ordering::Relaxed) {
                return Err(Error::Cancelled);
            }
            let t_in = Tensor::new(&[t, t], &Device::Cpu)?;
            let v = self.dit.forward(&Tensor::cat(&[&x, &x], 0)?, &mu, &t_in, &spks, &cond, streaming)?;
            let guided_v = ((v.narrow(0, 0, 1)? * (1.0 + w) as f64)? - (v.narrow(0, 1, 1)? * w as f64)?)?;
            x = (x + (guided_v * dt as f64)?)?;
            // as the reference: t advances by dt, and the next dt is measured from that running t
            t += dt;
            if step + 1 < self.cfg.n_timesteps {
                dt = grid[step + 2] - t;
            }
        }
        Ok(x)
    }
}

/// `n + 1` times from 0 to 1 warped as 1 - cos(pi/2 u), in float32 as torch's `linspace` computes them
/// (the first half counted up from 0, the second down from 1).
fn cosine_time_grid(n: usize) -> Vec<f32> {
    let steps = n + 1;
    let step = 1.0f32 / n as f32;
    let half = steps / 2;
    (0..=n)
        .map(|i| if i < half { step * i as f32 } else { 1.0 - step * (n - i) as f32 })
        .map(|u| 1.0 - (u * 0.5 * std::f32::consts::PI).cos())
        .collect()
}
