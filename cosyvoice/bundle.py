"""Finding, checking and loading a Fun-CosyVoice3 model directory ("bundle").

A bundle is the official release layout: ``cosyvoice3.yaml``, three ``torch.save`` state dicts, two ONNX
frontend models and the Qwen2 tokenizer folder ``CosyVoice-BlankEN``. Downloads are large and partial copies
are common, so :func:`validate_model_dir` inspects every file cheaply (zip directory, pickle framing, protobuf
framing; no tensor data is read) and reports *all* problems in one error, each with its fix, before anything
slow happens. The yaml is only ever read as data (:mod:`cosyvoice.config`), never executed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickletools
import re
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from cosyvoice.config import CosyVoice3Config, load_config
from cosyvoice.errors import ConfigError, ModelBundleError, WeightsError
from cosyvoice.flow import CausalMaskedDiffWithDiT
from cosyvoice.hifigan import CausalHiFTGenerator, rename_hift_key
from cosyvoice.llm import ENDOFPROMPT_ID, CosyVoice3LM
from cosyvoice.rng import SineGenRecipe, cfm_noise
from cosyvoice.weights import load_module, load_weights

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "FunAudioLLM/Fun-CosyVoice3-0.5B-2512"
MODEL_IN_REPO = "pretrained_models/Fun-CosyVoice3-0.5B"  # where the official folder goes in a clone
REPO = Path(__file__).resolve().parents[1]  # defaults resolve from the repository, not the working directory
DEFAULT_MODEL_DIR = REPO / MODEL_IN_REPO
DEMO_MODEL_DIR = REPO / "pretrained_models" / ".tiny-demo"
DEMO_WARNING = (f"DEMO MODE: no model was found at {MODEL_IN_REPO}, so a tiny RANDOMLY INITIALISED model runs "
                "instead, which produces noise-like audio, not speech. For real speech, download the model with "
                f"`modelscope download --model {DEFAULT_MODEL_ID} --local_dir {MODEL_IN_REPO}` (.venv/bin/pip "
                "install -e '.[download]' in the repository) and restart, or start with --model-dir DIR.")
TOKENIZER_DIR = "CosyVoice-BlankEN"
CHECKPOINTS = ("llm.pt", "flow.pt", "hift.pt")
# ONNX file -> number of graph inputs the frontend feeds it (README of the golden set, section 2).
ONNX_INPUTS = {"campplus.onnx": 1, "speech_tokenizer_v3.onnx": 2}
TOKENIZER_FILES = tuple(f"{TOKENIZER_DIR}/{name}"
                        for name in ("config.json", "vocab.json", "merges.txt", "tokenizer_config.json"))
REQUIRED_FILES = ("cosyvoice3.yaml", *CHECKPOINTS, *ONNX_INPUTS, *TOKENIZER_FILES)

_MODEL_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


_DIGESTS: dict[tuple, str] = {}  # (folder, each file's size and mtime) -> digest: hashed once per process
_DIGEST_LOCK = threading.Lock()


def bundle_digest(model_dir: str | Path) -> str:
    """The SHA-256 of every file the model is loaded from (names and whole contents): what a take's provenance
    records as the model, so two takes agree on it only if the same weights made them. A few seconds for a
    real bundle, then remembered while no file's size or modification time changes."""
    root = Path(model_dir).resolve()
    stats = tuple((name, s.st_size, s.st_mtime_ns) for name in REQUIRED_FILES
                  if (p := root / name).is_file() and (s := p.stat()))
    key = (str(root), stats)
    with _DIGEST_LOCK:  # one hashing at a time: concurrent first takes wait for it instead of repeating it
        if key not in _DIGESTS:
            digest = hashlib.sha256()
            for name, size, _ in stats:
                digest.update(f"{name}\0{size}\0".encode())
                with open(root / name, "rb") as f:
                    digest.update(hashlib.file_digest(f, "sha256").digest())
            _DIGESTS[key] = digest.hexdigest()
        return _DIGESTS[key]


