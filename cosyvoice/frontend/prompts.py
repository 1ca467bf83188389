"""CosyVoice3's prompt conventions, applied for the user.

Fun-CosyVoice3 was trained with a system prompt in front of the text the LLM conditions on, closed by
``<|endofprompt|>`` (the LLM refuses input without that token):

* zero-shot prompt transcript: ``You are a helpful assistant.<|endofprompt|>{transcript}``
* cross-lingual / fine-grained text: ``You are a helpful assistant.<|endofprompt|>{text}``
* instruct2 instruction: ``You are a helpful assistant. {instruction}<|endofprompt|>``

Users type plain text. These helpers add whatever is missing and never add it twice: input that already
carries the convention (with any stray whitespace, without the marker, or with only a bare
``<|endofprompt|>`` the user typed) comes out in the canonical form, a marker typed anywhere else is
removed, and applying a helper to its own output changes nothing.

Blank input is not an error here (the engine rejects empty text where it matters): it gives the bare
system prefix ``You are a helpful assistant.<|endofprompt|>``. Use :func:`user_text` to check whether any
user content is present.

Note on the official pipeline: text containing ``<|...|>`` skips text normalisation and splitting, so a
prefixed transcript or cross-lingual text is tokenized exactly as written.
"""

from __future__ import annotations

from cosyvoice.errors import InvalidInputError
from cosyvoice.frontend.tokenizer import END_OF_PROMPT

SYSTEM_PROMPT = "You are a helpful assistant."
SYSTEM_PREFIX = SYSTEM_PROMPT + END_OF_PROMPT


def split_prompt(text: str) -> tuple[str, str]:
    """``(head, body)`` of ``text`` in the canonical prefixed form (``head + body == zero_shot_prompt_text(text)``):
    the head is the system prompt closed by ``<|endofprompt|>`` (as the user typed it, when it starts with the
    system prompt), the body what the user wrote to be spoken or transcribed, stripped. The pipeline makes the
    head's token ids once and puts them before the body's; the voice library keeps a transcript's body alone."""
    prefixed = _prefixed(text)
    head, marker, body = prefixed.partition(END_OF_PROMPT)
    return head + marker, body


def transcript_ids(ids: list[int], end_of_prompt_id: int) -> list[int]:
    """A transcript's token ids without the system prompt: ids stored in the model's form (the official
    ``spk2info.pt``, voices saved before the library kept plain transcripts) carry it up to the first
    ``<|endofprompt|>``; plain ids pass unchanged."""
    return ids[ids.index(end_of_prompt_id) + 1:] if end_of_prompt_id in ids else ids


def zero_shot_prompt_text(transcript: str) -> str:
    """The prompt text for zero-shot cloning: system prefix + the prompt audio's transcript."""
    return _prefixed(transcript)


def cross_lingual_text(text: str) -> str:
    """The text to synthesise in cross-lingual mode (also used for fine-grained ``[breath]``-style control)."""
    return _prefixed(text)


def instruct_text(instruction: str) -> str:
    """The instruct2 prompt text: ``You are a helpful assistant. {instruction}<|endofprompt|>``.

    Accepts the plain instruction or an already wrapped one. Text after ``<|endofprompt|>`` has no place
    in an instruction and raises :class:`InvalidInputError`. A blank instruction gives the bare prefix.
    """
    head, body = _split_marker(instruction)
    if head is None:
        head = body
    elif body.strip():
        raise InvalidInputError(
            f"an instruction must end at {END_OF_PROMPT}; found text after it: {body.strip()[:80]!r} "
            "(put the text to speak in the tts text, not in the instruction)")
    instruction = _drop_system_prompt(head)
    return f"{SYSTEM_PROMPT} {instruction}{END_OF_PROMPT}" if instruction else SYSTEM_PREFIX


