"""Text frontend: parity with the official text_normalize / tokenizer, and behaviour at the edges."""

from __future__ import annotations

import json
import shutil
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cosyvoice.errors import CosyVoiceError, InvalidInputError, ModelBundleError
from cosyvoice.frontend.text import (
    MERGE_LEN,
    TOKEN_MAX_N,
    TOKEN_MIN_N,
    TextFrontend,
    WeTextNormalizer,
    default_normalizer,
    is_only_punctuation,
    language_branch,
    split_paragraph,
)
from cosyvoice.frontend.tokenizer import COSYVOICE3_SPECIAL_TOKENS, END_OF_PROMPT, CosyVoice3Tokenizer
from cosyvoice.tools.parity import text as text_parity
from cosyvoice.tools.parity.common import Golden


@pytest.fixture(scope="module")
def tokenizer(golden: Golden) -> CosyVoice3Tokenizer:
    return CosyVoice3Tokenizer.from_model_dir(golden.bundle_dir)


@pytest.fixture(scope="module")
def frontend(tokenizer: CosyVoice3Tokenizer) -> TextFrontend:
    return TextFrontend(tokenizer)


def test_parity(golden: Golden) -> None:
    results = text_parity.check(golden)
    failing = [r.row() for r in results if not r.passed]
    assert results and not failing, "\n".join(failing)


# ----------------------------------------------------------------------------- tokenizer


def test_special_tokens_follow_im_end(tokenizer: CosyVoice3Tokenizer) -> None:
    assert tokenizer.end_of_prompt_id == tokenizer.token_to_id("<|im_end|>") + 1
    new_tokens = COSYVOICE3_SPECIAL_TOKENS[2:]  # <|im_start|>, <|im_end|> already exist
    assert [tokenizer.special_tokens[t] for t in new_tokens] == list(
        range(tokenizer.end_of_prompt_id, tokenizer.end_of_prompt_id + len(new_tokens)))
    assert len(set(COSYVOICE3_SPECIAL_TOKENS)) == len(COSYVOICE3_SPECIAL_TOKENS)


def test_special_tokens_are_single_ids_inside_text(tokenizer: CosyVoice3Tokenizer) -> None:
    ids = tokenizer.encode(f"You are a helpful assistant.{END_OF_PROMPT}[breath]你好[j][ǐ]")
    assert ids.count(tokenizer.end_of_prompt_id) == 1
    for token in ("[breath]", "[j]", "[ǐ]"):
        assert tokenizer.special_tokens[token] in ids


def test_allowed_special_none_encodes_literally(tokenizer: CosyVoice3Tokenizer) -> None:
    text = f"hi{END_OF_PROMPT}[breath]"
    literal = tokenizer.encode(text, allowed_special="none")
    assert not set(literal) & set(tokenizer.special_tokens.values())
    assert tokenizer.decode(literal) == text
    with pytest.raises(InvalidInputError):
        tokenizer.encode(text, allowed_special="some")  # type: ignore[arg-type]


def test_decode(tokenizer: CosyVoice3Tokenizer) -> None:
    text = "Mixed 文本 with émoji 😀 and\nnewline"
    assert tokenizer.decode(tokenizer.encode(text)) == unicodedata.normalize("NFC", text)
    tagged = f"[breath]Hello{END_OF_PROMPT}"
    assert tokenizer.decode(tokenizer.encode(tagged)) == "Hello"
    assert tokenizer.decode(tokenizer.encode(tagged), skip_special_tokens=False) == tagged
    assert tokenizer.encode("") == []


def test_tokenizer_is_thread_safe(tokenizer: CosyVoice3Tokenizer) -> None:
    texts = [f"Sentence number {i}, 第{i}句话[breath]." for i in range(200)]
    expected = [tokenizer.encode(t) for t in texts]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(tokenizer.encode, texts)) == expected


def test_tokenizer_bundle_errors(golden: Golden, tmp_path: Path) -> None:
    with pytest.raises(ModelBundleError, match=r"vocab\.json"):
        CosyVoice3Tokenizer(tmp_path)
    src = golden.bundle_dir / "CosyVoice-BlankEN"
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(src / name, tmp_path / name)
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {"7": {"content": "<|endoftext|>", "special": True}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ModelBundleError, match="declared as id 7"):
        CosyVoice3Tokenizer(tmp_path)


# ----------------------------------------------------------------------------- normalisation


def test_skip_rule(frontend: TextFrontend) -> None:
    marked = f"  You are a helpful assistant.{END_OF_PROMPT}I have 3 cats.  "
    assert language_branch(marked) == "skipped"
    assert frontend.normalize(marked) == marked
    assert frontend.split(marked) == [marked]
    # Only both halves of the markup skip; a lone "<|" is ordinary text.
    assert language_branch("a <| b 5") == "en"
    assert "five" in frontend.normalize("a <| b 5")


