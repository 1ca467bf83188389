//! The DiT velocity estimator of the flow decoder (`decoder.estimator.*` in flow.pt), as
//! `cosyvoice/flow/dit.py` computes it:
//!
//! ```text
//! t -> sinusoid(256) -> Linear -> SiLU -> Linear                       = time embedding
//! [x, cond, mu, spks] -> Linear -> + causal grouped-conv position signal = frame features
//! depth x block: AdaLN-Zero(t) -> self-attention (RoPE) -> gate -> AdaLN(t) -> tanh-GELU MLP -> gate
//! AdaLN(t) -> Linear                                                     = velocity
//! ```
//!
//! Attention is full, or chunk-causal when streaming (frame i sees every frame up to the end of its chunk).

use candle_core::{Device, Module, Tensor, D};
use candle_nn::{ops, Linear};

use crate::checkpoint::Checkpoint;
use crate::config::DitConfig;
use crate::error::Result;
use crate::nn::{layer_norm, linear, mish, pad_zeros, Conv1d};

const LN_EPS: f32 = 1e-6;
const TIME_FREQ_DIM: usize = 256;
const POS_CONV_KERNEL: usize = 31;
const POS_CONV_GROUPS: usize = 16;

/// One transformer block: its AdaLN modulation, attention and feed-forward.
struct Block {
    modulation: Linear,
    q: Linear,
    k: Linear,
    v: Linear,
    out: Linear,
    ff_in: Linear,
    ff_out: Linear,
}

impl Block {
    fn load(ckpt: &Checkpoint, prefix: &str, cfg: &DitConfig) -> Result<Self> {
        let (d, inner, ff) = (cfg.dim, cfg.heads * cfg.dim_head, cfg.dim * cfg.ff_mult);
        Ok(Self {
            modulation: linear(ckpt, &format!("{prefix}.attn_norm.linear"), [6 * d, d], true)?,
            q: linear(ckpt, &format!("{prefix}.attn.to_q"), [inner, d], true)?,
            k: linear(ckpt, &format!("{prefix}.attn.to_k"), [inner, d], true)?,
            v: linear(ckpt, &format!("{prefix}.attn.to_v"), [inner, d], true)?,
            out: linear(ckpt, &format!("{prefix}.attn.to_out.0"), [d, inner], true)?,
            ff_in: linear(ckpt, &format!("{prefix}.ff.ff.0.0"), [ff, d], true)?,
            ff_out: linear(ckpt, &format!("{prefix}.ff.ff.2"), [d, ff], true)?,
        })
    }
}

/// The estimator: `forward(x, mu, t, spks, cond)` with mels as [B, C, N] -> velocity [B, mel_dim, N].
pub struct Dit {
    time_in: Linear,
    time_out: Linear,
    proj_in: Linear,
    pos_convs: [Conv1d; 2],
    inv_freq: Tensor,
    blocks: Vec<Block>,
    norm_out: Linear,
    proj_out: Linear,
    heads: usize,
    dim_head: usize,
    chunk: usize,
}

impl Dit {
    /// Builds the estimator from the tensors under `prefix` (`decoder.estimator`).
    pub fn load(ckpt: &Checkpoint, prefix: &str, cfg: &DitConfig) -> Result<Self> {
        let d = cfg.dim;
        let conv = |i: usize| {
            Conv1d::load(
                ckpt,
                &format!("{prefix}.input_embed.conv_pos_embed.conv{i}.0"),
                [d, d / POS_CONV_GROUPS, POS_CONV_KERNEL],
                POS_CONV_GROUPS,
            )
        };
        let blocks = (0..cfg.depth)
            .map(|i| Block::load(ckpt, &format!("{prefix}.transformer_blocks.{i}"), cfg))
            .collect::<Result<_>>()?;
        Ok(Self {
            time_in: linear(ckpt, &format!("{prefix}.time_embed.time_mlp.0"), [d, TIME_FREQ_DIM], true)?,
            time_out: linear(ckpt, &format!("{prefix}.time_embed.time_mlp.2"), [d, d], true)?,
            proj_in: linear(
                ckpt,
                &format!("{prefix}.input_embed.proj"),
                [d, 2 * cfg.mel_dim + cfg.mu_dim + cfg.spk_dim],
                true,
            )?,
            pos_convs: [conv(1)?, conv(2)?],
            inv_freq: ckpt.get_shaped(&format!("{prefix}.rotary_embed.inv_freq"), &[cfg.dim_head / 2])?,
            blocks,
            norm_out: linear(ckpt, &format!("{prefix}.norm_out.linear"), [2 * d, d], true)?,
            proj_out: linear(ckpt, &format!("{prefix}.proj_out"), [cfg.mel_dim, d], true)?,
            heads: cfg.heads,
            dim_head: cfg.dim_head,
            chunk: cfg.static_chunk_size,
        })
    }

