"""Which decoder layers each pipeline rank and model chunk holds, as Megatron-Core builds them.

Megatron splits the decoder evenly over ``pp x vpp`` chunks unless the first and/or last pipeline stage is given its
own layer count (``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``, Megatron-LM's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``); the other (middle) stages then
share the rest evenly; or unless the embedding and/or the loss count as one layer of the split
(``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``): the decoder's layers plus
those split evenly, the first chunk of the first stage (the last chunk of the last stage) holding one decoder layer
fewer. Every stage's layers are split evenly over its ``vpp`` chunks, and chunk ``c`` of every rank comes before chunk
``c + 1`` of any rank. Or a per-stage layout string says what each chunk holds (``pipeline_model_parallel_layout``,
:mod:`cfp_megatron.base.pipeline_layout`): the decoder layers, and where the embedding, the loss and any
multi-token-prediction (MTP) layers sit. :func:`chunk_layers` reproduces ``get_transformer_layer_offset`` and
``get_num_layers_to_build`` (the tests compare them) and says which chunk holds the embedding, the loss and the MTP
layers; the simulator, the memory model and the search read it instead of dividing the layer count themselves or
assuming the ends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cfp_megatron.base.config import MlpPartition, RecomputeMethod
from cfp_megatron.base.errors import ConfigIssue
from cfp_megatron.base.pipeline_layout import DECODER, EMBEDDING, LOSS, MTP, layout_count_issues, layout_stages

if TYPE_CHECKING:
    from cfp_megatron.base.config import JobSpec, ParallelSpec


@dataclass(frozen=True, kw_only=True)
class ChunkLayers:
    """The decoder layers of one model chunk on one pipeline rank."""

    offset: int
    """Index of the chunk's first layer in the whole decoder."""
    count: int
    """Layers in the chunk."""
    moe: int
    """Of those, MoE layers (the decoder's first ``moe_first_dense_layers`` are dense)."""
    embedding: bool = False
    """Whether the chunk holds the input embedding (Megatron-Core builds it on the first chunk of the first stage)."""
    loss: bool = False
    """Whether the chunk holds the final norm, the output layer and the loss (the last chunk of the last stage)."""
    mtp: int = 0
    """Multi-token-prediction layers in the chunk (the last chunk of the last stage without a layout, else where the
    layout's ``m`` sit)."""

    @property
    def dense(self) -> int:
        """Dense layers in the chunk."""
        return self.count - self.moe

    def leading(self, n: int) -> tuple[int, int]:
        """(dense, MoE) layers among the chunk's first ``n`` (a chunk's dense layers come first, as the decoder's
        do)."""
        n = min(n, self.count)
        dense = min(n, self.dense)
        return dense, n - dense

    def trailing(self, n: int) -> tuple[int, int]:
        """(dense, MoE) layers among the chunk's last ``n`` (its MoE layers come last)."""
        n = min(n, self.count)
        moe = min(n, self.moe)
        return n - moe, moe

    def recomputed(self, parallel: ParallelSpec) -> tuple[int, int]:
        """(dense, MoE) layers of the chunk the plan's recomputation covers: all of them, or with the ``block``
        method the first ``recompute_num_layers``."""
        block = parallel.recompute_method is RecomputeMethod.block
        return self.leading(parallel.recompute_num_layers if block else self.count)

    def primepar(self, parallel: ParallelSpec) -> int:
        """Dense layers of the chunk whose MLP runs PrimePar: none under Megatron's partition, else the first
        ``primepar_layers`` (every one by default; the runtime's :func:`~cfp_megatron.layers.primepar_mlp.
        with_primepar_mlp`)."""
        return self.primepar_of(parallel.mlp, parallel.primepar_layers)

    def primepar_of(self, mlp: MlpPartition, primepar_layers: int | None) -> int:
        """:meth:`primepar` from the two fields it reads (``parallel.mlp``, ``parallel.primepar_layers``)."""
        if mlp is not MlpPartition.primepar:
            return 0
        return self.leading(self.count if primepar_layers is None else primepar_layers)[0]


