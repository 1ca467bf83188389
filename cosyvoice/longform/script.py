"""From a document or a dialogue script to the rows of a segment table.

A document is read as chapters (Markdown headings ``#``..``######``, an EPUB's chapters, a DOCX's headings, a
PDF's outline or, without one, its headings told by their larger type) of paragraphs (blank-line separated);
a dialogue script as turns (``Alice: text`` or ``Alice (instruction): text``). Pause
tags (``[pause:1.5s]``, ``[pause:800ms]``) cut a paragraph where they stand. Each piece of text between these
breaks is split by the frontend's own splitter (``TextFrontend.split``: normalisation, then sentences packed
as the model reads them), so the table shows exactly the segments that will be spoken; the break that ends
each piece (sentence, paragraph, chapter, turn or a tag's seconds) becomes the pause after its last segment.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cosyvoice.errors import InvalidInputError

BREAKS = ("sentence", "paragraph", "chapter", "turn", "tag", "end")  # what follows a segment
DEFAULT_PAUSES = {"sentence": 0.25, "paragraph": 0.8, "chapter": 2.0, "turn": 0.5, "end": 0.0}
MAX_PAUSE_SECONDS = 30.0
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".epub", ".pdf", ".docx")

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
    """(text, chapters) of an uploaded file: .txt/.md as text (headings found later); .epub, .docx and .pdf as
    their chapters in reading order, each (title, plain text), or None where a PDF or DOCX has no headings."""
    suffix = Path(name).suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        raise InvalidInputError(f"unsupported file type {suffix or name!r}; use {', '.join(TEXT_SUFFIXES)}", "file")
    readers = {".epub": epub_chapters, ".docx": docx_chapters, ".pdf": pdf_chapters}
    if suffix not in readers:
        try:
            return data.decode("utf-8-sig"), None
        except UnicodeDecodeError as exc:
            raise InvalidInputError(f"{name} is not UTF-8 text", "file") from exc
    chapters = readers[suffix](data)
    text = "\n\n".join(body for _, body in chapters)
    if not text.strip():
        raise InvalidInputError(f"the {suffix[1:].upper()} has no readable text", "file")
    return text, chapters if any(title for title, _ in chapters) else None


def _chapters_at(paragraphs: list[tuple[int | None, str]]) -> list[tuple[str | None, str]]:
    """Chapters from (heading level or None for body text, text) in reading order: a chapter opens at each
    heading of the highest level used more than once (a book's one title above them opens its front matter);
    lower headings stay in the text as paragraphs of their own."""
    levels = [level for level, _ in paragraphs if level is not None]
    repeated = [level for level in set(levels) if levels.count(level) > 1]
    top = min(repeated or levels, default=None)
    chapters: list[tuple[str | None, list[str]]] = []
    for level, text in paragraphs:
        if level is not None and top is not None and level <= top:
            chapters.append((text, []))
        else:
            if not chapters:
                chapters.append((None, []))
            chapters[-1][1].append(text)
    return [(title, "\n\n".join(body)) for title, body in chapters if title or body]


def docx_chapters(data: bytes) -> list[tuple[str | None, str]]:
    """A Word document's paragraphs, in chapters at its top-level headings (the "Title" and "Heading N"
    styles, or a paragraph's own outline level)."""
    import io
    import zipfile

    import docx
    from docx.opc.exceptions import PackageNotFoundError

    try:
        document = docx.Document(io.BytesIO(data))
    except (zipfile.BadZipFile, KeyError, ValueError, PackageNotFoundError) as exc:
        raise InvalidInputError(f"the DOCX could not be read: {exc}", "file") from exc
    paragraphs: list[tuple[int | None, str]] = []
    for paragraph in document.paragraphs:
        text = " ".join(paragraph.text.split())
        if text:
            paragraphs.append((_docx_level(paragraph), text))
    return _chapters_at(paragraphs)


def _docx_level(paragraph: object) -> int | None:
    """0 for a title, N for "Heading N" (or a paragraph's own outline level N-1), None for body text."""
    from docx.oxml.ns import qn

    style = getattr(paragraph.style, "name", "") or ""  # type: ignore[attr-defined]
    if style == "Title":
        return 0
    match = re.fullmatch(r"Heading (\d)", style)
    if match:
        return int(match.group(1))
    ppr = paragraph._p.pPr  # type: ignore[attr-defined]
    outline = ppr.find(qn("w:outlineLvl")) if ppr is not None else None
    return int(outline.get(qn("w:val"))) + 1 if outline is not None else None


@dataclass
class _PdfLine:
    page: int
    y: float
    size: float
    text: str


def pdf_chapters(data: bytes) -> list[tuple[str | None, str]]:
    """A PDF's text in reading order, paragraphs found from the gaps between lines, in chapters at its outline's
    top-level entries or, without an outline, at its largest headings (lines in larger type than the body)."""
    import io

    import pypdf
    from pypdf.errors import PdfReadError

    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise InvalidInputError("the PDF is encrypted; save an unprotected copy first", "file")
        lines = [line for number, page in enumerate(reader.pages) for line in _pdf_lines(number, page)]
        outline = _pdf_outline(reader)
    except (PdfReadError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise InvalidInputError(f"the PDF could not be read: {exc}", "file") from exc
    if not lines:
        raise InvalidInputError("the PDF has no text layer (a scanned book needs text recognition first)", "file")
    body = _body_size(lines)
    if outline:
        return _outline_chapters(lines, outline, body)
    paragraphs = _pdf_paragraphs(lines, body)
    sizes = sorted({size for size, _ in paragraphs if size is not None}, reverse=True)
    return _chapters_at([(None if size is None else sizes.index(size), text) for size, text in paragraphs])


def _body_size(lines: list[_PdfLine]) -> float:
    """The type size that sets the most characters: the body's, however few lines a short document has."""
    chars: dict[float, int] = {}
    for line in lines:
        chars[round(line.size, 1)] = chars.get(round(line.size, 1), 0) + len(line.text)
    return max(chars, key=lambda size: chars[size])


def _pdf_lines(number: int, page: object) -> list[_PdfLine]:
    """The page's text lines top to bottom, each with its baseline and type size (text at the same baseline
    joined); bare page numbers dropped."""
    pieces: list[tuple[float, float, str]] = []

    def visit(text: str, cm: list[float], tm: list[float], font: object, size: float) -> None:
        if text.strip():
            scale = abs(tm[3] * cm[3]) or 1.0
            pieces.append((tm[5] * cm[3] + cm[5], size * scale, text))

    page.extract_text(visitor_text=visit)  # type: ignore[attr-defined]
    lines: list[_PdfLine] = []
    for y, size, text in pieces:
        if lines and abs(lines[-1].y - y) < 0.5 * max(size, 1.0):
            last = lines[-1]
            joiner = "" if last.text.endswith(" ") or text.startswith(" ") else " "
            lines[-1] = _PdfLine(number, last.y, max(last.size, size), last.text + joiner + text)
        else:
            lines.append(_PdfLine(number, y, size, text))
    return [line for line in lines if not line.text.strip().isdigit()]


def _pdf_paragraphs(lines: list[_PdfLine], body: float) -> list[tuple[int | None, str]]:
    """(heading size rounded, or None for body text; text): lines joined into paragraphs where the gap to the
    next line is no wider than the body's usual line spacing; a word hyphenated at a line end is joined."""
    gaps = [a.y - b.y for a, b in itertools.pairwise(lines) if a.page == b.page and a.y > b.y]
    spacing = float(np.median(gaps)) if gaps else 1.2 * body
    paragraphs: list[tuple[int | None, str]] = []
    current: list[str] = []
    heading = False
    for i, line in enumerate(lines):
        is_heading = line.size > 1.15 * body
        if current and (is_heading != heading or is_heading or not _same_paragraph(lines[i - 1], line, spacing)):
            paragraphs.append((round(lines[i - 1].size) if heading else None, _join_lines(current)))
            current = []
        current.append(line.text.strip())
        heading = is_heading
    if current:
        paragraphs.append((round(lines[-1].size) if heading else None, _join_lines(current)))
    return paragraphs


def _same_paragraph(a: _PdfLine, b: _PdfLine, spacing: float) -> bool:
    if a.page != b.page:
        return not re.search(r"[.!?。！？\"”]$", a.text.strip())  # a sentence running on to the next page
    return 0 < a.y - b.y <= 1.3 * spacing


def _join_lines(lines: list[str]) -> str:
    text = ""
    for line in lines:
        joined = text.endswith("-") and line[:1].islower()  # a word hyphenated at the line's end
        text = text[:-1] + line if joined else f"{text} {line}" if text else line
    return " ".join(text.split())


def _pdf_outline(reader: object) -> list[tuple[str, int]]:
    """(title, page index) of the outline's top-level entries, in page order."""
    entries = []
    for item in reader.outline:  # type: ignore[attr-defined]
        if isinstance(item, list):
            continue  # the children of the entry before
        page = reader.get_destination_page_number(item)  # type: ignore[attr-defined]
        if page is not None and page >= 0:
            entries.append((" ".join(str(item.title).split()), page))
    return sorted(entries, key=lambda entry: entry[1])


def _outline_chapters(lines: list[_PdfLine], outline: list[tuple[str, int]], body: float
                      ) -> list[tuple[str | None, str]]:
    """Chapters at the outline's entries: each opens on its page, at the line that reads as its title if there is
    one (that line is then the title, not text), else at the top of the page."""
    starts: list[int] = []
    for title, page in outline:
        on_page = [i for i, line in enumerate(lines) if line.page == page and (not starts or i >= starts[-1])]
        if not on_page:
            on_page = [next((i for i, line in enumerate(lines) if line.page > page), len(lines))]
        match = next((i for i in on_page if _norm(lines[i].text) == _norm(title)), None)
        starts.append(match if match is not None else on_page[0])
    chapters: list[tuple[str | None, str]] = []
    if starts and starts[0] > 0:
        chapters.append((None, "\n\n".join(text for _, text in _pdf_paragraphs(lines[: starts[0]], body))))
    for k, ((title, _), start) in enumerate(zip(outline, starts, strict=True)):
        end = starts[k + 1] if k + 1 < len(starts) else len(lines)
        part = lines[start:end]
        if part and _norm(part[0].text) == _norm(title):
            part = part[1:]
        chapters.append((title, "\n\n".join(text for _, text in _pdf_paragraphs(part, body))))
    return [(title, text) for title, text in chapters if title or text.strip()]


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


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
