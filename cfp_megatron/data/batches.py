"""The training data stream: micro-batches in Megatron's pretraining-sampler order.

For optimizer step ``s`` and micro-batch ``j`` (of ``global_batch_size // (micro_batch_size * dp_size)``), data-parallel
rank ``r`` gets the global sample ids ``s*GBS + (j*dp_size + r)*MBS + arange(MBS)``. A sample's content depends only on
its id (and the seed and data settings), never on the parallel layout, so one step's global batch is the same under
every DP size, and a stream started at ``start_step`` continues exactly where an uninterrupted one would be.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from cfp_megatron.base.config import DataKind, JobSpec, TrainSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.data.indexed import SAMPLE_FIELDS, build_indexed_samples, validate_indexed
from cfp_megatron.data.synthetic import SyntheticSamples


class SampleSource(Protocol):
    """Random access to training samples by global sample id."""

    @property
    def num_samples(self) -> int | None:
        """Samples available; ``None`` means unbounded."""
        ...

    def __getitem__(self, sample_id: int) -> dict[str, torch.Tensor]:
        """``tokens``, ``labels``, ``loss_mask``, ``position_ids`` of one sample, each of shape ``[seq]``."""
        ...


def check_batch_geometry(train: TrainSpec, dp_size: int) -> list[ConfigIssue]:
    """An issue when the global batch does not split into whole micro-batches on ``dp_size`` ranks."""
    per_round = train.micro_batch_size * dp_size
    if train.global_batch_size % per_round == 0:
        return []
    lower = max(per_round, train.global_batch_size // per_round * per_round)
    return [ConfigIssue(
        key="train.global_batch_size", value=train.global_batch_size,
        problem=f"is not a multiple of train.micro_batch_size={train.micro_batch_size} x data-parallel size "
                f"{dp_size} = {per_round}.",
        fix=f"use a multiple of {per_round}, e.g. {lower}, or change train.micro_batch_size or the parallel layout.",
    )]


def num_microbatches(train: TrainSpec, dp_size: int) -> int:
    """Micro-batches per optimizer step on each data-parallel rank."""
    issues = check_batch_geometry(train, dp_size)
    if issues:
        raise ConfigError(issues)
    return train.global_batch_size // (train.micro_batch_size * dp_size)


def micro_batch_sample_ids(step: int, microbatch: int, *, dp_rank: int, dp_size: int, global_batch_size: int,
                           micro_batch_size: int) -> range:
    """Global sample ids of micro-batch ``microbatch`` of optimizer step ``step`` on data-parallel rank ``dp_rank``."""
    first = step * global_batch_size + (microbatch * dp_size + dp_rank) * micro_batch_size
    return range(first, first + micro_batch_size)


def build_samples(job: JobSpec) -> SampleSource:
    """The sample source ``job.data`` names. For indexed data this builds Megatron's dataset (collective under
    ``torch.distributed``: every rank must call it)."""
    if job.data.kind is DataKind.synthetic:
        return SyntheticSamples.from_job(job)
    return build_indexed_samples(job, checked=validate_indexed(job))


def _collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    batch = {k: torch.stack([s[k] for s in samples]) for k in SAMPLE_FIELDS}
    batch["tokens"] = batch["tokens"].to(torch.int64)
    batch["labels"] = batch["labels"].to(torch.int64)
    batch["loss_mask"] = batch["loss_mask"].to(torch.float32)
    batch["position_ids"] = batch["position_ids"].to(torch.int64)
    return batch


def _stream(source: SampleSource, train: TrainSpec, *, dp_rank: int, dp_size: int,
            start_step: int) -> Iterator[dict[str, torch.Tensor]]:
    n_micro = train.global_batch_size // (train.micro_batch_size * dp_size)
    step = start_step
    while source.num_samples is None or (step + 1) * train.global_batch_size <= source.num_samples:
        for j in range(n_micro):
            ids = micro_batch_sample_ids(step, j, dp_rank=dp_rank, dp_size=dp_size,
                                         global_batch_size=train.global_batch_size,
                                         micro_batch_size=train.micro_batch_size)
            yield _collate([source[i] for i in ids])
        step += 1


def build_micro_batches(job: JobSpec, *, dp_rank: int, dp_size: int,
                        start_step: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """Micro-batches for data-parallel rank ``dp_rank`` of ``dp_size``, from optimizer step ``start_step`` on.

    Yields, in training order, dicts of ``tokens`` int64 ``[MBS, seq]``, ``labels`` int64 ``[MBS, seq]`` (the next
    tokens), ``loss_mask`` float32 ``[MBS, seq]`` and ``position_ids`` int64 ``[MBS, seq]``; causal masking is implied
    (no ``attention_mask``). Synthetic data never ends; indexed data ends after the last step whose whole global batch
    exists (at least ``train.steps`` steps).

    Settings are checked, and :class:`ConfigError` raised, when this is called, before any dataset is built. The
    indexed dataset is built here too, not at the first ``next()``; under ``torch.distributed`` that is a collective
    over the default process group, so every rank must call this function.
    """
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size}) and dp_size must be >= 1.")
    if start_step < 0:
        raise ValueError(f"start_step={start_step} must not be negative.")
    issues = check_batch_geometry(job.train, dp_size)
    if job.data.kind is DataKind.indexed:
        try:
            checked = validate_indexed(job)
        except ConfigError as err:
            raise ConfigError(issues + err.issues) from None
    if issues:
        raise ConfigError(issues)
    if job.data.kind is DataKind.synthetic:
        source: SampleSource = SyntheticSamples.from_job(job)
    else:
        source = build_indexed_samples(job, checked=checked)
    return _stream(source, job.train, dp_rank=dp_rank, dp_size=dp_size, start_step=start_step)