def bf16_end_layers(chunks: tuple[tuple[ChunkLayers, ...], ...], start: int, end: int
                    ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``[rank][chunk]`` (dense, MoE) decoder layers kept in bf16 by ``start`` layers at the stack's start and ``end``
    at its end (Megatron-Core's ``num_layers_at_start_in_bf16`` / ``_end_in_bf16``): the first chunk's leading
    layers and the last chunk's trailing ones (the counts are checked against those chunks,
    :class:`~cfp_megatron.base.parallel_dims.ParallelDims`)."""
    out = [[(0, 0)] * len(row) for row in chunks]
    first, last = chunks[0][0], chunks[-1][-1]
    out[0][0] = first.leading(start)
    if last is first:  # one chunk holds both ends
        tail = first.trailing(min(end, first.count - min(start, first.count)))
        out[0][0] = (out[0][0][0] + tail[0], out[0][0][1] + tail[1])
    else:
        out[-1][-1] = last.trailing(end)
    return tuple(tuple(row) for row in out)


def split_issues(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None,
                 prefix: str = "parallel", *, embedding: bool = False, loss: bool = False, layout: str | None = None,
                 mtp: int = 0) -> list[ConfigIssue]:
    """What is wrong with splitting ``num_layers`` layers over ``pp`` stages of ``vpp`` chunks with ``first`` /
    ``last`` layers on the first / last stage (``None`` = like the others), the embedding and/or the loss counted as
    a layer (``embedding``, ``loss``), or by a per-stage ``layout`` (whose syntax and stages
    :class:`~cfp_megatron.base.config.ParallelSpec` checked) for a model with ``mtp`` MTP layers; Megatron-Core's own
    checks, as :class:`~cfp_megatron.base.errors.ConfigIssue` values naming the setting and the fix."""
    issues: list[ConfigIssue] = []
    if layout is not None:
        return layout_count_issues(layout, num_layers, mtp, f"{prefix}.pipeline_model_parallel_layout")
    if embedding or loss:
        units = num_layers + embedding + loss
        counted = " and ".join(name for name, on in (("embedding", embedding), ("loss", loss)) if on)
        if units % (pp * vpp):
            issues.append(ConfigIssue(
                key=f"{prefix}.pp", value=pp,
                problem=f"model.num_layers={num_layers} plus the {counted} counted in the split ({units}) is not "
                        f"divisible by parallel.pp x parallel.vpp = {pp} x {vpp}.",
                fix="use a parallel.pp (and parallel.vpp) whose product divides it, or count the embedding/loss "
                    "otherwise (parallel.account_for_*_in_pipeline_split)."))
        return issues
    if first is None and last is None:
        if num_layers % (pp * vpp):
            issues.append(ConfigIssue(key=f"{prefix}.pp", value=pp, problem=f"model.num_layers={num_layers} is not "
                                      f"divisible by parallel.pp x parallel.vpp = {pp} x {vpp}.",
                                      fix=f"use a parallel.pp (and parallel.vpp) whose product divides {num_layers}, "
                                          "or give the first/last stage its own count (parallel.first_stage_layers, "
                                          "parallel.last_stage_layers)."))
        return issues
    if pp == 1:
        return [ConfigIssue(key=f"{prefix}.first_stage_layers" if first is not None else f"{prefix}.last_stage_layers",
                            value=first if first is not None else last,
                            problem="a first/last stage layer count needs pipeline parallelism (parallel.pp > 1).",
                            fix="set parallel.first_stage_layers=null and parallel.last_stage_layers=null.")]
    rest, middle = num_layers, pp
    for name, value in (("first_stage_layers", first), ("last_stage_layers", last)):
        if value is None:
            continue
        rest, middle = rest - value, middle - 1
        if value < 1:
            issues.append(ConfigIssue(key=f"{prefix}.{name}", value=value, problem="a stage needs at least one "
                                      "layer.", fix=f"set {prefix}.{name} to 1 or more, or null for an even split."))
        elif value % vpp:
            issues.append(ConfigIssue(key=f"{prefix}.{name}", value=value, problem=f"the stage's {value} layers do "
                                      f"not split into parallel.vpp={vpp} model chunks.",
                                      fix=f"use a multiple of {vpp}, or another parallel.vpp."))
    if middle == 0 and vpp > 1:
        issues.append(ConfigIssue(key=f"{prefix}.vpp", value=vpp, problem="with both the first and the last stage "
                                  "given their own layer count and no stage between them, Megatron-Core cannot place "
                                  "interleaved chunks (it divides by the number of middle stages).",
                                  fix="set parallel.vpp=null, or leave parallel.last_stage_layers=null."))
    if rest < 0 or bool(rest) != bool(middle) or (middle and rest % (middle * vpp)):
        issues.append(ConfigIssue(
            key=f"{prefix}.first_stage_layers" if first is not None else f"{prefix}.last_stage_layers",
            value=first if first is not None else last,
            problem=f"after the first/last stage ({first}/{last} layers), {rest} of model.num_layers={num_layers} "
                    f"layers remain for {middle} middle stages of parallel.vpp={vpp} chunks each, which do not "
                    "split evenly.",
            fix=f"choose counts that leave a multiple of {max(middle, 1) * vpp} layers for the middle stages."))
    return issues


def stage_counts(num_layers: int, pp: int, first: int | None = None, last: int | None = None, *,
                 embedding: bool = False, loss: bool = False, layout: str | None = None) -> list[int]:
    """Decoder layers on each pipeline stage (the split must be valid, see :func:`split_issues`)."""
    if layout is not None:
        stages = layout_stages(layout)
        return [sum(stage.count(DECODER) for stage in stages[rank::pp]) for rank in range(pp)]
    if embedding or loss:
        counts = [(num_layers + embedding + loss) // pp] * pp
        counts[0] -= embedding
        counts[-1] -= loss
        return counts
    if first is None and last is None:
        return [num_layers // pp] * pp
    rest = num_layers - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    each = rest // middle if middle else 0
    counts = [each] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


@functools.lru_cache(maxsize=4096)
def chunk_layers(num_layers: int, pp: int, vpp: int, first: int | None = None, last: int | None = None, *,
                 first_dense: int | None = None, embedding: bool = False, loss: bool = False,
                 layout: str | None = None, mtp: int = 0) -> tuple[tuple[ChunkLayers, ...], ...]:
    """``[rank][chunk]`` layers of the split (valid, see :func:`split_issues`); ``first_dense`` is the number of
    leading dense layers of a MoE decoder (``None``: every layer dense); ``embedding`` / ``loss``: counted as a layer
    of the first chunk of the first stage / the last chunk of the last stage; ``layout``: a per-stage layout string
    says what each chunk holds instead (chunk ``c`` of rank ``r`` is its stage ``c x pp + r``); ``mtp``: the
    model's MTP layers, on the last chunk of the last stage unless the layout places them."""
    dense_end = num_layers if first_dense is None else first_dense
    if layout is not None:
        stages = layout_stages(layout)
        before = [0]  # decoder layers in the stages before each stage
        for stage in stages:
            before.append(before[-1] + stage.count(DECODER))
        rows = []
        for r in range(pp):
            row = []
            for c in range(vpp):
                stage = stages[c * pp + r]
                offset, count = before[c * pp + r], stage.count(DECODER)
                moe = max(0, offset + count - max(offset, dense_end))
                row.append(ChunkLayers(offset=offset, count=count, moe=min(moe, count), embedding=EMBEDDING in stage,
                                       loss=LOSS in stage, mtp=stage.count(MTP)))
            rows.append(tuple(row))
        return tuple(rows)
    if embedding or loss:
        per_chunk = [(num_layers + embedding + loss) // (pp * vpp)] * pp
        embedding_units = int(embedding)
    else:
        per_chunk = [n // vpp for n in stage_counts(num_layers, pp, first, last)]
        embedding_units = 0
    round_size = sum(per_chunk)  # layers (and counted embedding/loss) in chunk c of all ranks together
    out = []
    for r in range(pp):
        row = []
        for c in range(vpp):
            is_first, is_last = (r, c) == (0, 0), (r, c) == (pp - 1, vpp - 1)
            offset = c * round_size + sum(per_chunk[:r]) - (0 if is_first else embedding_units)
            count = per_chunk[r] - (embedding and is_first) - (loss and is_last)
            moe = max(0, offset + count - max(offset, dense_end))
            row.append(ChunkLayers(offset=offset, count=count, moe=min(moe, count), embedding=is_first, loss=is_last,
                                   mtp=mtp if is_last else 0))
        out.append(tuple(row))
    return tuple(out)


def job_chunks(job: JobSpec) -> tuple[tuple[ChunkLayers, ...], ...]:
    """``[rank][chunk]`` layers of ``job``'s decoder under its pipeline sizes, first/last stage counts, the
    embedding/loss counted in the split or its per-stage layout, with where its embedding, loss and MTP layers sit."""
    return split_chunks(job_split(job))


SplitKey = tuple[int, int, int, int | None, int | None, int | None, bool, bool, str | None, int]
"""What :func:`job_chunks` reads of a job (:func:`job_split`): :func:`chunk_layers`' arguments, in order."""


def job_split(job: JobSpec) -> SplitKey:
    """The :data:`SplitKey` of ``job``: equal keys, equal :func:`job_chunks` (a hashable key for what depends on the
    split alone)."""
    m, p = job.model, job.parallel
    pipelined = p.pp > 1
    return (m.num_layers, p.pp, p.vpp or 1, p.first_stage_layers if pipelined else None,
            p.last_stage_layers if pipelined else None, m.moe_first_dense_layers if m.is_moe else None,
            p.account_for_embedding_in_pipeline_split and pipelined, p.account_for_loss_in_pipeline_split and pipelined,
            p.pipeline_model_parallel_layout if pipelined else None, m.mtp_num_layers)


def split_chunks(key: SplitKey) -> tuple[tuple[ChunkLayers, ...], ...]:
    """:func:`chunk_layers` of a :data:`SplitKey`."""
    num_layers, pp, vpp, first, last, first_dense, embedding, loss, layout, mtp = key
    return chunk_layers(num_layers, pp, vpp, first, last, first_dense=first_dense, embedding=embedding, loss=loss,
                        layout=layout, mtp=mtp)


def max_chunk_count(chunks: tuple[tuple[ChunkLayers, ...], ...]) -> int:
    """Decoder layers of the largest model chunk of a split."""
    return max(chunk.count for row in chunks for chunk in row)
