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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from cosyvoice.config import QwenConfig
from cosyvoice.errors import ResourceLimitError
from cosyvoice.system.pages import mapped_zeros

# cuDNN attention (torch's first pick for bf16/fp16 on recent GPUs) builds a new plan for every new
# key length (~100 ms each on an H100), and whole sequences come in every length. The other backends
# have no such cost.
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


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention [B, heads, T, D] of ``q`` [B, heads, T, D] over ``k``/``v`` [B, kv_heads, S, D] under ``mask``
    [B, 1, T, S], query head ``h`` reading kv head ``h // (heads / kv_heads)``: each kv head's query heads are
    stacked into one matrix, so the keys and values are read as they are. Repeating them per query head copied
    the whole past seven times per layer at every decode step (most of a step's time past a few hundred
    positions, in torch and in the exported graph). The softmax runs in float32 whatever the dtype."""
    b, heads, t, d = q.shape
    kv = k.shape[1]
    stacked = q.reshape(b, kv, heads // kv * t, d) * d ** -0.5
    scores = torch.matmul(stacked, k.transpose(-1, -2)).float().view(b, kv, heads // kv, t, -1)
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    weights = scores.softmax(-1).to(v.dtype).view(b, kv, heads // kv * t, -1)
    return torch.matmul(weights, v).view(b, heads, t, d)


@dataclass(frozen=True, eq=False)
class KVCache:
    """Keys/values of ``batch`` sequences, every layer, in slots allocated once (gpt-fast's static cache).

    Tensors are [layers, batch, kv_heads, slots, head_dim]. Slot ``p`` of a row holds position ``p``;
    attention lets a query at position ``q`` see slots ``0..q``, so a row needs no separate length and
    stale slots beyond it are never read. The owner (a session, the scheduler's slot pool) keeps the
    object alive across steps; :meth:`view` hands a forward call the rows and slots it may touch.
    """

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def allocate(cls, cfg: QwenConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> KVCache:
        """A zeroed cache of ``batch`` rows of ``max_len`` slots; on the CPU only the slots written become resident
        (:func:`~cosyvoice.system.pages.mapped_zeros`: 790 MB for the engine's eight sessions at the released
        sizes, of which a request uses its row's prefix)."""
        if batch <= 0 or max_len <= 0:
            raise RuntimeError(f"KV cache needs batch > 0 and max_len > 0, got batch={batch} max_len={max_len}")
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        if torch.device(device or "cpu").type == "cpu":
            return cls(mapped_zeros(shape, dtype), mapped_zeros(shape, dtype))
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def view(self, start: int = 0, stop: int | None = None, slots: int | None = None) -> KVCache:
        """Rows ``start .. stop-1`` and their first ``slots`` slots, sharing this cache's storage.

        A forward call attends over every slot of the cache it is given, so the slots of a view bound
        what it reads: a prefix just past the last position written (eager decoding), or all of them
        (a fixed shape for graph capture).
        """
        stop = self.batch if stop is None else stop
        slots = self.max_len if slots is None else slots
        if not 0 <= start < stop <= self.batch:
            raise RuntimeError(f"rows {start}..{stop} outside a cache of batch {self.batch}")
        if slots > self.max_len:
            raise ResourceLimitError(f"sequence needs {slots} KV-cache slots but the cache holds {self.max_len}")
        return KVCache(self.k[:, start:stop, :, :slots], self.v[:, start:stop, :, :slots])

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``layer``'s keys/values [B, kv_heads, T, D] of ``positions`` [B, T] to their slots; return
        that layer's whole cache [B, kv_heads, slots, D] to attend over."""
        rows = torch.arange(self.batch, device=positions.device)[:, None]
        k_cache, v_cache = self.k[layer], self.v[layer]
        # advanced indices (rows, positions) around a slice put [B, T] first: [B, T, kv_heads, D]
        k_cache[rows, :, positions] = k.transpose(1, 2)
        v_cache[rows, :, positions] = v.transpose(1, 2)
        return k_cache, v_cache

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """[B, 1, T, slots]: a query at position ``q`` sees slots ``0..q``."""
        slots = torch.arange(self.max_len, device=positions.device)
        return (slots[None, None, :] <= positions[:, :, None]).unsqueeze(1)

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

    def __init__(self, cfg: QwenConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer  # this block's index in a KVCache
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Attend causally over ``x`` alone (``cache`` None) or over the cache's slots under ``mask``, after
        this step's keys and values went to their ``positions`` [B, T]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            groups = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v = cache.update(self.layer, positions, k, v)
            out = grouped_attention(q, k, v, mask)
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

    def __init__(self, cfg: QwenConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, cache, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """Token embedding, decoder layers and final norm (HF ``Qwen2Model``)."""

    def __init__(self, cfg: QwenConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Hidden states [B, T, H] (after the final norm) of ``embeds`` [B, T, H] at ``positions`` [B, T].

        Without ``cache``: one causal pass over whole sequences (positions default to 0..T-1). With it, the
        step's keys/values go to their slots and every query attends over the cache's slots up to its own
        position: a prefill is T = prompt length at 0..T-1, a decode step T = 1, and rows may sit at
        different positions (batched sessions). The cache (a :meth:`KVCache.view`) bounds the slots read.
        """
        b, t, _ = embeds.shape
        if positions is None:
            positions = torch.arange(t, device=embeds.device).expand(b, t)
        if positions.shape != (b, t) or (cache is not None and cache.batch != b):
            rows = "no cache" if cache is None else f"cache batch {cache.batch}"
            raise RuntimeError(f"positions {tuple(positions.shape)} / {rows} do not fit inputs of shape "
                               f"{tuple(embeds.shape)}")
        mask = None if cache is None else cache.mask(positions)
        cos, sin = rotary_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, embeds.dtype)
        x = embeds
        with sdpa_kernel(_ATTENTION_BACKENDS):
            for layer in self.layers:
                x = layer(x, cos, sin, positions, cache, mask)
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
        #: an accelerated backend's stack (same arguments and result as :meth:`forward`), or None for torch
        self.runner: Callable[[torch.Tensor, torch.Tensor | None, KVCache | None], torch.Tensor] | None = None

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Last hidden states [B, T, H]; see :meth:`Qwen2Model.forward`."""
        if self.runner is not None:
            return self.runner(embeds, positions, cache)
        return self.model.model(embeds, positions, cache)

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        """A zeroed cache on this module's device and dtype."""
        weight = self.embed_tokens.weight
        return KVCache.allocate(self.cfg, batch, max_len, dtype=weight.dtype, device=weight.device)