def _download_hint(root: Path) -> str:
    return (f"download the model with `modelscope download --model {DEFAULT_MODEL_ID} --local_dir {root}` "
            f"(or pass the id {DEFAULT_MODEL_ID!r} instead of a directory)")


def _missing(root: Path) -> ModelBundleError:
    return ModelBundleError(f"model directory {root} does not exist; {_download_hint(root)}")


# ----------------------------------------------------------------------------- locating a bundle


def resolve_model_dir(model_dir_or_id: str | Path, download_root: str | Path = "pretrained_models") -> Path:
    """Return a local model directory: an existing directory as is, a ModelScope id downloaded first.

    Ids (``owner/name``) go to ``download_root/name``, the layout the official recipes use. A directory there
    that already holds every required file is reused without touching the network, so offline hosts work.
    """
    path = Path(model_dir_or_id).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelBundleError(f"{path} is a file; pass a model directory or a ModelScope id such as "
                               f"{DEFAULT_MODEL_ID!r}")
    model_id = str(model_dir_or_id)
    # owner/name is an id, unless the owner is a folder here or the download folder (the default
    # pretrained_models/Fun-CosyVoice3-0.5B is a path that looks like an id)
    if not _MODEL_ID_RE.match(model_id) or path.parent.is_dir() or path.parts[0] == Path(download_root).name:
        raise _missing(path)
    local_dir = Path(download_root).expanduser() / model_id.split("/")[1]
    if all((local_dir / name).is_file() for name in REQUIRED_FILES):
        return local_dir
    try:
        from modelscope import snapshot_download  # optional dependency, only needed for downloads
    except ImportError as exc:
        raise ModelBundleError(f"{model_id!r} is a ModelScope id but the `modelscope` package is not installed: "
                               f"`pip install modelscope`, or download the model yourself and pass its local "
                               f"directory") from exc
    try:
        downloaded = snapshot_download(model_id, local_dir=str(local_dir))
    except Exception as exc:  # modelscope surfaces network, HTTP and not-found failures with many exception types
        raise ModelBundleError(f"downloading {model_id!r} from ModelScope into {local_dir} failed "
                               f"({type(exc).__name__}: {exc}); check the id and your network connection, or "
                               f"download the model elsewhere and pass its local directory") from exc
    return Path(downloaded) if downloaded else local_dir


# ----------------------------------------------------------------------------- cheap integrity checks


def _check_checkpoint(path: Path) -> str | None:
    """A ``torch.save`` file is a zip holding ``<name>/data.pkl`` plus one record per storage.

    Truncated downloads lose the zip's central directory (at the end of the file), so opening the archive and
    checking each record's extent against the file size catches them without reading any tensor data.
    """
    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            pickles = [info for info in infos if info.filename.endswith("/data.pkl")]
            if len(pickles) != 1:
                return f"{path.name} is not a torch.save checkpoint (no data.pkl record)"
            short = [info.filename for info in infos if info.header_offset + info.compress_size > size]
            if short:
                return f"{path.name} is truncated (record {short[0]} runs past the end of the file)"
            for _ in pickletools.genops(archive.read(pickles[0])):
                pass  # walks the opcodes without executing them; raises on a damaged pickle
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        return f"{path.name} is truncated or not a torch.save checkpoint ({type(exc).__name__}: {exc})"
    except ValueError as exc:
        return f"{path.name} has a damaged data.pkl ({exc})"
    return None


class _ProtobufError(Exception):
    pass


def _read_varint(stream: BinaryIO) -> int:
    value, shift = 0, 0
    while True:
        byte = stream.read(1)
        if not byte:
            raise _ProtobufError("ends inside a varint")
        value |= (byte[0] & 0x7F) << shift
        if byte[0] < 0x80:
            return value
        shift += 7
        if shift > 63:
            raise _ProtobufError("varint longer than 10 bytes")


