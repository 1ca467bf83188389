"""An uploaded archive (EPUB, DOCX) opened within stated bounds, before any format library sees it.

python-docx and ebooklib read every member of a zip into memory and parse its XML as it comes; a hostile book
hides a gigabyte of zeros behind a picture, nests elements 20,000 deep or declares entities that expand a
billion times. :func:`bounded_copy` hands them a copy instead in which only text members (XML, XHTML,
relationships) are inflated, each to at most ``Limits.max_import_member_bytes`` and all together to
``max_import_inflated_bytes``; each XML member has been read once by lxml's event parser (no DTD entities, no
network, no huge trees, nesting at most ``max_import_xml_depth``, well-formed); every other member (images,
fonts, media: never text) is there, empty, so manifests still resolve and nothing else is inflated.
"""

from __future__ import annotations

import io
import re
import zipfile
import zlib

from cosyvoice.errors import InvalidInputError
from cosyvoice.settings import Limits, env_name

TEXT_MEMBERS = (".xml", ".rels", ".opf", ".ncx", ".xhtml", ".html", ".htm")
STRICT_XML = (".xml", ".rels", ".opf", ".ncx")  # (x)html is read by a lenient HTML parser: only entities refused
_ENTITY = re.compile(rb"<!ENTITY", re.I)


def refused(name: str, problem: str) -> InvalidInputError:
    """The error of an uploaded file: it names the file and the problem (and the limit, where one was hit)."""
    return InvalidInputError(f"{name}: {problem}", "file")


def limit(setting: str, value: int) -> str:
    """A limit as errors state it: its value and the environment variable that changes it."""
    shown = f"{value / 2**20:g} MB" if setting.endswith("_bytes") else f"{value:,}"
    return f"{shown} ({env_name(setting)})"


def bounded_copy(name: str, kind: str, data: bytes, limits: Limits) -> bytes:
    """A stored (uncompressed) copy of the zip ``data`` whose text members are screened and whose other members
    are empty; :class:`InvalidInputError` naming ``name``, the member and the limit otherwise."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, EOFError) as exc:
        raise refused(name, f"the {kind} could not be read: {exc}") from exc
    if len(members) > limits.max_import_members:
        raise refused(name, f"the {kind} has {len(members):,} members; at most "
                            f"{limit('max_import_members', limits.max_import_members)} are read")
    out, total = io.BytesIO(), 0
    with archive, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as copy:
        for info in members:
            if info.is_dir():
                continue
            lower = info.filename.lower()
            if not (lower.endswith(TEXT_MEMBERS) or lower == "mimetype"):
                copy.writestr(info.filename, b"")  # an image or a font: never inflated
                continue
            content = _inflate(name, archive, info, limits)
            total += len(content)
            if total > limits.max_import_inflated_bytes:
                raise refused(name, f"the {kind}'s text inflates to more than "
                                    f"{limit('max_import_inflated_bytes', limits.max_import_inflated_bytes)}")
            if lower.endswith(STRICT_XML):
                screen_xml(name, kind, info.filename, content, limits)
            elif _ENTITY.search(content):
                raise refused(name, f"{info.filename} declares XML entities, which a book never needs; "
                                    "entity expansion is not allowed")
            copy.writestr(info.filename, content)
    return out.getvalue()


def _inflate(name: str, archive: zipfile.ZipFile, info: zipfile.ZipInfo, limits: Limits) -> bytes:
    """The member's bytes, inflated to one byte past the bound at most (whatever its header claims)."""
    bound = limits.max_import_member_bytes
    try:
        with archive.open(info) as member:
            content = member.read(bound + 1)
    except (zipfile.BadZipFile, zlib.error, NotImplementedError, RuntimeError, EOFError, OSError) as exc:
        raise refused(name, f"{info.filename} could not be inflated: {exc}") from exc
    if len(content) > bound:
        raise refused(name, f"{info.filename} inflates to more than {limit('max_import_member_bytes', bound)}")
    return content


def screen_xml(name: str, kind: str, member: str, content: bytes, limits: Limits) -> None:
    """Read ``content`` once with lxml's event parser: well-formed, no entity declarations, nesting within
    ``max_import_xml_depth``; the tree is dropped as it is read."""
    from lxml import etree

    entities = refused(name, f"{member} declares XML entities (a DTD), which no word processor writes; entity "
                             "expansion is not allowed")
    deep = refused(name, f"{member} nests elements deeper than "
                         f"{limit('max_import_xml_depth', limits.max_import_xml_depth)}")
    depth = 0
    events = etree.iterparse(io.BytesIO(content), events=("start", "end"), resolve_entities=False, load_dtd=False,
                             no_network=True, huge_tree=False)
    try:
        for event, element in events:
            if event == "end":
                depth -= 1
                element.clear()
                continue
            depth += 1
            if depth == 1:
                dtd = element.getroottree().docinfo.internalDTD
                if dtd is not None and any(True for _ in dtd.iterentities()):
                    raise entities
            if depth > limits.max_import_xml_depth:
                raise deep
    except etree.XMLSyntaxError as exc:
        # libxml2 2.13+ reads ahead of the events and meets its own bounds first (nesting 256, entity expansion)
        text = str(exc)
        if "Excessive depth" in text:
            raise deep from exc
        if "entity" in text and ("amplification" in text or "loop" in text):
            raise entities from exc
        raise refused(name, f"the {kind} could not be read: {member} is not well-formed XML: {exc}") from exc
