"""Speech tokens -> mel: the CosyVoice3 flow model (``CausalMaskedDiffWithDiT``, weights = flow.pt).

Pipeline of :meth:`CausalMaskedDiffWithDiT.inference`:

1. prompt tokens ++ new tokens -> embedding -> :class:`PreLookaheadLayer` (each token also
   sees the next ``pre_lookahead_len`` tokens) -> repeated ``token_mel_ratio`` times = ``mu``,
   one row per mel frame;
2. speaker vector ``spks`` = Linear(L2-normalised campplus embedding);
3. ``cond`` = the prompt's mel in the prompt frames, zeros after;
4. the CFM decoder integrates from fixed noise to a mel for all frames; the frames after the
   prompt are returned.

How the reference streams with it (golden README sections 6-7): every call re-runs the whole
utterance so far, ``inference(tokens[:offset + hop + lookahead], streaming=True,
finalize=False)``; with ``finalize=False`` the last ``pre_lookahead_len`` tokens only serve as
look-ahead, so the output ends ``pre_lookahead_len * token_mel_ratio`` frames early, and the
caller keeps ``mel[:, :, offset * token_mel_ratio:]``. The last call passes all tokens with
``finalize=True`` and **streaming=False**, i.e. full attention over the whole utterance.
:class:`FlowStream` produces the same outputs while computing each chunk only once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cosyvoice.config import FlowConfig
from cosyvoice.flow.cfm import CausalConditionalCFM, guidance_batch, solve_euler_cfg
from cosyvoice.flow.dit import PackedTrunk, conv1d
from cosyvoice.flow.dit_cache import DiTCache, cache_cat, cache_rows, compact


class PreLookaheadLayer(nn.Module):
    """Residual conv pair giving each token a view of the next ``lookahead`` tokens.

    conv1 (kernel lookahead+1) reads tokens i..i+lookahead, then leaky-ReLU; conv2 (kernel 3)
    is causal over conv1's outputs. Without ``context`` the sequence end is zero-padded
    (``finalize``); with it, ``context`` supplies the real look-ahead tokens and is not output.
    """

    def __init__(self, in_channels: int, channels: int, lookahead: int) -> None:
        super().__init__()
        self.lookahead = lookahead
        self.conv1 = nn.Conv1d(in_channels, channels, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(channels, in_channels, kernel_size=3)

    @property
    def history(self) -> int:
        """How many earlier tokens conv2 reads (its left padding)."""
        return self.conv2.kernel_size[0] - 1

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        """``x`` [B, T, C] (and ``context`` [B, lookahead, C]) -> [B, T, C]."""
        h = x.transpose(1, 2)
        h = torch.cat((h, context.transpose(1, 2)), dim=2) if context is not None else F.pad(h, (0, self.lookahead))
        h = F.leaky_relu(conv1d(h, self.conv1))
        h = conv1d(F.pad(h, (self.history, 0)), self.conv2)
        return h.transpose(1, 2) + x


class CausalMaskedDiffWithDiT(nn.Module):
    """Token-to-mel flow model; ``state_dict`` keys equal the official flow.pt keys."""

    def __init__(self, cfg: FlowConfig, noise: Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.token_mel_ratio = cfg.token_mel_ratio
        self.pre_lookahead_len = cfg.pre_lookahead_len
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookaheadLayer(cfg.input_size, cfg.pre_lookahead_channels,
                                                     cfg.pre_lookahead_len)
        self.decoder = CausalConditionalCFM(cfg.dit, cfg.cfm, noise)

    def set_noise(self, noise: Tensor) -> None:
        """Inject the CFM start noise [1, mel_dim, L] (default: the official fixed buffer)."""
        self.decoder.set_noise(noise)

    # ------------------------------------------------------------------ conditions

    def speaker_condition(self, embedding: Tensor) -> Tensor:
        """``spks`` [B, output_size] from a speaker embedding [B, spk_embed_dim] (direction only: L2-normalised)."""
        return self.spk_embed_affine_layer(F.normalize(embedding, dim=1))

    def token_condition(self, tokens: Tensor, finalize: bool, first_frame: int = 0) -> Tensor:
        """``mu`` [B, frames - first_frame, input_size] for ``tokens`` [B, T] (prompt ++ new).

        ``finalize=False``: the last ``pre_lookahead_len`` tokens are look-ahead only, so
        ``frames = (T - pre_lookahead_len) * token_mel_ratio``; otherwise ``T * token_mel_ratio``.
        ``first_frame`` skips leading frames and only embeds the tokens they do not need
        beyond conv2's history, so a streaming continuation costs O(new tokens).
        """
        ratio = self.token_mel_ratio
        first_token = first_frame // ratio
        lo = max(first_token - self.pre_lookahead_layer.history, 0)
        # The reference clamps negative ids to 0 (its padding value) before the lookup.
        emb = self.input_embedding(tokens[:, lo:].clamp(min=0))
        if finalize:
            h = self.pre_lookahead_layer(emb)
        else:
            split = emb.shape[1] - self.pre_lookahead_len
            h = self.pre_lookahead_layer(emb[:, :split], context=emb[:, split:])
        h = h[:, first_token - lo:].repeat_interleave(ratio, dim=1)
        return h[:, first_frame - first_token * ratio:]

    # ------------------------------------------------------------------ inference

    @torch.inference_mode()
    def inference(self, token: Tensor, token_len: Tensor | int, prompt_token: Tensor, prompt_token_len: Tensor | int,
                  prompt_feat: Tensor, prompt_feat_len: Tensor | int, embedding: Tensor,
                  streaming: bool, finalize: bool, n_steps: int | None = None,
                  stop: Callable[[], bool] | None = None) -> Tensor:
        """Mel frames after the prompt, float32 [B, output_size, T_out].

        ``token`` [B, T], ``prompt_token`` [B, P] speech-token ids; ``prompt_feat`` [B, F, mels]
        the prompt's mel (normally F = P * token_mel_ratio); ``embedding`` [B, spk_embed_dim].
        Rows of a batch must have the same lengths (the ``*_len`` arguments must equal the
        widths; padded batches are not supported). ``streaming`` selects chunk-causal
        attention, ``finalize=False`` treats the last ``pre_lookahead_len`` tokens as
        look-ahead only. T_out = (P + T [- pre_lookahead_len]) * token_mel_ratio - F; when
        that is not positive (nothing beyond the prompt yet) the result is empty. ``n_steps``: Euler steps of
        the flow (None: the model's ``n_timesteps``). ``stop``: polled before each Euler step; True raises
        :class:`~cosyvoice.flow.cfm.Stopped` (an utterance-long call of a cancelled request ends within one step).

        The reference returns ``(mel, None)`` (the None is an unused cache slot); this returns the mel only.
        """
        token, prompt_token, prompt_feat, embedding = self._check_inputs(
            token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, embedding, finalize)
        tokens = torch.cat((prompt_token, token), dim=1)
        n_prompt = prompt_feat.shape[1]
        n_frames = self._frames_for(tokens.shape[1], finalize)
        if n_frames <= n_prompt:
            return prompt_feat.new_zeros(tokens.shape[0], self.cfg.output_size, 0, dtype=torch.float32)
        mu = self.token_condition(tokens, finalize)
        spks = self.speaker_condition(embedding)
        cond = self.prompt_condition(prompt_feat, n_frames)
        mel = self.decoder(mu.transpose(1, 2), spks, cond, streaming=streaming, n_steps=n_steps, stop=stop)
        return mel[:, :, n_prompt:].float()  # the reference always hands float32 to the vocoder

    def voice_frames(self, n_prompt_tokens: int, n_prompt_frames: int) -> int:
        """How many leading frames' DiT state depends on the voice alone, under the chunk-causal mask: the whole
        chunks before the first frame whose token features read a token after the prompt (the look-ahead of
        the last ``pre_lookahead_len`` prompt tokens reaches the first generated ones) or whose ``cond`` is not
        the prompt mel. Their keys/values at every Euler step are a function of the voice, the fixed noise and
        the step grid, so :class:`VoicePrefix` computes them once per voice."""
        frames = min((n_prompt_tokens - self.pre_lookahead_len) * self.token_mel_ratio, n_prompt_frames)
        chunk = self.decoder.estimator.chunk_size
        return max(frames, 0) // chunk * chunk

    def _frames_for(self, n_tokens: int, finalize: bool) -> int:
        usable = n_tokens if finalize else n_tokens - self.pre_lookahead_len
        return max(usable, 0) * self.token_mel_ratio

    def prompt_condition(self, prompt_feat: Tensor, n_frames: int, first_frame: int = 0) -> Tensor:
        """``cond`` [B, mels, n_frames - first_frame]: the prompt mel where it exists, zeros in frames to generate."""
        cond = prompt_feat.new_zeros(prompt_feat.shape[0], n_frames - first_frame, self.cfg.output_size)
        known = prompt_feat[:, first_frame:n_frames]
        cond[:, :known.shape[1]] = known
        return cond.transpose(1, 2)

    def _check_inputs(self, token: Tensor, token_len: Tensor | int, prompt_token: Tensor,
                      prompt_token_len: Tensor | int, prompt_feat: Tensor, prompt_feat_len: Tensor | int,
                      embedding: Tensor, finalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Validate shapes and ids; return the tensors on this module's device (ids as int64, floats in its dtype)."""
        weight = self.input_embedding.weight
        if token.ndim != 2 or prompt_token.ndim != 2:
            raise RuntimeError(f"token and prompt_token must be [B, T] id tensors, got {list(token.shape)} "
                                    f"and {list(prompt_token.shape)}")
        batch = token.shape[0]
        if prompt_token.shape[0] != batch:
            raise RuntimeError(f"prompt_token has batch {prompt_token.shape[0]}, token has {batch}")
        if prompt_feat.ndim != 3 or prompt_feat.shape[0] != batch or prompt_feat.shape[2] != self.cfg.output_size:
            raise RuntimeError(f"prompt_feat must be [{batch}, frames, {self.cfg.output_size}], "
                                    f"got {list(prompt_feat.shape)}")
        if embedding.shape != (batch, self.cfg.spk_embed_dim):
            raise RuntimeError(
                f"embedding must be [{batch}, {self.cfg.spk_embed_dim}], got {list(embedding.shape)}")
        for name, length, width in (("token_len", token_len, token.shape[1]),
                                    ("prompt_token_len", prompt_token_len, prompt_token.shape[1]),
                                    ("prompt_feat_len", prompt_feat_len, prompt_feat.shape[1])):
            if not bool((torch.as_tensor(length) == width).all()):
                raise RuntimeError(f"{name}={torch.as_tensor(length).tolist()} must equal the tensor width "
                                        f"{width} for every row: padded batches are not supported")
        for name, ids in (("token", token), ("prompt_token", prompt_token)):
            if ids.is_floating_point() or ids.is_complex():
                raise RuntimeError(f"{name} must hold integer speech-token ids, got {ids.dtype}")
            if ids.numel() and int(ids.max()) >= self.cfg.vocab_size:
                raise RuntimeError(f"{name} contains id {int(ids.max())}; speech tokens are "
                                        f"0..{self.cfg.vocab_size - 1}")
        if not finalize and token.shape[1] + prompt_token.shape[1] < self.pre_lookahead_len:
            raise RuntimeError(f"finalize=False needs at least {self.pre_lookahead_len} tokens "
                                    f"(prompt included) to use as look-ahead")
        device, dtype = weight.device, weight.dtype
        return (token.to(device=device, dtype=torch.long), prompt_token.to(device=device, dtype=torch.long),
                prompt_feat.to(device=device, dtype=dtype), embedding.to(device=device, dtype=dtype))


class FlowStream:
    """Incremental streaming of one utterance: each call takes only the new tokens and returns only new mel.

    The contract (shared with :class:`~cosyvoice.hifigan.HiFTStream`): :meth:`inference` gets the
    tokens that arrived since the previous call and returns the mel frames after the prompt that no
    earlier call returned; concatenated, the outputs equal what the reference's streaming calls give
    (``flow.inference(all tokens so far, streaming=True, finalize=False)`` sliced at the previous end,
    then one last ``streaming=False, finalize=True`` call), up to float rounding.

    Under chunk-causal attention a chunk whose frames all have their final inputs never changes, so the
    stream keeps, for every ODE step and DiT block, the keys/values of the finished chunks (plus the
    position convs' tails and the finished mel) and runs the DiT on the new frames only. A
    ``streaming=False`` call (the reference's last call: full attention) has nothing to reuse and
    recomputes the utterance. :meth:`drop_cache` frees the cache and switches the stream to that
    recompute path for its remaining calls (the engine's memory budget), with the same outputs.

    Cost: attention per call O(new x all frames) instead of O(all^2), the rest O(new).
    Memory per finished frame (:meth:`bytes_per_frame`): n_timesteps x depth x 2 (K, V) x 2B (guidance
    rows) x heads x dim_head elements of the flow's dtype; for the released 22-block, 16 x 64-head DiT
    that is 3.6 MB in float32 (1.8 MB in bf16), ~180 MB per second of audio (measured on an H100: 4.5 GiB
    of cache after 1300 frames). Not thread-safe: one session per utterance.

    ``steps``: the Euler steps of every call (None: the model's). ``prefix``: the voice's :class:`VoicePrefix` (same
    steps), so the first call starts after it (:meth:`voice_prefix` makes one; :mod:`cosyvoice.flow.prompt_cache`).
    """

    def __init__(self, flow: CausalMaskedDiffWithDiT, prompt_token: Tensor, prompt_feat: Tensor,
                 embedding: Tensor, steps: int | None = None, prefix: VoicePrefix | None = None) -> None:
        self.flow = flow
        _, self.prompt_token, self.prompt_feat, self.embedding = flow._check_inputs(
            prompt_token[:, :0], 0, prompt_token, prompt_token.shape[-1], prompt_feat, prompt_feat.shape[1],
            embedding, finalize=True)
        self.steps = steps or flow.decoder.n_timesteps  # Euler steps of every call
        with torch.inference_mode():
            self.spks = flow.speaker_condition(self.embedding)
        self._tokens = self.prompt_token  # prompt ++ every token seen so far
        self._caches: list[DiTCache | None] | None = [None] * self.steps
        self._mel = self.prompt_feat.new_zeros(self.prompt_feat.shape[0], flow.cfg.output_size, 0)
        if prefix is not None:  # the voice's finished chunks, computed once per voice (shared, never modified)
            assert prefix.steps == self.steps and prefix.length == flow.voice_frames(
                self.prompt_token.shape[1], self.prompt_feat.shape[1]), "a prefix of another voice or step count"
            self._caches, self._mel = list(prefix.caches), prefix.mel
        self._returned = 0  # mel frames after the prompt returned so far
        self._finalized = False

    @staticmethod
    def bytes_per_frame(flow: CausalMaskedDiffWithDiT, batch: int = 1, steps: int | None = None) -> int:
        """Cache bytes one finished mel frame costs (keys and values of every block at every ODE step)."""
        dit = flow.decoder.estimator
        attn = dit.transformer_blocks[0].attn
        elements = (steps or flow.decoder.n_timesteps) * len(dit.transformer_blocks) * 2 * 2 * batch * attn.heads \
            * attn.dim_head
        runner = getattr(dit, "runner", None)  # a graph's keys/values may be narrower than the module's weights
        own = dit.transformer_blocks[0].attn.compute_dtype or dit.proj_out.weight.dtype
        return elements * getattr(runner, "cache_dtype", own).itemsize

    @property
    def finished_frames(self) -> int:
        """Frames (prompt included) whose mel is final and cached."""
        return self._mel.shape[2]

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the attention cache now (0 after :meth:`drop_cache`)."""
        if self._caches is None or self._caches[0] is None:
            return 0
        return self.finished_frames * self.bytes_per_frame(self.flow, self.prompt_token.shape[0], self.steps)

    @property
    def caching(self) -> bool:
        return self._caches is not None

    def drop_cache(self) -> None:
        """Free the cache; later calls recompute the utterance as the reference does (same outputs)."""
        self._caches = None

    @torch.inference_mode()
    def inference(self, token: Tensor, finalize: bool, streaming: bool | None = None) -> Tensor:
        """New tokens ``token`` [B, n] (those after the previous call's) -> the new mel frames [B, mels, m].

        ``streaming`` defaults to ``not finalize``, the reference's calls; ``streaming=True, finalize=True``
        (chunk mask over a zero-padded end) is supported for completeness.
        """
        step = self.begin(token, finalize, streaming)
        return step if isinstance(step, Tensor) else self.solve(step)

    @torch.inference_mode()
    def solve(self, step: PendingExtension, stop: Callable[[], bool] | None = None) -> Tensor:
        """The second half of :meth:`inference` for this stream alone: the new mel frames of ``step``. ``stop``:
        polled before each Euler step (True raises :class:`~cosyvoice.flow.cfm.Stopped`)."""
        cfm = self.flow.decoder
        mu_in, spks_in, cond_in = guidance_batch(step.mu, self.spks, step.cond)
        # each step's cache is replaced as soon as its extension exists, so the old one is freed at once instead
        # of every step's old and new caches being held together until the last step (twice the cache)
        caches = self._caches

        def velocity(x_in: Tensor, t_in: Tensor, k: int) -> Tensor:
            out, caches[k] = cfm.estimator.forward_cached(x_in, mu_in, t_in, spks_in, cond_in, caches[k], step.keep)
            return out

        try:
            mel = solve_euler_cfg(velocity, step.noise, cfm.time_grid(step.mu, self.steps), cfm.cfg_rate, stop)
        except BaseException:
            self.drop_cache()  # some steps were extended, some not: recompute from here on
            raise
        return self._finish(step, mel, caches)

    @torch.inference_mode()
    def voice_prefix(self) -> VoicePrefix | None:
        """Compute this (new) stream's :class:`VoicePrefix` and start from it; None when the prompt has no whole
        chunk that depends on the voice alone."""
        assert self.finished_frames == 0 and not self._finalized, "a prefix is made before the first call"
        flow = self.flow
        length = flow.voice_frames(self.prompt_token.shape[1], self.prompt_feat.shape[1])
        if length == 0:
            return None
        # finalize=False: the last pre_lookahead_len prompt tokens are look-ahead only, as for every later token
        mu = flow.token_condition(self.prompt_token, finalize=False)[:, :length].transpose(1, 2)
        cond = flow.prompt_condition(self.prompt_feat, length)
        self.solve(PendingExtension(self, mu, cond, flow.decoder.start_noise(0, length, mu), length))
        # copies, so a kept prefix holds only itself (the tails are views of whole conv inputs, the keys/values of
        # buffers with room) and the streams that start from it never write into one buffer
        caches = tuple(compact(DiTCache(c.length, (c.conv_tails[0].clone(), c.conv_tails[1].clone()), c.kv))
                       for c in self._caches)
        self._caches = list(caches)
        return VoicePrefix(length, self.steps, caches, self._mel)

    @torch.inference_mode()
    def begin(self, token: Tensor, finalize: bool, streaming: bool | None = None,
              stop: Callable[[], bool] | None = None) -> Tensor | PendingExtension:
        """The first half of :meth:`inference`: the new mel when there is nothing to extend (recompute, or no
        new frame), else the :class:`PendingExtension` that :func:`extend_packed` computes, alone or packed
        with other streams' (the engine's token-to-wave batching). ``stop``: polled before each Euler step of a
        recompute made here (the last call under full attention is the longest of a stream); True raises
        :class:`~cosyvoice.flow.cfm.Stopped` and leaves the stream of no further use."""
        flow = self.flow
        streaming = not finalize if streaming is None else streaming
        if self._finalized:
            raise RuntimeError("this FlowStream was finalised; start a new one for a new utterance")
        self._finalized = finalize
        n_prompt_tokens, n_prompt = self.prompt_token.shape[1], self.prompt_feat.shape[1]
        token, _, _, _ = flow._check_inputs(token, token.shape[1], self.prompt_token, n_prompt_tokens,
                                            self.prompt_feat, n_prompt, self.embedding, finalize=True)
        tokens = torch.cat((self._tokens, token), dim=1)
        if not finalize and tokens.shape[1] < self.flow.pre_lookahead_len:
            raise RuntimeError(f"finalize=False needs at least {self.flow.pre_lookahead_len} tokens "
                                    f"(prompt included) to use as look-ahead")
        self._tokens = tokens
        if finalize and not streaming:
            self.drop_cache()  # the last call, under full attention: the chunk-causal cache has no use left
        if not streaming or self._caches is None:
            mel = flow.inference(tokens[:, n_prompt_tokens:], tokens.shape[1] - n_prompt_tokens, self.prompt_token,
                                 n_prompt_tokens, self.prompt_feat, n_prompt, self.embedding, streaming=streaming,
                                 finalize=finalize, n_steps=self.steps, stop=stop)
            return self._new_frames(mel)
        n_frames = flow._frames_for(tokens.shape[1], finalize)
        if n_frames <= n_prompt:
            return self._new_frames(self.prompt_feat.new_zeros(tokens.shape[0], flow.cfg.output_size, 0,
                                                               dtype=torch.float32))
        cfm = flow.decoder
        start = self.finished_frames
        # frames of whole chunks become final, unless the look-ahead of the last tokens was zero-padded
        keep = 0 if finalize else n_frames // cfm.estimator.chunk_size * cfm.estimator.chunk_size - start
        mu = flow.token_condition(tokens, finalize, first_frame=start).transpose(1, 2)
        cond = flow.prompt_condition(self.prompt_feat, n_frames, first_frame=start)
        return PendingExtension(self, mu, cond, cfm.start_noise(start, n_frames, mu), keep)

    def _new_frames(self, mel: Tensor) -> Tensor:
        """The frames after the prompt of ``mel`` (all of them so far) that no earlier call returned."""
        out = mel[:, :, self._returned:]
        self._returned = max(self._returned, mel.shape[2])
        return out

    def _finish(self, step: PendingExtension, mel: Tensor, caches: list[DiTCache]) -> Tensor:
        """The second half: take the computed frames ``mel`` [B, mels, n] and caches; the new frames."""
        start = self.finished_frames
        mel = torch.cat((self._mel, mel), dim=2)
        self._caches, self._mel = caches, mel[:, :, :start + step.keep]
        return self._new_frames(mel[:, :, self.prompt_feat.shape[1]:].float())


@dataclass(frozen=True, eq=False)
class VoicePrefix:
    """What a :class:`FlowStream` of one voice holds after its voice-only frames (:meth:`~CausalMaskedDiffWithDiT.
    voice_frames`): every Euler step's :class:`DiTCache` of them (both guidance rows) and their mel. The same for
    every request of the voice at this step count, so it is computed once (:mod:`cosyvoice.flow.prompt_cache`)
    and each stream of the voice starts from it: its first DiT call runs over the frames after it only."""

    length: int
    steps: int
    caches: tuple[DiTCache, ...]
    mel: Tensor  # [B, mels, length]

    @property
    def nbytes(self) -> int:
        tensors = [self.mel] + [t for c in self.caches for t in (*c.conv_tails, *(x for kv in c.kv for x in kv))]
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(eq=False)
class PendingExtension:
    """One stream's chunk-causal extension, ready to be solved (alone or packed with others')."""

    stream: FlowStream
    mu: Tensor  # [B, C, n] token features of the frames to compute
    cond: Tensor  # [B, mels, n]
    noise: Tensor  # [B, mels, n] start noise
    keep: int  # how many of the n frames become final (join the cache)

    @property
    def frames(self) -> int:
        return self.mu.shape[2]


@torch.inference_mode()
def extend_packed(steps: list[PendingExtension], trunk: PackedTrunk | None = None,
                  buckets: Callable[[int, int, int], tuple[int, int, int]] | None = None,
                  stop: Callable[[], bool] | None = None) -> list[Tensor]:
    """Solve the ODE of several streams' extensions in ONE DiT call per Euler step; each stream's new mel.

    Streams of one flow model; each may have its own batch (guidance doubles it), prompt, speaker, cache length
    and chunk length. Rows are right-padded to the widest (``DiT.forward_packed`` states the policy), so every
    step evaluates one [2 x rows, C, width] batch; the Euler update is per element, so each stream's result is
    what it gets alone up to float rounding. ``trunk`` / ``buckets``: a compiled DiT core and its shape buckets
    (:class:`~cosyvoice.engine.graphs.CompiledDiT`). ``stop``: polled before each Euler step (True raises
    :class:`~cosyvoice.flow.cfm.Stopped`).
    """
    flow = steps[0].stream.flow
    cfm = flow.decoder
    n_steps = steps[0].stream.steps
    assert all(s.stream.steps == n_steps for s in steps), "streams packed together share their Euler steps"
    width = max(s.frames for s in steps)
    rows = [s.mu.shape[0] for s in steps]
    offsets = [sum(rows[:i]) for i in range(len(steps))]
    n_rows = sum(rows)

    def pad(x: Tensor) -> Tensor:
        return F.pad(x, (0, width - x.shape[2]))

    mu = torch.cat([pad(s.mu) for s in steps])
    mu_in, spks_in, cond_in = guidance_batch(mu, torch.cat([s.stream.spks for s in steps]),
                                             torch.cat([pad(s.cond) for s in steps]))
    # guidance row r: stream row r % n_rows of its stream, conditioned (r < n_rows) or not; a stream's cache holds
    # its conditioned rows first, then its unconditioned ones, as its own guidance batch does
    owner = [(i, r - offsets[i]) for i, n in enumerate(rows) for r in range(offsets[i], offsets[i] + n)]
    lengths = [steps[i].frames for i, _ in owner] * 2
    keeps = [steps[i].keep for i, _ in owner] * 2
    new_caches: list[list[DiTCache | None]] = [[None] * len(steps) for _ in range(n_steps)]

    def velocity(x_in: Tensor, t_in: Tensor, step: int) -> Tensor:
        pasts = [cache_rows(steps[i].stream._caches[step], half * rows[i] + r, half * rows[i] + r + 1)
                 for half in (0, 1) for i, r in owner]
        out, caches = cfm.estimator.forward_packed(x_in, mu_in, t_in, spks_in, cond_in, pasts, lengths, keeps,
                                                   trunk, buckets)
        for i, n in enumerate(rows):
            lo = offsets[i]
            new_caches[step][i] = cache_cat(caches[lo:lo + n] + caches[n_rows + lo:n_rows + lo + n])
        return out

    mel = solve_euler_cfg(velocity, torch.cat([pad(s.noise) for s in steps]), cfm.time_grid(mu, n_steps),
                          cfm.cfg_rate, stop)
    return [s.stream._finish(s, mel[offsets[i]:offsets[i] + rows[i], :, :s.frames],
                             [new_caches[k][i] for k in range(n_steps)])
            for i, s in enumerate(steps)]