def _fields(stream: BinaryIO, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """Walk the protobuf message in ``stream[start:end]`` by its wire format, seeking over payloads.

    Yields ``(field number, payload offset, payload length)`` for length-delimited fields and
    ``(field number, -1, value)`` for varints. Leaves the stream positioned after the field it yielded,
    so callers may read the payload in between.
    """
    position = start
    while position < end:
        stream.seek(position)
        key = _read_varint(stream)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise _ProtobufError("field number 0")
        if wire_type == 0:
            item = (number, -1, _read_varint(stream))
            position = stream.tell()
        elif wire_type == 2:
            length = _read_varint(stream)
            item = (number, stream.tell(), length)
            position = stream.tell() + length
        elif wire_type in (1, 5):
            item = None
            position = stream.tell() + (8 if wire_type == 1 else 4)
        else:
            raise _ProtobufError(f"unsupported wire type {wire_type}")
        if position > end:
            raise _ProtobufError("a field runs past the end of its message (file truncated?)")
        if item is not None:
            yield item


def _string_field(stream: BinaryIO, start: int, length: int, number: int) -> str:
    for field, offset, size in _fields(stream, start, start + length):
        if field == number and offset >= 0:
            stream.seek(offset)
            return stream.read(size).decode("utf-8", errors="replace")
    return ""


def _onnx_graph_inputs(path: Path) -> list[str]:
    """Names of an ONNX model's real graph inputs (initializers excluded), read from the protobuf framing only."""
    end = path.stat().st_size
    with path.open("rb") as stream:
        graph = [(offset, size) for number, offset, size in _fields(stream, 0, end) if number == 7 and offset >= 0]
        if len(graph) != 1:
            raise _ProtobufError("no graph")
        start, length = graph[0]
        inputs, initializers = [], set()
        for number, offset, size in list(_fields(stream, start, start + length)):
            if number == 11:  # GraphProto.input (ValueInfoProto, name = field 1)
                inputs.append(_string_field(stream, offset, size, 1))
            elif number == 5:  # GraphProto.initializer (TensorProto, name = field 8)
                initializers.add(_string_field(stream, offset, size, 8))
    return [name for name in inputs if name not in initializers]


def _check_onnx(path: Path, expected_inputs: int) -> str | None:
    try:
        inputs = _onnx_graph_inputs(path)
    except (_ProtobufError, OSError) as exc:
        return f"{path.name} is truncated or not an ONNX model ({exc})"
    if len(inputs) != expected_inputs:
        return (f"{path.name} has {len(inputs)} graph inputs {inputs}, the frontend feeds it {expected_inputs}; "
                f"it is not the model this file name stands for")
    return None


def _check_json_object(path: Path, name: str) -> str | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{name} is not valid JSON ({exc})"
    if not isinstance(value, dict):
        return f"{name} must hold a JSON object"
    if path.name == "vocab.json" and not all(isinstance(i, int) for i in value.values()):
        return f"{name} must map token strings to integer ids"
    return None


def _check_merges(path: Path, name: str) -> str | None:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return f"{name} is unreadable ({exc})"
    merges = [line for line in lines if line and not line.startswith("#version")]
    if not merges:
        return f"{name} holds no BPE merges"
    bad = [line for line in merges if len(line.split(" ")) != 2]
    if bad:
        return f"{name} must hold 'left right' BPE merges, one per line (bad line: {bad[0]!r})"
    return None


def _check_file(path: Path, name: str) -> tuple[type[ModelBundleError], str | None]:
    """Run the cheap integrity check that fits the file's kind; the yaml is checked by :func:`load_config`."""
    if name in CHECKPOINTS:
        return WeightsError, _check_checkpoint(path)
    if name in ONNX_INPUTS:
        return ModelBundleError, _check_onnx(path, ONNX_INPUTS[name])
    if name.endswith(".json"):
        kind = ConfigError if name == f"{TOKENIZER_DIR}/config.json" else ModelBundleError
        return kind, _check_json_object(path, name)
    if name.endswith("merges.txt"):
        return ModelBundleError, _check_merges(path, name)
    return ModelBundleError, None


# ----------------------------------------------------------------------------- the bundle


@dataclass(frozen=True)
class ModelBundle:
    """A validated model directory: where each file is, the typed config, and strict module loaders."""

    root: Path
    config: CosyVoice3Config

    @property
    def llm_path(self) -> Path:
        return self.root / "llm.pt"

    @property
    def flow_path(self) -> Path:
        return self.root / "flow.pt"

    @property
    def hift_path(self) -> Path:
        return self.root / "hift.pt"

    @property
    def campplus_path(self) -> Path:
        return self.root / "campplus.onnx"

    @property
    def speech_tokenizer_path(self) -> Path:
        return self.root / "speech_tokenizer_v3.onnx"

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / TOKENIZER_DIR

    def load_llm(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 endofprompt_id: int = ENDOFPROMPT_ID) -> CosyVoice3LM:
        """``CosyVoice3LM`` built from the yaml with llm.pt loaded strictly, in eval mode; ``endofprompt_id``: the
        id of ``<|endofprompt|>`` in this bundle's tokenizer (the released one's by default)."""
        module = load_module(lambda: CosyVoice3LM(self.config.llm, endofprompt_id), self.llm_path)
        return module.to(device=device, dtype=dtype).eval()

    def load_flow(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
                  ) -> CausalMaskedDiffWithDiT:
        """``CausalMaskedDiffWithDiT`` built from the yaml with flow.pt loaded strictly, in eval mode, in torch
        (:func:`cosyvoice.backends.attach_flow` runs its DiT on another backend)."""
        noise = cfm_noise()  # made here: a module built on the meta device would hold none
        module = load_module(lambda: CausalMaskedDiffWithDiT(self.config.flow, noise), self.flow_path)
        return module.to(device=device, dtype=dtype).eval()

    def load_hift(self, device: torch.device | str = "cpu") -> CausalHiFTGenerator:
        """``CausalHiFTGenerator`` built from the yaml with hift.pt loaded strictly, in eval mode, float32.

        Keys are normalised first as the official loader allows: no ``generator.`` prefix (HiFiGan training
        checkpoints) and legacy ``weight_g``/``weight_v`` weight-norm names. The vocoder stays float32 (its
        F0 predictor float64) whatever the other modules run in: half precision audibly moves its phases.
        """
        # the official SineGen noise depends on draws made while the flow is built, so it needs the whole config
        module = CausalHiFTGenerator(self.config.hift, SineGenRecipe.from_config(self.config))
        load_weights(module, self.hift_path, rename=rename_hift_key)
        return module.to(device=device).eval()


def validate_model_dir(model_dir: str | Path) -> ModelBundle:
    """Check every file of a model directory and read its config; raise one error listing every problem.

    The error is a :class:`ConfigError` or :class:`WeightsError` when all problems are of that kind,
    otherwise a :class:`ModelBundleError` (their common base class).
    """
    root = Path(model_dir).expanduser()
    if not root.is_dir():
        raise _missing(root)
    hint = _download_hint(root)
    problems: list[tuple[type[ModelBundleError], str]] = []
    usable = set()
    for name in REQUIRED_FILES:
        path = root / name
        if not path.is_file():
            problems.append((ModelBundleError, f"{name} missing in {root}: {hint}"))
        elif path.stat().st_size == 0:
            problems.append((ModelBundleError, f"{name} is empty in {root} (interrupted download?): {hint}"))
        else:
            kind, problem = _check_file(path, name)
            if problem is None:
                usable.add(name)
            else:
                problems.append((kind, f"{problem}; {hint}"))

    config = None
    if {"cosyvoice3.yaml", f"{TOKENIZER_DIR}/config.json"} <= usable:
        try:
            config = load_config(root)
        except ConfigError as exc:
            problems.append((ConfigError, str(exc)))

    if problems:
        kinds = {kind for kind, _ in problems}
        error = kinds.pop() if len(kinds) == 1 else ModelBundleError
        listed = "\n".join(f"  - {message}" for _, message in problems)
        raise error(f"model directory {root} has {len(problems)} problem(s):\n{listed}")
    assert config is not None
    return ModelBundle(root=root, config=config)


def open_model_dir(model_dir_or_id: str | Path, download_root: str | Path = "pretrained_models") -> ModelBundle:
    """:func:`resolve_model_dir` then :func:`validate_model_dir`: the one call a service makes at start-up."""
    return validate_model_dir(resolve_model_dir(model_dir_or_id, download_root))
