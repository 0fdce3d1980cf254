"""A checkpoint folder's manifest: the size and BLAKE2b hash of every file a save wrote, checked before a resume
reads (unpickles) any of them.

A save writes the manifest (``cfp_manifest.json``) last, through a temporary name and ``os.replace``, once every rank
has finished writing; the folder is only then made current (renamed and named in the pointer file). A resume verifies
it before anything in the folder is opened by Megatron, torch DCP or DeepSpeed, and raises one
:class:`~cfp_megatron.base.errors.CheckpointError` naming the first file that is missing, truncated, changed or not
written by the save. What it protects against is in ``docs/checkpoints.md``: accidental corruption and changes after
the save, not a writer who rewrites the manifest too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.base.files import fsync_dir, write_atomic

MANIFEST = "cfp_manifest.json"
"""Name of the manifest inside a checkpoint folder."""
FORMAT = 1
"""Version of the manifest's layout."""
HASH = "blake2b-128"
"""The hash: BLAKE2b with a 16-byte digest (hashlib; ~1 GB/s per core, computed on several threads)."""
_CHUNK = 8 << 20
_PICKLES = (".metadata", ".pt", ".pth", ".pkl", ".pickle", ".bin")


@dataclass(frozen=True)
class FileEntry:
    """One file a save wrote."""

    size: int
    """Its size in bytes."""
    digest: str
    """Its BLAKE2b-128 hash, hex."""


def _files(folder: Path) -> Iterator[str]:
    """Relative POSIX paths of the regular files (and links) under ``folder``, the manifest and its temp excluded."""
    for path in sorted(folder.rglob("*")):
        if path.is_dir() and not path.is_symlink():
            continue
        rel = path.relative_to(folder).as_posix()
        if rel not in (MANIFEST, MANIFEST + ".tmp"):
            yield rel


def file_digest(path: Path) -> str:
    """BLAKE2b-128 of the file at ``path`` (read in 8 MiB chunks; hashlib releases the GIL, so threads overlap)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _digests(folder: Path, names: list[str]) -> dict[str, str]:
    workers = max(1, min(8, os.cpu_count() or 1, len(names)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, pool.map(lambda n: file_digest(folder / n), names), strict=True))


def write_manifest(folder: Path, record: dict[str, Any] | None = None) -> Path:
    """Hash every file under ``folder`` and write the manifest there (temp file, fsync, ``os.replace``), with
    ``record`` (:data:`RECORD_KEYS`: what was saved, and by which job); call it on one rank after every rank
    finished writing, before the folder is made current."""
    names = list(_files(folder))
    digests = _digests(folder, names)
    files = {n: {"size": (folder / n).stat().st_size, "digest": digests[n]} for n in names}
    extra = {k: v for k, v in (record or {}).items() if k in RECORD_KEYS and v is not None}
    write_atomic(folder / MANIFEST, json.dumps({"format": FORMAT, "hash": HASH, "files": files, **extra}, indent=1,
                                               sort_keys=True), key="train.checkpoint_dir", sync=True)
    return folder / MANIFEST


RECORD_KEYS = ("model", "layout", "writer")
"""What a manifest records besides its files: the model (its ModelSpec as plain JSON), the layout it was saved
under, and the token of the job's folder lock (:mod:`.checkpoint_lock`) that wrote it."""


def read_record(folder: Path) -> dict[str, Any]:
    """The :data:`RECORD_KEYS` the manifest in ``folder`` holds (empty when it has none, or cannot be read: the
    verification reports that)."""
    try:
        raw = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return {k: raw[k] for k in RECORD_KEYS if k in raw} if isinstance(raw, dict) else {}


SAVE_FAULT_ENV = "CFP_SAVE_FAULT"
"""Fault-drill hook: ``<phase>:<folder name>`` (``manifest:iter_0000004``) SIGKILLs the publishing rank inside that
save, in a torchrun job's first attempt only: ``manifest`` (every rank's files written, no manifest yet), ``rename``
(manifest written, folder not renamed) or ``pointer`` (renamed, pointer not updated)."""