    /// Velocity [B, mel_dim, N] of `x`, `mu`, `cond` [B, C, N], `spks` [B, S] at ODE times `t` [B]; chunk-causal
    /// attention when `streaming`, full attention otherwise.
    pub fn forward(
        &self,
        x: &Tensor,
        mu: &Tensor,
        t: &Tensor,
        spks: &Tensor,
        cond: &Tensor,
        streaming: bool,
    ) -> Result<Tensor> {
        let n = x.dim(2)?;
        // the time embedding, through the SiLU every AdaLN modulation applies to it first
        let emb = self.time_out.forward(&self.time_in.forward(&time_features(t)?)?.silu()?)?.silu()?;
        let mut h = self.input(x, mu, spks, cond)?;
        let rope = self.rotary(n)?;
        let mask = attention_mask(n, if streaming { self.chunk } else { n })?;
        for block in &self.blocks {
            h = self.block(block, &h, &emb, &rope, &mask)?;
        }
        let modulation = self.norm_out.forward(&emb)?.chunk(2, 1)?; // scale first, unlike the blocks
        let h = modulate(&layer_norm(&h, LN_EPS)?, &modulation[1], &modulation[0])?;
        Ok(self.proj_out.forward(&h)?.transpose(1, 2)?)
    }

    /// Frame features [B, N, dim]: the projected inputs plus their causal position signal.
    fn input(&self, x: &Tensor, mu: &Tensor, spks: &Tensor, cond: &Tensor) -> Result<Tensor> {
        let (b, _, n) = x.dims3()?;
        let spks = spks.unsqueeze(2)?.broadcast_as((b, spks.dim(1)?, n))?;
        let fused = Tensor::cat(&[x, cond, mu, &spks], 1)?.transpose(1, 2)?;
        let h = self.proj_in.forward(&fused)?;
        let mut pos = h.transpose(1, 2)?;
        for conv in &self.pos_convs {
            pos = mish(&conv.forward(&pad_zeros(&pos, conv.context(), 0)?)?)?;
        }
        Ok((pos.transpose(1, 2)? + h)?)
    }

    /// cos/sin [N, dim_head]: channel pairs (2i, 2i+1) share frequency i.
    fn rotary(&self, n: usize) -> Result<(Tensor, Tensor)> {
        let positions = Tensor::arange(0u32, n as u32, &Device::Cpu)?.to_dtype(candle_core::DType::F32)?;
        let angles = positions.unsqueeze(1)?.broadcast_mul(&self.inv_freq.unsqueeze(0)?)?;
        let angles = Tensor::stack(&[&angles, &angles], 2)?.reshape((n, self.dim_head))?;
        Ok((angles.cos()?, angles.sin()?))
    }

    fn block(&self, block: &Block, x: &Tensor, emb: &Tensor, rope: &(Tensor, Tensor), mask: &Tensor) -> Result<Tensor> {
        let m = block.modulation.forward(emb)?.chunk(6, 1)?; // shift, scale, gate, ff_shift, ff_scale, ff_gate
        let normed = modulate(&layer_norm(x, LN_EPS)?, &m[0], &m[1])?;
        let x = (x + gate(&m[2], &self.attention(block, &normed, rope, mask)?)?)?;
        let ff_in = modulate(&layer_norm(&x, LN_EPS)?, &m[3], &m[4])?;
        let ff = block.ff_out.forward(&block.ff_in.forward(&ff_in)?.gelu()?)?;
        Ok((&x + gate(&m[5], &ff)?)?)
    }

