"""The CosyVoice3 text tokenizer: Qwen2 byte-level BPE plus CosyVoice3's control tokens.

The official model tokenizes with ``transformers.AutoTokenizer`` on ``CosyVoice-BlankEN/`` (only
``vocab.json`` + ``merges.txt``, so transformers converts the slow Qwen2 tokenizer into a fast one) and
then registers a fixed list of special tokens. We build the same fast tokenizer directly with the
``tokenizers`` library, so ids are identical without depending on transformers:

* model: byte-level BPE, no unknown token, no byte fallback;
* normaliser: Unicode NFC;
* pre-tokenizer: the Qwen2 split regex (isolated matches), then the GPT-2 byte-to-unicode mapping;
* added tokens: ``tokenizer_config.json``'s ``added_tokens_decoder`` in id order, then
  :data:`COSYVOICE3_SPECIAL_TOKENS` in order. A token already known keeps its id; every new one gets the
  next id after the largest added id, which puts ``<|endofprompt|>`` right after ``<|im_end|>``
  (151646 for Qwen2: ``CosyVoice3LM`` looks for exactly that id).

Special tokens are matched on the raw text before normalisation and are never split.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Literal

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from cosyvoice.errors import InvalidInputError, ModelBundleError

TOKENIZER_SUBDIR = "CosyVoice-BlankEN"

END_OF_PROMPT = "<|endofprompt|>"

# Qwen2's pre-tokenization pattern: contractions, letter runs (with one leading non-letter), single
# digits, punctuation runs, newlines, and whitespace (trailing whitespace stays apart from the next word).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Vocal events, emphasis tags and prompt separators, in the official registration order.
_CONTROL_TOKENS = (
    "<|im_start|>", "<|im_end|>", END_OF_PROMPT,
    "[breath]", "<strong>", "</strong>", "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]", "<laughter>", "</laughter>", "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]",
    "[mn]", "<|endofsystem|>",
)

# CMU (ARPAbet) phonemes for inline English pronunciation; vowels also come with stress 0/1/2.
_ARPABET_VOWELS = frozenset({"AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW"})
_ARPABET_CONSONANTS = ("B", "CH", "D", "DH", "F", "G", "HH", "JH", "K", "L", "M", "N", "NG", "P", "R", "S", "SH", "T",
                       "TH", "V", "W", "Y", "Z", "ZH")
_ARPABET_TOKENS = tuple(
    f"[{phone}{stress}]"
    for phone in sorted([*_ARPABET_VOWELS, *_ARPABET_CONSONANTS])
    for stress in (("", "0", "1", "2") if phone in _ARPABET_VOWELS else ("",))
)

# Pinyin initials and toned finals for inline Chinese pronunciation (e.g. "[j][ǐ]"), official order.
_PINYIN_UNITS = (
    "a", "ai", "an", "ang", "ao", "b", "c", "ch", "d", "e", "ei", "en", "eng", "f", "g", "h", "i", "ian", "in",
    "ing", "iu", "ià", "iàn", "iàng", "iào", "iá", "ián", "iáng", "iáo", "iè", "ié", "iòng", "ióng", "iù", "iú",
    "iā", "iān", "iāng", "iāo", "iē", "iě", "iōng", "iū", "iǎ", "iǎn", "iǎng", "iǎo", "iǒng", "iǔ", "j", "k", "l",
    "m", "n", "o", "ong", "ou", "p", "q", "r", "s", "sh", "t", "u", "uang", "ue", "un", "uo", "uà", "uài", "uàn",
    "uàng", "uá", "uái", "uán", "uáng", "uè", "ué", "uì", "uí", "uò", "uó", "uā", "uāi", "uān", "uāng", "uē", "uě",
    "uī", "uō", "uǎ", "uǎi", "uǎn", "uǎng", "uǐ", "uǒ", "vè", "w", "x", "y", "z", "zh", "à", "ài", "àn", "àng",
    "ào", "á", "ái", "án", "áng", "áo", "è", "èi", "èn", "èng", "èr", "é", "éi", "én", "éng", "ér", "ì", "ìn",
    "ìng", "í", "ín", "íng", "ò", "òng", "òu", "ó", "óng", "óu", "ù", "ùn", "ú", "ún", "ā", "āi", "ān", "āng", "āo",
    "ē", "ēi", "ēn", "ēng", "ě", "ěi", "ěn", "ěng", "ěr", "ī", "īn", "īng", "ō", "ōng", "ōu", "ū", "ūn", "ǎ", "ǎi",
    "ǎn", "ǎng", "ǎo", "ǐ", "ǐn", "ǐng", "ǒ", "ǒng", "ǒu", "ǔ", "ǔn", "ǘ", "ǚ", "ǜ",
)
_PINYIN_TOKENS = tuple(f"[{unit}]" for unit in _PINYIN_UNITS)

# Everything CosyVoice3 registers on top of the Qwen2 vocabulary; order determines the new ids.
COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = _CONTROL_TOKENS + _ARPABET_TOKENS + _PINYIN_TOKENS

AllowedSpecial = Literal["all", "none"]


class CosyVoice3Tokenizer:
    """Text -> token ids for the CosyVoice3 LLM, identical to the official tokenizer.

    Safe to share between threads: the underlying ``tokenizers`` objects are never mutated once built,
    and encoding/decoding only reads them.
    """

    def __init__(self, tokenizer_dir: str | Path) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self._tok, config_tokens = _build_qwen2_bpe(self.tokenizer_dir)
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in COSYVOICE3_SPECIAL_TOKENS])
        self._literal: Tokenizer | None = None  # built on first allowed_special="none" call
        self._literal_lock = threading.Lock()
        #: every added token (tokenizer_config.json's, then CosyVoice3's) -> its id
        self.special_tokens: dict[str, int] = {
            token: self._tok.token_to_id(token) for token in (*config_tokens, *COSYVOICE3_SPECIAL_TOKENS)}
        self.end_of_prompt_id = self.special_tokens[END_OF_PROMPT]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> CosyVoice3Tokenizer:
        """Load from a CosyVoice3 model directory (the tokenizer lives in ``CosyVoice-BlankEN/``)."""
        return cls(Path(model_dir) / TOKENIZER_SUBDIR)

    def encode(self, text: str, allowed_special: AllowedSpecial = "all") -> list[int]:
        """Token ids of ``text``, no BOS/EOS added.

        ``allowed_special="all"`` (the official behaviour) turns every registered special token
        written in the text (``<|endofprompt|>``, ``[breath]``, ``[j]``...) into its single id;
        ``"none"`` encodes such text as plain characters.
        """
        if allowed_special == "all":
            return self._tok.encode(text).ids
        if allowed_special == "none":
            return self._literal_tokenizer().encode(text).ids
        raise InvalidInputError(f"allowed_special must be 'all' or 'none', got {allowed_special!r}")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped by default, as the official tokenizer is configured."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _literal_tokenizer(self) -> Tokenizer:
        """A copy that encodes special-token text as ordinary characters (a flag we must not flip on ``_tok``)."""
        with self._literal_lock:
            if self._literal is None:
                literal = Tokenizer.from_str(self._tok.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
            return self._literal

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __len__(self) -> int:
        """Number of distinct ids, added tokens included (ids themselves may be sparse)."""
        return self._tok.get_vocab_size(with_added_tokens=True)


def _build_qwen2_bpe(tokenizer_dir: Path) -> tuple[Tokenizer, list[str]]:
    """The fast Qwen2 tokenizer that transformers derives from the folder, and the added tokens' names."""
    vocab = _read_json(tokenizer_dir / "vocab.json")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ModelBundleError(f"{tokenizer_dir / 'vocab.json'}: expected a JSON object mapping tokens to ids")
    merges = _read_merges(tokenizer_dir / "merges.txt")
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    config_path = tokenizer_dir / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    declared = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else {}
    try:
        entries = sorted((int(i), spec) for i, spec in declared.items())
    except (AttributeError, ValueError) as exc:
        raise ModelBundleError(f"{config_path}: 'added_tokens_decoder' must map integer ids to tokens") from exc
    for token_id, spec in entries:
        if not isinstance(spec, dict) or not isinstance(spec.get("content"), str):
            raise ModelBundleError(f"{config_path}: added token {token_id} has no 'content' string")
        token = AddedToken(spec["content"], single_word=spec.get("single_word", False),
                           lstrip=spec.get("lstrip", False), rstrip=spec.get("rstrip", False),
                           normalized=spec.get("normalized", not spec.get("special", False)),
                           special=spec.get("special", False))
        (tok.add_special_tokens if token.special else tok.add_tokens)([token])
        if tok.token_to_id(token.content) != token_id:
            raise ModelBundleError(
                f"{config_path}: added token {token.content!r} is declared as id {token_id} but lands on "
                f"{tok.token_to_id(token.content)}; vocab.json and tokenizer_config.json do not belong together")
    return tok, [spec["content"] for _, spec in entries]


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelBundleError(f"tokenizer file missing: {path} (expected in <model_dir>/{TOKENIZER_SUBDIR}/)") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelBundleError(f"{path}: unreadable JSON ({exc})") from exc


def _read_merges(path: Path) -> list[tuple[str, str]]:
    """BPE merges in rank order, one ``left right`` pair per line.

    As transformers reads them: only a first line starting with ``#version:`` is a header (a later line
    starting with ``#`` is a merge of ``#`` symbols), blank lines are skipped, and a repeated pair keeps the
    position of its first occurrence.
    """
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as exc:
        raise ModelBundleError(f"tokenizer file missing: {path} (expected in <model_dir>/{TOKENIZER_SUBDIR}/)") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelBundleError(f"{path}: unreadable ({exc})") from exc
    merges: dict[tuple[str, str], None] = {}
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if not line or (number == 1 and line.startswith("#version:")):
            continue
        pair = line.split()
        if len(pair) != 2:
            raise ModelBundleError(f"{path}:{number}: expected two space-separated symbols, got {line!r}")
        merges.setdefault((pair[0], pair[1]))
    return list(merges)
