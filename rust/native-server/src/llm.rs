//! CosyVoice3's speech-token LM: a Qwen2 decoder over
//! `[sos] + text_embedding(prompt_text ++ text) + [task_id] + speech_embedding(prompt_speech)`, continued one
//! speech token at a time, each step's hidden state scored by `llm_decoder`.
//!
//! Numerics follow transformers' Qwen2 (4.51) as `cosyvoice/llm/qwen2.py` does: float32 RMSNorm, rotary in
//! the `rotate_half` layout from float32 frequencies, hidden states taken after the final norm.

use candle_core::{Device, Module, Tensor, D};
use candle_nn::{ops, Linear};

use crate::checkpoint::Checkpoint;
use crate::config::{LlmConfig, QwenConfig, SamplingConfig};
use crate::error::{Error, Result};
use crate::nn::linear;
use crate::sampling::Sampler;

/// Speech tokens the official decoding loop stops passing on after `MAX_SILENT_RUN` of them in a row.
pub const SILENT_TOKENS: [u32; 11] = [1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323];
pub const MAX_SILENT_RUN: usize = 5;

/// Rows of the speech tables past the real speech tokens: sos, eos, task_id, fill, then unused stop ids.
pub const N_EXTRA_TOKENS: usize = 200;

/// Keys and values of every position fed so far, per layer ([1, kv_heads, positions, head_dim]).
#[derive(Default)]
pub struct KvCache {
    layers: Vec<(Tensor, Tensor)>,
    len: usize,
}

impl KvCache {
    /// Positions fed so far: the next call's first position.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `layer`'s new keys/values and returns everything it may attend over.
    fn extend(&mut self, layer: usize, k: Tensor, v: Tensor) -> Result<(Tensor, Tensor)> {
        if layer == self.layers.len() {
            self.layers.push((k, v));
        } else {
            let (old_k, old_v) = &self.layers[layer];
            self.layers[layer] = (Tensor::cat(&[old_k, &k], 2)?, Tensor::cat(&[old_v, &v], 2)?);
        }
        Ok(self.layers[layer].clone())
    }
}

/// Grouped-query self-attention: biased q/k/v projections, unbiased output projection.
struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn load(ckpt: &Checkpoint, prefix: &str, cfg: &QwenConfig) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim());
        let (q_out, kv_out) = (cfg.num_attention_heads * d, cfg.num_key_value_heads * d);
        Ok(Self {
            q: linear(ckpt, &format!("{prefix}.q_proj"), [q_out, h], true)?,
            k: linear(ckpt, &format!("{prefix}.k_proj"), [kv_out, h], true)?,
            v: linear(ckpt, &format!("{prefix}.v_proj"), [kv_out, h], true)?,
            o: linear(ckpt, &format!("{prefix}.o_proj"), [h, q_out], false)?,
            heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: d,
        })
    }

    /// `x` [1, T, H] at the positions after `cache`'s; `mask` [T, cache + T] is 0 where visible, -inf not.
    fn forward(
        &self,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        mask: &Tensor,
        layer: usize,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let t = x.dim(1)?;
        let split = |y: Tensor, heads: usize| -> Result<Tensor> {
            Ok(y.reshape((1, t, heads, self.head_dim))?.transpose(1, 2)?.contiguous()?)
        };
        let q = candle_nn::rotary_emb::rope(&split(self.q.forward(x)?, self.heads)?, &rope.0, &rope.1)?;
        let k = candle_nn::rotary_emb::rope(&split(self.k.forward(x)?, self.kv_heads)?, &rope.0, &rope.1)?;
        let v = split(self.v.forward(x)?, self.kv_heads)?;
        let (k, v) = cache.extend(layer, k, v)?;
        let groups = self.heads / self.kv_heads;
        // kv head j serves query heads j*groups .. (j+1)*groups (torch's repeat_interleave)
        let repeat = |y: Tensor| -> Result<Tensor> {
            let (_, kvh, s, d) = y.dims4()?;
            Ok(y.unsqueeze(2)?.broadcast_as((1, kvh, groups, s, d))?.reshape((1, kvh * groups, s, d))?)
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let scores = (q.matmul(&k.transpose(2, 3)?.contiguous()?)? * scale)?.broadcast_add(mask)?;
        let out = ops::softmax_last_dim(&scores)?.matmul(&v)?;
        let out = out.transpose(1, 2)?.reshape((1, t, self.heads * self.head_dim))?;
        Ok(self.o.forward(&out)?)
    }
}

/// One pre-norm block: x + attn(norm(x)), then x + down(silu(gate(norm(x))) * up(norm(x))).
struct Layer {
    attn: Attention,
    gate: Linear,
    up: Linear,
    down: Linear,
    input_norm: Tensor,
    post_norm: Tensor,
}

