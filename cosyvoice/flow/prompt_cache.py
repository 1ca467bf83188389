"""The flow's per-voice work done once per voice: :class:`~cosyvoice.flow.model.VoicePrefix`, in memory and on disk.

Why: a streamed request's first DiT call used to run every Euler step over the whole prompt again (~150 frames
for a 3 s prompt), which on a CPU is most of the time to first audio. Under the chunk-causal mask the prompt's
whole chunks before the look-ahead's reach depend only on the voice, the fixed noise and the step grid
(:meth:`~cosyvoice.flow.model.CausalMaskedDiffWithDiT.voice_frames`), so their keys/values are computed once per
voice and every later request's DiT runs over its new frames only, with the same mel up to float rounding.

The key is a SHA-256 over everything the prefix is a function of: the model digest (``bundle.bundle_digest``: every
file the model is loaded from), the flow's numerics (device type, parameter dtypes, module classes, so bf16 and
int8 weights never share an entry with fp32, and an accelerated runner), the step count, the prefix length, the
voice's tensors (flow prompt tokens, prompt mel, speaker embedding) and the fixed noise columns it starts from. An
entry made under anything else is never used; it ages out of the bounds.

Memory: least recently used entries go beyond ``max_bytes``. Disk (optional, :meth:`PromptCache.persist`): one
safetensors file per key in a folder (the voice library's), written atomically off the synthesis thread, the least
recently used files removed beyond ``max_disk_bytes``; several processes may share the folder. A disk failure
costs only the caching (logged once).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save
from torch import Tensor

from cosyvoice.flow.dit_cache import DiTCache
from cosyvoice.flow.model import CausalMaskedDiffWithDiT, FlowStream, VoicePrefix
from cosyvoice.system.fs import atomic_write

logger = logging.getLogger(__name__)

FORMAT = "cosyvoice3-voice-prefix/1"
SUFFIX = ".safetensors"
FOLDER = "prompt-cache"  # the service's disk tier: this sub-folder of the voice library's folder


def flow_signature(flow: CausalMaskedDiffWithDiT) -> str:
    """What besides the weights decides the flow's numbers: device type, dtypes, module classes, runner."""
    dtypes = sorted({str(t.dtype) for t in (*flow.parameters(), *flow.buffers())})
    classes = sorted({f"{type(m).__module__}.{type(m).__qualname__}" for m in flow.modules()})
    runner = flow.decoder.estimator.runner
    return "|".join((flow.input_embedding.weight.device.type, *dtypes, *classes, type(runner).__qualname__))