def _fault_point(phase: str, final: Path) -> None:
    if (os.environ.get(SAVE_FAULT_ENV) == f"{phase}:{final.name}"
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        os.kill(os.getpid(), signal.SIGKILL)


def publish(partial: Path, final: Path, pointer: Path, text: str, record: dict[str, Any] | None = None) -> None:
    """Make the save in ``partial`` the newest complete checkpoint (rank 0, after every rank wrote its part): its
    manifest (with ``record``), then the rename of the folder to ``final``, then ``text`` written into the
    ``pointer`` file (``latest``) through a temporary file and a rename, each synced to disk; a kill at any point
    leaves the previous checkpoint and its pointer as they were. A ``final`` already there is replaced only when
    this job wrote it (its manifest's ``writer`` is ``record``'s: a save killed before its pointer was updated);
    any other is a CheckpointError, and stays."""
    writer = (record or {}).get("writer")
    if final.exists() and (writer is None or read_record(final).get("writer") != writer):
        raise CheckpointError(f"{final} is already there and was not written by this job: a save never replaces a "
                              f"step folder another run wrote, and nothing was published. Fix: move {final} away, "
                              "or choose another train.checkpoint_dir.")
    _fault_point("manifest", final)
    write_manifest(partial, record)
    _fault_point("rename", final)
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    fsync_dir(final.parent)
    _fault_point("pointer", final)
    write_atomic(pointer, text, key="train.checkpoint_dir", sync=True)


def read_manifest(folder: Path, fix: str) -> dict[str, FileEntry] | None:
    """The manifest's entries, or ``None`` when the folder has none; a CheckpointError when it cannot be read."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT or raw.get("hash") != HASH:
            raise ValueError(f"format {raw.get('format')!r} / hash {raw.get('hash')!r}, expected {FORMAT} / {HASH}")
        return {str(k): FileEntry(size=int(v["size"]), digest=str(v["digest"])) for k, v in raw["files"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{path} cannot be read ({err}): the checkpoint cannot be verified. {fix}") from None


def verify(folder: Path, *, trust_unverified: bool, fix: str) -> bool:
    """Check ``folder`` against its manifest before anything in it is loaded; raise one CheckpointError naming the
    first file that differs, is missing, truncated or extra, ending with ``fix``. A folder without a manifest (a
    save by an older version, or not by cfp) is refused unless ``trust_unverified``; returns whether it was
    verified."""
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} is missing. {fix}")
    entries = read_manifest(folder, fix)
    if entries is None:
        if trust_unverified:
            return False
        raise CheckpointError(
            f"{folder} has no {MANIFEST} (written by an older version, by another tool, or its save never "
            "finished), so its files cannot be checked before they are unpickled. Fix: if you or your own job "
            "wrote this folder, set train.trust_unverified_checkpoint=true to load it once (the next save writes a "
            f"manifest); otherwise: {fix}")
    for name, entry in entries.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (the save wrote it: {entry.size} bytes). {fix}")
        size = path.stat().st_size
        if size != entry.size:
            what = "truncated" if size < entry.size else "longer than saved"
            raise CheckpointError(f"{path} is {what}: {size} bytes, the save wrote {entry.size}. {fix}")
    extra = [n for n in _files(folder) if n not in entries]
    if extra:
        kind = " (a pickle-format file: loading it could run code)" if extra[0].endswith(_PICKLES) else ""
        raise CheckpointError(f"{folder / extra[0]} was not written by the save{kind}; "
                              f"{len(extra)} unexpected file(s) in all. {fix}")
    names = list(entries)
    for name, digest in _digests(folder, names).items():
        if digest != entries[name].digest:
            raise CheckpointError(f"{folder / name} differs from what the save wrote (same size, different "
                                  f"content: {HASH} {digest} != {entries[name].digest}). {fix}")
    return True