impl Layer {
    fn load(ckpt: &Checkpoint, prefix: &str, cfg: &QwenConfig) -> Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            attn: Attention::load(ckpt, &format!("{prefix}.self_attn"), cfg)?,
            gate: linear(ckpt, &format!("{prefix}.mlp.gate_proj"), [i, h], false)?,
            up: linear(ckpt, &format!("{prefix}.mlp.up_proj"), [i, h], false)?,
            down: linear(ckpt, &format!("{prefix}.mlp.down_proj"), [h, i], false)?,
            input_norm: ckpt.get_shaped(&format!("{prefix}.input_layernorm.weight"), &[h])?,
            post_norm: ckpt.get_shaped(&format!("{prefix}.post_attention_layernorm.weight"), &[h])?,
        })
    }
}

/// The Qwen2 body: decoder layers and the final norm (the text embedding lives in [`CosyVoice3Lm`]).
pub struct Qwen2 {
    layers: Vec<Layer>,
    norm: Tensor,
    eps: f32,
    rope_theta: f64,
    head_dim: usize,
}

impl Qwen2 {
    fn load(ckpt: &Checkpoint, prefix: &str, cfg: &QwenConfig) -> Result<Self> {
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::load(ckpt, &format!("{prefix}.layers.{i}"), cfg))
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            norm: ckpt.get_shaped(&format!("{prefix}.norm.weight"), &[cfg.hidden_size])?,
            eps: cfg.rms_norm_eps as f32,
            rope_theta: cfg.rope_theta,
            head_dim: cfg.head_dim(),
        })
    }

    /// Hidden states [T, H] (after the final norm) of `embeds` [T, H], fed at the positions after `cache`'s
    /// (causal among themselves, seeing everything cached); their keys/values are appended to `cache`.
    pub fn forward(&self, embeds: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let (t, _) = embeds.dims2()?;
        let start = cache.len;
        let rope = rotary_tables(start, t, self.head_dim, self.rope_theta)?;
        let mask = causal_mask(start, t)?;
        let mut x = embeds.unsqueeze(0)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = ops::rms_norm(&x, &layer.input_norm, self.eps)?;
            x = (x + layer.attn.forward(&h, &rope, &mask, i, cache)?)?;
            let h = ops::rms_norm(&x, &layer.post_norm, self.eps)?;
            let mlp = layer.down.forward(&(layer.gate.forward(&h)?.silu()? * layer.up.forward(&h)?)?)?;
            x = (x + mlp)?;
        }
        cache.len += t;
        Ok(ops::rms_norm(&x, &self.norm, self.eps)?.squeeze(0)?)
    }
}

/// cos/sin [T, head_dim/2] of positions `start..start+T`: float32 inverse frequencies
/// `1 / theta^(2i/head_dim)` times the position, as transformers computes them.
fn rotary_tables(start: usize, t: usize, head_dim: usize, theta: f64) -> Result<(Tensor, Tensor)> {
    let inv_freq: Vec<f32> =
        (0..head_dim / 2).map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32)).collect();
    let angles: Vec<f32> = (start..start + t).flat_map(|p| inv_freq.iter().map(move |f| p as f32 * f)).collect();
    let angles = Tensor::from_vec(angles, (t, head_dim / 2), &Device::Cpu)?;
    Ok((angles.cos()?, angles.sin()?))
}

/// [T, start + T]: query i (position start + i) sees keys 0..=start + i.
fn causal_mask(start: usize, t: usize) -> Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..start + t).map(move |j| if j <= start + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(mask, (t, start + t), &Device::Cpu)?)
}

/// The speech-token LM of `llm.pt`.
pub struct CosyVoice3Lm {
    qwen: Qwen2,
    text_embedding: Tensor,
    speech_embedding: Tensor,
    decoder: Tensor,
    speech_token_size: usize,
    pub sampling: SamplingConfig,
}

impl CosyVoice3Lm {
    /// Builds the LM from `llm.pt`'s state dict, every tensor's shape checked.
    pub fn load(ckpt: &Checkpoint, qwen: &QwenConfig, cfg: &LlmConfig) -> Result<Self> {
        let rows = cfg.speech_token_size + N_EXTRA_TOKENS;
        let h = qwen.hidden_size;
        // With tied embeddings torch loads `embed_tokens` then `lm_head` into one storage, so the later key,
        // `lm_head.weight`, is the text embedding the official model ends up with.
        let tied = "llm.model.lm_head.weight";
        let text_key = if ckpt.contains(tied) { tied } else { "llm.model.model.embed_tokens.weight" };
        Ok(Self {
            qwen: Qwen2::load(ckpt, "llm.model.model", qwen)?,
            text_embedding: ckpt.get_shaped(text_key, &[qwen.vocab_size, h])?,
            speech_embedding: ckpt.get_shaped("speech_embedding.weight", &[rows, cfg.input_size])?,
            decoder: ckpt.get_shaped("llm_decoder.weight", &[rows, cfg.output_size])?,
            speech_token_size: cfg.speech_token_size,
            sampling: cfg.sampling.clone(),
        })
    }

