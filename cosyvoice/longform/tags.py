"""What every exported file says about the book: its title, author, narrator and cover, in the tags of its MP3,
M4B and MP4 files (the whole mix's and each ACX chapter's), and the covers kept in the data folder
(``longform/covers/<project>``)."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from cosyvoice.errors import InvalidInputError
from cosyvoice.longform.store import ProjectStore
from cosyvoice.system.fs import atomic_write
from cosyvoice.system.sqlite import require_writable

COVER_TYPES = {b"\xff\xd8\xff": "image/jpeg", b"\x89PNG\r\n\x1a\n": "image/png"}
MAX_COVER_BYTES = 10 * 2 ** 20
MAX_TAG_CHARS = 200


@dataclass(frozen=True)
class BookTags:
    """What every delivered file says about the book; empty strings are left out of the tags."""

    title: str
    author: str = ""
    narrator: str = ""
    cover: bytes | None = None

    @property
    def cover_type(self) -> str | None:
        return cover_type(self.cover) if self.cover else None


def cover_type(data: bytes) -> str:
    """The MIME type of a cover image (JPEG or PNG, the two every player shows); a clear error otherwise."""
    if len(data) > MAX_COVER_BYTES:
        raise InvalidInputError(f"the cover is larger than {MAX_COVER_BYTES // 2 ** 20} MB", "cover")
    for magic, mime in COVER_TYPES.items():
        if data.startswith(magic):
            return mime
    raise InvalidInputError("the cover must be a JPEG or PNG image", "cover")


def tag_text(value: object, field_name: str) -> str:
    """A tag value as stored: one line, trimmed, at most MAX_TAG_CHARS characters."""
    if not isinstance(value, str):
        raise InvalidInputError(f"{field_name} must be text", field_name)
    text = " ".join(value.split())
    if len(text) > MAX_TAG_CHARS:
        raise InvalidInputError(f"{field_name} is longer than {MAX_TAG_CHARS} characters", field_name)
    return text


def tag_file(file: BinaryIO, kind: str, tags: BookTags, chapter: str | None = None,
             track: tuple[int, int] | None = None) -> None:
    """Write ``tags`` into the MP3 (ID3v2) or MP4/M4B (iTunes atoms) in the seekable ``file``, in place. The
    narrator goes where audiobook players look for it: the composer field and a NARRATOR field."""
    file.seek(0)
    if kind == "mp3":
        _tag_mp3(file, tags, chapter, track)
    elif kind in ("m4b", "mp4"):
        _tag_mp4(file, tags)
    file.seek(0, io.SEEK_END)


def _tag_mp3(file: BinaryIO, tags: BookTags, chapter: str | None, track: tuple[int, int] | None) -> None:
    from mutagen import id3

    frames = id3.ID3()
    frames.add(id3.TIT2(encoding=3, text=chapter or tags.title))
    frames.add(id3.TALB(encoding=3, text=tags.title))
    frames.add(id3.TCON(encoding=3, text="Audiobook"))
    if tags.author:
        frames.add(id3.TPE1(encoding=3, text=tags.author))
        frames.add(id3.TPE2(encoding=3, text=tags.author))
    if tags.narrator:
        frames.add(id3.TCOM(encoding=3, text=tags.narrator))
        frames.add(id3.TXXX(encoding=3, desc="NARRATOR", text=tags.narrator))
    if track:
        frames.add(id3.TRCK(encoding=3, text=f"{track[0]}/{track[1]}"))
    if tags.cover:
        frames.add(id3.APIC(encoding=3, mime=tags.cover_type, type=3, desc="Cover", data=tags.cover))
    frames.save(file, v2_version=4)


def _tag_mp4(file: BinaryIO, tags: BookTags) -> None:
    from mutagen import mp4

    book = mp4.MP4(file)
    if book.tags is None:
        book.add_tags()
    book.tags["\xa9nam"] = [tags.title]
    book.tags["\xa9alb"] = [tags.title]
    book.tags["\xa9gen"] = ["Audiobook"]
    if tags.author:
        book.tags["\xa9ART"] = [tags.author]
        book.tags["aART"] = [tags.author]
    if tags.narrator:
        book.tags["\xa9wrt"] = [tags.narrator]
        book.tags["----:com.apple.iTunes:NARRATOR"] = [mp4.MP4FreeForm(tags.narrator.encode())]
    if tags.cover:
        kind = mp4.MP4Cover.FORMAT_PNG if tags.cover_type == "image/png" else mp4.MP4Cover.FORMAT_JPEG
        book.tags["covr"] = [mp4.MP4Cover(tags.cover, kind)]
    file.seek(0)
    book.save(file)


def file_stem(name: str) -> str:
    """A file name's stem from a title: letters, digits, - and _ kept, spaces as -, at most 80 characters."""
    stem = "".join(ch if ch.isalnum() or ch in "-_ " else "_" for ch in name).strip().replace(" ", "-")
    return stem[:80] or "project"



class Covers:
    """The books' covers, one file a project in ``longform/covers``, and the tags each project's files carry."""

    def __init__(self, store: ProjectStore) -> None:
        self.store = store
        self.folder = store.audio_root / "covers"

    def tags(self, project_id: str) -> BookTags:
        project = self.store.project(project_id)
        cover = self.folder / project_id
        return BookTags(project.settings.get("title") or project.name, project.settings.get("author", ""),
                        project.settings.get("narrator", ""), cover.read_bytes() if cover.exists() else None)

    def has_cover(self, project_id: str) -> bool:
        return (self.folder / project_id).exists()

    def set_cover(self, project_id: str, data: bytes | None) -> None:
        """The book's cover image (JPEG or PNG), or none (``data`` None); written whole or not at all."""
        self.store.project(project_id)
        require_writable(self.store.read_only)
        path = self.folder / project_id
        if data is None:
            path.unlink(missing_ok=True)
            return
        cover_type(data)
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))

    def remove(self, project_id: str) -> None:
        (self.folder / project_id).unlink(missing_ok=True)
