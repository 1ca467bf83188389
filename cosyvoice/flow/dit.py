"""The DiT velocity estimator of the CosyVoice3 flow-matching decoder.

One call maps a noisy mel ``x`` plus its conditions (token features ``mu``, speaker
vector ``spks``, prompt mel ``cond``) and the ODE time ``t`` to a velocity with the shape
of ``x``. Layout, as in the released checkpoint (``decoder.estimator.*`` in flow.pt):

    t    -> sinusoid(256) -> Linear -> SiLU -> Linear                      = time embedding
    [x, cond, mu, spks] -> Linear -> + causal grouped-conv position signal  = frame features
    depth x DiT block: AdaLN-Zero(t) -> self-attention (RoPE) -> gate -> AdaLN(t) -> tanh-GELU MLP -> gate
    AdaLN(t) -> Linear                                                      = velocity

Attention is either full (non-streaming) or chunk-causal: frame ``i`` sees every frame
up to the end of its own chunk of ``static_chunk_size`` frames. Under the chunk mask a
finished chunk never changes when later frames arrive, which :meth:`DiT.forward_cached`
exploits to extend an utterance without recomputing its finished chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice.config import DiTConfig
from cosyvoice.flow.dit_cache import DiTCache, PastFrames, append_frames, attend_past
from cosyvoice.flow.modulation import Modulation, ModulationCache, cacheable

_LN_EPS = 1e-6
_TIME_FREQ_DIM = 256  # width of the sinusoidal time features fed to the time MLP
_POS_CONV_KERNEL = 31
_POS_CONV_GROUPS = 16


def sinusoidal_time_features(t: Tensor, dim: int = _TIME_FREQ_DIM, scale: float = 1000.0) -> Tensor:
    """``[sin(s*t*f_i), cos(s*t*f_i)]`` with geometric frequencies from 1 down to 1/10000; t in [0, 1]."""
    half = dim // 2
    log_step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, device=t.device).float() * -log_step)
    angles = scale * t.unsqueeze(1) * freqs.unsqueeze(0)
    return torch.cat((angles.sin(), angles.cos()), dim=-1).to(t.dtype)


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(_TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return self.time_mlp(sinusoidal_time_features(t))


def conv1d(x: Tensor, conv: nn.Conv1d) -> Tensor:
    """``conv(x)`` for an unpadded, stride-1 ``nn.Conv1d``; on CUDA computed as one batched matmul per kernel tap.

    Why not cuDNN: for the kernel-31, 16-group position convs its heuristics choose an FFT
    algorithm at common lengths (H100, dim 1024: 150-224 frames, ~55 ms and a 17 GiB workspace
    per conv instead of ~1 ms), and by default it convolves in TF32, which alone moves the mel
    by ~1e-3. Matmuls stay float32 unless ``torch.backends.cuda.matmul.allow_tf32`` is on (off by default).
    """
    if x.device.type != "cuda":
        return conv(x)
    batch, _, length = x.shape
    groups, taps = conv.groups, conv.kernel_size[0]
    n_out = length - taps + 1
    weight = conv.weight.view(groups, conv.out_channels // groups, conv.in_channels // groups, taps)
    x = x.reshape(batch, groups, conv.in_channels // groups, length)
    out = weight[..., 0] @ x[..., :n_out]
    for i in range(1, taps):
        out = out + weight[..., i] @ x[..., i:i + n_out]
    out = out.reshape(batch, conv.out_channels, n_out)
    return out if conv.bias is None else out + conv.bias.unsqueeze(1)


class CausalConvPositionEmbedding(nn.Module):
    """Two grouped convolutions with Mish, zero-padded on the left only, so frame i sees frames <= i.

    ``tails`` replaces the left zero padding with the real preceding inputs of each conv
    (used when continuing an utterance). The padded conv inputs are returned so a caller
    can cut the tails for the next continuation at any frame.
    """

    def __init__(self, dim: int, kernel_size: int = _POS_CONV_KERNEL, groups: int = _POS_CONV_GROUPS) -> None:
        super().__init__()
        self.context = kernel_size - 1
        # Sequential only for the flow.pt key names (conv1.0.weight); forward applies conv then Mish itself.
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: Tensor, tails: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        h = x.transpose(1, 2)  # [B, D, N]
        first_in = torch.cat((tails[0], h), dim=2) if tails is not None else F.pad(h, (self.context, 0))
        h = self.conv1[1](conv1d(first_in, self.conv1[0]))
        second_in = torch.cat((tails[1], h), dim=2) if tails is not None else F.pad(h, (self.context, 0))
        h = self.conv2[1](conv1d(second_in, self.conv2[0]))
        return h.transpose(1, 2), (first_in, second_in)


class InputEmbedding(nn.Module):
    """Fuse noisy mel, prompt mel, token features and speaker vector per frame, then add the conv position signal."""

    def __init__(self, mel_dim: int, mu_dim: int, spk_dim: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * mel_dim + mu_dim + spk_dim, dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(dim)

    def forward(self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor,
                tails: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        spks = spks.unsqueeze(1).expand(-1, x.shape[1], -1)
        h = self.proj(torch.cat((x, cond, mu, spks), dim=-1))
        pos, conv_inputs = self.conv_pos_embed(h, tails)
        # h first: an elementwise result takes its first operand's layout, and pos is a transposed view; the
        # residual stream must be frame-major, or every norm and projection of every block copies it
        return h + pos, conv_inputs


class RotaryEmbedding(nn.Module):
    """Rotary angles with base 10000; channel pairs (2i, 2i+1) share frequency i (interleaved layout)."""

    def __init__(self, dim: int, base: float = 10000.0) -> None:
        super().__init__()
        # Persistent: flow.pt carries it, so a strict load needs the key.
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        # Angles in float32 whatever the model dtype: positions in bf16 would be rounded.
        angles = positions.float().unsqueeze(1) * self.inv_freq.float().unsqueeze(0)
        # = repeat_interleave(2, dim=-1), which the ONNX exporter gives a wrong rank
        angles = torch.stack((angles, angles), dim=-1).reshape(angles.shape[0], -1)
        return angles.cos(), angles.sin()


def rotate_leading_channels(x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Apply RoPE to the first ``cos.shape[-1]`` channels of ``x`` [B, N, C]; the remaining channels pass through.
    ``dtype``: the result's (None: type promotion's), the rotated channels rounded to it once."""
    width = cos.shape[-1]
    rot, rest = x[..., :width], x[..., width:]
    rot_half = torch.stack((-rot[..., 1::2], rot[..., 0::2]), dim=-1).reshape(rot.shape)  # pairs (2i, 2i+1)
    rotated = rot * cos + rot_half * sin
    if dtype is None:
        return torch.cat((rotated, rest), dim=-1)
    return torch.cat((rotated.to(dtype), rest.to(dtype)), dim=-1)