    /// The start-of-sequence row of the speech table (also the first stop id).
    pub fn sos(&self) -> u32 {
        self.speech_token_size as u32
    }

    /// The end-of-speech id.
    pub fn eos(&self) -> u32 {
        self.sos() + 1
    }

    /// The row that separates text from speech in the prompt.
    pub fn task_id(&self) -> u32 {
        self.sos() + 2
    }

    /// Whether `token` ends generation (any id past the real speech tokens).
    pub fn is_stop(&self, token: u32) -> bool {
        token as usize >= self.speech_token_size
    }

    /// (min_len, max_len) of the speech tokens for `n_text` tts-text tokens (prompt text excluded).
    pub fn length_limits(n_text: usize) -> (usize, usize) {
        (n_text * 2, n_text * 20)
    }

    /// The prompt [L, H]: sos, the text embeddings of `prompt_text ++ text`, task_id, the prompt speech.
    pub fn lm_input(&self, text: &[u32], prompt_text: &[u32], prompt_speech: &[u32]) -> Result<Tensor> {
        let all_text: Vec<u32> = prompt_text.iter().chain(text).copied().collect();
        let parts = [
            self.speech_embeddings(&[self.sos()])?,
            lookup(&self.text_embedding, &all_text, "text")?,
            self.speech_embeddings(&[self.task_id()])?,
            self.speech_embeddings(prompt_speech)?,
        ];
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Speech-table rows [N, H] of `tokens` (what each decoding step feeds back).
    pub fn speech_embeddings(&self, tokens: &[u32]) -> Result<Tensor> {
        lookup(&self.speech_embedding, tokens, "speech")
    }

    /// Hidden states [T, H] of `embeds` [T, H] after `cache`'s positions (see [`Qwen2::forward`]).
    pub fn forward(&self, embeds: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        self.qwen.forward(embeds, cache)
    }

    /// The official decoding loop: the prompt `lm_input` [L, H], then one speech token per step until a stop
    /// id (not emitted) or `max_len` tokens. As the reference, only index `speech_token_size` (sos, not eos) is
    /// banned before `min_len`, so the other stop ids can end generation early; silent tokens are fed back but
    /// not passed on after `MAX_SILENT_RUN` in a row. Returns the tokens passed on.
    pub fn generate(
        &self,
        lm_input: &Tensor,
        min_len: usize,
        max_len: usize,
        sampler: &mut dyn Sampler,
    ) -> Result<Vec<u32>> {
        let mut cache = KvCache::default();
        let (mut decoded, mut emitted) = (Vec::new(), Vec::new());
        let mut silent_run = 0;
        let mut x = lm_input.clone();
        for step in 0..max_len {
            let hidden = self.forward(&x, &mut cache)?;
            let last = hidden.narrow(0, hidden.dim(0)? - 1, 1)?;
            let mut scores = self.log_probs(&last)?.squeeze(0)?.to_vec1::<f32>()?;
            if step < min_len {
                scores[self.sos() as usize] = f32::NEG_INFINITY;
            }
            let token = sampler.sample(&scores, &decoded);
            if self.is_stop(token) {
                break;
            }
            decoded.push(token);
            silent_run = if SILENT_TOKENS.contains(&token) { silent_run + 1 } else { 0 };
            if silent_run <= MAX_SILENT_RUN {
                emitted.push(token);
            }
            x = self.speech_embeddings(&[token])?;
        }
        Ok(emitted)
    }

    /// Log-probabilities [T, speech_token_size + 200] of the next token for hidden states [T, H].
    pub fn log_probs(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(ops::log_softmax(&hidden.matmul(&self.decoder.t()?)?, D::Minus1)?)
    }
}

/// Rows of `table` for `ids`, each checked to exist.
fn lookup(table: &Tensor, ids: &[u32], what: &str) -> Result<Tensor> {
    let rows = table.dim(0)?;
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= rows) {
        return Err(Error::Input(format!("{what} token id {bad} outside the table's {rows} rows")));
    }
    Ok(table.index_select(&Tensor::new(ids, &Device::Cpu)?, 0)?)
}
