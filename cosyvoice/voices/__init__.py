"""A persistent library of prompt voices, so that a recording is featurised once and then reused.

Featurising a prompt (speech tokenizer, speaker encoder, mel) is the slowest step of a zero-shot request
before the model itself runs, and people upload the same recording again and again. Entries are
content-addressed: the id hashes the decoded samples, their sample rate, the whitespace-normalised prompt
text and the model's identity, so re-encoding a recording to another format still hits, and another model
(other tokenizer or speaker encoder) never reuses features it did not make.

On disk, one folder per model identity holds ``<id>.safetensors`` (the tensors) and ``<id>.json`` (name,
transcript, creation time, who uploaded it and who saved it). The JSON is written last, so an entry exists once
its JSON does; its mtime is the last use. Unnamed entries are a cache: the least recently used go when there are
more than ``max_entries`` of them or they take more than ``max_bytes``. Named entries (saved voices) stay until
deleted. Each entry also keeps its prompt recording (16-bit, as decoded) so that a voice can be previewed and
exported.

The folder is the truth for every process that shares it (servers, web UI, the Python API): each process's index
is only a cache of it, re-read when the folder changes. Every change (store, name, rename, delete, eviction) is
made under an exclusive ``flock`` of ``<folder>/.lock`` after re-reading the folder, and every file is replaced
atomically. ``flock`` rather than O_EXCL name files: the kernel releases it when a process dies, even by
``kill -9``, so a crash never leaves a stale lock or a stale name claim behind. Hence names are unique across
processes, eviction never deletes a voice another process has named, and a delete removes the voice its key
names now. Names never look like ids (32 hex digits), so a key is never ambiguous.

Ownership: an unnamed upload is visible only to the owners that uploaded it (``owner`` strings, see
:class:`~cosyvoice.settings.VoicePolicy`; ``None`` is a local, unrestricted caller that sees everything). Named
voices are visible to everyone; who may rename, export or delete one is the library's ``policy``.

Caching is optional: when the disk is full or the folder turns read-only, a new upload is used without being
cached (logged once); saving a named voice then fails with :class:`~cosyvoice.errors.StorageError`. A folder
that is read-only from the start (voices baked into an image, a read-only mount) is served read-only: its saved
voices are listed and spoken with, uploads are used uncached, and every change is refused with
:class:`~cosyvoice.errors.ReadOnlyError` naming ``COSYVOICE_VOICE_DIR``. Tensors are
read into memory (never memory-mapped), so deleting a voice frees its space at once.

Built-in voices come from a read-only folder of ``<name>.wav`` + ``<name>.txt`` (its transcript), e.g. the
repository's ``assets/voices``; they are listed first, featurised on first use, and cannot be renamed or
deleted. An exported voice is one safetensors file holding the features, the transcript's token ids, the
recording and (as metadata) the name, transcript and model identity; importing it into a library of another
model recomputes the features from the recording, so the file stays portable across model releases.
"""

from cosyvoice.voices.entries import (
    BUILTIN_PREFIX,
    BUILTIN_VOICE_DIR,
    IDENTITY_FILES,
    MAX_NAME_CHARS,
    VoiceInfo,
    check_name,
    model_identity,
)
from cosyvoice.voices.library import VoiceLibrary
from cosyvoice.voices.portable import EXPORT_FORMAT, EXPORT_SUFFIX

__all__ = ["BUILTIN_PREFIX", "BUILTIN_VOICE_DIR", "EXPORT_FORMAT", "EXPORT_SUFFIX", "IDENTITY_FILES", "MAX_NAME_CHARS",
           "VoiceInfo", "VoiceLibrary", "check_name", "model_identity"]
