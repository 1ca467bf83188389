"""Hostile books, scripts and references against the REST server as its own process (issue 31), with two API keys:
each attack of the issue's table is a clear 400 or 404 naming the problem and the limit, within a stated bound on
the server's peak memory (its ``VmHWM``, reset before each attack) and its CPU time; an import whose client goes
away stops; the server then answers a normal request, and the project made before the attacks is as it was.

The bombs are made here, each a few hundred KB: a 0.6 MB DOCX and EPUB hiding 600 MB of zeros behind a picture, a
PDF whose one content stream inflates to 300 MB, entity and nesting bombs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import struct
import subprocess
import sys
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from waiting import free_port, until, until_ready

from cosyvoice.settings import Limits, ServerSettings, env_name

KEY_A, KEY_B = "hostile-key-a", "hostile-key-b"
A, B = ({"Authorization": f"Bearer {key}"} for key in (KEY_A, KEY_B))
LIMITS = Limits()  # the server runs with the defaults: what a deployment gets
BOMB_BYTES = 600 * 2**20
PEAK_MB = 200  # what any one attack may add to the server's peak resident memory (the table saw +1.2 to +3 GB)
CPU_SECONDS = 15  # and the CPU time it may cost the server (the table saw 33 s for one "word" and no end for a book)
PARAGRAPH = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods. " * 5
W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"


class ServerProcess:
    """``python -m cosyvoice.server.rest`` on a free loopback port with two keys, measurable from /proc."""

    def __init__(self, model_dir: Path, root: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / "server.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COSYVOICE_DEVICE": "cpu"}
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "cosyvoice.server.rest", "--model-dir", str(model_dir), "--port",
                 str(self.port), "--voice-dir", str(root / "voices"), "--api-key", KEY_A, "--api-key", KEY_B,
                 "--log-level", "warning"], env=env, stdout=log, stderr=subprocess.STDOUT)
        until_ready(self.process, self.url, log=self.log)

    def kb(self, field: str) -> int:
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.M).group(1))

    def reset_peak(self) -> None:
        """The peak (VmHWM) starts again from what is resident now."""
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> str:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        return self.log.read_text()


@dataclass
class Cost:
    peak_mb: float = 0.0
    cpu: float = 0.0


@contextlib.contextmanager
def measured(server: ServerProcess) -> Iterator[Cost]:
    """What the block costs the server: its peak memory above what was resident at the start, its CPU time."""
    server.reset_peak()
    base, cpu = server.kb("VmRSS"), server.cpu_seconds()
    cost = Cost()
    yield cost
    cost.peak_mb, cost.cpu = (server.kb("VmHWM") - base) / 1024, server.cpu_seconds() - cpu


@dataclass
class Served:
    server: ServerProcess
    client: httpx.Client  # key A's
    voice: str  # a saved voice (everyone's)
    upload: str  # key A's unsaved upload: its id
    project: dict  # key A's project, made before the attacks


@pytest.fixture(scope="module")
def served(tiny_bundle_dir: Path, prompt_wav: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("hostile")
    server = ServerProcess(tiny_bundle_dir, root)
    wav = prompt_wav.read_bytes()
    try:
        with httpx.Client(base_url=server.url, headers=A, timeout=120) as client:
            made = client.post("/v1/voices", data={"name": "Narrator", "transcript": "Hello there."},
                               files={"audio": ("prompt.wav", wav, "audio/wav")})
            assert made.status_code == 201, made.text
            saved = {p.stem for p in (root / "voices").glob("*/*.json")}  # the library's entries
            spoken = client.post("/inference_zero_shot", data={"tts_text": "Hi.", "prompt_text": "Hello there."},
                                 files={"prompt_wav": ("other.wav", wav[:-2000], "audio/wav")})
            assert spoken.status_code == 200 and spoken.content, spoken.text
            upload = ({p.stem for p in (root / "voices").glob("*/*.json")} - saved).pop()
            project = client.post("/v1/longform/projects", json={"name": "Kept", "text": "One. Two.\n\nThree.",
                                                                 "voice": "Narrator"})
            assert project.status_code == 201, project.text
            yield Served(server, client, made.json()["id"], upload, project.json())
    finally:
        log = server.stop()
    assert "Traceback" not in log, log


def _refused(answer: httpx.Response, *words: str, status: int = 400) -> str:
    assert answer.status_code == status, (answer.status_code, answer.text[:500])
    message = answer.json()["error"]["message"]
    for word in words:
        assert word in message, message
    return message


def _upload(client: httpx.Client, name: str, data: bytes, **form: str) -> httpx.Response:
    return client.post("/v1/longform/projects/upload", data={"voice": "Narrator", **form},
                       files={"file": (name, data, "application/octet-stream")})


# ----------------------------------------------------------------------------- the bombs


def _zeros_member(archive: zipfile.ZipFile, name: str, size: int) -> None:
    """A member of ``size`` zero bytes, written deflated in pieces (600 MB become 0.6 MB)."""
    chunk = bytes(1 << 20)
    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED
    with archive.open(info, "w", force_zip64=True) as member:
        for _ in range(size // len(chunk)):
            member.write(chunk)


def _rezip(data: bytes, replace: dict[str, bytes], zeros: dict[str, int] | None = None) -> bytes:
    """The zip ``data`` with members replaced by ``replace`` and others by ``zeros`` of their sizes."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as source, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as copy:
        for info in source.infolist():
            if info.filename in (zeros or {}):
                _zeros_member(copy, info.filename, zeros[info.filename])
            else:
                copy.writestr(info, replace.get(info.filename, source.read(info)))
    return out.getvalue()


