"""Text-stream ("bi-streaming") decoding: speech tokens while the text is still arriving.

The reference's ``CosyVoice3LM.inference_bistream`` as a :mod:`job <cosyvoice.llm.job>`. It interleaves
text and speech at a fixed ratio (``mix_ratio`` = 5 text : 15 speech, the released yaml's value):

1. The prefix ``[sos] + prompt text up to and including <|endofprompt|>`` starts the input; the rest of
   the prompt text heads the text queue.
2. While prompt speech tokens remain, each piece of text that brings the queue to 5 tokens appends a
   block of 5 text + up to 15 prompt-speech embeddings (no model call yet).
3. Once the prompt speech is used up, speech tokens are sampled one at a time (``ignore_eos``: index
   ``speech_token_size`` banned). At output index ``next_fill_index`` (first ``(P // 15 + 1) * 15 - P``
   for P prompt speech tokens, then every 16) the fill token is forced without sampling; a fill token,
   forced or sampled, is recorded but never fed: decoding pauses until 5 more text tokens are there,
   and the next call is that text block alone.
4. When the text has ended: ``[remaining text, task_id]`` and decoding until ``eos``.

The reference pulls one piece per loop iteration and resumes after a fill at most once per piece; its
frontend hands the LLM one text token per piece, so by default each id of the stream is one piece
(``per_token=True``). ``per_token=False`` makes each batch the stream hands over one piece, as when
``inference_bistream`` is called with multi-token pieces (golden README §13).

Stopping: the reference ends only at ``eos`` and raises ValueError for any other non-speech token, with
no bound on the final phase (``strict=True``, our parity mode: :class:`BistreamError` and the cache
bound). The engine runs ``strict=False``: in the final phase any stop id ends the utterance and at most
``max_token_text_ratio`` x the text tokens are spoken, as the reference's non-streaming ``inference``
does, and while text still streams in it bans every stop id but the fill before sampling, instead of failing
a request that has already streamed audio (docs/differences.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator

import torch

from cosyvoice.errors import CosyVoiceError, ResourceLimitError
from cosyvoice.llm.job import Job, Step, TokenStream, Wait
from cosyvoice.llm.model import MAX_SILENT_RUN, SILENT_TOKENS, CosyVoice3LM, TokenIds

#: text tokens : speech tokens per interleaved block (``mix_ratio`` of the released cosyvoice3.yaml)
MIX_RATIO = (5, 15)


class BistreamError(CosyVoiceError):
    """The model chose a token the bi-streaming algorithm cannot continue from (the reference raises ValueError)."""


def first_fill_index(n_prompt_speech: int, mix_ratio: tuple[int, int] = MIX_RATIO) -> int:
    """Output index of the first forced fill token for a prompt of ``n_prompt_speech`` speech tokens."""
    speech = mix_ratio[1]
    return (n_prompt_speech // speech + 1) * speech - n_prompt_speech


def bistream_job(lm: CosyVoice3LM, prompt_text: TokenIds, prompt_speech_token: TokenIds, stream: TokenStream, *,
                 max_len: int, mix_ratio: tuple[int, int] = MIX_RATIO,
                 silent_tokens: frozenset[int] = SILENT_TOKENS, per_token: bool = True, strict: bool = True,
                 max_token_text_ratio: float = 20.0) -> Job:
    """The bi-streaming decoding of one request, reading text ids from ``stream`` without blocking.

    ``prompt_text`` must hold ``<|endofprompt|>`` (``lm.endofprompt_id``; zero-shot transcript or instruct2
    instruction); ``prompt_speech_token`` may be empty (instruct2). ``max_len`` bounds the positions the job feeds
    (the KV cache it will run on): beyond it the job raises :class:`ResourceLimitError`. Emitted tokens
    follow the official engine's silent-run rule (see ``CosyVoice3LM.generate``); ``strict`` and
    ``max_token_text_ratio``: see the module docstring. Validation happens
    here, at the call; the returned job raises :class:`BistreamError` where the reference raises ValueError,
    and re-raises the stream writer's error.
    """
    device = lm.speech_embedding.weight.device
    prompt_ids = lm._ids(prompt_text, "prompt_text", lm.cfg.qwen.vocab_size, device)
    speech_ids = lm._ids(prompt_speech_token, "prompt_speech_token", lm.speech_token_size, device)
    endofprompt_id = lm.endofprompt_id
    hits = (prompt_ids == endofprompt_id).nonzero().flatten().tolist()
    if not hits:
        raise RuntimeError(
            f"text-stream synthesis needs <|endofprompt|> (id {endofprompt_id}) in the prompt text: end the "
            "zero-shot transcript or the instruct2 instruction with it (cross-lingual mode cannot stream text)")
    n_text, n_speech = mix_ratio
    if n_text <= 0 or n_speech <= 0:
        raise RuntimeError(f"mix_ratio must be two positive counts, got {mix_ratio}")
    eop = hits[0]  # the reference splits at the first <|endofprompt|>
    prefix = torch.cat([lm.speech_embedding.weight[lm.sos][None].detach(), _embed_text(lm, prompt_ids[:eop + 1])])
    if prefix.shape[0] >= max_len:
        raise ResourceLimitError(f"the prompt alone needs {prefix.shape[0]} LLM positions; at most {max_len} "
                                 "are allowed per text-stream request")
    limit_ratio = None if strict else max_token_text_ratio
    return _run(lm, prefix, prompt_ids[eop + 1:], speech_ids, stream, max_len, mix_ratio, silent_tokens, per_token,
                limit_ratio)


@torch.no_grad()
def _embed_text(lm: CosyVoice3LM, ids: torch.Tensor) -> torch.Tensor:
    return lm.llm.embed_tokens(ids)


def _speech_row(lm: CosyVoice3LM, token: int) -> torch.Tensor:
    return lm.speech_embedding.weight[token].detach().view(1, -1)


def _run(lm: CosyVoice3LM, prefix: torch.Tensor, text_head: torch.Tensor, speech_ids: torch.Tensor,
         stream: TokenStream, max_len: int, mix_ratio: tuple[int, int], silent_tokens: frozenset[int],
         per_token: bool, limit_ratio: float | None) -> Job:
    """The job: its state is made at its first step, in the thread that runs it, as everything after."""
    decoding = _Bistream(lm, prefix, text_head, speech_ids, max_len, mix_ratio, silent_tokens, limit_ratio)
    return (yield from decoding.run(stream, per_token))


class _Bistream:
    """The decoding state of one bi-streaming job and its phases (see the module docstring's steps)."""

    def __init__(self, lm: CosyVoice3LM, prefix: torch.Tensor, text_head: torch.Tensor, speech_ids: torch.Tensor,
                 max_len: int, mix_ratio: tuple[int, int], silent_tokens: frozenset[int],
                 limit_ratio: float | None) -> None:
        self.lm, self.max_len, self.mix_ratio, self.device = lm, max_len, mix_ratio, prefix.device
        self.silent_tokens, self.limit_ratio = silent_tokens, limit_ratio
        with torch.no_grad():
            self.prompt_speech = lm.speech_embedding.weight[speech_ids].detach()
        self.text_cache = _embed_text(lm, text_head)  # [n, H] text embeddings not fed yet
        self.lm_input = prefix  # the next call's input; after a fill break it still holds the input already fed
        self.out_tokens: list[int] = []  # every decision, fill tokens included: the sampler's history, as the reference
        self.next_fill = first_fill_index(speech_ids.numel(), mix_ratio)
        self.position = 0
        self.emit: list[int] = []
        self.silent_run = 0
        self.n_streamed = 0  # text tokens of the stream (the length bound counts them alone, as inference() does)
        self.n_spoken = 0  # speech tokens decided (fills excluded)
        self.arrived: deque[list[int]] = deque()  # pieces taken from the stream, not yet processed

    def step(self, x: torch.Tensor, **kwargs) -> Step:
        """The model call on ``x``, carrying the tokens kept since the last call; bounded by ``max_len``."""
        if self.position + x.shape[0] > self.max_len:
            raise ResourceLimitError(
                f"the text stream needs more than {self.max_len} LLM positions (prompt, text and speech so far); "
                "send less text per request (COSYVOICE_MAX_LLM_POSITIONS raises the bound)")
        self.position += x.shape[0]
        request = Step(x, history=self.out_tokens, emit=tuple(self.emit), **kwargs)
        self.emit.clear()
        return request

    def keep(self, token: int) -> None:
        """Pass a speech token on, but not past the official llm_job's run of silent tokens."""
        if token in self.silent_tokens:
            self.silent_run += 1
            if self.silent_run > MAX_SILENT_RUN:
                return  # fed back to the model, not passed on (official llm_job)
        else:
            self.silent_run = 0
        self.emit.append(token)

    def run(self, stream: TokenStream, per_token: bool) -> Job:
        """Text pieces as they arrive, decoding between them; then the final phase."""
        while True:
            piece = yield from self._next_piece(stream, per_token)
            if piece is None:
                break
            if self._take_text(piece):
                yield from self._decode_to_fill()
        return (yield from self._finish())

    def _next_piece(self, stream: TokenStream, per_token: bool) -> Generator[Wait, None, list[int] | None]:
        """The reference's ``for this_text in text``: the next piece, waiting while none has arrived; None at
        the stream's end."""
        while not self.arrived:
            ids, ended = stream.take()
            if ids:
                self.arrived.extend([[i] for i in ids] if per_token else [ids])
            elif ended:
                return None
            else:
                yield Wait(tuple(self.emit))
                self.emit.clear()
        return self.arrived.popleft()

    def _take_text(self, ids: list[int]) -> bool:
        """Queue a piece's embeddings, mix prompt blocks while prompt speech remains; whether decoding resumes."""
        lm, (n_text, n_speech) = self.lm, self.mix_ratio
        piece = torch.tensor(ids, dtype=torch.long, device=self.device)
        if int(piece.min()) < 0 or int(piece.max()) >= lm.cfg.qwen.vocab_size:
            raise RuntimeError(f"text-stream ids must be in [0, {lm.cfg.qwen.vocab_size})")
        self.text_cache = torch.cat([self.text_cache, _embed_text(lm, piece)])
        self.n_streamed += piece.numel()
        while self.prompt_speech.shape[0] and self.text_cache.shape[0] >= n_text:
            self.lm_input = torch.cat([self.lm_input, self.text_cache[:n_text], self.prompt_speech[:n_speech]])
            self.text_cache, self.prompt_speech = self.text_cache[n_text:], self.prompt_speech[n_speech:]
        if self.prompt_speech.shape[0]:
            return False  # not enough text for the next prompt block yet
        if self.out_tokens and self.out_tokens[-1] == lm.fill:
            if self.text_cache.shape[0] < n_text:
                return False  # paused after a fill until a whole text block is there
            self.lm_input, self.text_cache = self.text_cache[:n_text], self.text_cache[n_text:]  # fill never fed
        return True

    def _decode_to_fill(self) -> Generator[Step, int | None, None]:
        """Speech tokens until a fill, forced at its index or sampled.

        Reference quirk: its `lm_input.size(1) == 1` start rule never holds for CosyVoice3 (the prefix holds the
        prompt text), so without prompt speech decoding starts before any text of the stream is fed."""
        lm = self.lm
        while True:
            if len(self.out_tokens) == self.next_fill:
                yield self.step(self.lm_input, sample=False)  # the fill is forced; the call's logits are unused
                token = lm.fill
            else:
                # ignore_eos bans index speech_token_size; the engine (not strict) also bans every other stop id
                # but the fill, which would end the reference with ValueError mid-stream
                token = yield self.step(self.lm_input, ban_sos=True, ban_stop=self.limit_ratio is not None,
                                        keep_fill=True)
            if token == lm.fill:
                self.next_fill = len(self.out_tokens) + self.mix_ratio[1] + 1
            self.out_tokens.append(token)
            if token == lm.fill:
                return
            if token >= lm.speech_token_size:
                raise BistreamError(
                    f"the model chose token {token} (not a speech token) while text was still streaming in; the "
                    "reference's bi-streaming algorithm stops with ValueError here. Retry with another seed")
            self.n_spoken += 1
            self.keep(token)
            self.lm_input = _speech_row(lm, token)

    def _finish(self) -> Job:
        """The text has ended: ``[remaining text, task_id]``, then decoding until eos (or the length bound).

        Reference quirks: after a fill the already fed input is fed again, ahead of the remaining text and
        task_id; prompt speech tokens still unused when the text ends (text shorter than the prompt's blocks)
        are dropped."""
        lm = self.lm
        lm_input = torch.cat([self.lm_input, self.text_cache, _speech_row(lm, lm.task_id)])
        limit = None if self.limit_ratio is None else \
            CosyVoice3LM.length_limits(self.n_streamed, max_ratio=self.limit_ratio)[1]
        while limit is None or self.n_spoken < limit:
            token = yield self.step(lm_input)
            self.out_tokens.append(token)
            if token == lm.eos or (limit is not None and token in lm.stop_token_ids):
                return tuple(self.emit)
            if token >= lm.speech_token_size:
                raise BistreamError(f"the model chose token {token} where only a speech token or eos can follow; "
                                    "the reference's bi-streaming algorithm stops with ValueError here. Retry with "
                                    "another seed")
            self.n_spoken += 1
            self.keep(token)
            lm_input = _speech_row(lm, token)
        return tuple(self.emit)