def llm_prompt(mode: str, instruction: str = "", transcript_head: str = "") -> str:
    """The text of the LLM's prompt in engine ``mode``, ahead of a zero-shot voice's plain transcript: the system
    prompt (``transcript_head``, the one the user typed before the transcript, by default ``SYSTEM_PREFIX``),
    the wrapped instruct2 instruction, or nothing (cross-lingual)."""
    if mode == "zero_shot":
        return transcript_head or SYSTEM_PREFIX
    if mode == "instruct2":  # the instruction replaces the transcript; the reference keeps a saved voice's
        return instruct_text(instruction)  # transcript here instead, silently dropping it (docs/differences.md)
    return ""


_MODEL_FORM = ("CosyVoice3 needs '<|endofprompt|>' in the prompt: end the zero-shot transcript with it ('You are a "
               "helpful assistant.<|endofprompt|>' + transcript), wrap the instruct2 instruction as 'You are a "
               "helpful assistant. <instruction><|endofprompt|>', or start cross-lingual text with 'You are a "
               "helpful assistant.<|endofprompt|>' (cosyvoice.frontend.prompts does this for you)")


def check_model_form(mode: str, text: str | None, transcript: str, instruction: str) -> None:
    """A request in the model's form (the official API) carries ``<|endofprompt|>`` where the service's ``mode``
    needs it (``text`` None: a text stream; ``transcript`` ``''``: none uploaded)."""
    if mode == "cross_lingual" and text is None:
        raise InvalidInputError("text given as a stream works in zero_shot and instruct2 mode only (the reference's "
                                "bi-streaming needs <|endofprompt|> in the prompt text); use instruct2 with a neutral "
                                "instruction for a voice without a transcript", "text")
    needs = {"zero_shot": ("transcript", transcript), "cross_lingual": ("text", text),
             "instruct": ("instruction", instruction)}
    field, value = needs.get(mode, ("", None))
    if isinstance(value, str) and value.strip() and END_OF_PROMPT not in value:
        raise InvalidInputError(_MODEL_FORM, field)


def user_text(text: str) -> str:
    """What the user wrote, without the system prompt and ``<|endofprompt|>``: the transcript or text of a
    prefixed prompt, or the instruction of a wrapped instruction; ``''`` if there is none."""
    head, body = _split_marker(text)
    if head is not None and head.strip().startswith(SYSTEM_PROMPT):
        return " ".join(part for part in (_drop_system_prompt(head), body.strip()) if part)
    return _drop_system_prompt((head or "") + body)


def _prefixed(text: str) -> str:
    """``{system}<|endofprompt|>{body}``.

    A head before the marker that starts with the system prompt is kept (canonically spaced), so
    ``You are a helpful assistant. Speak happily.<|endofprompt|>...`` stays as the user meant it. Any
    other marker is stray: it is removed and the text around it is the body.
    """
    head, body = _split_marker(text)
    if head is not None and head.strip().startswith(SYSTEM_PROMPT):
        instruction = _drop_system_prompt(head)
        system = f"{SYSTEM_PROMPT} {instruction}" if instruction else SYSTEM_PROMPT
    else:
        system, body = SYSTEM_PROMPT, _drop_system_prompt((head or "") + body)
    return f"{system}{END_OF_PROMPT}{body.strip()}"


def _split_marker(text: str) -> tuple[str | None, str]:
    """``(before, after)`` the first ``<|endofprompt|>`` (``before`` is None without one); further markers
    are removed from ``after`` so the result never carries two."""
    if END_OF_PROMPT not in text:
        return None, text
    head, _, body = text.partition(END_OF_PROMPT)
    return head, body.replace(END_OF_PROMPT, "")


def _drop_system_prompt(text: str) -> str:
    """``text`` stripped, without a leading system sentence (so it is never added a second time)."""
    text = text.strip()
    if text.startswith(SYSTEM_PROMPT):
        text = text[len(SYSTEM_PROMPT):].strip()
    return text