def _png() -> bytes:
    """A 1x1 black PNG: a picture a word processor and an e-book would carry."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)  # 1x1, 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0\0\0\0"))
            + chunk(b"IEND", b""))


def docx_book(picture: bool = False) -> bytes:
    import docx

    document = docx.Document()
    document.add_heading("A Book", 1)
    document.add_paragraph("It begins here. It goes on.")
    if picture:
        document.add_picture(io.BytesIO(_png()))
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


def _document_xml(body: str, doctype: str = "") -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8" standalone="yes"?>{doctype}<w:document xmlns:w="{W}">'
            f"<w:body>{body}</w:body></w:document>").encode()


def laughs_docx() -> bytes:
    entities = '<!ENTITY l0 "ha">' + "".join(f'<!ENTITY l{i} "{f"&l{i - 1};" * 10}">' for i in range(1, 10))
    document = _document_xml("<w:p><w:r><w:t>&l9;</w:t></w:r></w:p>", f"<!DOCTYPE w:document [{entities}]>")
    return _rezip(docx_book(), {"word/document.xml": document})


def deep_docx(depth: int = 20000) -> bytes:
    nested = "<w:sdt><w:sdtContent>" * (depth // 2) + "</w:sdtContent></w:sdt>" * (depth // 2)
    return _rezip(docx_book(), {"word/document.xml": _document_xml(nested)})


def cut_docx() -> bytes:
    book = docx_book()
    with zipfile.ZipFile(io.BytesIO(book)) as archive:
        document = archive.read("word/document.xml")
    return _rezip(book, {"word/document.xml": document[: len(document) // 2]})


def picture_bomb_docx() -> bytes:
    book = docx_book(picture=True)
    with zipfile.ZipFile(io.BytesIO(book)) as archive:
        media = [n for n in archive.namelist() if n.startswith("word/media/")]
    assert media
    return _rezip(book, {}, dict.fromkeys(media, BOMB_BYTES))


def picture_bomb_epub(tmp: Path) -> bytes:
    from ebooklib import epub

    book = epub.EpubBook()
    book.set_identifier("bomb")
    book.set_title("Bomb")
    book.set_language("en")
    chapter = epub.EpubHtml(title="One", file_name="c1.xhtml", lang="en")
    chapter.content = "<html><body><h1>One</h1><p>It begins here.</p><img src='big.png'/></body></html>"
    book.add_item(chapter)
    book.add_item(epub.EpubImage(uid="big", file_name="big.png", media_type="image/png", content=_png()))
    book.add_item(epub.EpubNcx())
    book.add_item(epub.EpubNav())
    book.spine = [chapter]
    path = tmp / "bomb.epub"
    epub.write_epub(str(path), book)
    data = path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        image = next(n for n in archive.namelist() if n.endswith("big.png"))
    return _rezip(data, {}, {image: BOMB_BYTES})


def stream_bomb_pdf(size: int = 300 * 2**20) -> bytes:
    """One page whose content stream is a line of text and then ``size`` spaces, deflated (0.3 MB)."""
    packer, chunk = zlib.compressobj(9), b" " * (1 << 20)
    stream = packer.compress(b"BT /F1 12 Tf 72 720 Td (Hello there.) Tj ET\n")
    stream += b"".join(packer.compress(chunk) for _ in range(size // len(chunk))) + packer.flush()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
               b"/Resources << /Font << /F1 5 0 R >> >> >>",
               b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream",
               b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


# ----------------------------------------------------------------------------- the table


def _check(served: Served, answer_of, *words: str, status: int = 400, peak_mb: float = PEAK_MB) -> str:
    """``answer_of()`` is refused with ``status`` naming ``words``, within the memory and CPU bounds."""
    with measured(served.server) as cost:
        message = _refused(answer_of(), *words, status=status)
    assert cost.peak_mb < peak_mb, f"peak +{cost.peak_mb:.0f} MB: {message}"
    assert cost.cpu < CPU_SECONDS, f"{cost.cpu:.1f} CPU-s: {message}"
    return message


@pytest.mark.parametrize(("name", "make", "words"), [
    ("laughs.docx", laughs_docx, ["laughs.docx", "word/document.xml", "entities"]),
    ("deep.docx", deep_docx, ["deep.docx", "word/document.xml", f"deeper than {LIMITS.max_import_xml_depth}",
                              env_name("max_import_xml_depth")]),
    ("cut.docx", cut_docx, ["cut.docx", "the DOCX could not be read:", "word/document.xml", "not well-formed"]),
    ("stream.pdf", stream_bomb_pdf, ["stream.pdf", "the PDF could not be read", "inflates to more than 32 MB",
                                     env_name("max_import_member_bytes")]),
], ids=["billion-laughs", "20000-deep", "cut-off", "pdf-stream-bomb"])
def test_a_hostile_book_is_a_400_naming_file_problem_and_limit(served: Served, name: str, make, words: list) -> None:
    data = make()
    assert len(data) < 1_000_000  # a few hundred KB
    _check(served, lambda: _upload(served.client, name, data), *words)


@pytest.mark.parametrize("kind", ["docx", "epub"])
def test_a_picture_that_inflates_to_600_mb_is_never_inflated(served: Served, kind: str, tmp_path: Path) -> None:
    data = picture_bomb_docx() if kind == "docx" else picture_bomb_epub(tmp_path)
    assert len(data) < 1_000_000
    with measured(served.server) as cost:
        answer = _upload(served.client, f"bomb.{kind}", data)
    assert answer.status_code == 201, answer.text[:500]
    assert [s["text"] for s in answer.json()["segments"]][-1].startswith("It begins here")
    assert cost.peak_mb < 100 and cost.cpu < CPU_SECONDS, cost  # the table saw +1.2 GB


def test_a_text_of_one_20_mb_word_is_refused_within_seconds(served: Served) -> None:
    message = _check(served, lambda: _upload(served.client, "word.txt", b"a" * 20_000_000),
                     "word.txt", "line 1 has 20,000,000 characters without a space or punctuation",
                     env_name("max_import_run_chars"))
    assert f"at most {LIMITS.max_import_run_chars:,}" in message


def test_a_49_mb_markdown_book_is_refused_with_the_text_limit(served: Served) -> None:
    chapter = f"# Chapter\n\n{PARAGRAPH}\n\n".encode()
    book = chapter * (49_000_000 // len(chapter))
    _check(served, lambda: _upload(served.client, "huge.md", book), "huge.md", f"{len(book):,} characters",
           f"at most {LIMITS.max_import_chars:,}", env_name("max_import_chars"))
    _check(served, lambda: _upload(served.client, "larger.md", b"x" * (LIMITS.max_import_bytes + 1)),
           "larger.md", "larger than 50 MB", env_name("max_import_bytes"))


def test_an_import_stops_when_its_client_goes_away(served: Served) -> None:
    """A 1.8 MB book (seconds of splitting, its progress readable by its owner alone) sent on a raw socket that
    closes once the splitting is under way: the import ends within a moment, costing under a CPU-second more, and
    no project is made."""
    book = "\n\n".join(f"# Chapter {i}\n\n" + "\n\n".join([PARAGRAPH] * 20) for i in range(200)).encode()
    request = served.client.build_request("POST", "/v1/longform/projects/upload",
                                          data={"voice": "Narrator", "import_id": "abandoned-book"},
                                          files={"file": ("abandoned.md", book, "text/markdown")})
    head = f"POST {request.url.raw_path.decode()} HTTP/1.1\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in request.headers.items()) + "\r\n"
    before = len(served.client.get("/v1/longform/projects").json())
    progress = "/v1/longform/imports/abandoned-book"
    seen: dict = {}

    def splitting() -> bool:
        answer = served.client.get(progress)
        seen.update(answer.json() if answer.status_code == 200 else {})
        return seen.get("stage") == "splitting" and seen["done"] > 0

    with socket.create_connection(("127.0.0.1", served.server.port)) as sock:
        sock.sendall(head.encode() + request.read())
        until(splitting, 60, "the import's first progress")
        assert seen["total"] > seen["done"]
        with httpx.Client(base_url=served.server.url, headers=B, timeout=60) as b:
            assert b.get(progress).status_code == 404  # another owner's import is not found
    gone = served.server.cpu_seconds()
    until(lambda: served.client.get(progress).status_code == 404, 20, "the import's end once its client left")
    assert served.server.cpu_seconds() - gone < 1.0  # an import left running goes on for seconds
    assert len(served.client.get("/v1/longform/projects").json()) == before


def test_another_owners_unsaved_upload_is_not_found_in_a_project(served: Served) -> None:
    with httpx.Client(base_url=served.server.url, headers=B, timeout=60) as b:
        assert b.get(f"/v1/voices/{served.upload}").status_code == 404  # the direct read
        _refused(b.post("/v1/longform/projects", json={"text": "Hi there.", "voice": served.upload}),
                 served.upload, status=404)
        _refused(b.post("/v1/longform/projects", json={"text": "X: Hi there.", "kind": "dialogue",
                                                       "speakers": {"X": served.upload}}), status=404)
        _refused(_upload(b, "mine.md", b"Hi there.", voice=served.upload), status=404)
        mine = b.post("/v1/longform/projects", json={"text": "Hi there.", "voice": "Narrator"})
        assert mine.status_code == 201
        project, segment = mine.json()["id"], mine.json()["segments"][0]["id"]
        _refused(b.patch(f"/v1/longform/projects/{project}/segments/{segment}", json={"voice": served.upload}),
                 status=404)
    own = served.client.post("/v1/longform/projects", json={"text": "Hi there.", "voice": served.upload})
    assert own.status_code == 201, own.text  # its owner may


def _batch(client: httpx.Client, rows: list[dict]) -> dict:
    started = client.post("/workbench/api/batches", json={"rows": rows})
    assert started.status_code == 202, started.text
    status: dict = {}

    def finished() -> bool:
        status.update(client.get(f"/workbench/api/batches/{started.json()['id']}").json())
        return status["state"] not in ("queued", "running")

    until(finished, 120, "the batch's end")
    return status


def test_a_batch_row_naming_another_owners_upload_fails_as_an_unknown_voice(served: Served) -> None:
    rows = [{"text": "Hi there.", "voice": served.upload}]
    with httpx.Client(base_url=served.server.url, headers=B, timeout=60) as b:
        status = _batch(b, rows)
        assert (status["done"], status["failed"]) == (0, 1), status
        assert served.upload in status["errors"][0]["message"] and "unknown voice" in status["errors"][0]["message"]
        assert b.get("/workbench/api/takes").json()["takes"] == []
    status = _batch(served.client, rows)
    assert (status["done"], status["failed"]) == (1, 0), status  # its owner's batch speaks with it


def test_dialogue_scripts_are_bounded_in_turns_and_speakers(served: Served) -> None:
    def dialogue(text: str, **extra: object):
        return lambda: served.client.post("/v1/longform/projects", json={"text": text, "kind": "dialogue",
                                                                          "voice": "Narrator", **extra})

    many = "\n".join(f"Speaker{i % 5000}: Hello there, how are you?" for i in range(20000))
    _check(served, dialogue(many), f"line {LIMITS.max_dialogue_speakers + 1}",
           f"more than {LIMITS.max_dialogue_speakers} speakers", env_name("max_dialogue_speakers"))
    long = "\n".join(f"{'Ann' if i % 2 else 'Bob'}: Hello there." for i in range(20000))
    _check(served, dialogue(long), f"more than {LIMITS.max_dialogue_turns:,} turns", env_name("max_dialogue_turns"))
    labels = {f"S{i}": "Narrator" for i in range(LIMITS.max_dialogue_speakers + 1)}
    _check(served, dialogue("S1: Hi.", speakers=labels), env_name("max_dialogue_speakers"))
    _check(served, lambda: _upload(served.client, "play.txt", b"S1: Hi.", kind="dialogue", speakers='["Narrator"]'),
           "speakers must map")
    _check(served, lambda: _upload(served.client, "play.txt", b"S1: Hi.", kind="dialogue", speakers="[" * 100_000),
           "speakers must be a JSON object")  # a form field, which no body bound looks inside


def test_the_server_answers_afterwards_and_nothing_was_lost(served: Served) -> None:
    client = served.client
    assert client.get("/health").status_code == 200
    kept = client.get(f"/v1/longform/projects/{served.project['id']}")
    assert kept.status_code == 200
    assert [s["text"] for s in kept.json()["segments"]] == [s["text"] for s in served.project["segments"]]
    book = _upload(client, "fine.md", f"# One\n\n{PARAGRAPH}\n\n# Two\n\n{PARAGRAPH}".encode(), import_id="fine-book")
    assert book.status_code == 201, book.text
    assert client.get("/v1/longform/imports/fine-book").status_code == 404  # ended with its answer
    _refused(_upload(client, "fine.md", b"Hi.", import_id="../x"), "import_id")
    assert [s["chapter"] for s in book.json()["segments"] if s["chapter"]] == ["One", "Two"]
    assert json.loads(client.get("/v1/voices").text)["data"][0]["name"] == "Narrator"


@pytest.mark.parametrize(("path", "body"), [
    ("/workbench/api/tests", b'{"kind": "mos", "items": [' + b",".join([b'{"takes": ["t"]}'] * 1_500_000) + b"]}"),
    ("/v1/longform/projects", b'{"text": "A: Hi.", "kind": "dialogue", "speakers": {'
     + b",".join(b'"%d": 1' % i for i in range(2_000_000)) + b"}}"),
    ("/workbench/api/batches", b'{"rows": [' + b",".join([b'{"text": "a"}'] * 2_000_000) + b"]}"),
], ids=["test-items", "dialogue-speakers", "batch-rows"])
def test_a_json_body_of_millions_of_values_is_refused_before_it_is_parsed(served: Served, path: str,
                                                                          body: bytes) -> None:
    """A 20 MB body of small values (each a Python object once parsed: 1.4 GB for 65 MB, and 8 GB when pydantic
    failed each of 6 million speakers) is refused while it is read, naming the bound."""
    limit = ServerSettings().max_json_values
    _check(served, lambda: served.client.post(path, content=body, headers={"content-type": "application/json"}),
           f"more than {limit:,} JSON values", env_name("max_json_values"))
