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

import torch

from cfp_megatron.base.config import DataSpec, JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
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
    for prefix in data.path:
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


@contextlib.contextmanager
def _quiet_partial_dataset() -> Iterator[None]:
    """Silence the ``AttributeError`` that megatron-core 0.16.1's ``IndexedDataset.__del__`` (and its readers')
    raise for a dataset whose constructor failed: Python prints it as "Exception ignored ... Traceback" after the
    clear error. Any other unraisable exception still reaches the previous hook."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        owner = getattr(unraisable.object, "__qualname__", "")
        if isinstance(unraisable.exc_value, AttributeError) and owner.endswith("__del__"):
            return
        previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def train_split_tokens(prefix: str, split: str) -> int:
    """Tokens in the training split of the indexed dataset at ``prefix`` (reads only the ``.idx`` file)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    bookends = _train_bookends(split)
    if bookends is None:
        return 0
    if os.path.getsize(f"{prefix}.bin") == 0:
        raise ConfigError(ConfigIssue(key="data.path", value=prefix, problem=f"{prefix}.bin is empty.",
                                      fix=_rebuild_fix(prefix)))
    failure = None
    with _quiet_partial_dataset():
        try:
            dataset = IndexedDataset(prefix, mmap=True)
        except (AssertionError, ValueError, OSError, struct.error) as err:
            failure = repr(err)
        # the half-built dataset is collected here, when the except clause drops its traceback
    if failure is not None:
        raise ConfigError(ConfigIssue(key="data.path", value=prefix,
                                      problem=f"is not a readable Megatron indexed dataset ({failure}).",
                                      fix=_preprocess_fix(prefix)))
    # sequence_lengths is a view into the .idx memory map, which the dataset closes when it is collected: keep
    # `dataset` alive until the sum is taken (reading the view afterwards crashes the interpreter).
    lengths = dataset.sequence_lengths
    n = lengths.shape[0]  # GPTDataset splits by sequence; one sequence per document here
    begin, end = (int(round(f * float(n))) for f in bookends)
    tokens = int(lengths[begin:end].sum(dtype="int64"))
    expected = _expected_bin_bytes(dataset)
    del lengths, dataset
    actual = os.path.getsize(f"{prefix}.bin")
    if actual < expected:  # a copy cut short: Megatron would fail on the first sample past the end, mid-training
        raise ConfigError(ConfigIssue(key="data.path", value=prefix,
                                      problem=f"{prefix}.bin holds {actual:,} bytes but {prefix}.idx indexes "
                                              f"{expected:,} (the .bin is truncated: an interrupted copy or "
                                              "preprocessing run).",
                                      fix=_rebuild_fix(prefix)))
    return tokens


def _expected_bin_bytes(dataset: Any) -> int:
    """Bytes the ``.bin`` must hold for every sequence the ``.idx`` of ``dataset`` (an ``IndexedDataset``) lists."""
    index = dataset.index
    if index.sequence_count == 0:
        return 0
    last = index.sequence_count - 1
    return int(index.sequence_pointers[last]) + int(index.sequence_lengths[last]) * int(index.dtype_size)


def check_train_tokens(data: DataSpec) -> tuple[list[ConfigIssue], list[int]]:
    """Issues for prefixes whose training split is empty (Megatron 0.16.1 loops forever on one), and the training
    tokens of each prefix."""
    issues: list[ConfigIssue] = []
    counts: list[int] = []
    for prefix in data.path:
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
    """Tokens in the training split of each ``data.path`` prefix (the blend weights)."""


def validate_indexed(job: JobSpec) -> IndexedCheck:
    """Check files, split, tokenizer and vocabulary, reading only the ``.idx`` files; raises :class:`ConfigError`
    with every problem found."""
    issues = check_data_files(job.data) + check_split(job.data)
    counts: list[int] = []
    if not issues:
        token_issues, counts = check_train_tokens(job.data)
        issues.extend(token_issues)
    tokenizer: Tokenizer | None = None
    try:
        tokenizer = build_tokenizer(job.data)
    except ConfigError as err:
        issues.extend(err.issues)
    if tokenizer is not None:
        issues.extend(check_vocab(job, tokenizer))
    if issues or tokenizer is None:
        raise ConfigError(issues)
    return IndexedCheck(tokenizer=tokenizer, train_tokens=counts)


def build_indexed_samples(job: JobSpec, *, checked: IndexedCheck | None = None) -> IndexedSamples:
    """Build the training split of ``data.path`` with enough samples for ``train.steps`` steps; ``checked`` is the
    result of :func:`validate_indexed` when the caller already ran it.

    Several prefixes are blended in proportion to the tokens of their training splits. Collective over the default
    process group when ``torch.distributed`` is initialised (see the module docstring).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if checked is None:
        checked = validate_indexed(job)
    train, data = job.train, job.data
    prefixes = list(data.path)
    weights = None if len(prefixes) == 1 else [float(c) for c in checked.train_tokens]
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
    with _rank_zero_without_process_group():
        train_ds, _, _ = builder.build()
    if train_ds is None or len(train_ds) == 0:
        raise ConfigError(ConfigIssue(key="data.split", value=data.split,
                                      problem=f"leaves no training samples of train.seq_length={train.seq_length} "
                                              f"tokens in data.path={prefixes}.",
                                      fix="use more data, a larger training weight, or a shorter sequence."))
    return IndexedSamples(dataset=train_ds, tokenizer=checked.tokenizer)
