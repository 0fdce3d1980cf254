"""Megatron's indexed dataset (``.bin``/``.idx``) read through ``GPTDataset``, indexed by global sample id.

The dataset is built with ``BlendedMegatronDatasetBuilder``. With ``torch.distributed`` initialised the build is a
collective over the default process group (Megatron builds on global rank 0, writes its index cache, calls
``barrier()``, then the other ranks load the cache): every rank must call :func:`build_indexed_samples`, and the cache
directory must be on a file system all ranks see. Without ``torch.distributed`` it builds in the calling process.

Megatron caches the document/sample/shuffle indices as ``.npy`` files named by an MD5 of the dataset description
(``<hash>-GPTDataset-train-*.npy``; a blend adds ``<hash>-BlendedDataset-train-*.npy``) in ``data.cache_dir``, or,
when that is unset, in the directory ``<prefix>/cache/GPTDataset_indices/`` beside ``<prefix>.bin`` (a blend's own
index is then rebuilt on every run, with a warning). A second run with the same settings reuses them.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy
import torch

from cfp_megatron.base.config import DataSpec, JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import open_regular, regular_file_problem
from cfp_megatron.data.index_cache import Split, atomic_index_cache, check_index_cache
from cfp_megatron.data.tokenizer import Tokenizer, build_tokenizer

SAMPLE_FIELDS: tuple[str, ...] = ("tokens", "labels", "loss_mask", "position_ids")
"""The per-sample tensors the training step consumes."""


def _preprocess_fix(prefix: str) -> str:
    return (f"run python -m cfp_megatron.data.preprocess --input CORPUS.jsonl --output-prefix {prefix} "
            "(or point data.path at an existing prefix: the path without .bin/.idx).")


def _rebuild_fix(prefix: str) -> str:
    return (f"copy {prefix}.bin again, or re-run preprocessing: python -m cfp_megatron.data.preprocess --input "
            f"CORPUS.jsonl --output-prefix {prefix} --overwrite.")


def check_data_files(data: DataSpec) -> list[ConfigIssue]:
    """Issues for each ``data.path`` prefix whose ``.bin`` or ``.idx`` file is missing."""
    issues: list[ConfigIssue] = []
    for prefix in data.blend.prefixes:
        odd = [problem for p in (f"{prefix}.bin", f"{prefix}.idx")
               if (problem := regular_file_problem(p)) is not None and os.path.lexists(p)]
        if odd:  # a folder, a named pipe or a device where a file belongs: reading it could wait forever
            issues.append(ConfigIssue(key="data.path", value=prefix, problem=" ".join(odd),
                                      fix=f"point data.path at a prefix whose .bin and .idx are regular files. "
                                          f"{_preprocess_fix(prefix)}"))
            continue
        missing = [p for p in (f"{prefix}.bin", f"{prefix}.idx") if not os.path.isfile(p)]
        if not missing:
            continue
        stem, ext = os.path.splitext(prefix)
        if ext in (".bin", ".idx") and os.path.isfile(f"{stem}.bin") and os.path.isfile(f"{stem}.idx"):
            fix = f"drop the extension: data.path=[{stem}] (a prefix names both {stem}.bin and {stem}.idx)."
        else:
            fix = _preprocess_fix(prefix)
        issues.append(ConfigIssue(key="data.path", value=prefix, problem=f"{' and '.join(missing)} not found.",
                                  fix=fix))
    return issues


def check_vocab(job: JobSpec, tokenizer: Tokenizer) -> list[ConfigIssue]:
    """An issue when the tokenizer's ids do not fit in ``model.vocab_size``."""
    if tokenizer.vocab_size <= job.model.vocab_size:
        return []
    return [ConfigIssue(
        key="model.vocab_size", value=job.model.vocab_size,
        problem=f"is smaller than the vocabulary of data.tokenizer={job.data.tokenizer.value} "
                f"({tokenizer.vocab_size} ids), so token ids would fall outside the embedding.",
        fix=f"set model.vocab_size={tokenizer.vocab_size} (or more), or use the tokenizer the model was built for.",
    )]


