"""CosyVoice3's speech-token language model: text (+ prompt) ids in, speech tokens out.

The Qwen2 stack reads one sequence of embeddings

    [sos] + embed_tokens(prompt_text ++ text) + [task_id] + speech_embedding(prompt_speech_tokens)

and then continues it one speech token at a time; ``sos`` and ``task_id`` are rows of the
speech embedding table past the 6561 real speech tokens. The three request modes differ only in
what they pass: zero-shot (prompt transcript + prompt speech tokens), cross-lingual (no prompt
text, no prompt speech; the text itself carries ``<|endofprompt|>``) and instruct2 (the
instruction as prompt text, no prompt speech). There is no speaker-embedding slot in CosyVoice3.

:meth:`CosyVoice3LM.prepare` validates a request and builds its prompt; :meth:`CosyVoice3LM.generate_job`
is the decoding loop as a job, run by the engine's batched scheduler; :meth:`CosyVoice3LM.generate` runs it
alone (eager) as a lazy token iterator: one prefill pass, then one cached decode step per token, each
computed only when the consumer asks for the next token, so closing the iterator stops all work at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from cosyvoice.config import LLMConfig
from cosyvoice.llm.job import Job, Sampler, Step, run_eager
from cosyvoice.llm.qwen2 import KVCache, Qwen2Backbone
from cosyvoice.llm.sampling import SeededSampler, to_device

TokenIds = Sequence[int] | torch.Tensor

#: Id of ``<|endofprompt|>`` in the released tokenizer; the official model hard-codes it. A bundle's loader
#: gives the model the id its own tokenizer resolves instead (:meth:`ModelBundle.load_llm`).
ENDOFPROMPT_ID = 151646
#: Speech tokens that are silence or breath in the released FSQ codebook (official ``llm_job``).
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
#: Longest run of silent tokens passed on; later ones in the same run are dropped.
MAX_SILENT_RUN = 5
#: Speech-table rows past the real speech tokens: sos, eos, task_id, fill, then unused stop ids.
N_EXTRA_TOKENS = 200


class CosyVoice3LM(nn.Module):
    """Qwen2 backbone + speech-token embedding and head; keys equal the official ``llm.pt``."""

    def __init__(self, cfg: LLMConfig, endofprompt_id: int = ENDOFPROMPT_ID) -> None:
        super().__init__()
        self.cfg = cfg
        #: the tokenizer's id of ``<|endofprompt|>``, which every prompt must carry (see :meth:`prepare`)
        self.endofprompt_id = endofprompt_id
        n = cfg.speech_token_size
        self.speech_token_size = n
        self.sos, self.eos, self.task_id, self.fill = n, n + 1, n + 2, n + 3
        #: sampling any id past the real speech tokens ends the utterance
        self.stop_token_ids = range(n, n + N_EXTRA_TOKENS)
        self.llm = Qwen2Backbone(cfg.qwen)
        self.llm_decoder = nn.Linear(cfg.llm_output_size, n + N_EXTRA_TOKENS, bias=False)
        self.speech_embedding = nn.Embedding(n + N_EXTRA_TOKENS, cfg.llm_input_size)

    # ------------------------------------------------------------------ building blocks

    @staticmethod
    def length_limits(n_text: int, min_ratio: float = 2.0, max_ratio: float = 20.0) -> tuple[int, int]:
        """(min_len, max_len) of the speech tokens for ``n_text`` tts-text tokens (prompt text excluded)."""
        n = torch.tensor(n_text, dtype=torch.int32)
        # the reference multiplies an int32 tensor by the ratio (float32 arithmetic), then truncates
        return int(n * min_ratio), int(n * max_ratio)

    def build_lm_input(self, text: torch.Tensor, prompt_text: torch.Tensor,
                       prompt_speech_token: torch.Tensor) -> torch.Tensor:
        """The prompt sequence [1, L, H] from 1-D id tensors on this module's device."""
        weight = self.speech_embedding.weight
        return torch.cat([
            weight[self.sos][None],
            self.llm.embed_tokens(torch.cat([prompt_text, text])),
            weight[self.task_id][None],
            self.speech_embedding(prompt_speech_token),
        ])[None]

    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Speech-token log-probabilities (float32) of last hidden states [..., H]."""
        return self.llm_decoder(hidden).float().log_softmax(dim=-1)

    def decode_step(self, embeds: torch.Tensor, start: int, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``embeds`` [1, T, H] at positions ``start``.. ; return the last (hidden [1, H], log-probs [1, V])."""
        t = embeds.shape[1]
        positions = torch.arange(start, start + t, device=embeds.device)[None]
        hidden = self.llm(embeds, positions, cache.view(slots=start + t))[:, -1]
        return hidden, self.log_probs(hidden)

    # ------------------------------------------------------------------ generation

    def apply_bans(self, logp: torch.Tensor, steps: Sequence[Step]) -> torch.Tensor:
        """Log-probs [B, V] with each row's bans of ``steps[b]`` applied in place (no host sync)."""
        ban_sos = [s.ban_sos for s in steps]
        ban_stop = [s.ban_stop for s in steps]
        if any(ban_sos):
            rows = to_device(ban_sos, logp.device)
            logp[:, self.sos] = logp[:, self.sos].masked_fill(rows, -float("inf"))
        if any(ban_stop):
            rows = to_device(ban_stop, logp.device)[:, None]
            fill = logp[:, self.fill].clone()
            logp[:, self.speech_token_size:] = logp[:, self.speech_token_size:].masked_fill(rows, -float("inf"))
            keep = [s.ban_stop and s.keep_fill for s in steps]
            if any(keep):
                logp[:, self.fill] = torch.where(to_device(keep, logp.device), fill, logp[:, self.fill])
        return logp

    def prepare(self, text: TokenIds, prompt_text: TokenIds, prompt_speech_token: TokenIds, *,
                min_token_text_ratio: float = 2.0, max_token_text_ratio: float = 20.0
                ) -> tuple[torch.Tensor, int, int]:
        """Validate one request and build its prompt: (lm_input [L, H], min_len, max_len).

        Inputs are 1-D token ids (or [1, T]); see the module docstring for what each mode passes.
        Raises RuntimeError before any model work on input the service would never pass (invariants).
        """
        device = self.speech_embedding.weight.device
        text_ids = self._ids(text, "text", self.cfg.qwen.vocab_size, device)
        prompt_ids = self._ids(prompt_text, "prompt_text", self.cfg.qwen.vocab_size, device)
        speech_ids = self._ids(prompt_speech_token, "prompt_speech_token", self.speech_token_size, device)
        endofprompt_id = self.endofprompt_id
        if not bool((text_ids == endofprompt_id).any() or (prompt_ids == endofprompt_id).any()):
            raise RuntimeError(
                f"CosyVoice3 needs the <|endofprompt|> token (id {endofprompt_id}) in the prompt text or the text: "
                "end the prompt transcript (zero-shot), the instruction (instruct2) or a leading system prompt "
                "(cross-lingual) with '<|endofprompt|>', e.g. 'You are a helpful assistant.<|endofprompt|>'")
        min_len, max_len = self.length_limits(len(text_ids), min_token_text_ratio, max_token_text_ratio)
        with torch.inference_mode():
            lm_input = self.build_lm_input(text_ids, prompt_ids, speech_ids)
        return lm_input[0], min_len, max_len

    def generate(self, text: TokenIds, prompt_text: TokenIds, prompt_speech_token: TokenIds,
                 seed: int, *, min_token_text_ratio: float = 2.0, max_token_text_ratio: float = 20.0,
                 silent_tokens: frozenset[int] = SILENT_TOKENS, cache: KVCache | None = None,
                 sampler: Sampler | None = None, should_stop: Callable[[], bool] | None = None,
                 fixed_tokens: int | None = None) -> Iterator[int]:
        """Speech tokens for ``text`` in the voice of the prompt, one at a time (the eager runner).

        ``seed`` selects the request's random stream (:class:`SeededSampler`: the same tokens as the
        batched scheduler gives for that seed). Generation stops at a stop id (not yielded) or after
        ``max_len`` tokens. ``silent_tokens`` applies the official
        engine's rule: tokens of this set beyond ``MAX_SILENT_RUN`` in a row are still fed back to
        the model but not yielded (pass ``frozenset()`` to yield every token). ``cache`` lets a
        session reuse its KV cache (batch 1, at least prompt length + max_len - 1 slots);
        ``sampler`` replaces ras sampling (e.g. to replay a recorded token sequence). ``should_stop`` is
        polled before every decode step, so a caller in another thread can end generation within one step
        even while silent tokens are being withheld. ``fixed_tokens``: see :meth:`generate_job`.
        Raises RuntimeError at call time on input the service would never pass, before any model work.
        """
        lm_input, min_len, max_len = self.prepare(
            text, prompt_text, prompt_speech_token, min_token_text_ratio=min_token_text_ratio,
            max_token_text_ratio=max_token_text_ratio)
        if fixed_tokens is not None:
            min_len = max_len = self.check_fixed_tokens(fixed_tokens)
        needed = lm_input.shape[0] + max(max_len - 1, 0)
        device = lm_input.device
        if cache is None:
            cache = self.llm.new_cache(1, needed)
        elif cache.batch != 1 or cache.max_len < needed or cache.dtype != lm_input.dtype or cache.device != device:
            raise RuntimeError(
                f"KV cache (batch {cache.batch}, {cache.max_len} slots, {cache.dtype}, {cache.device}) cannot hold "
                f"this request: it needs batch 1, {needed} slots, {lm_input.dtype} on {device}")
        sample = sampler or SeededSampler(seed, self.cfg.sampling)
        job = self.generate_job(lm_input, min_len, max_len, silent_tokens, ban_stop=fixed_tokens is not None)
        return run_eager(self, job, cache, sample, should_stop=should_stop)

    @staticmethod
    def check_fixed_tokens(n: int) -> int:
        """``fixed_tokens`` must be a positive int: the exact number of speech tokens to decode."""
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise RuntimeError(f"fixed_tokens must be a positive integer, got {n!r}")
        return n

    def generate_job(self, lm_input: torch.Tensor, min_len: int, max_len: int,
                     silent_tokens: frozenset[int] = SILENT_TOKENS, ban_stop: bool = False) -> Job:
        """The official decoding loop as a :mod:`job <cosyvoice.llm.job>`: prefill ``lm_input`` [L, H], then
        one speech token per step until a stop id (not emitted) or ``max_len`` tokens.

        ``ban_stop`` masks every stop id at every step (with ``min_len = max_len = N``: exactly N tokens,
        the ``fixed_tokens`` benchmark option, so runs of different engines decode the same length)."""
        decoded: list[int] = []
        silent_run = 0
        x = lm_input
        emit: tuple[int, ...] = ()
        for step in range(max_len):
            # reference quirk: only index speech_token_size (sos, not eos) is banned before min_len,
            # so the other stop ids can still end generation early
            token = yield Step(x, history=decoded, ban_sos=step < min_len, ban_stop=ban_stop, emit=emit)
            if token in self.stop_token_ids:
                return ()
            decoded.append(token)
            x = self.speech_embedding.weight[token].view(1, -1)
            emit = (token,)
            if token in silent_tokens:
                silent_run += 1
                if silent_run > MAX_SILENT_RUN:
                    emit = ()  # fed back to the model, not passed on
            else:
                silent_run = 0
        return emit

    @staticmethod
    def _ids(ids: TokenIds, name: str, limit: int, device: torch.device) -> torch.Tensor:
        """1-D int64 ids on ``device``, each in [0, limit)."""
        t = ids.detach() if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long)
        if t.dim() == 2 and t.shape[0] == 1:
            t = t[0]
        if t.dim() != 1 or t.is_floating_point() or t.is_complex():
            raise RuntimeError(f"{name} must be 1-D integer token ids (or shape [1, T]), "
                                    f"got {t.dtype} of shape {tuple(t.shape)}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= limit):
            raise RuntimeError(f"{name} has ids outside [0, {limit}): min {int(t.min())}, max {int(t.max())}")
        return t.to(device=device, dtype=torch.long)