class PromptCache:
    """Voice prefixes by key, bounded in memory (``max_bytes``) and, once :meth:`persist` names a folder, on disk.

    ``model_digest`` names the model's weights (called once, on the first use: it may hash the bundle). Used by
    the engine's token-to-wave thread; the counters (``hits``, ``disk_hits``, ``misses``) are for tests and the
    benchmark.
    """

    def __init__(self, max_bytes: int, model_digest: Callable[[], str] | None = None) -> None:
        self.max_bytes = max_bytes
        self._model_digest = model_digest
        self._digest: str | None = None
        self._memory: OrderedDict[str, VoicePrefix] = OrderedDict()
        self._lock = threading.Lock()
        self.folder: Path | None = None
        self.max_disk_bytes = 0
        self._writer: ThreadPoolExecutor | None = None
        self._writes: list[Future[None]] = []
        self._disk_failure: str | None = None
        self.hits = self.disk_hits = self.misses = 0

    def persist(self, folder: str | Path, max_disk_bytes: int) -> None:
        """Also keep prefixes in ``folder`` (created if missing), at most ``max_disk_bytes`` of them."""
        if max_disk_bytes <= 0 or self.folder == Path(folder):
            return
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning("prompt cache: cannot use %s (%s); voice prefixes stay in memory", folder, exc)
            return
        if self._writer is not None:  # another folder now: what was handed to the old one is written first
            self.flush()
            self._writer.shutdown()
        self.folder, self.max_disk_bytes = Path(folder), max_disk_bytes
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cosyvoice-prompt-cache")

    @property
    def memory_bytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for p in self._memory.values())

    def stream(self, flow: CausalMaskedDiffWithDiT, prompt_token: Tensor, prompt_feat: Tensor, embedding: Tensor,
               steps: int | None = None) -> FlowStream:
        """A new :class:`FlowStream` of this voice, started from its prefix (computed now on a miss)."""
        stream = FlowStream(flow, prompt_token, prompt_feat, embedding, steps)
        length = flow.voice_frames(stream.prompt_token.shape[1], stream.prompt_feat.shape[1])
        if length == 0:
            return stream
        key = self.key(stream, length)
        prefix = self._recall(key) or self._read(key, stream, length)
        if prefix is None:
            self.misses += 1
            prefix = stream.voice_prefix()
            assert prefix is not None
            self._remember(key, prefix)
            self._write(key, prefix)
            return stream
        return FlowStream(flow, prompt_token, prompt_feat, embedding, stream.steps, prefix)

    def key(self, stream: FlowStream, length: int) -> str:
        """The hex SHA-256 naming ``stream``'s prefix of ``length`` frames (see the module docstring)."""
        if self._digest is None:
            self._digest = self._model_digest() if self._model_digest is not None else "unnamed model"
        flow = stream.flow
        digest = hashlib.sha256(f"{FORMAT}\0{self._digest}\0{flow_signature(flow)}\0{stream.steps}\0{length}\0"
                                f"{flow.decoder.cfg_rate}\0{flow.decoder.t_scheduler}\0".encode())
        for tensor in (stream.prompt_token, stream.prompt_feat, stream.embedding,
                       flow.decoder.noise[:, :, :length]):
            digest.update(f"{tensor.dtype}{list(tensor.shape)}\0".encode())
            digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def flush(self) -> None:
        """Wait until every prefix handed to the disk is written (tests; a clean shutdown)."""
        while self._writes:
            self._writes.pop(0).result()

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._writer.shutdown()

    # ------------------------------------------------------------------ memory

    def _recall(self, key: str) -> VoicePrefix | None:
        with self._lock:
            prefix = self._memory.get(key)
            if prefix is not None:
                self._memory.move_to_end(key)
                self.hits += 1
            return prefix

    def _remember(self, key: str, prefix: VoicePrefix) -> None:
        if prefix.nbytes > self.max_bytes:
            return
        with self._lock:
            self._memory[key] = prefix
            total = sum(p.nbytes for p in self._memory.values())
            while total > self.max_bytes:
                _, old = self._memory.popitem(last=False)
                total -= old.nbytes

    # ------------------------------------------------------------------ disk

    def _path(self, key: str) -> Path:
        assert self.folder is not None
        return self.folder / f"{key[:40]}{SUFFIX}"

    def _read(self, key: str, stream: FlowStream, length: int) -> VoicePrefix | None:
        """The prefix from disk (an unreadable or foreign file is removed: a miss)."""
        if self.folder is None:
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._failed("read", exc)
            return None
        try:
            prefix = _decode(data, key, stream, length)
        except (SafetensorError, ValueError, KeyError) as exc:
            logger.warning("prompt cache: dropping unreadable %s (%s: %s)", path.name, type(exc).__name__, exc)
            path.unlink(missing_ok=True)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # its last use, for the eviction order
        self.disk_hits += 1
        self._remember(key, prefix)
        return prefix

    def _write(self, key: str, prefix: VoicePrefix) -> None:
        if self._writer is None or prefix.nbytes > self.max_disk_bytes:
            return
        self._writes = [w for w in self._writes if not w.done()]
        self._writes.append(self._writer.submit(self._store, key, prefix))

    def _store(self, key: str, prefix: VoicePrefix) -> None:
        """Write one prefix atomically, then evict the least recently used files beyond the bound."""
        path = self._path(key)
        try:
            data = save({**_tensors(prefix), "key": _label(key)},
                        metadata={"format": FORMAT, "length": str(prefix.length), "steps": str(prefix.steps)})
            atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))
            self._evict(keep=path)
        except OSError as exc:
            self._failed("write", exc)

    def _evict(self, keep: Path) -> None:
        assert self.folder is not None
        files = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                try:
                    st = entry.stat()
                except FileNotFoundError:  # removed by another process sharing the folder
                    continue
                files.append((st.st_mtime, entry.name, st.st_size))
        total = sum(size for _, _, size in files)
        for _, name, size in sorted(files):
            if total <= self.max_disk_bytes:
                break
            if name != keep.name:
                (self.folder / name).unlink(missing_ok=True)
                total -= size

    def _failed(self, action: str, exc: OSError) -> None:
        """A disk failure costs the caching only; logged once per kind."""
        kind = f"{action}:{exc.errno}"
        if kind != self._disk_failure:
            logger.warning("prompt cache: cannot %s voice prefixes in %s (%s); they stay in memory", action,
                           self.folder, exc.strerror or exc)
        self._disk_failure = kind


def _label(key: str) -> Tensor:
    """The format and full key as bytes, stored in the file: a file is used only under the key it was made for."""
    return torch.tensor(list(f"{FORMAT}\0{key}".encode()), dtype=torch.uint8)


def _tensors(prefix: VoicePrefix) -> dict[str, Tensor]:
    tensors = {"mel": prefix.mel}
    for step, cache in enumerate(prefix.caches):
        tensors[f"{step}.tail0"], tensors[f"{step}.tail1"] = cache.conv_tails
        for block, (k, v) in enumerate(cache.kv):
            tensors[f"{step}.{block}.k"], tensors[f"{step}.{block}.v"] = k, v
    return {name: t.detach().cpu().contiguous() for name, t in tensors.items()}


def _decode(data: bytes, key: str, stream: FlowStream, length: int) -> VoicePrefix:
    """A written prefix back on the stream's device, checked against what the stream expects of it."""
    tensors = load(data)
    if not torch.equal(tensors["key"], _label(key)):
        raise ValueError("another format or key")
    device = stream.prompt_feat.device
    depth = len(stream.flow.decoder.estimator.transformer_blocks)
    caches = tuple(DiTCache(length, (tensors[f"{s}.tail0"].to(device), tensors[f"{s}.tail1"].to(device)),
                            [(tensors[f"{s}.{b}.k"].to(device), tensors[f"{s}.{b}.v"].to(device))
                             for b in range(depth)])
                   for s in range(stream.steps))
    mel = tensors["mel"].to(device)
    if mel.shape[2] != length or any(k.shape[2] != length for c in caches for k, _ in c.kv):
        raise ValueError(f"a prefix of another length than {length}")
    return VoicePrefix(length, stream.steps, caches, mel)