def _train_bookends(split: str) -> tuple[float, float] | None:
    """The training split's ``(begin, end)`` fraction of each dataset's documents, as Megatron computes it."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )

    weights = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not weights or weights[0] <= 0.0 or any(w < 0.0 for w in weights):
        return None
    return convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[0]


def check_split(data: DataSpec) -> list[ConfigIssue]:
    """An issue when ``data.split`` gives the training split no weight."""
    if _train_bookends(data.split) is not None:
        return []
    return [ConfigIssue(key="data.split", value=data.split, problem="gives the training split no weight.",
                        fix="give the first (training) weight a positive value, e.g. 98,1,1.")]


def _rebuild_index_fix(prefix: str) -> str:
    return (f"rebuild the index (and its .bin) from the corpus: python -m cfp_megatron.data.preprocess --input "
            f"CORPUS.jsonl --output-prefix {prefix} --overwrite (or copy both files again from where they were made).")


_HEADER = struct.Struct("<9sQBQQ")
"""The ``.idx`` header Megatron-Core writes (``_IndexWriter``): magic, version, dtype code, sequence count, document
count (34 bytes); then int32 sequence lengths, int64 sequence pointers (byte offsets into the ``.bin``) and int64
document boundaries."""


def _megatron_codes() -> dict[int, numpy.dtype]:
    """Megatron-Core's token dtype codes (``indexed_dataset.DType``): code -> NumPy dtype."""
    from megatron.core.datasets.indexed_dataset import DType

    return {member.value: numpy.dtype(member.name) for member in DType}


def _codes_text(codes: dict[int, numpy.dtype]) -> str:
    return ", ".join(f"{code} {dtype.name}" for code, dtype in sorted(codes.items()))


@dataclass(frozen=True, kw_only=True)
class IndexFile:
    """What an ``.idx`` file says, read and checked by :func:`read_index` (arrays are views of its memory map)."""

    prefix: str
    """The ``data.path`` prefix."""
    code: int
    """The header's dtype code (Megatron-Core's ``DType``)."""
    dtype: numpy.dtype
    """The token dtype of the ``.bin`` that the code names."""
    lengths: numpy.ndarray
    """Tokens per sequence (int32)."""
    pointers: numpy.ndarray
    """Byte offset of each sequence in the ``.bin`` (int64)."""

    @property
    def tokens(self) -> int:
        """Tokens of every sequence."""
        return int(self.lengths.sum(dtype="int64"))


def _index_issue(prefix: str, problem: str, fix: str | None = None) -> ConfigError:
    return ConfigError(ConfigIssue(key="data.path", value=prefix, problem=problem,
                                   fix=fix or _rebuild_index_fix(prefix)))


def _pointer_step(lengths: numpy.ndarray, pointers: numpy.ndarray) -> int | None:
    """The bytes per token the sequence pointers were written with (each pointer is the bytes of the sequences
    before it), or ``None`` where they cannot tell it (no sequence after a non-empty one)."""
    before = int(lengths[:-1].sum(dtype="int64")) if lengths.shape[0] > 1 else 0
    if before == 0:
        return None
    step, rest = divmod(int(pointers[-1]), before)
    return step if rest == 0 else -1


def _pointers_follow(lengths: numpy.ndarray, pointers: numpy.ndarray, itemsize: int) -> bool:
    """Whether every pointer is the bytes of the sequences before it (checked in blocks, bounded memory)."""
    block, offset = 1 << 22, 0
    for start in range(0, lengths.shape[0], block):
        part = lengths[start:start + block].astype("int64") * itemsize
        expected = numpy.concatenate(([offset], offset + numpy.cumsum(part)[:-1])) if part.shape[0] else part
        if not numpy.array_equal(pointers[start:start + block], expected):
            return False
        offset += int(part.sum())
    return True


