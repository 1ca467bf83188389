"""Text frontend: normalisation and sentence splitting before tokenization.

Behaviour follows the official ``CosyVoiceFrontEnd.text_normalize`` with the ``wetext`` normaliser
(the path taken when ``ttsfrd`` is not installed):

1. Text containing both ``<|`` and ``|>`` (prompt markup such as ``<|endofprompt|>``) is passed on
   untouched and unsplit, as is any text when ``text_frontend=False``.
2. The text is stripped and goes down the Chinese branch if it contains a CJK ideograph
   (U+4E00..U+9FFF), else the English branch.
3. Both branches run wetext's FST normaliser (numbers, dates, money, units -> words); wetext only does
   so when the text contains a digit. Chinese text is then cleaned (newlines and blanks between
   non-ASCII characters removed, ``²``/``³`` spelled, ``.`` -> ``。``, brackets dropped, a trailing comma
   turned into ``。``); in English text any digit left is spelled out with ``inflect``.
4. The text is cut after sentence punctuation and sentences are packed into pieces of about 60-80
   units (characters for Chinese, tokens for English); pieces made only of punctuation are dropped.

Inline control tokens (``[breath]``, ``<strong>``, pinyin ``[j][ǐ]``, CMU ``[AH0]``) pass through.
Where the official code would crash (blank text, an FST without a path for the input), we return a
sensible result instead; each such place is marked in a comment.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import threading
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from cosyvoice.errors import CosyVoiceError
from cosyvoice.frontend.tokenizer import COSYVOICE3_SPECIAL_TOKENS, CosyVoice3Tokenizer

Branch = Literal["zh", "en", "skipped"]

# Splitting budget used by every official inference mode.
TOKEN_MAX_N = 80
TOKEN_MIN_N = 60
MERGE_LEN = 20

_CJK = re.compile(r"[\u4e00-\u9fff]")
_DIGIT = re.compile(r"\d")  # Python's \d: any Unicode decimal digit, as wetext tests it
_ZH_ENDERS = frozenset("。？！；：、.?!;")
_EN_ENDERS = frozenset(".?!;:")
_CLOSING_QUOTES = frozenset('"”')
# A blank survives Chinese cleanup only between two ASCII non-blank characters ("two bananas").
_ISOLATED_BLANK = re.compile(r"(?<![\x00-\x1f\x21-\x7f]) | (?![\x00-\x1f\x21-\x7f])")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
# Control tokens whose names contain digits (CMU stress marks): English number spelling leaves them alone.
_DIGIT_TOKENS = re.compile("|".join(re.escape(t) for t in COSYVOICE3_SPECIAL_TOKENS if _DIGIT.search(t)))


def contains_chinese(text: str) -> bool:
    return _CJK.search(text) is not None


def language_branch(text: str) -> Branch:
    """Which normalisation path ``text`` takes: ``skipped`` for prompt markup, else zh / en."""
    if "<|" in text and "|>" in text:
        return "skipped"
    return "zh" if contains_chinese(text) else "en"


def is_only_punctuation(text: str) -> bool:
    """True for text made only of Unicode punctuation (P*) and symbols (S*), including ''."""
    return all(unicodedata.category(ch)[0] in "PS" for ch in text)


# ----------------------------------------------------------------------------- wetext


# Field order wetext's verbalizers expect inside a tagged token, per language (tokens not listed keep
# the tagger's order, as do English dates tagged preserve_order: "true").
_FIELD_ORDER: dict[str, dict[str, tuple[str, ...]]] = {
    "zh": {
        "date": ("year", "month", "day"),
        "fraction": ("denominator", "numerator"),
        "measure": ("denominator", "numerator", "value"),
        "money": ("value", "currency"),
        "time": ("noon", "hour", "minute", "second"),
    },
    "en": {
        "date": ("preserve_order", "text", "day", "month", "year"),
        "money": ("integer_part", "fractional_part", "quantity", "currency_maj"),
    },
}
_VALUE = r'"(?:\\.|[^"\\])*"'  # a quoted field value; a backslash escapes the next character
_TAGGED_TOKEN = re.compile(rf"\s*([A-Za-z_]+)\s*\{{((?:\s*[A-Za-z_]+\s*:\s*{_VALUE})*)\s*\}}\s*", re.S)
_FIELD = re.compile(rf"\s*([A-Za-z_]+)\s*:\s*({_VALUE})", re.S)


class WeTextNormalizer:
    """wetext text normalisation (TN) as the official frontend runs it.

    The reference environment used the wetext 0.0.4 runtime: pick zh/en by the presence of a CJK
    ideograph, and only if the text contains a digit run tagger FST -> reorder each token's fields ->
    verbalizer FST. The FST files are those shipped in the ``wetext`` wheel (0.1.8), or any folder with
    the same ``{en,zh}/tn/{tagger,verbalizer}.fst`` layout. (wetext 0.1.x's own API differs: it runs
    English text through the FSTs even without digits, so we drive the FSTs ourselves.)

    FSTs load on first use, once per language. Calls are serialised by a lock because the compiled
    FST objects are not documented as thread-safe; one normalisation takes well under a millisecond.
    """

    def __init__(self, fst_dir: str | Path | None = None) -> None:
        self.fst_dir = Path(fst_dir) if fst_dir is not None else _wetext_fst_dir()
        self._graphs: dict[str, tuple[Any, Any]] = {}
        self._lock = threading.Lock()

    def normalize(self, text: str) -> str:
        if not _DIGIT.search(text):
            return text
        lang = "zh" if contains_chinese(text) else "en"
        with self._lock:
            tagger, verbalizer = self._load(lang)
            tagged = tagger(text)
            reordered = _reorder_fields(tagged, _FIELD_ORDER[lang]) if tagged else None
            spoken = verbalizer(reordered) if reordered else ""
        # No FST path for the input (e.g. "#1", double blanks in English): the official runtime raises;
        # we keep the text as it is.
        return spoken or text

    def _load(self, lang: str) -> tuple[Any, Any]:
        if lang not in self._graphs:
            try:
                import kaldifst
            except ImportError as exc:
                raise CosyVoiceError("text normalisation needs kaldifst: pip install wetext==0.1.8") from exc
            paths = [self.fst_dir / lang / "tn" / f"{name}.fst" for name in ("tagger", "verbalizer")]
            missing = [str(p) for p in paths if not p.is_file()]
            if missing:
                raise CosyVoiceError(f"wetext FST files missing: {', '.join(missing)}")
            self._graphs[lang] = (kaldifst.TextNormalizer(str(paths[0])), kaldifst.TextNormalizer(str(paths[1])))
        return self._graphs[lang]


def _wetext_fst_dir() -> Path:
    """``fsts/`` of the installed wetext package, located without importing it (its import loads every FST)."""
    spec = importlib.util.find_spec("wetext")
    if spec is None or not spec.submodule_search_locations:
        raise CosyVoiceError("text normalisation needs the wetext FST files: pip install wetext==0.1.8")
    return Path(next(iter(spec.submodule_search_locations))) / "fsts"


def _reorder_fields(tagged: str, order: dict[str, tuple[str, ...]]) -> str | None:
    """Rewrite ``name { key: "v" ... } ...`` with each token's fields in verbalizer order.

    Returns None if ``tagged`` is not a sequence of such tokens.
    """
    tokens, pos = [], 0
    while pos < len(tagged):
        match = _TAGGED_TOKEN.match(tagged, pos)
        if match is None:
            return None
        pos = match.end()
        name = match.group(1)
        fields = _FIELD.findall(match.group(2))
        values = dict(fields)
        keys = [key for key, _ in fields]
        if name in order and values.get("preserve_order") != '"true"':
            keys = [key for key in order[name] if key in values]  # fields missing from the order are dropped
        tokens.append(name + " {" + "".join(f" {key}: {values[key]}" for key in keys) + " }")
    return " ".join(tokens)


_default_normalizer: WeTextNormalizer | None = None
_default_normalizer_lock = threading.Lock()


def default_normalizer() -> WeTextNormalizer:
    """The process-wide normaliser over the installed wetext FSTs, created on first use."""
    global _default_normalizer
    with _default_normalizer_lock:
        if _default_normalizer is None:
            _default_normalizer = WeTextNormalizer()
        return _default_normalizer


# ----------------------------------------------------------------------------- English numbers

_inflect_engine: Any = None
_inflect_lock = threading.Lock()  # inflect keeps per-call state on the engine


def _number_words(digits: str) -> str:
    global _inflect_engine
    with _inflect_lock:
        if _inflect_engine is None:
            try:
                import inflect
            except ImportError as exc:
                raise CosyVoiceError("English number spelling needs inflect: pip install inflect==7.3.1") from exc
            _inflect_engine = inflect.engine()
        return _inflect_engine.number_to_words(digits)


def spell_out_numbers(text: str) -> str:
    """Replace every run of digit characters (``str.isdigit``, so also ``²`` or ``３``) by English words.

    Deliberate difference: digits inside CMU phoneme tokens (``[AH0]``) are kept; the official code
    would turn them into ``[AHzero]``.
    """
    out, pos = [], 0
    for tag in itertools.chain(_DIGIT_TOKENS.finditer(text), [None]):
        end = tag.start() if tag else len(text)
        for is_digit, run in itertools.groupby(text[pos:end], key=str.isdigit):
            chars = "".join(run)
            out.append(_number_words(chars) if is_digit else chars)
        if tag:
            out.append(tag.group())
            pos = tag.end()
    return "".join(out)


# ----------------------------------------------------------------------------- splitting


def split_paragraph(text: str, lang: Literal["zh", "en"], length: Callable[[str], int],
                    max_len: int = TOKEN_MAX_N, min_len: int = TOKEN_MIN_N, merge_len: int = MERGE_LEN) -> list[str]:
    """Cut ``text`` into sentences and pack them greedily into pieces.

    A piece is closed before a sentence that would push it past ``max_len`` units, but only once it
    holds more than ``min_len``; a final piece shorter than ``merge_len`` joins the previous one.
    ``length`` measures units (characters for Chinese, tokens for English).
    """
    if not text:
        return []
    enders = _ZH_ENDERS if lang == "zh" else _EN_ENDERS
    if text[-1] not in enders:
        text += "。" if lang == "zh" else "."

    sentences: list[str] = []
    start = 0
    for i, ch in enumerate(text):
        if ch not in enders:
            continue
        if i > start:
            sentences.append(text[start:i + 1])
        # A punctuation mark right after another one is dropped (official quirk: "Wait..." -> "Wait.").
        start = i + 1
        # A closing quote joins the sentence before it (the official code raises if there is none yet).
        if start < len(text) and text[start] in _CLOSING_QUOTES and sentences:
            sentences[-1] += text[start]
            start += 1

    pieces: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current + sentence) > max_len and length(current) > min_len:
            pieces.append(current)
            current = ""
        current += sentence
    if current:
        if pieces and length(current) < merge_len:
            pieces[-1] += current
        else:
            pieces.append(current)
    return pieces


# ----------------------------------------------------------------------------- the frontend


class TextFrontend:
    """``normalize`` (for prompt/instruct text) and ``split`` (for text to synthesise).

    Thread-safe: it holds no per-call state; the normaliser and the number speller lock internally.
    """

    def __init__(self, tokenizer: CosyVoice3Tokenizer, normalizer: WeTextNormalizer | None = None) -> None:
        self.tokenizer = tokenizer
        self._normalizer = normalizer

    @property
    def normalizer(self) -> WeTextNormalizer:
        return self._normalizer or default_normalizer()

    def normalize(self, text: str, text_frontend: bool = True) -> str:
        """The whole text normalised, not split (official ``text_normalize(split=False)``).

        Returns ``text`` unchanged when ``text_frontend`` is False or it carries ``<|...|>`` markup,
        and ``''`` for blank text (the official code raises on whitespace-only input).
        """
        if not text_frontend or language_branch(text) == "skipped":
            return text
        return self._normalize(text)[0]

    def split(self, text: str, text_frontend: bool = True) -> list[str]:
        """Normalised pieces to synthesise one by one (official ``text_normalize(split=True)``).

        Returns ``[text]`` when ``text_frontend`` is False or the text carries ``<|...|>`` markup, and
        ``[]`` when nothing is left to speak: blank text or only punctuation (the official code returns
        ``['']`` for ``''`` and raises on whitespace-only input).
        """
        if not text_frontend or language_branch(text) == "skipped":
            return [text] if text.strip() else []
        normalized, lang = self._normalize(text)
        if lang == "zh":
            pieces = split_paragraph(normalized, "zh", len)
        else:
            pieces = split_paragraph(normalized, "en", lambda s: len(self.tokenizer.encode(s)))
        return [piece for piece in pieces if not is_only_punctuation(piece)]

    def _normalize(self, text: str) -> tuple[str, Literal["zh", "en"]]:
        text = text.strip()
        if not contains_chinese(text):
            return spell_out_numbers(self.normalizer.normalize(text)), "en"
        text = self.normalizer.normalize(text)
        text = text.replace("\n", "")
        # Unlike the official loop, a blank at either end of the text is simply dropped (there it reads past
        # the end and raises, or wraps around); strip() above makes that case unreachable in practice.
        text = _ISOLATED_BLANK.sub("", text)
        text = text.replace("²", "平方").replace("³", "立方")
        text = text.replace(".", "。")
        text = text.replace(" - ", "，")
        text = text.replace("（", "").replace("）", "").replace("【", "").replace("】", "").replace("`", "")
        text = text.replace("——", " ")
        text = _TRAILING_COMMAS.sub("。", text)
        return text, "zh"
