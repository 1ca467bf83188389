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

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cosyvoice.engine import CancelToken
from cosyvoice.errors import InvalidInputError
from cosyvoice.jobs import Cancelled
from cosyvoice.settings import Limits, env_name

BREAKS = ("sentence", "paragraph", "chapter", "turn", "tag", "end")  # what follows a segment
DEFAULT_PAUSES = {"sentence": 0.25, "paragraph": 0.8, "chapter": 2.0, "turn": 0.5, "end": 0.0}
MAX_PAUSE_SECONDS = 30.0

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


def dialogue_blocks(script: str, limits: Limits | None = None) -> list[Block]:
    """Blocks of a dialogue script: ``Name: line`` or ``Name (instruction): line`` per turn; a line without a
    label continues the turn before it; Markdown headings open chapters (scenes). At most
    ``limits.max_dialogue_turns`` turns by ``max_dialogue_speakers`` speakers (default: the environment's)."""
    limits = limits or Limits.from_env()
    turns: list[tuple[str, str, str, str | None]] = []  # speaker, instruction, text, chapter
    speakers: set[str] = set()
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
            speakers.add(turns[-1][0])
            chapter = None
            if len(turns) > limits.max_dialogue_turns:
                raise InvalidInputError(f"line {number}: the script has more than {limits.max_dialogue_turns:,} turns "
                                        f"({env_name('max_dialogue_turns')}); split it into several projects", "script")
            if len(speakers) > limits.max_dialogue_speakers:
                raise InvalidInputError(f"line {number}: the script has more than {limits.max_dialogue_speakers:,} "
                                        f"speakers ({env_name('max_dialogue_speakers')})", "script")
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


def segment_drafts(blocks: list[Block], split: Callable[[str], list[str]], limits: Limits | None = None,
                   cancel: CancelToken | None = None,
                   progress: Callable[[int, int], None] | None = None) -> list[SegmentDraft]:
    """The segment table of ``blocks``, each split by ``split`` (the frontend's splitter). A block with nothing
    to speak hands its break to the segment before it (a pause tag's seconds win over a plain break; two tags
    add up) and its chapter to the next segment. At most ``limits.max_project_segments`` rows; ``cancel`` stops
    the splitting (:class:`Cancelled`); ``progress(blocks split, blocks)`` hears how far it is, every 64 blocks."""
    limits = limits or Limits.from_env()
    drafts: list[SegmentDraft] = []
    carry_chapter: str | None = None
    for number, block in enumerate(blocks):
        if cancel is not None and cancel.cancelled:
            raise Cancelled
        if progress is not None and number % 64 == 0:
            progress(number, len(blocks))
        pieces = split(block.text) if block.text.strip() else []
        chapter = block.chapter or carry_chapter
        if not pieces:
            carry_chapter = chapter
            if drafts:
                drafts[-1] = _merge_break(drafts[-1], block)
            continue
        carry_chapter = None
        if block.brk == "tag" and mid_sentence(block.text):
            pieces[-1] = pieces[-1][:-1] + _PAUSE_MARK.get(pieces[-1][-1], pieces[-1][-1])
        for i, piece in enumerate(pieces):
            final = i == len(pieces) - 1
            drafts.append(SegmentDraft(piece, block.brk if final else "sentence", block.pause if final else None,
                                       chapter if i == 0 else None, block.speaker, block.instruction))
        if len(drafts) > limits.max_project_segments:
            raise InvalidInputError(f"the text makes more than {limits.max_project_segments:,} segments "
                                    f"({env_name('max_project_segments')}); split it into several projects", "text")
    if not drafts:
        raise InvalidInputError("the text has nothing to speak", "text")
    return drafts


_SENTENCE_ENDS = frozenset(".?!;:。？！；：…")
_PAUSE_MARK = {".": ",", "。": "，"}  # the full stop the splitter ends every piece with, as a pause inside one


def mid_sentence(text: str) -> bool:
    """Whether ``text`` stops inside a sentence (a pause tag in mid-flow): the splitter would end it with a full
    stop, which the model reads as the sentence's end; its segment ends with a comma instead."""
    text = text.rstrip()
    return bool(text) and text[-1] not in _SENTENCE_ENDS


def _merge_break(draft: SegmentDraft, block: Block) -> SegmentDraft:
    brk, pause = block.brk, block.pause
    if draft.brk == "tag":
        brk, pause = "tag", draft.pause + (block.pause if block.brk == "tag" else 0.0)
    return SegmentDraft(draft.text, brk, pause, draft.chapter, draft.speaker, draft.instruction)