def read_index(prefix: str) -> IndexFile:
    """Read and check ``<prefix>.idx`` (one :class:`ConfigError` naming ``data.path`` and the field at fault: the
    magic bytes, the version, the dtype code, the counts, the lengths, the pointers, the document boundaries, and a
    dtype code that disagrees with the pointers named as such), then ``<prefix>.bin``'s size against it."""
    idx, bin_path = f"{prefix}.idx", f"{prefix}.bin"
    for path in (idx, bin_path):
        problem = regular_file_problem(path)
        if problem is not None:
            raise _index_issue(prefix, problem, _preprocess_fix(prefix))
    try:
        with open_regular(idx, "rb") as fh:
            head = fh.read(_HEADER.size)
        size = os.path.getsize(idx)
    except OSError as err:
        raise _index_issue(prefix, f"{idx} cannot be read: {err.strerror or err}.",
                           "check the file's permissions and the disk holding it.") from None
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER as magic

    if len(head) < _HEADER.size or head[:len(magic)] != magic:
        what = "is shorter than the 34-byte header" if len(head) < _HEADER.size else \
            f"starts with {head[:len(magic)]!r}, not Megatron's {magic!r}"
        raise _index_issue(prefix, f"{idx} is not a Megatron index: it {what} (another file, or a damaged copy).",
                           _preprocess_fix(prefix))
    _, version, code, sequences, documents = _HEADER.unpack(head)
    if version != 1:
        raise _index_issue(prefix, f"{idx}'s header says index version {version} (bytes 9-16); Megatron-Core "
                                   "reads version 1 only: the header was changed, or another tool wrote the file.")
    codes = _megatron_codes()
    if code not in codes:
        raise _index_issue(prefix, f"{idx}'s header has dtype code {code} (byte 17), which Megatron-Core does not "
                                   f"know (its codes: {_codes_text(codes)}): the code was changed or damaged.")
    dtype = codes[code]
    if dtype.kind not in "iu":
        raise _index_issue(prefix, f"{idx}'s header has dtype code {code} ({dtype.name}), not an integer type: token "
                                   "ids are integers (Megatron writes uint16 below 65,500 ids, int32 above), so the "
                                   "code was changed.")
    need = _HEADER.size + sequences * 12 + documents * 8
    if size != need:
        raise _index_issue(prefix, f"{idx}'s header counts {sequences:,} sequences and {documents:,} document "
                                   f"boundaries, which take {need:,} bytes, but the file holds {size:,}: a count in "
                                   "the header was changed, or the file was cut short or added to.")
    memory = numpy.memmap(idx, mode="r")
    lengths = numpy.frombuffer(memory, dtype=numpy.int32, count=sequences, offset=_HEADER.size)
    pointers = numpy.frombuffer(memory, dtype=numpy.int64, count=sequences, offset=_HEADER.size + sequences * 4)
    bounds = numpy.frombuffer(memory, dtype=numpy.int64, count=documents, offset=_HEADER.size + sequences * 12)
    if sequences and int(lengths.min()) < 0:
        raise _index_issue(prefix, f"{idx} holds a negative sequence length ({int(lengths.min())}): it is damaged.")
    if documents == 0 or bounds[0] != 0 or bounds[-1] != sequences or bool((numpy.diff(bounds) < 0).any()):
        raise _index_issue(prefix, f"{idx}'s document boundaries do not run from 0 to its {sequences:,} sequences: "
                                   "it is damaged.")
    step = _pointer_step(lengths, pointers)
    if step is not None and step != dtype.itemsize:
        same = [f"{c} ({d.name})" for c, d in sorted(codes.items()) if d.itemsize == step and d.kind in "iu"]
        if same:
            raise _index_issue(prefix, f"{idx}'s header has dtype code {code} ({dtype.name}, {dtype.itemsize} "
                                       f"byte{'s' if dtype.itemsize > 1 else ''} per token), but its sequence "
                                       f"pointers advance {step} bytes per token, as code {' or '.join(same)} "
                                       "writes them: the dtype code (byte 17) was changed, "
                                       f"so every token would be read wrong. Megatron-Core's codes: "
                                       f"{_codes_text(codes)}.")
    if (step is not None and step != dtype.itemsize) or (sequences and int(pointers[0]) != 0) \
            or not _pointers_follow(lengths, pointers, dtype.itemsize):
        raise _index_issue(prefix, f"{idx}'s sequence pointers do not follow its sequence lengths: it is damaged.")
    index = IndexFile(prefix=prefix, code=code, dtype=dtype, lengths=lengths, pointers=pointers)
    expected, actual = index.tokens * dtype.itemsize, os.path.getsize(bin_path)
    fits = [f"{c} ({d.name})" for c, d in sorted(codes.items())
            if d.kind in "iu" and d.itemsize != dtype.itemsize and index.tokens * d.itemsize == actual > 0]
    if step is None and actual != expected and fits:  # the pointers could not tell it (one sequence): the size can
        raise _index_issue(prefix, f"{idx}'s header has dtype code {code} ({dtype.name}), but {bin_path} holds "
                                   f"{actual:,} bytes for the {index.tokens:,} tokens the index lists: "
                                   f"{actual // index.tokens} bytes per token, as code {' or '.join(fits)} writes "
                                   "them: the dtype code (byte 17) was changed.")
    if actual < expected:  # a copy cut short: Megatron would fail on the first sample past the end, mid-training
        raise _index_issue(prefix, f"{bin_path} holds {actual:,} bytes but {idx} indexes {expected:,} (the .bin is "
                                   "truncated: an interrupted copy or preprocessing run).", _rebuild_fix(prefix))
    if actual > expected:
        raise _index_issue(prefix, f"{bin_path} holds {actual:,} bytes but {idx} indexes only {expected:,} "
                                   f"({index.tokens:,} {dtype.name} tokens): the two files were not written "
                                   "together (the .idx of another, shorter corpus?), and the rest would never be "
                                   "read.")
    return index