def chunk_causal_mask(n_keys: int, chunk: int, first_query: int = 0, device: torch.device | None = None) -> Tensor:
    """Boolean [n_queries, n_keys] mask: query frame i may attend key frame j iff j < (i // chunk + 1) * chunk.

    Queries are frames ``first_query .. n_keys - 1``; keys are frames ``0 .. n_keys - 1``.
    Every chunk sees itself and all chunks to its left (the reference always uses all left
    chunks: its DiT passes -1 for the left-chunk count whatever the yaml says).
    """
    queries = torch.arange(first_query, n_keys, device=device)
    chunk_end = (queries // chunk + 1) * chunk
    return torch.arange(n_keys, device=device).unsqueeze(0) < chunk_end.unsqueeze(1)


class Attention(nn.Module):
    """Multi-head self-attention with RoPE on its first head's channels (the reference's layout, see forward).

    ``compute_dtype``: what its products run in and the keys/values it returns (and a stream caches) are held in:
    None, its input's dtype; bfloat16 where its projections are (:func:`cosyvoice.backends.precision.bf16_dit`):
    their outputs are bf16 values already (but the rotated channels), the output projection rounds the result to
    bf16 anyway, and a cache of half the bytes is what a stream holds and reads at every step. The output is the
    output projection's (bf16 there), which the block's residual promotes to its own dtype."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads = heads
        self.dim_head = dim_head
        self.compute_dtype: torch.dtype | None = None
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # index 0 as in flow.pt (slot 1 was training dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Returns the output and the keys/values of all frames attended to (past + these), per head; of these
        frames only when ``past`` is :class:`PastFrames` (the cached graph: the caller keeps the past)."""
        b, n, _ = x.shape
        dtype = self.compute_dtype
        if dtype is not None:
            x = x.to(dtype)  # once for the three projections
        # Reference quirk: RoPE is applied to the projected q/k before the head split, so only
        # the first dim_head channels (= head 0) are rotated; the other heads get no position signal.
        q = rotate_leading_channels(self.to_q(x), cos, sin, dtype)
        k = rotate_leading_channels(self.to_k(x), cos, sin, dtype)
        v = self.to_v(x)
        q, k, v = (y.view(b, n, self.heads, self.dim_head).transpose(1, 2) for y in (q, k, v))
        if dtype is not None:
            v = v.to(dtype)
        if isinstance(past, PastFrames):
            out = attend_past(q, k, v, past, mask)
        else:
            if past is not None:
                k, v = append_frames(past[0], k), append_frames(past[1], v)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, n, -1)), k, v


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        # Nesting and indices reproduce the flow.pt keys ff.ff.0.0 / ff.ff.2 (slot 1 was training dropout).
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(approximate="tanh")),
                                nn.Identity(), nn.Linear(dim * mult, dim))

    def forward(self, x: Tensor) -> Tensor:
        return self.ff(x)


