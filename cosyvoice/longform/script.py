"""From a document or a dialogue script to the rows of a segment table.

A document is read as chapters (Markdown headings ``#``..``######``, or an EPUB's chapters) of paragraphs
(blank-line separated); a dialogue script as turns (``Alice: text`` or ``Alice (instruction): text``). Pause
tags (``[pause:1.5s]``, ``[pause:800ms]``) cut a paragraph where they stand. Each piece of text between these
breaks is split by the frontend's own splitter (``TextFrontend.split``: normalisation, then sentences packed
as the model reads them), so the table shows exactly the segments that will be spoken; the break that ends
each piece (sentence, paragraph, chapter, turn or a tag's seconds) becomes the pause after its last segment.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from cosyvoice.errors import InvalidInputError

BREAKS = ("sentence", "paragraph", "chapter", "turn", "tag", "end")  # what follows a segment
DEFAULT_PAUSES = {"sentence": 0.25, "paragraph": 0.8, "chapter": 2.0, "turn": 0.5, "end": 0.0}
MAX_PAUSE_SECONDS = 30.0
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".epub")

PAUSE_TAG = re.compile(r"\[pause:\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*\]", re.I)
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$")
# a label is one to three words (``Alice``, ``Dr. Bob``), optionally with an instruction in () or [], then a colon
_SPEAKER = re.compile(r"^\s*([^\s:()\[\]]+(?:[ \t]+[^\s:()\[\]]+){0,2})\s*(?:[(\[]([^)\]]*)[)\]])?\s*[:：]\s*(.*)$")


@dataclass(frozen=True)
class Block:
    """A run of text read without a break, with what follows it."""

    text: str
    brk: str  # one of BREAKS
    pause: float | None = None  # seconds, for brk == "tag"
    chapter: str | None = None  # the title of the chapter this block opens
    speaker: str | None = None
    instruction: str = ""


@dataclass(frozen=True)
class SegmentDraft:
    """One row of a new segment table."""

    text: str
    brk: str
    pause: float | None = None
    chapter: str | None = None
    speaker: str | None = None
    instruction: str = ""


def pause_seconds(value: str, unit: str | None) -> float:
    seconds = float(value) / (1000.0 if (unit or "s").lower() == "ms" else 1.0)
    if seconds > MAX_PAUSE_SECONDS:
        raise InvalidInputError(f"a pause of {seconds:g} s is longer than the {MAX_PAUSE_SECONDS:g} s allowed", "text")
    return seconds


def _with_tags(text: str, brk: str, **extra: object) -> list[Block]:
    """``text`` cut at its pause tags: each tag ends a block with its own pause; the last block keeps ``brk``."""
    blocks, pos = [], 0
    for tag in PAUSE_TAG.finditer(text):
        blocks.append(Block(text[pos:tag.start()], "tag", pause_seconds(tag.group(1), tag.group(2)), **extra))
        extra = {k: v for k, v in extra.items() if k != "chapter"}  # a chapter opens once
        pos = tag.end()
    blocks.append(Block(text[pos:], brk, **extra))
    return blocks


def _paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, each on one line (a line break inside a paragraph is a space)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]


def document_blocks(text: str, chapters: Iterable[tuple[str | None, str]] | None = None) -> list[Block]:
    """Blocks of a document: ``text`` (Markdown headings open chapters), or ``chapters`` as (title, body)."""
    if chapters is None:
        chapters, title, lines = [], None, []
        for line in text.replace("\r\n", "\n").split("\n"):
            heading = _HEADING.match(line)
            if heading:
                if title is not None or "".join(lines).strip():
                    chapters.append((title, "\n".join(lines)))
                title, lines = heading.group(1), []
            else:
                lines.append(line)
        chapters.append((title, "\n".join(lines)))
    blocks: list[Block] = []
    for title, body in chapters:
        paragraphs = ([title] if title else []) + _paragraphs(body)  # a chapter's title is read first
        for i, paragraph in enumerate(paragraphs):
            blocks += _with_tags(paragraph, "paragraph", chapter=title if i == 0 else None)
        if blocks:
            blocks[-1] = _rebreak(blocks[-1], "chapter")
    if blocks:
        blocks[-1] = _rebreak(blocks[-1], "end")
    return blocks


def dialogue_blocks(script: str) -> list[Block]:
    """Blocks of a dialogue script: ``Name: line`` or ``Name (instruction): line`` per turn; a line without a
    label continues the turn before it; Markdown headings open chapters (scenes)."""
    turns: list[tuple[str, str, str, str | None]] = []  # speaker, instruction, text, chapter
    chapter = None
    for number, line in enumerate(script.replace("\r\n", "\n").split("\n"), 1):
        if not line.strip():
            continue
        heading = _HEADING.match(line)
        if heading:
            chapter = heading.group(1)
            continue
        label = _SPEAKER.match(line)
        if label:
            turns.append((label.group(1).strip(), (label.group(2) or "").strip(), label.group(3).strip(), chapter))
            chapter = None
        elif turns:
            speaker, instruction, text, opened = turns[-1]
            turns[-1] = (speaker, instruction, f"{text} {line.strip()}", opened)
        else:
            raise InvalidInputError(f"line {number} has no speaker label; write it as 'Name: what they say'", "script")
    if not turns:
        raise InvalidInputError("the script has no lines; write each line as 'Name: what they say'", "script")
    blocks: list[Block] = []
    for speaker, instruction, text, opened in turns:
        blocks += _with_tags(text, "turn", chapter=opened, speaker=speaker, instruction=instruction)
    blocks[-1] = _rebreak(blocks[-1], "end")
    return blocks


def _rebreak(block: Block, brk: str) -> Block:
    """The block with a stronger break after it (a tag's own pause stays)."""
    if block.brk == "tag":
        return block
    return Block(block.text, brk, block.pause, block.chapter, block.speaker, block.instruction)


def segment_drafts(blocks: list[Block], split: Callable[[str], list[str]]) -> list[SegmentDraft]:
    """The segment table of ``blocks``, each split by ``split`` (the frontend's splitter). A block with nothing
    to speak hands its break to the segment before it (a pause tag's seconds win over a plain break; two tags
    add up) and its chapter to the next segment."""
    drafts: list[SegmentDraft] = []
    carry_chapter: str | None = None
    for block in blocks:
        pieces = split(block.text) if block.text.strip() else []
        chapter = block.chapter or carry_chapter
        if not pieces:
            carry_chapter = chapter
            if drafts:
                drafts[-1] = _merge_break(drafts[-1], block)
            continue
        carry_chapter = None
        for i, piece in enumerate(pieces):
            final = i == len(pieces) - 1
            drafts.append(SegmentDraft(piece, block.brk if final else "sentence", block.pause if final else None,
                                       chapter if i == 0 else None, block.speaker, block.instruction))
    if not drafts:
        raise InvalidInputError("the text has nothing to speak", "text")
    return drafts


def _merge_break(draft: SegmentDraft, block: Block) -> SegmentDraft:
    brk, pause = block.brk, block.pause
    if draft.brk == "tag":
        brk, pause = "tag", draft.pause + (block.pause if block.brk == "tag" else 0.0)
    return SegmentDraft(draft.text, brk, pause, draft.chapter, draft.speaker, draft.instruction)


# ----------------------------------------------------------------------------- files


def read_document(name: str, data: bytes) -> tuple[str, list[tuple[str | None, str]] | None]:
    """(text, chapters) of an uploaded file: .txt/.md as text (headings found later); .epub as its chapters
    in reading order, each (title, plain text)."""
    suffix = Path(name).suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        raise InvalidInputError(f"unsupported file type {suffix or name!r}; use {', '.join(TEXT_SUFFIXES)}", "file")
    if suffix != ".epub":
        try:
            return data.decode("utf-8-sig"), None
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"{name} is not UTF-8 text", "file") from exc
    chapters = epub_chapters(data)
    return "\n\n".join(body for _, body in chapters), chapters