def _train_range(index: IndexFile, split: str) -> tuple[int, int]:
    """The training split's sequences ``[begin, end)`` of ``index``, as Megatron's ``GPTDataset`` splits them (by
    sequence; one sequence per document here)."""
    bookends = _train_bookends(split)
    if bookends is None:
        return 0, 0
    n = index.lengths.shape[0]
    begin, end = (int(round(f * float(n))) for f in bookends)
    return begin, end


def train_split_tokens(prefix: str, split: str) -> int:
    """Tokens in the training split of the indexed dataset at ``prefix`` (reads the ``.idx`` file, checked by
    :func:`read_index`)."""
    if _train_bookends(split) is None:
        return 0
    if os.path.isfile(f"{prefix}.bin") and os.path.getsize(f"{prefix}.bin") == 0:
        raise ConfigError(ConfigIssue(key="data.path", value=prefix, problem=f"{prefix}.bin is empty.",
                                      fix=_rebuild_fix(prefix)))
    index = read_index(prefix)
    begin, end = _train_range(index, split)
    return int(index.lengths[begin:end].sum(dtype="int64"))


SCAN_BYTES = 4 << 30
"""The most bytes of a training split's tokens :func:`scan_token_ids` reads; a larger split is read in evenly spaced
blocks of this much in all (and the scan says what it covered)."""

_SCAN_BLOCK = 64 << 20
"""Bytes of tokens read at once."""


@dataclass(frozen=True, kw_only=True)
class TokenScan:
    """The smallest and largest token ids of a training split (:func:`scan_token_ids`)."""

    low: int
    """The smallest id found."""
    high: int
    """The largest id found."""
    scanned: int
    """Tokens read."""
    total: int
    """Tokens of the training split."""

    def coverage(self) -> str:
        """``all 12,345 tokens`` or ``1,024 of 9,999 tokens (evenly spaced blocks)``."""
        if self.scanned >= self.total:
            return f"all {self.total:,} tokens of the training split"
        return (f"{self.scanned:,} of the training split's {self.total:,} tokens (evenly spaced blocks: the scan "
                f"reads at most {SCAN_BYTES / 2**30:g} GiB)")


_SCANS: dict[tuple[Any, ...], TokenScan] = {}
"""Scans of this process by file identity and split, so the checks before and after planning read the data once."""


