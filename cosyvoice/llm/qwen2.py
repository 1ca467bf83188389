"""A small Qwen2 decoder, just what CosyVoice3's speech-token LM needs.

The official model wraps HuggingFace ``Qwen2ForCausalLM``; we rebuild the same network with
plain torch so inference does not depend on transformers, and so the KV cache is ours: a
preallocated, caller-owned :class:`KVCache` whose slot ``p`` holds the keys/values of position
``p``. Module and parameter names mirror the official checkpoint
(``llm.model.model.layers.{i}.self_attn.q_proj.weight`` ...), which is why the nesting is three
levels deep: :class:`Qwen2Backbone` (``llm``) > :class:`Qwen2CausalLM` (``llm.model``) >
:class:`Qwen2Model` (``llm.model.model``).

Numerics follow transformers' Qwen2 (4.51): RMSNorm and the rotary tables are computed in
float32 whatever the weight dtype, rotary uses the ``rotate_half`` layout, and the returned
hidden states are taken after the final norm (HF ``hidden_states[-1]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from cosyvoice.config import QwenConfig
from cosyvoice.errors import ResourceLimitError

# cuDNN attention (torch's first pick for bf16/fp16 on recent GPUs) builds a new plan for every new
# key length, i.e. at every decode step: ~100 ms each on an H100. The other backends have no such cost.
_ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in float32 so bf16/fp16 weights give stable output."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, T, head_dim] for integer ``positions`` [B, T].

    Built from float32 frequencies on every call (a few hundred flops) instead of a buffer, so
    casting the module to bf16 never degrades the frequencies.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, T, D] by the tables [B, T, D] (HF Qwen2 ``rotate_half`` convention)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Static keys/values for ``batch`` sequences of up to ``max_len`` positions, every layer.

    Tensors are [layers, batch, kv_heads, max_len, head_dim], allocated once. Slot ``p`` of a row
    holds position ``p``; attention lets a query at position ``q`` see slots ``0..q``, so a row
    needs no separate length and stale slots beyond it are never read. The owner (a request or a
    session) keeps the object alive across decode steps and may reuse it for its next request.
    """

    def __init__(self, cfg: QwenConfig, batch: int, max_len: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        if batch <= 0 or max_len <= 0:
            raise RuntimeError(f"KV cache needs batch > 0 and max_len > 0, got batch={batch} max_len={max_len}")
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def rows(self, start: int, stop: int) -> KVCache:
        """Rows ``start .. stop-1`` as a cache of their own that shares this one's storage (a slot pool's view)."""
        if not 0 <= start < stop <= self.batch:
            raise RuntimeError(f"rows {start}..{stop} outside a cache of batch {self.batch}")
        view = object.__new__(KVCache)
        view.k, view.v = self.k[:, start:stop], self.v[:, start:stop]
        return view

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device


class Attention(nn.Module):
    """Grouped-query self-attention: biased q/k/v projections, unbiased output projection."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend causally over ``x`` alone (``kv`` None) or over a layer's cache slots.

        ``kv`` = (k_cache, v_cache [B, kv_heads, S, D], positions [B, T], kv_len): this step's keys
        and values are written to their position slots, then the first ``kv_len`` slots are read
        under ``mask`` [B, 1, T, kv_len].
        """
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv is not None:
            k_cache, v_cache, positions, kv_len = kv
            rows = torch.arange(b, device=x.device)[:, None]
            # advanced indices (rows, positions) around a slice put [B, T] first: [B, T, kv_heads, D]
            k_cache[rows, :, positions] = k.transpose(1, 2)
            v_cache[rows, :, positions] = v.transpose(1, 2)
            k, v = k_cache[:, :, :kv_len], v_cache[:, :, :kv_len]
        groups = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=kv is None)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Token embedding, decoder layers and final norm (HF ``Qwen2Model``)."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """Causal pass over whole sequences ``embeds`` [B, T, H] at positions 0..T-1, no cache."""
        b, t, _ = embeds.shape
        positions = torch.arange(t, device=embeds.device).expand(b, t)
        cos, sin = rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, embeds.dtype)
        x = embeds
        with sdpa_kernel(_ATTENTION_BACKENDS):
            for layer in self.layers:
                x = layer(x, cos, sin)
        return self.norm(x)

    def forward_cached(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       kv_len: int | None = None) -> torch.Tensor:
        """Run ``embeds`` [B, T, H] at ``positions`` [B, T], reading and extending ``cache``.

        A prefill is T = prompt length at positions 0..T-1; a decode step is T = 1. Rows may sit at
        different positions (batched sessions). ``kv_len`` bounds the slots read (must exceed every
        position); the default reads all ``cache.max_len`` slots, a fixed shape for graph capture.
        """
        b, t, _ = embeds.shape
        kv_len = cache.max_len if kv_len is None else kv_len
        if cache.batch != b or positions.shape != (b, t):
            raise RuntimeError(f"positions {tuple(positions.shape)} / cache batch {cache.batch} do not fit "
                                    f"inputs of shape {tuple(embeds.shape)}")
        if kv_len > cache.max_len:
            raise ResourceLimitError(f"sequence needs {kv_len} KV-cache slots but the cache holds {cache.max_len}")
        slots = torch.arange(kv_len, device=embeds.device)
        mask = (slots[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        cos, sin = rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, embeds.dtype)
        x = embeds
        with sdpa_kernel(_ATTENTION_BACKENDS):
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, (cache.k[i], cache.v[i], positions, kv_len), mask)
        return self.norm(x)


class Qwen2CausalLM(nn.Module):
    """``Qwen2Model`` plus its LM head (HF ``Qwen2ForCausalLM``).

    CosyVoice3 never uses the text LM head (speech tokens come from its own ``llm_decoder``), but
    the official checkpoint stores ``lm_head.weight`` and strict loading needs the key. With tied
    embeddings it shares the embedding's storage, so it costs no memory; as in HF, loading writes
    ``lm_head.weight`` after ``embed_tokens.weight``, so the file's ``lm_head`` values win.
    """

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class Qwen2Backbone(nn.Module):
    """The ``llm`` submodule of CosyVoice3LM: hidden states of the Qwen2 stack for input embeddings."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Qwen2CausalLM(cfg)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        """Last hidden states (after the final norm) of a causal pass without cache, [B, T, H]."""
        return self.model.model(embeds)

    def forward_cached(self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       kv_len: int | None = None) -> torch.Tensor:
        """Last hidden states [B, T, H] of an incremental pass; see :meth:`Qwen2Model.forward_cached`."""
        return self.model.model.forward_cached(embeds, positions, cache, kv_len)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A zeroed cache on this module's device and dtype."""
        weight = self.embed_tokens.weight
        return KVCache(self.cfg, batch, max_len, dtype=weight.dtype, device=weight.device)
