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
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import numpy

from cfp_megatron.base.config import DataSpec
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


def check_index_cache(data: DataSpec) -> list[ConfigIssue]:
    """Issues for index-cache folders that cannot be written (a read-only or full disk, a file in the way; created
    when missing, as Megatron would), unless the folder already holds a training split's cached index (a prepared
    cache on a read-only disk: a run with the same settings only reads it; one with others is said at the build,
    :func:`atomic_index_cache`)."""
    issues = []
    for folder in index_cache_folders(data):
        problem = writable_dir_problem(folder)
        if problem is None or (folder.is_dir() and any(folder.glob(CACHED))):
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
    except FileNotFoundError as err:
        if os.environ.get("RANK", "0") == "0" or not str(err.filename or "").endswith((".npy", ".txt")):
            raise write_error(err, err.filename or (folders[0] if folders else "."), KEY) from None
        raise ConfigError(ConfigIssue(
            key=KEY, value=data.cache_dir, problem=f"{err.filename}, the index rank 0 built and saved, is not "
            "there on this rank: the folder is not on a file system every rank sees.",
            fix="set data.cache_dir to a folder on a shared file system (every node's ranks read what global rank "
                "0 writes).")) from None
    except OSError as err:
        raise write_error(err, err.filename or (folders[0] if folders else "."), KEY) from None
