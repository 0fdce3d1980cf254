"""Megatron's index cache for an indexed dataset: where ``GPTDataset`` writes it, whether it can, and its writes
made atomic.

``GPTDataset`` saves its document, sample and shuffle indices (``<hash>-GPTDataset-train-*.npy`` and a
``description.txt``) in ``data.cache_dir``, or, when that is unset, in ``<prefix>/cache/GPTDataset_indices/``
beside the data; a blend adds its own index in ``data.cache_dir`` only. It writes them with plain ``open`` and
``numpy.save``: on a read-only disk that is an ``OSError`` from deep inside Megatron, and a disk that fills mid-save
leaves a truncated ``.npy`` that a later run takes for a cache hit. So the folder is checked before any process
group (:func:`check_index_cache`), and the build's saves go through :func:`~cfp_megatron.base.files.atomic_writer`
(:func:`atomic_index_cache`), an ``OSError`` in them one :class:`~cfp_megatron.base.files.FileWriteError`
naming ``data.cache_dir``.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy

from cfp_megatron.base.config import DataSpec, JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import atomic_writer, writable_dir_problem, write_error

KEY = "data.cache_dir"
"""The setting that chooses the folder."""

CACHED = "*-GPTDataset-train-description.txt"
"""What a folder holding Megatron's index of a training split has (the first of its four files)."""


def index_cache_folders(data: DataSpec) -> list[Path]:
    """The folders ``GPTDataset`` writes its index cache into: ``data.cache_dir``, else one per prefix beside the
    data (``<prefix>/cache/GPTDataset_indices``, as Megatron-Core 0.16.1 names it); none for ``data.cache_dir=''``
    (Megatron then rebuilds the index on every run and writes nothing)."""
    if data.cache_dir is not None:
        return [Path(data.cache_dir).expanduser()] if data.cache_dir else []
    return list(dict.fromkeys(Path(prefix).expanduser() / "cache" / "GPTDataset_indices"
                              for prefix in data.blend.prefixes))


def _where(data: DataSpec) -> str:
    return "data.cache_dir" if data.cache_dir else "data.cache_dir is unset, so Megatron writes it beside the data"


_ENTRY_BYTES = 8
"""Bytes per entry of Megatron's index arrays, at most (int32 or int64 document and sample indices, uint32 or int64
shuffle indices)."""
_FILE_BYTES = 128 + 4096
"""A cache file's ``.npy`` header and its last, partly filled block, at most (or the description's text)."""


@dataclass(frozen=True, kw_only=True)
class Split:
    """A prefix's training split, as the index cache's size depends on it."""

    documents: int
    """Its documents (sequences: one per document in Megatron's GPT datasets)."""
    tokens: int
    """Its tokens."""
    share: float
    """Its share of the samples (its blend weight, normalised)."""


def cache_bytes(job: JobSpec, splits: list[Split]) -> dict[Path, int]:
    """An upper bound of the bytes ``GPTDataset`` (and a blend's ``BlendedDataset``) saves in each index-cache
    folder for ``job``: per prefix a document index of its documents times the epochs it is read, a sample index
    and a shuffle index of the samples those epochs hold, four files; a blend's own two indices of every sample."""
    train, folders = job.train, index_cache_folders(job.data)
    samples = max(train.steps, 1) * train.global_batch_size
    needed: dict[Path, int] = dict.fromkeys(folders, 0)
    for index, split in enumerate(splits):
        if not folders or split.tokens == 0:
            continue
        mine = math.ceil(samples * split.share * (1.005 if len(splits) > 1 else 1.0))  # Megatron's blend surplus
        epochs = max(math.ceil((mine * train.seq_length + 1) / split.tokens), 1)
        held = epochs * split.tokens // train.seq_length + 1
        folder = folders[0] if job.data.cache_dir else folders[index]
        needed[folder] += _ENTRY_BYTES * (split.documents * epochs + 3 * held) + 4 * _FILE_BYTES
    if len(splits) > 1 and job.data.cache_dir:
        needed[folders[0]] += _ENTRY_BYTES * 2 * samples + 3 * _FILE_BYTES
    return needed


def check_index_cache(job: JobSpec, splits: list[Split]) -> list[ConfigIssue]:
    """Issues for index-cache folders that cannot be written (a read-only or full disk, a file in the way; created
    when missing, as Megatron would) or have less free space than the index takes (:func:`cache_bytes`), unless the
    folder already holds a training split's cached index (a prepared cache on a read-only disk: a run with the same
    settings only reads it; one with others is said at the build, :func:`atomic_index_cache`)."""
    data = job.data
    issues = []
    for folder, need in cache_bytes(job, splits).items():
        problem = writable_dir_problem(folder)
        if folder.is_dir() and any(folder.glob(CACHED)):
            continue
        free = shutil.disk_usage(folder).free if problem is None else None
        if free is not None and free < need:
            problem = (f"its disk has {free:,} bytes free and the index takes up to {need:,} "
                       f"(train.steps x train.global_batch_size = "
                       f"{max(job.train.steps, 1) * job.train.global_batch_size:,} samples).")
        if problem is None:
            continue
        issues.append(ConfigIssue(
            key=KEY, value=data.cache_dir, problem=f"Megatron writes the dataset's index cache into {folder} "
            f"({_where(data)}), but {problem}",
            fix="set data.cache_dir to a folder this user can write to, on a disk with free space that every rank "
                "sees (or free space there, or fix the permissions)."))
    return issues


@contextlib.contextmanager
def atomic_index_cache(data: DataSpec) -> Iterator[None]:
    """Megatron's dataset build with its index saves (``numpy.save`` to a path) written atomically (a disk that
    fills leaves no truncated ``.npy``), and an ``OSError`` of the build's cache writes raised as one
    :class:`~cfp_megatron.base.files.FileWriteError` naming ``data.cache_dir``; an index another rank wrote that
    this one cannot find is a :class:`ConfigError` (the folder is not on a file system every rank sees)."""
    real_save = numpy.save

    def save(file: Any, arr: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(file, str | os.PathLike):
            return real_save(file, arr, *args, **kwargs)
        target = os.fspath(file) if os.fspath(file).endswith(".npy") else f"{os.fspath(file)}.npy"
        with atomic_writer(target, "wb", key=KEY) as fh:
            return real_save(fh, arr, *args, **kwargs)

    folders = index_cache_folders(data)
    try:
        with mock.patch.object(numpy, "save", save):
            yield
    except Exception as err:  # noqa: BLE001 - only an OSError, or Megatron's wrapper of one, is turned into ours
        # Under torch.distributed, Megatron's builder re-raises rank 0's OSError as a plain Exception (its cause)
        cause = err if isinstance(err, OSError) else err.__cause__ if type(err) is Exception else None
        if not isinstance(cause, OSError):
            raise
        if isinstance(cause, FileNotFoundError) and os.environ.get("RANK", "0") != "0":
            raise ConfigError(ConfigIssue(
                key=KEY, value=data.cache_dir, problem=f"{cause.filename}, the index rank 0 built and saved, is not "
                "there on this rank: the folder is not on a file system every rank sees.",
                fix="set data.cache_dir to a folder on a shared file system (every node's ranks read what global "
                    "rank 0 writes).")) from None
        raise write_error(cause, cause.filename or (folders[0] if folders else "."), KEY) from None
