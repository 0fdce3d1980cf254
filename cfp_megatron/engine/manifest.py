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

import errno
import hashlib
import json
import os
import shutil
import signal
import stat
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.base.files import fsync_dir, json_loads_unique, read_regular, write_atomic

MANIFEST = "cfp_manifest.json"
"""Name of the manifest inside a checkpoint folder."""
FORMAT = 2
"""Version of the manifest's layout: 2 records the model (required) and the training state; 1 (written before)
has neither and still verifies."""
FORMATS = (1, 2)
"""The versions a resume reads."""
MANIFEST_LIMIT = 64 << 20
"""Most bytes a manifest holds (about 150 bytes per file: some 400,000 files)."""
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
    version = FORMAT if "model" in extra else 1  # without the model (tests, tools): the older layout's meaning
    write_atomic(folder / MANIFEST, json.dumps({"format": version, "hash": HASH, "files": files, **extra},
                                               indent=1, sort_keys=True), key="train.checkpoint_dir", sync=True)
    return folder / MANIFEST


RECORD_KEYS = ("model", "layout", "writer", "state")
"""What a manifest records besides its files: the model (its ModelSpec as plain JSON), the layout it was saved
under, the token of the job's folder lock (:mod:`.checkpoint_lock`) that wrote it, and the training state's form
(``state``: the settings a resume must keep, by setting name, e.g. ``train.precision``)."""
_RECORD_TYPES: dict[str, tuple[type, str]] = {"model": (dict, "object"), "layout": (str, "string"),
                                              "writer": (str, "string"), "state": (dict, "object")}


class ManifestError(ValueError):
    """A manifest that cannot be read or is not one a save wrote (the reason is the message)."""


def _entry_problem(name: object, value: object) -> str | None:
    if not isinstance(name, str) or not name or "\0" in name or name.startswith("/") \
            or any(part in ("", ".", "..") for part in name.split("/")):
        return f"the file name {name!r} is not a path inside the folder"
    if not isinstance(value, dict):
        return f"the entry of {name!r} is {value!r}, not an object"
    size, digest = value.get("size"), value.get("digest")
    if type(size) is not int or size < 0:
        return f"the size of {name!r} is {size!r}, not a byte count"
    if not isinstance(digest, str) or len(digest) != 32 or any(c not in "0123456789abcdef" for c in digest):
        return f"the digest of {name!r} is {digest!r}, not a {HASH} hex digest"
    return None


def _load(folder: Path) -> dict[str, Any] | None:
    """The manifest in ``folder`` as saved, every field checked (``None``: there is none); a :class:`ManifestError`
    saying why it is not one a save wrote (unreadable, not a regular file, duplicate keys, a field of the wrong
    type, a file name outside the folder, a format-2 manifest without its model)."""
    path = folder / MANIFEST
    try:
        data = read_regular(path, MANIFEST_LIMIT)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ManifestError((err.strerror or str(err)).rstrip(".")) from None
    try:
        raw = json_loads_unique(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise ManifestError(str(err)) from None
    if not isinstance(raw, dict):
        raise ManifestError(f"it holds a JSON {type(raw).__name__}, not an object")
    version, hashed = raw.get("format"), raw.get("hash")
    if type(version) is not int or version not in FORMATS or hashed != HASH:
        raise ManifestError(f"format {version!r} / hash {hashed!r}, expected one of {list(FORMATS)} / {HASH}")
    files = raw.get("files")
    if not isinstance(files, dict):
        raise ManifestError(f"its 'files' is {files!r:.60}, not an object")
    for name, value in files.items():
        if (problem := _entry_problem(name, value)) is not None:
            raise ManifestError(problem)
    for key, (kind, name) in _RECORD_TYPES.items():
        if key in raw and not isinstance(raw[key], kind):
            raise ManifestError(f"its {key!r} is {raw[key]!r:.60}, not a JSON {name}")
    if version >= 2 and "model" not in raw:
        raise ManifestError(f"a format-{version} manifest records the model, and this one has none")
    return raw


def read_record(folder: Path) -> dict[str, Any]:
    """The :data:`RECORD_KEYS` the manifest in ``folder`` holds (empty when it has none, or cannot be read: the
    verification reports that)."""
    try:
        raw = _load(folder)
    except ManifestError:
        return {}
    return {k: raw[k] for k in RECORD_KEYS if k in raw} if raw is not None else {}


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
    """The manifest's entries, or ``None`` when the folder has none; a CheckpointError when it cannot be read or
    is not one a save wrote (:func:`_load`)."""
    try:
        raw = _load(folder)
    except ManifestError as err:
        raise CheckpointError(f"{folder / MANIFEST} cannot be read ({err}): the checkpoint cannot be verified. "
                              f"{fix}") from None
    if raw is None:
        return None
    return {k: FileEntry(size=v["size"], digest=v["digest"]) for k, v in raw["files"].items()}


def verify(folder: Path, *, trust_unverified: bool, fix: str) -> bool:
    """Check ``folder`` against its manifest before anything in it is loaded; raise one CheckpointError naming the
    first file that differs, is missing, truncated or extra, ending with ``fix``. A folder without a manifest (a
    save by an older version, or not by cfp) is refused unless ``trust_unverified``; returns whether it was
    verified."""
    try:
        os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"checkpoint folder {folder} is missing. {fix}") from None
    except OSError as err:
        raise CheckpointError(f"checkpoint folder {folder} cannot be read ({err.strerror or err}). {fix}") from None
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
        try:
            info = path.lstat()
        except OSError as err:
            what = "missing" if err.errno in (errno.ENOENT, errno.ENOTDIR) else f"unreadable ({err.strerror})"
            raise CheckpointError(f"{path} is {what} (the save wrote it: {entry.size} bytes). {fix}") from None
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path} is not the file the save wrote (a folder, link or special file is "
                                  f"there). {fix}")
        size = info.st_size
        if size != entry.size:
            what = "truncated" if size < entry.size else "longer than saved"
            raise CheckpointError(f"{path} is {what}: {size} bytes, the save wrote {entry.size}. {fix}")
    extra = [n for n in _files(folder) if n not in entries]
    if extra:
        kind = " (a pickle-format file: loading it could run code)" if extra[0].endswith(_PICKLES) else ""
        raise CheckpointError(f"{folder / extra[0]} was not written by the save{kind}; "
                              f"{len(extra)} unexpected file(s) in all. {fix}")
    names = list(entries)
    try:
        digests = _digests(folder, names)
    except OSError as err:
        raise CheckpointError(f"{err.filename or folder} cannot be read ({err.strerror or err}). {fix}") from None
    for name, digest in digests.items():
        if digest != entries[name].digest:
            raise CheckpointError(f"{folder / name} differs from what the save wrote (same size, different "
                                  f"content: {HASH} {digest} != {entries[name].digest}). {fix}")
    return True