def _layer_norm(x: Tensor) -> Tensor:
    # int(): the width is fixed, and the ONNX exporter needs it as a constant rather than a traced size
    return F.layer_norm(x, (int(x.shape[-1]),), eps=_LN_EPS)


class AdaLayerNormZero(nn.Module):
    """Time-conditioned shift/scale for attention and MLP inputs, plus their residual gates.

    :meth:`modulation` depends on the time embedding only, so the DiT computes it once per ODE time
    (:mod:`cosyvoice.flow.modulation`) and :meth:`forward` takes its result."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 6)

    def modulation(self, emb: Tensor) -> Tensor:
        return self.linear(F.silu(emb))

    def forward(self, x: Tensor, mod: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        shift, scale, gate, ff_shift, ff_scale, ff_gate = mod.chunk(6, dim=1)
        return _layer_norm(x) * (1 + scale[:, None]) + shift[:, None], gate, ff_shift, ff_scale, ff_gate


class AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)

    def modulation(self, emb: Tensor) -> Tensor:
        return self.linear(F.silu(emb))

    def forward(self, x: Tensor, mod: Tensor) -> Tensor:
        scale, shift = mod.chunk(2, dim=1)  # scale first, unlike the per-block norm
        return _layer_norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int, ff_mult: int) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(dim)
        self.attn = Attention(dim, heads, dim_head)
        self.ff = FeedForward(dim, ff_mult)

    def forward(self, x: Tensor, mod: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                past: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``mod``: this block's AdaLN modulation [B, 6 dim] (:meth:`AdaLayerNormZero.modulation` of the time
        embedding)."""
        normed, gate, ff_shift, ff_scale, ff_gate = self.attn_norm(x, mod)
        attn, k, v = self.attn(normed, cos, sin, mask, past)
        x = x + gate.unsqueeze(1) * attn
        ff_in = _layer_norm(x) * (1 + ff_scale[:, None]) + ff_shift[:, None]
        x = x + ff_gate.unsqueeze(1) * self.ff(ff_in)
        return x, k, v


class EstimatorRunner(Protocol):
    """What an accelerated backend provides in place of :meth:`DiT.trunk`, given the ODE time's modulation (the
    DiT's :meth:`~DiT.modulation`, kept per time)."""

    def velocity(self, x: Tensor, mu: Tensor, mod: Modulation, spks: Tensor, cond: Tensor, mask: Tensor) -> Tensor:
        """The velocity [B, mel_dim, N] under the boolean attention mask [N, N]."""

    def velocity_cached(self, x: Tensor, mu: Tensor, mod: Modulation, spks: Tensor, cond: Tensor, mask: Tensor,
                        past: DiTCache | None) -> tuple[Tensor, tuple[Tensor, Tensor], list[tuple[Tensor, Tensor]]]:
        """What :meth:`DiT.trunk` returns with ``past``: velocity, position-conv inputs, per-block K/V."""


