"""Megatron's indexed dataset (``.bin``/``.idx``) read through ``GPTDataset``, indexed by global sample id.

The dataset is built with ``BlendedMegatronDatasetBuilder``. With ``torch.distributed`` initialised the build is a
collective over the default process group (Megatron builds on global rank 0, writes its index cache, calls
``barrier()``, then the other ranks load the cache): every rank must call :func:`build_indexed_samples`, and the cache
directory must be on a file system all ranks see. Without ``torch.distributed`` it builds in the calling process.

Megatron caches the document/sample/shuffle indices as ``.npy`` files named by an MD5 of the dataset description
(``<hash>-GPTDataset-train-*.npy``; a blend adds ``<hash>-BlendedDataset-train-*.npy``) in ``data.cache_dir``, or,
when that is unset, in ``<prefix>/cache/GPTDataset_indices/`` next to the data. A second run with the same settings
reuses them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from cfp_megatron.config import DataSpec, JobSpec
from cfp_megatron.data.tokenizer import Tokenizer, build_tokenizer
from cfp_megatron.errors import ConfigError, ConfigIssue

SAMPLE_FIELDS: tuple[str, ...] = ("tokens", "labels", "loss_mask", "position_ids")
"""The per-sample tensors the training step consumes."""


def _preprocess_fix(prefix: str) -> str:
    return (f"run python -m cfp_megatron.data.preprocess --input CORPUS.jsonl --output-prefix {prefix} "
            "(or point data.path at an existing prefix: the path without .bin/.idx).")


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


def _train_fraction(split: str) -> float:
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    return float(parse_and_normalize_split(split)[0])


def check_split(data: DataSpec) -> list[ConfigIssue]:
    """An issue when ``data.split`` leaves no documents for training."""
    try:
        ok = _train_fraction(data.split) > 0.0
    except (AssertionError, ZeroDivisionError, ValueError):
        ok = False
    if ok:
        return []
    return [ConfigIssue(key="data.split", value=data.split, problem="gives the training split no weight.",
                        fix="give the first (training) weight a positive value, e.g. 98,1,1.")]


@contextlib.contextmanager
def _rank_zero_without_process_group() -> Iterator[None]:
    """megatron-core 0.16.1's ``BlendedDataset._build_indices`` calls ``torch.distributed.get_rank()`` without checking
    ``is_initialized()`` when a cache directory is set, which raises in a single process; there the rank is 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        yield
        return
    with mock.patch.object(torch.distributed, "get_rank", lambda *args, **kwargs: 0):
        yield


def _token_counts(prefixes: list[str]) -> list[int]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    counts = []
    for prefix in prefixes:
        dataset = IndexedDataset(prefix, mmap=True)
        counts.append(int(dataset.sequence_lengths.sum(dtype="int64")))
        del dataset
    return counts


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


def validate_indexed(job: JobSpec) -> Tokenizer:
    """Check files, split, tokenizer and vocabulary without building anything heavy; returns the tokenizer.

    Raises :class:`ConfigError` with every problem found."""
    issues = check_data_files(job.data) + check_split(job.data)
    tokenizer: Tokenizer | None = None
    try:
        tokenizer = build_tokenizer(job.data)
    except ConfigError as err:
        issues.extend(err.issues)
    if tokenizer is not None:
        issues.extend(check_vocab(job, tokenizer))
    if issues or tokenizer is None:
        raise ConfigError(issues)
    return tokenizer


def build_indexed_samples(job: JobSpec, *, tokenizer: Tokenizer | None = None) -> IndexedSamples:
    """Build the training split of ``data.path`` with enough samples for ``train.steps`` steps.

    Collective over the default process group when ``torch.distributed`` is initialised (see the module docstring).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    if tokenizer is None:
        tokenizer = validate_indexed(job)
    train, data = job.train, job.data
    prefixes = list(data.path)
    weights = None if len(prefixes) == 1 else [float(c) for c in _token_counts(prefixes)]
    config = GPTDatasetConfig(
        random_seed=train.seed,
        sequence_length=train.seq_length,
        blend=(prefixes, weights),
        split=data.split,
        path_to_cache=data.cache_dir,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    num_samples = max(train.steps, 1) * train.global_batch_size
    builder = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, 0, 0], lambda: True, config)
    with _rank_zero_without_process_group():
        train_ds, _, _ = builder.build()
    if train_ds is None or len(train_ds) == 0:
        raise ConfigError(ConfigIssue(key="data.split", value=data.split,
                                      problem=f"leaves no training samples of train.seq_length={train.seq_length} "
                                              f"tokens in data.path={prefixes}.",
                                      fix="use more data, a larger training weight, or a shorter sequence."))
    return IndexedSamples(dataset=train_ds, tokenizer=tokenizer)
