"""CosyVoice3 prompt conventions: canonical forms, idempotence, never doubling, blank input."""

from __future__ import annotations

import pytest

from cosyvoice.errors import InvalidInputError
from cosyvoice.frontend.prompts import (
    SYSTEM_PREFIX,
    SYSTEM_PROMPT,
    cross_lingual_text,
    instruct_text,
    user_text,
    zero_shot_prompt_text,
)
from cosyvoice.frontend.text import TextFrontend
from cosyvoice.frontend.tokenizer import END_OF_PROMPT, CosyVoice3Tokenizer
from cosyvoice.tools.parity.common import Golden

SP, EOP = SYSTEM_PROMPT, END_OF_PROMPT

USER_INPUTS = [
    "Hello, this is a short prompt.",
    "  希望你以后能够做的比我还好呦。 ",
    f"{SP}{EOP}Hello there.",
    f"  {SP}  {EOP}   Hello there.  ",
    f"{EOP}Hello there.",
    f"{SP} Hello there.",
    f"Hello {EOP} there {EOP}.",
    "[breath]因为他们那一辈人[breath]在乡里面住的要习惯一点。",
    "",
    "   ",
    EOP,
    SYSTEM_PREFIX,
]


@pytest.mark.parametrize("build", [zero_shot_prompt_text, cross_lingual_text])
def test_prefix_canonical_forms(build) -> None:
    assert build("Hello there.") == f"{SP}{EOP}Hello there."
    assert build(f"  {SP}  {EOP}   Hello there.  ") == f"{SP}{EOP}Hello there."
    assert build(f"{EOP}Hello there.") == f"{SP}{EOP}Hello there."
    assert build(f"{SP} Hello there.") == f"{SP}{EOP}Hello there."
    assert build("") == build("  ") == build(EOP) == SYSTEM_PREFIX
    # A system prompt with an instruction is kept; a marker after anything else is stray.
    assert build(f"{SP}   Speak happily. {EOP} Hi") == f"{SP} Speak happily.{EOP}Hi"
    assert build(f"Hello {EOP}there.{EOP}") == f"{SP}{EOP}Hello there."


def test_instruct_canonical_forms() -> None:
    assert instruct_text("请用广东话表达。") == f"{SP} 请用广东话表达。{EOP}"
    assert instruct_text(f"{SP} 请用广东话表达。{EOP}") == f"{SP} 请用广东话表达。{EOP}"
    assert instruct_text(f"  {SP}Speak slowly.  ") == f"{SP} Speak slowly.{EOP}"
    assert instruct_text(f"Speak slowly.{EOP}  ") == f"{SP} Speak slowly.{EOP}"
    assert instruct_text("") == instruct_text(SYSTEM_PREFIX) == instruct_text(EOP) == SYSTEM_PREFIX


def test_instruct_rejects_text_after_marker() -> None:
    with pytest.raises(InvalidInputError, match="after it"):
        instruct_text(f"Speak slowly.{EOP}Hello")


@pytest.mark.parametrize("build", [zero_shot_prompt_text, cross_lingual_text, instruct_text])
@pytest.mark.parametrize("text", USER_INPUTS)
def test_idempotent_and_never_doubled(build, text: str) -> None:
    try:
        once = build(text)
    except InvalidInputError:
        assert build is instruct_text  # text after the marker is not an instruction
        return
    assert build(once) == once
    assert once.count(EOP) == 1
    assert once.count(SP) == 1


@pytest.mark.parametrize("text", USER_INPUTS)
def test_user_text(text: str) -> None:
    plain = user_text(text)
    assert EOP not in plain and not plain.startswith(SP) and plain == plain.strip()
    assert user_text(zero_shot_prompt_text(text)) == plain
    assert bool(plain) == any(ch.isalnum() for ch in text.replace(SP, "").replace(EOP, ""))


def test_user_text_of_wrapped_forms() -> None:
    assert user_text(zero_shot_prompt_text(" Hello ")) == "Hello"
    assert user_text(instruct_text(" Speak slowly. ")) == "Speak slowly."
    assert user_text(SYSTEM_PREFIX) == user_text("") == ""


def test_prompt_text_reaches_the_llm_verbatim(golden: Golden) -> None:
    """Prefixed text skips normalisation and carries exactly one <|endofprompt|> id."""
    tokenizer = CosyVoice3Tokenizer.from_model_dir(golden.bundle_dir)
    frontend = TextFrontend(tokenizer)
    for text in (zero_shot_prompt_text("I have 3 cats."), cross_lingual_text("今天是2024年。"),
                 instruct_text("Speak 2 times faster.")):
        assert frontend.normalize(text) == text and frontend.split(text) == [text]
        assert tokenizer.encode(text).count(tokenizer.end_of_prompt_id) == 1