class DiT(nn.Module):
    """Velocity estimator: ``forward(x, mu, t, spks, cond)`` with mels as [B, C, N] -> velocity [B, mel_dim, N]."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.chunk_size = cfg.static_chunk_size
        self.time_embed = TimestepEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(cfg.mel_dim, cfg.mu_dim, cfg.spk_dim, cfg.dim)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList(
            [DiTBlock(cfg.dim, cfg.heads, cfg.dim_head, cfg.ff_mult) for _ in range(cfg.depth)])
        self.norm_out = AdaLayerNormZeroFinal(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.mel_dim)
        # an accelerated backend (cosyvoice.backends) that computes the trunk instead of these modules
        self.runner: EstimatorRunner | None = None
        self.modulation_cache = ModulationCache()

    def modulation(self, t: Tensor) -> Modulation:
        """Every block's AdaLN modulation and the output norm's for the ODE times ``t`` [B]; kept per ``t`` on
        the eager CPU path (:mod:`cosyvoice.flow.modulation`: the same values, computed once)."""
        if not cacheable(t):
            return self._modulation(t)
        return self.modulation_cache.get(t, self.modulation_weights(), self._modulation)

    def _modulation(self, t: Tensor) -> Modulation:
        emb = self.time_embed(t)
        return Modulation(tuple(b.attn_norm.modulation(emb) for b in self.transformer_blocks),
                          self.norm_out.modulation(emb))

    def modulation_weights(self) -> list[Tensor]:
        """Every weight :meth:`modulation` reads (the time MLP and each AdaLN linear)."""
        modules = [self.time_embed, self.norm_out, *(b.attn_norm for b in self.transformer_blocks)]
        return [p for m in modules for p in m.parameters()]

    def attention_mask(self, n_frames: int, streaming: bool, device: torch.device) -> Tensor:
        """Chunk-causal when streaming, else all-True (an explicit mask, as the reference passes one)."""
        if streaming:
            return chunk_causal_mask(n_frames, self.chunk_size, device=device)
        return torch.ones(n_frames, n_frames, dtype=torch.bool, device=device)

    def forward(self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                streaming: bool = False) -> Tensor:
        mask = self.attention_mask(x.shape[2], streaming, x.device)
        mod = self.modulation(t.expand(x.shape[0]))
        if self.runner is not None:
            return self.runner.velocity(x, mu, mod, spks, cond, mask)
        return self.trunk(x, mu, mod, spks, cond, mask)[0]

    def forward_cached(self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                       past: DiTCache | None, keep: int) -> tuple[Tensor, DiTCache]:
        """Chunk-causal velocity of the frames after ``past`` only; the first ``keep`` of them join the cache.

        ``keep`` must end on a chunk boundary (so the cache holds whole, final chunks). The
        result equals the matching frames of ``forward(..., streaming=True)`` over the whole
        utterance, at O(new frames x all frames) attention cost instead of O(all frames^2).
        """
        start = 0 if past is None else past.length
        n = x.shape[2]
        if keep and (start + keep) % self.chunk_size:
            raise RuntimeError(
                f"keep={keep} does not end on a chunk boundary (start {start}, chunk {self.chunk_size})")
        mask = chunk_causal_mask(start + n, self.chunk_size, first_query=start, device=x.device)
        trunk = self.trunk if self.runner is None else self.runner.velocity_cached
        out, conv_inputs, kv = trunk(x, mu, self.modulation(t.expand(x.shape[0])), spks, cond, mask, past)
        length = start + keep
        tails = tuple(inp[..., keep:keep + self.input_embed.conv_pos_embed.context] for inp in conv_inputs)
        cache = DiTCache(length, (tails[0], tails[1]), [(k[:, :, :length], v[:, :, :length]) for k, v in kv])
        return out, cache

    def forward_packed(self, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                       pasts: list[DiTCache | None], lengths: list[int], keeps: list[int],
                       trunk: PackedTrunk | None = None,
                       buckets: Callable[[int, int, int], tuple[int, int, int]] | None = None
                       ) -> tuple[Tensor, list[DiTCache]]:
        """:meth:`forward_cached` for B independent rows in ONE call (chunks of different sessions).

        Row ``b`` continues its own utterance after ``pasts[b]`` (one row's cache, or None) with
        ``lengths[b]`` real frames, right-padded to the common width ``x.shape[2]``; each real frame gets the
        velocity that ``forward_cached`` gives it alone (up to float rounding: the padded shapes change
        reduction sizes), padded frames get garbage. Padding policy: new frames are padded to the widest row,
        cached keys/values to the longest cache, and the masks of :func:`packed_chunk_mask` keep every real
        query to its own row's real keys. Returns the velocities [B, mel_dim, width] and each row's new cache
        (its first ``keeps[b]`` new frames appended). ``trunk`` / ``buckets``: a compiled tensor core and the shape
        buckets it was built for (cosyvoice/engine/graphs.py).
        """
        return _forward_packed(self, x, mu, t, spks, cond, pasts, lengths, keeps, trunk, buckets)

    def trunk(self, x: Tensor, mu: Tensor, mod: Modulation, spks: Tensor, cond: Tensor, mask: Tensor,
              past: DiTCache | None = None) -> tuple[Tensor, tuple[Tensor, Tensor], list[tuple[Tensor, Tensor]]]:
        """The velocity, the position convs' inputs and every block's keys/values, given the ODE time's
        :meth:`modulation`: what the exported graphs compute (their time input is the modulation)."""
        start = 0 if past is None else past.length
        x, mu, cond = x.transpose(1, 2), mu.transpose(1, 2), cond.transpose(1, 2)
        h, conv_inputs = self.input_embed(x, cond, mu, spks, None if past is None else past.conv_tails)
        cos, sin = self.rotary_embed(torch.arange(start, start + x.shape[1], device=x.device))
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        kv = []
        for i, block in enumerate(self.transformer_blocks):
            h, k, v = block(h, mod.blocks[i], cos, sin, mask, None if past is None else past.kv[i])
            kv.append((k, v))
        out = self.proj_out(self.norm_out(h, mod.final)).transpose(1, 2)
        return out, conv_inputs, kv


def packed_chunk_mask(starts: list[int], lengths: list[int], past: int, width: int, chunk: int,
                      device: torch.device) -> Tensor:
    """Boolean [B, 1, width, past + width] mask of a packed call (see :meth:`DiT.forward_packed`).

    Row ``b``'s keys are its ``past_len`` cached frames, zero-padded to ``past``, then its ``width`` new frames,
    of which the first ``lengths[b]`` are real. Its real query ``q`` (frame ``starts[b] + q``) sees every cached
    frame and the real new frames up to the end of its own chunk, exactly as :func:`chunk_causal_mask`; padded
    queries see only their own cached/new region's first real key, so no row of the softmax is empty (their
    outputs are discarded, and no real query ever sees a padded key).
    """
    rows = []
    q = torch.arange(width, device=device)
    k_new = torch.arange(width, device=device)
    for start, length in zip(starts, lengths, strict=True):
        past_len = start  # the cache holds every frame before the chunk's start
        chunk_end = ((start + q) // chunk + 1) * chunk - start  # in new-frame coordinates
        new = (k_new.unsqueeze(0) < chunk_end.unsqueeze(1)) & (k_new.unsqueeze(0) < length)
        old = (torch.arange(past, device=device) < past_len).unsqueeze(0).expand(width, -1)
        mask = torch.cat((old, new), dim=1)
        mask[length:] = False
        mask[length:, past] = True  # padded queries: one harmless key
        rows.append(mask)
    return torch.stack(rows).unsqueeze(1)


#: the tensor core of a packed DiT call (:func:`packed_trunk`, or a compiled/graphed version of it)
PackedTrunk = Callable[..., tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]


def packed_trunk(dit: DiT, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, tails0: Tensor,
                 tails1: Tensor, past_k: Tensor, past_v: Tensor, positions: Tensor,
                 mask: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The DiT on padded, stacked tensors only (no Python lists, no data-dependent shapes), so it can be compiled
    or captured per shape bucket. ``x``/``mu``/``cond`` [B, C, W]; ``t`` [B]; ``spks`` [B, S]; ``tails*``
    [B, D, context] (the position convs' left inputs); ``past_k``/``past_v`` [depth, B, H, P, dh]; ``positions``
    [B, W]; ``mask`` [B, 1, W, P + W]. Returns the velocity [B, mel, W], the new frames' keys and values
    [depth, B, H, W, dh] and the two position convs' padded inputs (to cut the next tails from)."""
    batch, _, width = x.shape
    x, mu, cond = x.transpose(1, 2), mu.transpose(1, 2), cond.transpose(1, 2)
    mod = dit.modulation(t)
    emb = dit.input_embed
    h = emb.proj(torch.cat((x, cond, mu, spks.unsqueeze(1).expand(-1, width, -1)), dim=-1))
    pos_embed = emb.conv_pos_embed
    first_in = torch.cat((tails0, h.transpose(1, 2)), dim=2)
    g = pos_embed.conv1[1](conv1d(first_in, pos_embed.conv1[0]))
    second_in = torch.cat((tails1, g), dim=2)
    g = pos_embed.conv2[1](conv1d(second_in, pos_embed.conv2[0]))
    h = g.transpose(1, 2) + h
    cos, sin = dit.rotary_embed(positions.reshape(-1))
    cos, sin = cos.view(batch, width, -1).to(h.dtype), sin.view(batch, width, -1).to(h.dtype)
    past = past_k.shape[3]
    new_k, new_v = [], []
    for i, block in enumerate(dit.transformer_blocks):
        h, k, v = block(h, mod.blocks[i], cos, sin, mask, (past_k[i], past_v[i]) if past else None)
        new_k.append(k[:, :, past:])
        new_v.append(v[:, :, past:])
    out = dit.proj_out(dit.norm_out(h, mod.final)).transpose(1, 2)
    return out, torch.stack(new_k), torch.stack(new_v), first_in, second_in


