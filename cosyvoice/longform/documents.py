"""Uploaded books (.txt .md .epub .docx .pdf) as chapters of plain text, read within stated bounds.

A book is a user's file, and a hostile one costs a stated amount at most: the file's bytes
(``Limits.max_import_bytes``); an EPUB's or DOCX's members through :func:`archives.bounded_copy` (text inflated
within bounds and screened as XML, images never inflated); a PDF's pages (``max_import_pages``) and any one of
its streams, inflated (``max_import_member_bytes``, pypdf's own stream limits); then the text read, from any
source (:func:`check_text`: characters, and the longest run without a space or punctuation, which the sentence
splitter would otherwise take whole). A reader checks a :class:`~cosyvoice.engine.CancelToken` between pages,
chapters and paragraphs, so an import whose client has gone stops. Any problem is an
:class:`InvalidInputError` naming the file, the problem and the limit (with its environment variable).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import numpy as np

from cosyvoice.engine import CancelToken
from cosyvoice.errors import InvalidInputError
from cosyvoice.jobs import Cancelled
from cosyvoice.longform.archives import bounded_copy, limit, refused
from cosyvoice.settings import Limits

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".epub", ".pdf", ".docx")
Chapters = list[tuple[str | None, str]]
# what ends a run of characters for the splitter: white space, and the punctuation that ends a clause
_RUN_BREAKS = r"\s.,;:!?\-\u2013\u2014\u3001\u3002\uff0c\uff1b\uff1a\uff01\uff1f"


def read_document(name: str, data: bytes, limits: Limits | None = None,
                  cancel: CancelToken | None = None) -> tuple[str, Chapters | None]:
    """(text, chapters) of an uploaded file: .txt/.md as text (headings found later); .epub, .docx and .pdf as
    their chapters in reading order, each (title, plain text), or None where a PDF or DOCX has no headings.
    ``limits``: the import bounds (default: the environment's); ``cancel``: stops the reading (:class:`Cancelled`)."""
    limits = limits or Limits.from_env()
    if len(data) > limits.max_import_bytes:
        raise refused(name, f"the file is larger than {limit('max_import_bytes', limits.max_import_bytes)}")
    suffix = Path(name).suffix.lower()
    if suffix not in TEXT_SUFFIXES:
        raise refused(name, f"unsupported file type {suffix or name!r}; use {', '.join(TEXT_SUFFIXES)}")
    readers = {".epub": epub_chapters, ".docx": docx_chapters, ".pdf": pdf_chapters}
    if suffix not in readers:
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as exc:
            raise refused(name, f"not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})") from exc
        check_text(text, limits, name)
        return text, None
    kind = suffix[1:].upper()
    with _reading(name, kind):
        chapters = readers[suffix](name, data, limits, cancel)
    text = "\n\n".join(body for _, body in chapters)
    if not text.strip():
        raise refused(name, f"the {kind} has no readable text")
    check_text(text, limits, name)
    return text, chapters if any(title for title, _ in chapters) else None


def check_text(text: str, limits: Limits, name: str | None = None) -> None:
    """A project's text within ``max_import_chars`` characters, none of its runs without a space or punctuation
    longer than ``max_import_run_chars``: :class:`InvalidInputError` naming the file ``name`` (else the field
    ``text``), where and the limit."""
    def error(problem: str) -> InvalidInputError:
        return refused(name, problem) if name else InvalidInputError(f"the text: {problem}", "text")

    run = re.search(f"[^{_RUN_BREAKS}]{{{limits.max_import_run_chars + 1},}}", text)
    if run:
        line = text.count("\n", 0, run.start()) + 1
        raise error(f"line {line} has {run.end() - run.start():,} characters without a space or punctuation; "
                    f"at most {limit('max_import_run_chars', limits.max_import_run_chars)}")
    if len(text) > limits.max_import_chars:
        raise error(f"it has {len(text):,} characters; at most {limit('max_import_chars', limits.max_import_chars)} "
                    "are read into one project; split the book into several projects")


def go_on(cancel: CancelToken | None) -> None:
    """Raise :class:`Cancelled` if the import was cancelled (its client went away)."""
    if cancel is not None and cancel.cancelled:
        raise Cancelled


@contextlib.contextmanager
def _reading(name: str, kind: str) -> Iterator[None]:
    """A format library's failure on a user's file is that file's 400, never a 500."""
    try:
        yield
    except (InvalidInputError, Cancelled, MemoryError):
        raise
    except Exception as exc:  # whatever the library raises for a file it cannot read
        raise refused(name, f"the {kind} could not be read: {exc or type(exc).__name__}") from exc


def _chapters_at(paragraphs: list[tuple[int | None, str]]) -> Chapters:
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


def docx_chapters(name: str, data: bytes, limits: Limits, cancel: CancelToken | None = None) -> Chapters:
    """A Word document's paragraphs, in chapters at its top-level headings (the "Title" and "Heading N"
    styles, or a paragraph's own outline level)."""
    import docx

    document = docx.Document(io.BytesIO(bounded_copy(name, "DOCX", data, limits)))
    paragraphs: list[tuple[int | None, str]] = []
    for number, paragraph in enumerate(document.paragraphs):
        if number % 256 == 0:
            go_on(cancel)
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


def pdf_chapters(name: str, data: bytes, limits: Limits, cancel: CancelToken | None = None) -> Chapters:
    """A PDF's text in reading order, paragraphs found from the gaps between lines, in chapters at its outline's
    top-level entries or, without one, at its largest headings (lines in larger type than the body)."""
    import pypdf
    from pypdf.errors import LimitReachedError

    bound = limits.max_import_member_bytes  # what any one stream inflates to (pypdf's own limits, at ours)
    streams = {f"{kind}_maximum_output_length": bound for kind in ("zlib", "lzw", "run_length", "brotli",
                                                                   "array_based_stream")}
    try:
        with pypdf.apply_configuration(**streams):
            reader = pypdf.PdfReader(io.BytesIO(data))
            if reader.is_encrypted and not reader.decrypt(""):
                raise refused(name, "the PDF is encrypted; save an unprotected copy first")
            pages = len(reader.pages)
            if pages > limits.max_import_pages:
                raise refused(name, f"the PDF has {pages:,} pages; at most "
                                    f"{limit('max_import_pages', limits.max_import_pages)} are read")
            lines = []
            for number, page in enumerate(reader.pages):
                go_on(cancel)
                lines += _pdf_lines(number, page)
            outline = _pdf_outline(reader)
    except LimitReachedError as exc:
        raise refused(name, f"the PDF could not be read: a stream inflates to more than "
                            f"{limit('max_import_member_bytes', bound)} ({exc})") from exc
    if not lines:
        raise refused(name, "the PDF has no text layer (a scanned book needs text recognition first)")
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
                      ) -> Chapters:
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


class _EpubText(HTMLParser):
    """An EPUB document's text, blocks separated by blank lines; its first h1-h3 heading is the title."""

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


def epub_chapters(name: str, data: bytes, limits: Limits, cancel: CancelToken | None = None) -> Chapters:
    """The chapters of an EPUB in spine order: (first heading or None, paragraphs separated by blank lines)."""
    import tempfile

    import ebooklib
    from ebooklib import epub

    with tempfile.NamedTemporaryFile(suffix=".epub") as tmp:  # ebooklib reads a path
        tmp.write(bounded_copy(name, "EPUB", data, limits))
        tmp.flush()
        book = epub.read_epub(tmp.name, options={"ignore_ncx": True})
    chapters = []
    for item_id, _ in book.spine:
        go_on(cancel)
        item = book.get_item_with_id(item_id)
        if item is None or item.get_type() != ebooklib.ITEM_DOCUMENT:
            continue
        parser = _EpubText()
        parser.feed(item.get_content().decode("utf-8", "replace"))
        body = "".join(parser.parts)
        if body.strip() or parser.title:
            chapters.append((parser.title, body))
    if not chapters:
        raise refused(name, "the EPUB has no readable text")
    return chapters