def test_text_frontend_false_is_verbatim(frontend: TextFrontend) -> None:
    text = " I have 3 cats "
    assert frontend.normalize(text, text_frontend=False) == text
    assert frontend.split(text, text_frontend=False) == [text]
    assert frontend.split("   ", text_frontend=False) == []


@pytest.mark.parametrize("text", ["", "   ", " \n\t "])
def test_blank_text(frontend: TextFrontend, text: str) -> None:
    assert frontend.normalize(text) == ""
    assert frontend.split(text) == []


def test_only_punctuation(frontend: TextFrontend) -> None:
    assert is_only_punctuation("...!!!") and is_only_punctuation("") and not is_only_punctuation(". .")
    assert frontend.split("...!!!") == []
    assert frontend.normalize("...!!!") == "...!!!"


def test_numbers(frontend: TextFrontend) -> None:
    assert frontend.normalize("I have 23 apples.") == "I have twenty three apples."
    assert frontend.normalize("我有3个苹果。") == "我有三个苹果。"
    # The FSTs have no path for double blanks; the official runtime raises, we keep the text and spell the digit.
    assert frontend.normalize("I have  2 apples.") == "I have  two apples."
    # Digits wetext leaves alone are spelled by inflect (English only).
    assert frontend.normalize("x²") == "xzero"


def test_inline_control_tokens_pass_through(frontend: TextFrontend, tokenizer: CosyVoice3Tokenizer) -> None:
    zh = "高管也通过电话、短信、微信等方式对报道[j][ǐ]予好评。"
    assert frontend.split(zh) == [zh]
    assert frontend.split("[breath]我们走吧[laughter]，") == ["[breath]我们走吧[laughter]。"]
    en = "Say [B][AH0][N][AE1][N][AH0] 2 times."
    assert frontend.normalize(en) == "Say [B][AH0][N][AE1][N][AH0] two times."
    assert tokenizer.special_tokens["[AH0]"] in tokenizer.encode(frontend.split(en)[0])


def test_repeated_punctuation_and_quotes(frontend: TextFrontend) -> None:
    # Official quirk: a punctuation mark right after another one is dropped from the pieces.
    assert frontend.split("Wait... what?") == ["Wait. what?"]
    assert frontend.split('He said "go!" Then left.') == ['He said "go!" Then left.']
    assert frontend.split('!"Hello') == ['"Hello.']  # the official code raises here


def _long_paragraph(sentence: str, n: int) -> str:
    return "".join(sentence.format(i=chr(ord("a") + i % 26)) for i in range(n))


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_long_paragraph_split_respects_bounds(frontend: TextFrontend, tokenizer: CosyVoice3Tokenizer,
                                              lang: str) -> None:
    if lang == "en":
        text = _long_paragraph("The fox {i} jumps over the lazy dog again. ", 30).strip()
        length = lambda s: len(tokenizer.encode(s))  # noqa: E731
    else:
        text = _long_paragraph("今天天气很好，我们一起去公园散步吧。", 30)
        length = len
    pieces = frontend.split(text)
    assert len(pieces) > 2
    assert "".join(pieces) == frontend.normalize(text)
    assert all(TOKEN_MIN_N < length(p) <= TOKEN_MAX_N for p in pieces[:-1])
    assert MERGE_LEN <= length(pieces[-1]) <= TOKEN_MAX_N + MERGE_LEN


def test_split_paragraph_merges_short_tail() -> None:
    pieces = split_paragraph("a" * 70 + "。" + "b" * 30 + "。" + "c" * 5, "zh", len)
    assert pieces == ["a" * 70 + "。", "b" * 30 + "。" + "c" * 5 + "。"]
    assert split_paragraph("", "en", len) == []


def test_normalizer_is_thread_safe() -> None:
    normalizer = default_normalizer()
    texts = [f"今天是2024年5月{i % 28 + 1}日。" if i % 2 else f"It costs ${i}.50 today." for i in range(60)]
    expected = [normalizer.normalize(t) for t in texts]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(normalizer.normalize, texts)) == expected
    assert default_normalizer() is normalizer


def test_missing_fst_files(tmp_path: Path) -> None:
    normalizer = WeTextNormalizer(tmp_path)
    assert normalizer.normalize("no digits here") == "no digits here"  # FSTs are only needed for digits
    with pytest.raises(CosyVoiceError, match="FST files missing"):
        normalizer.normalize("1 digit")