def _forward_packed(dit: DiT, x: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor,
                    pasts: list[DiTCache | None], lengths: list[int], keeps: list[int],
                    trunk: PackedTrunk | None = None,
                    buckets: Callable[[int, int, int], tuple[int, int, int]] | None = None
                    ) -> tuple[Tensor, list[DiTCache]]:
    """See :meth:`DiT.forward_packed`. ``buckets(rows, width, past) -> (rows, width, past)``: pad further to a
    shape bucket (padded rows: one real frame of zeros, no cache), so a compiled ``trunk`` sees few shapes."""
    chunk, context = dit.chunk_size, dit.input_embed.conv_pos_embed.context
    batch, _, width = x.shape
    starts = [0 if p is None else p.length for p in pasts]
    rows, padded_width, past_width = (buckets or (lambda *shape: shape))(batch, width, max(starts))
    attn = dit.transformer_blocks[0].attn
    depth, dim = len(dit.transformer_blocks), dit.proj_out.in_features

    def pad(y: Tensor) -> Tensor:
        return F.pad(y, (0, padded_width - y.shape[2], 0, 0, 0, rows - batch))

    past_k = x.new_zeros(depth, rows, attn.heads, past_width, attn.dim_head, dtype=attn.compute_dtype or x.dtype)
    past_v = torch.zeros_like(past_k)
    tails = x.new_zeros(2, rows, dim, context)
    for b, p in enumerate(pasts):
        if p is not None:
            tails[0, b], tails[1, b] = p.conv_tails[0][0], p.conv_tails[1][0]
            for i, (k, v) in enumerate(p.kv):
                past_k[i, b, :, :p.length], past_v[i, b, :, :p.length] = k[0], v[0]
    starts += [0] * (rows - batch)
    positions = torch.stack([torch.arange(s, s + padded_width, device=x.device) for s in starts])
    mask = packed_chunk_mask(starts, lengths + [1] * (rows - batch), past_width, padded_width, chunk, x.device)
    t = t.expand(batch) if t.ndim == 0 else t
    out, new_k, new_v, first_in, second_in = (trunk or packed_trunk)(
        dit, pad(x), pad(mu), F.pad(t, (0, rows - batch)), F.pad(spks, (0, 0, 0, rows - batch)), pad(cond),
        tails[0], tails[1], past_k, past_v, positions, mask)
    caches = []
    for b, (start, keep, past) in enumerate(zip(starts, keeps, pasts, strict=False)):
        kv = []
        for i in range(depth):
            ks, vs = new_k[i, b:b + 1, :, :keep], new_v[i, b:b + 1, :, :keep]
            if past is not None:
                ks, vs = torch.cat((past.kv[i][0], ks), dim=2), torch.cat((past.kv[i][1], vs), dim=2)
            kv.append((ks.clone(), vs.clone()))
        conv_tails = (first_in[b:b + 1, :, keep:keep + context].clone(),
                      second_in[b:b + 1, :, keep:keep + context].clone())
        caches.append(DiTCache(start + keep, conv_tails, kv))
    return out[:batch, :, :width], caches