def epub_chapters(data: bytes) -> list[tuple[str | None, str]]:
    """The chapters of an EPUB in spine order: (first heading or None, paragraphs separated by blank lines)."""
    import io
    import tempfile
    import zipfile
    from html.parser import HTMLParser

    import ebooklib
    from ebooklib import epub

    class _Text(HTMLParser):
        BLOCKS = frozenset({"p", "div", "br", "li", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "section", "tr"})

        def __init__(self) -> None:
            super().__init__()
            self.parts: list[str] = []
            self.title: str | None = None
            self._heading: list[str] | None = None
            self._skip = 0

        def handle_starttag(self, tag: str, attrs: object) -> None:
            if tag in ("script", "style", "head"):
                self._skip += 1
            if tag in self.BLOCKS:
                self.parts.append("\n\n")
            if tag in ("h1", "h2", "h3") and self.title is None:
                self._heading = []

        def handle_endtag(self, tag: str) -> None:
            if tag in ("script", "style", "head"):
                self._skip = max(0, self._skip - 1)
            if tag in self.BLOCKS:
                self.parts.append("\n\n")
            if tag in ("h1", "h2", "h3") and self._heading is not None:
                self.title = " ".join("".join(self._heading).split()) or None
                self._heading = None

        def handle_data(self, text: str) -> None:
            if self._skip:
                return
            if self._heading is not None:
                self._heading.append(text)
            else:
                self.parts.append(text)

    try:
        with tempfile.NamedTemporaryFile(suffix=".epub") as tmp:  # ebooklib reads a path
            tmp.write(data)
            tmp.flush()
            book = epub.read_epub(tmp.name, options={"ignore_ncx": True})
    except (zipfile.BadZipFile, KeyError, ValueError, epub.EpubException, io.UnsupportedOperation) as exc:
        raise InvalidInputError(f"the EPUB could not be read: {exc}", "file") from exc
    chapters = []
    for item_id, _ in book.spine:
        item = book.get_item_with_id(item_id)
        if item is None or item.get_type() != ebooklib.ITEM_DOCUMENT:
            continue
        parser = _Text()
        parser.feed(item.get_content().decode("utf-8", "replace"))
        body = "".join(parser.parts)
        if body.strip() or parser.title:
            chapters.append((parser.title, body))
    if not chapters:
        raise InvalidInputError("the EPUB has no readable text", "file")
    return chapters