def scan_token_ids(index: IndexFile, split: str) -> TokenScan | None:
    """The smallest and largest token id of the training split of ``index`` (``None`` when it has no tokens): all of
    it up to :data:`SCAN_BYTES`, else evenly spaced blocks of that much in all, first and last included."""
    begin, end = _train_range(index, split)
    if end <= begin:
        return None
    itemsize = index.dtype.itemsize
    first = int(index.pointers[begin]) // itemsize
    stop = int(index.pointers[end - 1]) // itemsize + int(index.lengths[end - 1])
    if stop <= first:
        return None
    bin_path = f"{index.prefix}.bin"
    stat = os.stat(bin_path)
    key = (os.path.realpath(bin_path), stat.st_size, stat.st_mtime_ns, stat.st_ino, first, stop)
    if key in _SCANS:
        return _SCANS[key]
    tokens = numpy.memmap(bin_path, dtype=index.dtype, mode="r")
    block = max(_SCAN_BLOCK // itemsize, 1)
    total = stop - first
    if total * itemsize <= SCAN_BYTES:
        starts = list(range(first, stop, block))
    else:
        count = max(SCAN_BYTES // _SCAN_BLOCK, 2)
        starts = sorted({first + max(total - block, 0) * i // (count - 1) for i in range(count)})
    low, high, scanned = None, None, 0
    for start in starts:
        part = tokens[start:min(start + block, stop)]
        low = int(part.min()) if low is None else min(low, int(part.min()))
        high = int(part.max()) if high is None else max(high, int(part.max()))
        scanned += part.shape[0]
    del tokens
    found = TokenScan(low=int(low or 0), high=int(high or 0), scanned=min(scanned, total), total=total)
    _SCANS[key] = found
    return found


def check_token_ids(job: JobSpec) -> list[ConfigIssue]:
    """Issues for ``data.path`` prefixes whose training split holds token ids the model cannot embed or predict:
    negative, or at or above ``model.vocab_size`` (the padded rows Megatron adds to round the embedding train but
    are never predicted: its inference clamps samples below ``vocab_size``; from the padded size on an id cannot be
    embedded at all, an ``IndexError`` mid-training). A split larger than :data:`SCAN_BYTES` is scanned in blocks,
    and the scan says what it covered (in the issue, or in one note on rank 0 when it finds nothing)."""
    model = job.model
    issues: list[ConfigIssue] = []
    for prefix in job.data.blend.prefixes:
        index = read_index(prefix)
        scan = scan_token_ids(index, job.data.split)
        if scan is None:
            continue
        where = f"{scan.coverage()} ({index.dtype.name}, dtype code {index.code})"
        if scan.low < 0:
            unsigned = [c for c, d in _megatron_codes().items() if d.kind == "u" and d.itemsize == index.dtype.itemsize]
            hint = (f" A tokenizer never writes negative ids: with dtype code {unsigned[0]} (the unsigned type of "
                    f"the same size) they would read as ids; the code was probably changed." if unsigned else "")
            issues.append(ConfigIssue(key="data.path", value=prefix,
                                      problem=f"holds negative token ids (down to {scan.low}) in {where}.{hint}",
                                      fix=_rebuild_index_fix(prefix)))
        elif scan.high >= model.vocab_size:
            padded = model.padded_vocab_size
            beyond = (f"ids from {padded:,} on cannot be embedded at all (an IndexError mid-training)"
                      if scan.high >= padded else
                      f"ids {model.vocab_size:,}-{scan.high:,} fall in the rows Megatron adds only to pad the "
                      "embedding to a multiple of model.make_vocab_size_divisible_by="
                      f"{model.make_vocab_size_divisible_by} (padded size {padded:,}): they would train, but "
                      "the model never predicts them (Megatron's inference keeps samples below vocab_size)")
            issues.append(ConfigIssue(
                key="model.vocab_size", value=model.vocab_size,
                problem=f"is at or below the largest token id {scan.high:,} found in data.path={prefix} ({where}): "
                        f"{beyond}.",
                fix=f"set model.vocab_size={scan.high + 1} or more if the data's tokenizer has that many ids, or "
                    f"use data made with the tokenizer the model was built for (python -m cfp_megatron.data."
                    f"preprocess --tokenizer ...; data.tokenizer={job.data.tokenizer.value} has "
                    "its own vocabulary)."))
        elif scan.scanned < scan.total:
            _note_once(f"cfp: data.path={prefix}: {where}: token ids {scan.low}-{scan.high}, below "
                       f"model.vocab_size={model.vocab_size} (the rest of the split is not checked)")
    return issues


_NOTED: set[str] = set()


def _note_once(line: str) -> None:
    """Print ``line`` once per process, on global rank 0 only."""
    if line in _NOTED or os.environ.get("RANK", "0") != "0":
        return
    _NOTED.add(line)
    print(line, file=sys.stderr, flush=True)


def check_train_tokens(data: DataSpec) -> tuple[list[ConfigIssue], list[int]]:
    """Issues for prefixes whose training split is empty (Megatron 0.16.1 loops forever on one), and the training
    tokens of each prefix."""
    issues: list[ConfigIssue] = []
    counts: list[int] = []
    for prefix in data.blend.prefixes:
        try:
            count = train_split_tokens(prefix, data.split)
        except ConfigError as err:
            issues.extend(err.issues)
            continue
        counts.append(count)
        if count == 0:
            issues.append(ConfigIssue(
                key="data.split", value=data.split, problem=f"leaves no training documents in {prefix}.",
                fix="use more documents, or a larger first (training) weight, e.g. 100,0,0 for a tiny corpus."))
    return issues, counts


def check_sample_length(job: JobSpec, counts: list[int]) -> list[ConfigIssue]:
    """Issues for prefixes whose training split (``counts``: its tokens, per prefix) is shorter than one sample
    (``train.seq_length`` + 1 tokens: each sample would hold the same documents several times over)."""
    need = job.train.seq_length + 1
    return [ConfigIssue(
        key="data.path", value=prefix, problem=f"its training split holds {count:,} tokens, fewer than one sample of "
        f"train.seq_length + 1 = {need:,}: every sample would repeat the same documents within itself.",
        fix=f"use more data, or a train.seq_length below {count:,}.") for prefix, count in
        zip(job.data.blend.prefixes, counts, strict=True) if 0 < count < need]


def train_splits(job: JobSpec, counts: list[int]) -> list[Split]:
    """Each prefix's training split (``counts``: its tokens) with its documents and its share of the samples."""
    blend = job.data.blend
    weights = blend.weights or tuple(float(c) for c in counts)
    found = []
    for prefix, count, weight in zip(blend.prefixes, counts, weights, strict=True):
        begin, end = _train_range(read_index(prefix), job.data.split)
        found.append(Split(documents=end - begin, tokens=count, share=weight / sum(weights)))
    return found


def note_epochs(job: JobSpec, counts: list[int]) -> None:
    """A note on rank 0 for each prefix whose training split (``counts``: its tokens) the run reads more than once
    (Megatron repeats the documents, shuffled anew each epoch)."""
    train, blend = job.train, job.data.blend
    weights = blend.weights or tuple(float(c) for c in counts)
    read = max(train.steps, 1) * train.global_batch_size * train.seq_length
    for prefix, count, weight in zip(blend.prefixes, counts, weights, strict=True):
        epochs = read * weight / sum(weights) / count
        if epochs > 1:
            _note_once(f"cfp: data.path={prefix}: train.steps={train.steps} x train.global_batch_size="
                       f"{train.global_batch_size} x train.seq_length={train.seq_length} read its training split's "
                       f"{count:,} tokens {epochs:.3g} times (Megatron repeats the documents, shuffled each epoch)")


@contextlib.contextmanager
def _rank_zero_without_process_group() -> Iterator[None]:
    """megatron-core 0.16.1's ``BlendedDataset._build_indices`` calls ``torch.distributed.get_rank()`` without checking
    ``is_initialized()`` when a cache directory is set, which raises in a single process; there the rank is 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield
        return
    with mock.patch.object(torch.distributed, "get_rank", lambda *args, **kwargs: 0):
        yield


@dataclass(frozen=True, kw_only=True)
class IndexedSamples:
    """Random access by global sample id to Megatron's ``GPTDataset`` (or a ``BlendedDataset`` of several)."""

    dataset: Any
    """The Megatron dataset (``GPTDataset`` or ``BlendedDataset``)."""
    tokenizer: Tokenizer
    """The tokenizer the dataset was built with."""

    @property
    def num_samples(self) -> int:
        """Samples available (at least ``train.steps * train.global_batch_size``)."""
        return len(self.dataset)

    def __getitem__(self, sample_id: int) -> dict[str, torch.Tensor]:
        """One sample: ``tokens``, ``labels`` (next tokens), ``loss_mask`` and ``position_ids``, each ``[seq]``."""
        if not 0 <= sample_id < len(self.dataset):
            raise IndexError(f"sample id {sample_id} is outside the indexed dataset's {len(self.dataset)} samples.")
        item = self.dataset[sample_id]
        return {k: item[k] for k in SAMPLE_FIELDS}


@dataclass(frozen=True, kw_only=True)
class IndexedCheck:
    """What :func:`validate_indexed` found."""

    tokenizer: Tokenizer
    """The tokenizer ``data.tokenizer`` names."""
    train_tokens: list[int]
    """Tokens in the training split of each ``data.path`` prefix (the blend weights, where it gives none)."""


def validate_indexed(job: JobSpec) -> IndexedCheck:
    """Check files, split, tokenizer and vocabulary: the ``.idx`` files (:func:`read_index`), each training split
    against one sample (:func:`check_sample_length`), the index cache's folder
    (:func:`~cfp_megatron.data.index_cache.check_index_cache`) and the token ids of the training splits
    (:func:`check_token_ids`); raises :class:`ConfigError` with every problem found."""
    issues = check_data_files(job.data) + check_split(job.data)
    counts: list[int] = []
    if not issues:
        token_issues, counts = check_train_tokens(job.data)
        issues.extend(token_issues or check_sample_length(job, counts))
        if not issues:
            issues.extend(check_index_cache(job, train_splits(job, counts)))
    tokenizer: Tokenizer | None = None
    try:
        tokenizer = build_tokenizer(job.data)
    except ConfigError as err:
        issues.extend(err.issues)
    if tokenizer is not None:
        issues.extend(check_vocab(job, tokenizer))
    if not issues:  # the files read and the split has tokens: the ids the run will read, against the vocabulary
        issues.extend(check_token_ids(job))
    if issues or tokenizer is None:
        raise ConfigError(issues)
    note_epochs(job, counts)
    return IndexedCheck(tokenizer=tokenizer, train_tokens=counts)


def build_indexed_samples(job: JobSpec, *, checked: IndexedCheck | None = None) -> IndexedSamples:
    """Build the training split of ``data.path`` with enough samples for ``train.steps`` steps; ``checked`` is the
    result of :func:`validate_indexed` when the caller already ran it.

    Several prefixes are blended in proportion to the weights ``data.path`` gives them, else to the tokens of their
    training splits. Collective over the default process group when ``torch.distributed`` is initialised (see the
    module docstring); the index cache is saved atomically (:func:`~cfp_megatron.data.index_cache.atomic_index_cache`).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if checked is None:
        checked = validate_indexed(job)
    train, data = job.train, job.data
    blend = data.blend
    prefixes = list(blend.prefixes)
    weights = None if len(prefixes) == 1 else list(blend.weights or (float(c) for c in checked.train_tokens))
    config = GPTDatasetConfig(
        random_seed=train.seed,
        sequence_length=train.seq_length,
        blend=(prefixes, weights),
        split=data.split,
        path_to_cache=data.cache_dir,
        tokenizer=checked.tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    # Only the training split is built: the validation and test fractions of data.split stay reserved (no document of
    # theirs is trained on) but are not materialised. Besides saving work, this avoids a hang: megatron-core 0.16.1
    # loops forever building a split with a positive weight and no documents, as small corpora give for e.g. 98,1,1.
    config.split_matrix = [config.split_matrix[0], None, None]
    num_samples = max(train.steps, 1) * train.global_batch_size
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config)
    with _rank_zero_without_process_group(), atomic_index_cache(data):
        train_ds, _, _ = builder.build()
    if train_ds is None or len(train_ds) == 0:
        raise ConfigError(ConfigIssue(key="data.split", value=data.split,
                                      problem=f"leaves no training samples of train.seq_length={train.seq_length} "
                                              f"tokens in data.path={prefixes}.",
                                      fix="use more data, a larger training weight, or a shorter sequence."))
    return IndexedSamples(dataset=train_ds, tokenizer=checked.tokenizer)