    /// Self-attention of `x` [B, N, dim]. As the reference (x-transformers), RoPE is applied to the projected
    /// q/k before the head split, so only the first `dim_head` channels (head 0) carry position.
    fn attention(&self, block: &Block, x: &Tensor, rope: &(Tensor, Tensor), mask: &Tensor) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let heads = |y: Tensor| -> Result<Tensor> {
            Ok(y.reshape((b, n, self.heads, self.dim_head))?.transpose(1, 2)?.contiguous()?)
        };
        let q = heads(self.rotate_leading(&block.q.forward(x)?, rope)?)?;
        let k = heads(self.rotate_leading(&block.k.forward(x)?, rope)?)?;
        let v = heads(block.v.forward(x)?)?;
        let scale = 1.0 / (self.dim_head as f64).sqrt();
        let scores = (q.matmul(&k.transpose(2, 3)?.contiguous()?)? * scale)?.broadcast_add(mask)?;
        let out = ops::softmax_last_dim(&scores)?.matmul(&v)?;
        Ok(block.out.forward(&out.transpose(1, 2)?.reshape((b, n, self.heads * self.dim_head))?)?)
    }

    /// `x` [B, N, C] with its first `dim_head` channels rotated pairwise; the rest pass through.
    fn rotate_leading(&self, x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Result<Tensor> {
        let (b, n, c) = x.dims3()?;
        let w = self.dim_head;
        let rot = x.narrow(2, 0, w)?;
        let pairs = rot.reshape((b, n, w / 2, 2))?;
        let half = Tensor::cat(&[&pairs.narrow(3, 1, 1)?.neg()?, &pairs.narrow(3, 0, 1)?], 3)?.reshape((b, n, w))?;
        let rotated = (rot.broadcast_mul(cos)? + half.broadcast_mul(sin)?)?;
        Ok(Tensor::cat(&[&rotated, &x.narrow(2, w, c - w)?], 2)?)
    }
}

/// `[sin(1000 t f_i), cos(1000 t f_i)]`, frequencies geometric from 1 down to 1/10000: [B, 256].
fn time_features(t: &Tensor) -> Result<Tensor> {
    let half = TIME_FREQ_DIM / 2;
    let log_step = (10000f64.ln() / (half - 1) as f64) as f32;
    let freqs: Vec<f32> = (0..half).map(|i| (i as f32 * -log_step).exp()).collect();
    let freqs = Tensor::from_vec(freqs, (1, half), &Device::Cpu)?;
    let angles = (t.unsqueeze(1)? * 1000.0)?.broadcast_mul(&freqs)?;
    Ok(Tensor::cat(&[angles.sin()?, angles.cos()?], D::Minus1)?)
}

/// [N, N], 0 where query frame i may see key frame j (j < (i / chunk + 1) * chunk), -inf elsewhere.
fn attention_mask(n: usize, chunk: usize) -> Result<Tensor> {
    let mask: Vec<f32> = (0..n)
        .flat_map(|i| {
            let end = (i / chunk + 1) * chunk;
            (0..n).map(move |j| if j < end { 0.0 } else { f32::NEG_INFINITY })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (n, n), &Device::Cpu)?)
}

/// `x * (1 + scale) + shift`, with `shift`, `scale` [B, C] broadcast over frames.
fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    Ok(x.broadcast_mul(&(scale.unsqueeze(1)? + 1.0)?)?.broadcast_add(&shift.unsqueeze(1)?)?)
}

fn gate(g: &Tensor, x: &Tensor) -> Result<Tensor> {
    Ok(g.unsqueeze(1)?.broadcast_mul(x)?)
}
