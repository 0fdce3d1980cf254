"""The layouts a search may choose: every combination of DP, TP, PP, virtual PP, CP, EP, expert TP, sequence
parallelism, micro-batch, recompute and distributed optimizer that the model, the cluster and the runtime allow.

Knobs are checked family by family (a TP size that does not divide the heads rules out every plan with it) so the
reasons a search reports name whole families, and the combinations of what is left are enumerated in a fixed order.
Only layouts the runtime executes are offered: Megatron-Core's own layers under its TP/SP/CP/EP splits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import (
    FsdpStrategy,
    JobSpec,
    MlpPartition,
    ModelSpec,
    ParallelSpec,
    Precision,
    Recompute,
    RecomputeMethod,
    RecomputeModule,
    TrainSpec,
    resolve_precision,
)
from cfp_megatron.base.errors import ConfigIssue
from cfp_megatron.base.layout_rules import batch, moe, pipeline, recompute, sequence, tensor
from cfp_megatron.base.layout_rules.problem import briefs
from cfp_megatron.base.parallel_dims import data_parallel_size, expert_data_parallel_size, model_parts
from cfp_megatron.base.pipeline_layout import balanced_layout
from cfp_megatron.base.pipeline_split import split_issues, stage_counts
from cfp_megatron.model.options import PartitionOption, SizeContext, choice_fits, model_options, size_reasons


@dataclass(frozen=True, kw_only=True, order=True)
class Candidate:
    """One layout (DP is what the world leaves: ``world / (tp x cp x pp)``)."""

    tp: int
    """Tensor-parallel size."""
    cp: int
    """Context-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    ep: int
    """Expert-parallel size (1 for dense models)."""
    etp: int
    """Expert tensor-parallel size (1 for dense models)."""
    sp: bool
    """Sequence parallelism."""
    micro_batch: int
    """Sequences per micro-batch."""
    recompute: str
    """Recompute granularity (a :class:`~cfp_megatron.base.config.Recompute` value), or ``block``: full recomputation of
    the first ``recompute_layers`` layers of each pipeline chunk (Megatron's ``recompute_method=block``)."""
    mlp: str = MlpPartition.megatron.value
    """Partition of the dense MLP over the TP group (a :class:`~cfp_megatron.base.config.MlpPartition` value)."""
    vpp: int
    """Model chunks per pipeline rank."""
    first_stage_layers: int = 0
    """Decoder layers on the first pipeline stage (0: as many as the middle stages)."""
    last_stage_layers: int = 0
    """Decoder layers on the last pipeline stage (0: as many as the middle stages)."""
    balanced: bool = False
    """The decoder spread as evenly as possible over the ``pp x vpp`` model chunks, the first ones holding a layer
    more (Megatron-DeepSpeed's uniform partition with a remainder), run as Megatron-Core's per-stage layout
    (:func:`~cfp_megatron.base.pipeline_layout.balanced_layout`, ``parallel.pipeline_model_parallel_layout``): a
    split whose layers the chunks do not divide. ``first_stage_layers`` and ``last_stage_layers`` are then 0."""
    distributed_optimizer: bool
    """Megatron's distributed optimizer."""
    recompute_layers: int = 0
    """With ``recompute=block``: layers recomputed per chunk; the search sets it to the fewest that fit in memory
    (0 until then)."""
    primepar_layers: int = 0
    """With ``mlp=primepar``: layers per chunk whose MLP runs PrimePar, the others Megatron's (0: every layer); the
    search sets it to the most that fit in memory where every layer's does not and PrimePar's layer is the
    faster."""
    dp_overlap: bool = False
    """Overlap the data-parallel gradient reduce and (with the distributed optimizer) parameter gather with the
    passes (``parallel.overlap_grad_reduce`` / ``overlap_param_gather``): on for GPU clusters
    (:attr:`Space.gpu_overlap`)."""
    tp_overlap: bool = False
    """Transformer Engine's TP communication overlap (``parallel.tp_comm_overlap``); the search turns it on where it
    runs (:meth:`Space.tp_overlap`) and its buffers fit in memory."""
    a2a_overlap: bool = False
    """Overlap the expert all-to-all with another micro-batch (``parallel.moe_a2a_overlap``); the search turns it on
    where Megatron-Core runs it (:meth:`Space.a2a_overlap`) and its extra micro-batch in flight fits in memory."""
    fsdp: str = FsdpStrategy.none.value
    """Megatron-FSDP's strategy (a :class:`~cfp_megatron.base.config.FsdpStrategy` value, ``parallel.fsdp``), with the
    distributed optimizer: the search sets the least sharding that fits in memory (:meth:`Space.sharding_ladder`)."""
    dp_shard: int = 0
    """With ``fsdp``: ranks of DP x CP one hybrid shard group spans (``parallel.dp_shard_size``; 0: all of them)."""

    def key(self) -> tuple:
        """The fields that place it in the space, in order (candidates sort by it; :meth:`from_key` inverts it);
        ``recompute_layers`` and ``primepar_layers``, which the search chooses, are not among them."""
        return tuple(getattr(self, name) for name in _KEY_FIELDS)

    @classmethod
    def from_key(cls, key: tuple) -> Candidate:
        """The candidate of :meth:`key`'s tuple."""
        return cls(**dict(zip(_KEY_FIELDS, key, strict=True)))

    def layout(self, model: ModelSpec) -> str | None:
        """The per-stage layout string of a balanced split of ``model`` (``None`` for the others)."""
        if not self.balanced:
            return None
        return balanced_layout(model.num_layers, self.pp, self.vpp, mtp_layers=model.mtp_num_layers)

    def parallel(self, base: ParallelSpec, *, layout: str | None = None) -> ParallelSpec:
        """``base`` with this layout's sizes (``layout``: its :meth:`layout` string, which a balanced split needs)."""
        return ParallelSpec._replaced(base, **self._changes(base, layout))

    def _changes(self, base: ParallelSpec, layout: str | None) -> dict[str, object]:
        """The :class:`ParallelSpec` fields this layout sets on ``base`` (:meth:`parallel`)."""
        if self.balanced and layout is None:
            raise ValueError("a balanced split's ParallelSpec needs its layout string (Candidate.layout(model))")
        return dict(tp=self.tp, sp=self.sp, pp=self.pp, vpp=self.vpp if self.vpp > 1 else None,
                    first_stage_layers=self.first_stage_layers or None,
                    last_stage_layers=self.last_stage_layers or None,
                    account_for_embedding_in_pipeline_split=False,  # not offered by the search yet
                    account_for_loss_in_pipeline_split=False,
                    pipeline_model_parallel_layout=layout,
                    cp=self.cp, ep=self.ep, etp=self.etp if self.ep > 1 or self.etp > 1 else None,
                    distributed_optimizer=self.distributed_optimizer, mlp=MlpPartition(self.mlp),
                    primepar_layers=self.primepar_layers or None,
                    moe_a2a_overlap=self.a2a_overlap, tp_comm_overlap=self.tp_overlap,
                    overlap_grad_reduce=base.overlap_grad_reduce or self.dp_overlap,
                    **self._recompute(base),
                    overlap_param_gather=(base.overlap_param_gather or self.dp_overlap) and self.distributed_optimizer,
                    fp8_param_gather=base.fp8_param_gather and self.distributed_optimizer,
                    fsdp=FsdpStrategy(self.fsdp), dp_shard_size=self.dp_shard or None)

    def _recompute(self, base: ParallelSpec) -> dict[str, object]:
        """The recompute fields; a selective candidate recomputes ``base``'s ``recompute_modules`` (the user's)."""
        if self.recompute == BLOCK:
            return {"recompute": Recompute.full, "recompute_method": RecomputeMethod.block,
                    "recompute_num_layers": max(self.recompute_layers, 1), "recompute_modules": None}
        recompute, modules = recompute_parts(self.recompute, base.recompute_modules)
        return {"recompute": recompute, "recompute_method": RecomputeMethod.uniform, "recompute_num_layers": 1,
                "recompute_modules": modules}

    def job(self, job: JobSpec) -> JobSpec:
        """``job`` under this layout."""
        return JobSpec(model=job.model, cluster=job.cluster, parallel=self.parallel(job.parallel,
                                                                                    layout=self.layout(job.model)),
                       train=_train_with(job.train, self.micro_batch), data=job.data)

    def shared_job(self, job: JobSpec, specs: dict[tuple, ParallelSpec]) -> JobSpec:
        """:meth:`job`, its :class:`ParallelSpec` (checked) taken from ``specs`` where an equal one was built from the
        same ``job`` (the store of one search: many candidates differ from each other only outside it, e.g. in the
        micro-batch); raises :class:`ConfigError` as :meth:`job` does."""
        changes = self._changes(job.parallel, self.layout(job.model))
        key = tuple(changes.items())
        parallel = specs.get(key)
        if parallel is None:
            parallel = specs[key] = ParallelSpec._replaced(job.parallel, **changes)
        return JobSpec(model=job.model, cluster=job.cluster, parallel=parallel,
                       train=_train_with(job.train, self.micro_batch), data=job.data)

    def screened_job(self, job: JobSpec) -> JobSpec:
        """:meth:`job` for a candidate of the search's own space, equal to it: its :class:`ParallelSpec` built
        without the checks the search's screens already ran (:meth:`ParallelSpec._replaced
        <cfp_megatron.base.config.ParallelSpec._replaced>`).
        The job's cross-section checks (:meth:`~cfp_megatron.base.parallel_dims.ParallelDims.build`) still run in
        the simulator."""
        base = job.parallel
        parallel = ParallelSpec._replaced(base, checked=False, **self._changes(base, self.layout(job.model)))
        return JobSpec(model=job.model, cluster=job.cluster, parallel=parallel,
                       train=_train_with(job.train, self.micro_batch), data=job.data)

    def describe(self, world: int) -> str:
        """A short label such as ``dp8 tp8 sp pp16 vpp2 mb1 rc=none dopt`` (``first7 last7``: layers of the first
        and the last pipeline stage where they differ from the others)."""
        dp = data_parallel_size(world, self.tp, self.cp, self.pp)
        parts = [f"dp{dp}", f"tp{self.tp}" + (" sp" if self.sp else ""), f"pp{self.pp}"]
        parts += [f"vpp{self.vpp}"] if self.vpp > 1 else []
        parts += [f"first{self.first_stage_layers}"] if self.first_stage_layers else []
        parts += [f"last{self.last_stage_layers}"] if self.last_stage_layers else []
        parts += ["balanced"] if self.balanced else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp > 1 else []
        rc = f"block{self.recompute_layers}" if self.recompute == BLOCK else self.recompute
        if rc.startswith(MODULES):
            rc = f"selective[{rc[len(MODULES):]}]"
        parts += [f"primepar{self.primepar_layers or ''}"] if self.mlp == MlpPartition.primepar.value else []
        parts += [f"mb{self.micro_batch}", f"rc={rc}"]
        parts += ["dopt"] if self.distributed_optimizer else []
        parts += [f"fsdp={self.fsdp}"] if self.fsdp != FsdpStrategy.none.value else []
        parts += [f"shard{self.dp_shard}"] if self.dp_shard else []
        parts += ["tpco"] if self.tp_overlap else []
        parts += ["a2ao"] if self.a2a_overlap else []
        return " ".join(parts)


@functools.lru_cache(maxsize=64)
def _train_with(train: TrainSpec, micro_batch: int) -> TrainSpec:
    """``train`` with ``micro_batch`` sequences per micro-batch (checked, once: a search builds a job per candidate,
    from a few micro-batch sizes)."""
    return dataclasses.replace(train, micro_batch_size=micro_batch)


_KEY_FIELDS = tuple(f.name for f in dataclasses.fields(Candidate) if f.name not in ("recompute_layers",
                                                                                     "primepar_layers", "dp_overlap",
                                                                                     "tp_overlap", "a2a_overlap",
                                                                                     "fsdp", "dp_shard"))



@dataclass(frozen=True, kw_only=True, order=True)
class Family:
    """The model-parallel sizes a group of candidates shares (their process-group layout)."""

    tp: int
    """Tensor-parallel size."""
    cp: int
    """Context-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    ep: int
    """Expert-parallel size."""
    etp: int
    """Expert tensor-parallel size."""

    @classmethod
    def of_prefix(cls, prefix: tuple) -> Family:
        """The family of :func:`family_of_key`'s prefix."""
        return cls(**dict(zip(FAMILY_FIELDS, prefix, strict=True)))

    def dp(self, world: int) -> int:
        """Data-parallel size."""
        return data_parallel_size(world, self.tp, self.cp, self.pp)


FAMILY_FIELDS = tuple(f.name for f in dataclasses.fields(Family))
"""The fields of a :class:`Family`: the first fields of every :meth:`Candidate.key`, in that order."""


def family_of_key(key: tuple) -> tuple:
    """The family part of a candidate key (its first :data:`FAMILY_FIELDS`), a cheap label for what the search
    reports by family; :meth:`Family.of_prefix` makes it a Family."""
    return key[:len(FAMILY_FIELDS)]


@dataclass(frozen=True, kw_only=True)
class Rejection:
    """A knob value, or a family, that no plan can use, and why."""

    what: str
    """The rejected value or family, e.g. ``tp=3`` or ``tp8 pp16 cp1``."""
    reason: str
    """Why, with the numbers."""
    count: int = 0
    """Plans it rules out (0 where the value never made a family)."""


SEARCHED_FSDP = (FsdpStrategy.none, FsdpStrategy.optim_grads, FsdpStrategy.optim_grads_params)
"""The Megatron-FSDP strategies the search sets, least sharded first (``optim`` is refused; the distributed
optimizer shards the same states)."""

BLOCK = "block"
"""The candidate recompute value for full recomputation of only some layers per chunk (``recompute_method=block``)."""

MODULES = "selective:"
"""Prefix of a candidate recompute value that recomputes named submodules selectively: ``selective:moe_act+layernorm``
(Megatron-Core's ``recompute_modules``); a plain ``selective`` recomputes the user's modules (core attention by
default)."""


def recompute_parts(value: str, user_modules: str | None = None) -> tuple[Recompute, str | None]:
    """(granularity, modules) of a candidate's recompute value: ``block`` is full recomputation, ``selective:<m>``
    selective recomputation of the modules ``m`` (``+``-joined), a plain ``selective`` that of ``user_modules``
    (``parallel.recompute_modules``); modules are ``None`` for any other granularity."""
    if value == BLOCK:
        return Recompute.full, None
    if value.startswith(MODULES):
        return Recompute.selective, value[len(MODULES):]
    recompute = Recompute(value)
    return recompute, user_modules if recompute is Recompute.selective else None


@functools.lru_cache(maxsize=64)
def offered_modules(model: ModelSpec, *, te_available: bool) -> str | None:
    """The submodules the search offers to recompute besides core attention, where the user names none: a MoE
    model's norms and expert activations (cheap to recompute, and a routed expert's activation input is among the
    largest tensors a MoE layer keeps), with MLA's up-projections on an MLA model: what NVIDIA's H100 MoE recipes
    recompute (GPT-OSS: ``layernorm+moe_act``). ``None`` for a dense model, or without Transformer Engine (the
    experts' activation is recomputed only in its grouped-GEMM experts): the offer is those of them that the
    recomputation rules allow (:func:`~cfp_megatron.base.layout_rules.recompute.modules_fit`), and none without
    ``moe_act``."""
    parts = model_parts(model)
    offer = [m.value for m in (RecomputeModule.moe_act, RecomputeModule.layernorm, RecomputeModule.mla_up_proj)
             if not recompute.modules_fit({m.value}, parts, te=te_available)]
    return "+".join(offer) if RecomputeModule.moe_act.value in offer else None

MAX_STAGE_DEFICIT = 2
"""How many model chunks of layers fewer than a middle stage the first or the last pipeline stage may hold."""


@functools.lru_cache(maxsize=4096)
def _pipeline_splits(num_layers: int, pp: int, interleave: bool) -> tuple[tuple[int, int, int, bool], ...]:
    """See :meth:`Space.pipeline_splits` (``interleave``: whether the micro-batch count allows vpp > 1)."""
    if pp == 1:
        return ((1, 0, 0, False),)
    values: list[tuple[int, int, int, bool]] = []
    for vpp in range(1, (num_layers // pp if interleave else 1) + 1):
        found = len(values)
        for a in range(MAX_STAGE_DEFICIT + 1):
            for b in range(MAX_STAGE_DEFICIT + 1):
                total = num_layers + (a + b) * vpp
                if total % (pp * vpp):
                    continue
                middle = total // pp
                first, last = (middle - a * vpp if a else None), (middle - b * vpp if b else None)
                if split_issues(num_layers, pp, vpp, first, last):
                    continue
                counts = stage_counts(num_layers, pp, first, last)
                # one entry per split: a stage with the middle stages' count is written as 0 (pp = 2: the last)
                even = counts[1] if pp > 2 else counts[0]
                split = (vpp, 0 if counts[0] == even else counts[0], 0 if counts[-1] == even else counts[-1], False)
                if split not in values and not split_issues(num_layers, pp, vpp, split[1] or None, split[2] or None):
                    values.append(split)
        if len(values) == found and vpp in (1, num_layers // pp):  # no even or first/last split: the balanced layout
            values.append((vpp, 0, 0, True))
    return tuple(values)


@functools.lru_cache(maxsize=4096)
def max_chunk_layers(num_layers: int, pp: int, vpp: int, first: int, last: int, balanced: bool = False) -> int:
    """Layers of the largest model chunk of a split (``first``/``last`` 0: as the middle stages; ``balanced``: the
    balanced layout, whose first chunks hold the most)."""
    if balanced:
        return -(-num_layers // (pp * vpp))
    return max(stage_counts(num_layers, pp, first or None, last or None)) // vpp


@functools.lru_cache(maxsize=8192)
def split_stage_counts(num_layers: int, pp: int, vpp: int, first: int, last: int,
                       balanced: bool = False) -> tuple[int, ...]:
    """Decoder layers on each pipeline stage of a split (``first``/``last`` 0: as the middle stages)."""
    if balanced:
        return tuple(stage_counts(num_layers, pp, layout=balanced_layout(num_layers, pp, vpp)))
    return tuple(stage_counts(num_layers, pp, first or None, last or None))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _allowed(cfp: CfpSpec, name: str, values: list, rejected: list[Rejection], world: int) -> list:
    """``values`` within the pin or set of knob ``name``; a pinned or allowed value that is not among them is
    rejected with its reason (unless a reason against it is already there)."""
    allowed = cfp.allowed(name)
    if allowed is None:
        return values
    keep = [v for v in values if v in allowed]
    said = {r.what for r in rejected}
    for v in allowed:
        what = f"{name}={_value(v)}"
        if v in values or what in said:
            continue
        sized = isinstance(v, int) and not isinstance(v, bool)
        reason = (f"does not divide the world size {world}" if sized and world % v
                  else "not valid for this model (see the other reasons)")
        rejected.append(Rejection(what=what, reason=reason))
    return keep


def _screen(cfp: CfpSpec, name: str, values: list[int], reasons: Callable[[int], list[str]],
            rejected: list[Rejection], world: int) -> list[int]:
    """The values of knob ``name`` with no reason against them, within the pins and sets; the others go to
    ``rejected`` with their reasons."""
    kept = []
    for v in values:
        why = reasons(v)
        if why:
            rejected.append(Rejection(what=f"{name}={v}", reason="; ".join(why)))
        else:
            kept.append(v)
    return _allowed(cfp, name, kept, rejected, world)


def _value(v: object) -> str:
    return str(getattr(v, "value", v)).lower()


@dataclass(frozen=True, kw_only=True)
class Space:
    """The families and knob values of one search, and what was ruled out on the way."""

    world: int
    """Ranks."""
    families: tuple[Family, ...]
    """Valid model-parallel families."""
    rejected: tuple[Rejection, ...]
    """Values and families ruled out, with reasons."""
    job: JobSpec
    """The job being planned."""
    cfp: CfpSpec
    """The planner's settings."""
    options: tuple[PartitionOption, ...] = ()
    """The model's partition options (:func:`~cfp_megatron.model.options.model_options`)."""
    choices: dict[tuple[int, int], bool] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """Whether PrimePar's MLP fits, by (TP size, micro-batch), filled as the search asks."""
    te_available: bool = True
    """Whether Transformer Engine runs the plan (preflight planning for GPUs assumes it)."""
    primepar: frozenset[int] | None = None
    """TP sizes at which PrimePar's MLP may be offered; ``None``: wherever it runs (the analytical model has it).
    With measurements, the sizes profiling timed it at: a plan is never compared on an analytical layer against
    measured ones."""

    @property
    def gpu_overlap(self) -> bool:
        """Whether the search turns on the communication overlaps NVIDIA's recipes run: a GPU cluster, and
        ``cfp.overlap`` not false."""
        return self.cfp.overlap is not False and not self.job.cluster.on_cpu

    def tp_overlap(self, *, tp: int, sp: bool) -> bool:
        """Whether a candidate may overlap its TP communication (Transformer Engine's userbuffers): TP > 1 with
        sequence parallelism, Transformer Engine (or a preflight that assumes it) on a cluster that supports it
        (``cluster.supports_tp_overlap``: Hopper or later, whose comm-GEMM overlap NVIDIA's recipes turn on), and
        :attr:`gpu_overlap`."""
        return (self.gpu_overlap and tp > 1 and sp and self.te_available
                and self.job.cluster.supports_tp_overlap is True)

    def a2a_overlap(self, *, ep: int, pp: int, vpp: int | None, recompute: str) -> bool:
        """Whether a candidate may overlap its expert all-to-all with another micro-batch: a MoE model with EP > 1
        and the alltoall or flex dispatcher in bf16/fp16, no full recomputation, the interleaved schedule when
        pipelined (``vpp=None``: some chunk count may be), and :attr:`gpu_overlap`."""
        job = self.job
        model = job.model
        if not self.gpu_overlap or not model.is_moe:
            return False
        if resolve_precision(job.train.precision, on_gpu=True) is Precision.fp32:
            return False
        return not (moe.a2a_overlap_needs_ep(True, ep)
                    or moe.overlap_dispatcher(overlaps=["moe_a2a_overlap"], dispatcher=model.moe_token_dispatcher.value)
                    or moe.a2a_overlap_schedule(a2a_overlap=True, shared_overlap=job.parallel.moe_shared_expert_overlap,
                                                full_recompute=recompute_parts(recompute)[0] is Recompute.full,
                                                pp=pp, vpp=vpp))

    def micro_batches(self, family: Family) -> list[int]:
        """Micro-batch sizes that divide the family's per-rank batch."""
        per_rank = self.job.train.global_batch_size // family.dp(self.world)
        sizes = [mb for mb in _divisors(per_rank) if mb <= self.cfp.constraints.max_micro_batch]
        allowed = self.cfp.allowed("micro_batch")
        return [mb for mb in sizes if allowed is None or mb in allowed]

    def sp_values(self, family: Family) -> list[bool]:
        """Sequence-parallel settings valid for the family."""
        allowed = self.cfp.allowed("sp")
        return [v for v in (True, False) if not self.sp_problems(family, v) and (allowed is None or v in allowed)]

    def sp_problems(self, family: Family, sp: bool) -> list[str]:
        """Why sequence parallelism on (``sp``) or off does not fit the family (the tensor and sequence rules)."""
        m, seq = self.job.model, self.job.train.seq_length
        return briefs([*tensor.sequence_parallel_needs_tp(sp, family.tp),
                       *sequence.sequence_parallel_split(sp, seq, family.cp, family.tp),
                       *sequence.sequence_parallel_missing(sp, m.is_moe, family.tp)])

    def pipeline_splits(self, family: Family, microbatches: int) -> list[tuple[int, int, int, bool]]:
        """``(vpp, first_stage_layers, last_stage_layers, balanced)`` choices of the family (0: as the middle
        stages).

        ``vpp`` is 1, or with PP a number of chunks every stage's layers split into (the interleaved schedule also
        needs the micro-batch count to be a multiple of PP). Besides the even split, the first and the last stage
        may each hold up to :data:`MAX_STAGE_DEFICIT` chunks of layers fewer than the middle stages (they also run
        the embedding and the output layer and loss, and the first holds the most micro-batches in flight), where the
        rest splits evenly: Megatron-Core's ``num_layers_in_first/last_pipeline_stage``. A decoder whose layer count
        no PP size divides (Llama-3 405B's 126 layers over 16 stages) gets such splits. Where neither gives ``pp x
        vpp`` chunks, the balanced layout spreads the layers as evenly as possible over them (``balanced``,
        Megatron-DeepSpeed's uniform partition with a remainder, run as Megatron-Core's per-stage layout), with one
        chunk per rank and with the most (``num_layers // pp``, one or two layers each, where the interleaved
        schedule's bubble is smallest); the chunk counts between are left out to keep the search fast (each would be
        a candidate of every group)."""
        values = _pipeline_splits(self.job.model.num_layers, family.pp, pipeline.interleaves(microbatches, family.pp))
        if not self.cfp.constraints.uneven_stages:
            values = tuple(v for v in values if v[1:] == (0, 0, False))
        allowed = self.cfp.allowed("vpp")
        return [v for v in values if allowed is None or v[0] in allowed]

    def recompute_values(self) -> list[str]:
        """Recompute granularities, ``block`` (full recomputation of the fewest layers per chunk that fit, chosen by
        the search) where full recomputation is allowed and the model has layers to leave out, and selective
        recomputation of :func:`offered_modules` where selective recomputation is allowed and the user names no
        modules."""
        allowed = self.cfp.allowed("recompute")
        values = [r.value for r in Recompute if allowed is None or r in allowed]
        if Recompute.full.value in values and self.job.model.num_layers > 1:
            values.append(BLOCK)
        modules = offered_modules(self.job.model, te_available=self.te_available)
        if Recompute.selective.value in values and modules and self.job.parallel.recompute_modules is None:
            values.append(MODULES + modules)
        return values

    def mlp_values(self, family: Family, micro_batch: int) -> list[str]:
        """MLP partitions the runtime executes for the family: Megatron's always; PrimePar's
        (:mod:`cfp_megatron.layers`) on a TP group of 4^k ranks (with or without SP: under SP it reshards the
        sequence-split boundary to and from its replicated input and output), for a dense model whose hidden and FFN
        sizes and tokens per micro-batch the grid side divides, unless :attr:`primepar` says it was not profiled at
        that TP size."""
        values = [MlpPartition.megatron]
        key = (family.tp, micro_batch)
        if key not in self.choices:  # asked for every family and micro-batch: answered once per TP and size
            context = SizeContext(seq_length=self.job.train.seq_length, micro_batch=micro_batch)
            self.choices[key] = choice_fits(self.options, "mlp", MlpPartition.primepar.value, self.job.model,
                                            family.tp, context)
        if self.choices[key] and (self.primepar is None or family.tp in self.primepar):
            values.append(MlpPartition.primepar)
        allowed = self.cfp.allowed("mlp")
        return [v.value for v in values if allowed is None or v in allowed]

    def dopt_values(self, family: Family) -> list[bool]:
        """Distributed-optimizer settings (it changes nothing without data parallelism; Megatron-FSDP, where the
        ``cfp`` pins or sets ask for it alone, needs it)."""
        allowed = self.cfp.allowed("distributed_optimizer")
        fsdp_only = FsdpStrategy.none.value not in self.fsdp_values()
        return [v for v in (False, True) if not self.dopt_problems(family, v) and (allowed is None or v in allowed)
                and (v or not fsdp_only)]

    def fsdp_values(self) -> list[str]:
        """The Megatron-FSDP strategies the search may set (``cfp.fsdp`` / ``cfp.constraints.fsdp``, else all it
        trains; none where the job saves checkpoints, :func:`~cfp_megatron.base.layout_rules.batch.fsdp_checkpoints`),
        least sharded first; ``optim`` is refused (:func:`~cfp_megatron.base.layout_rules.batch.
        fsdp_settings`)."""
        allowed = self.cfp.allowed("fsdp")
        return [v.value for v in SEARCHED_FSDP if (allowed is None or v in allowed)
                and not batch.fsdp_checkpoints(v.value, self.job.train.checkpoint_dir)]

    def sharding_ladder(self, cand: Candidate) -> list[tuple[str, int]]:
        """(strategy, hybrid shard size) settings for ``cand`` in the order the search tries them, least sharded
        first: Megatron-Core's DDP, ``optim_grads``, ``optim_grads_params`` hybrid-sharded within an NVLink domain
        (where DP x CP spans more than one; not on CPU nor with expert parallelism,
        :func:`~cfp_megatron.base.layout_rules.batch.shard_groups`), then over all of DP x CP; empty without the
        distributed optimizer, which steps Megatron-FSDP's shards. Unless ``cfp`` pins or sets the strategies, a
        pipelined candidate keeps to Megatron-Core's DDP (Megatron-FSDP's gathers repeat for each of the many
        micro-batches a pipeline needs; docs/planning.md, "Sharded data parallelism")."""
        if not cand.distributed_optimizer:
            return []
        if cand.pp > 1 and self.cfp.allowed("fsdp") is None:
            return [(FsdpStrategy.none.value, 0)]  # unpinned, Megatron-FSDP is searched without pipelining
        dp_cp = data_parallel_size(self.world, cand.tp, cand.cp, cand.pp) * cand.cp
        out: list[tuple[str, int]] = []
        for value in self.fsdp_values():
            if value == FsdpStrategy.optim_grads_params.value and not self.job.cluster.on_cpu and cand.ep == 1:
                cluster = self.job.cluster
                domain = cluster.domain_size(cluster.gpus_per_node or self.world, self.world)
                shard = math.gcd(dp_cp, max(domain // cand.tp, 1))  # TP varies fastest, then CP and DP
                if 1 < shard < dp_cp:
                    out.append((value, shard))
            out.append((value, 0))
        return out

    def dopt_problems(self, family: Family, dopt: bool) -> list[str]:
        """Why the distributed optimizer on (``dopt``) does not fit the family (it shards over data parallelism)."""
        expert_dp = (expert_data_parallel_size(self.world, family.etp, family.ep, family.pp)
                     if self.job.model.is_moe else None)
        return briefs(batch.sharded_optimizer(dopt, dp=family.dp(self.world), expert_dp=expert_dp)
                      + batch.distributed_optimizer_kind(dopt, self.job.train.optimizer.value))

    def candidates(self, family: Family) -> Iterator[Candidate]:
        """Every candidate of ``family``, in a fixed order."""
        for key in self.keys(family):
            yield Candidate.from_key(key)

    def keys(self, family: Family) -> Iterator[tuple]:
        """:meth:`candidates` as :meth:`Candidate.key` tuples (what a search sorts, without building objects)."""
        for g in self.groups(family):
            for split in g.splits:
                for dopt in g.dopts:
                    yield g.head + split + (dopt,)

    def groups(self, family: Family) -> Iterator[Group]:
        """The candidates of ``family`` by (micro-batch, SP, recompute), in :meth:`candidates`' order."""
        f = family
        dp = f.dp(self.world)
        dopts = tuple(self.dopt_values(f))
        recomputes = self.recompute_values()
        num_layers = self.job.model.num_layers
        for mb in self.micro_batches(f):
            microbatches = self.job.train.global_batch_size // (dp * mb)
            splits = tuple(self.pipeline_splits(f, microbatches))
            # where every chunk has one layer, block recomputation is full recomputation
            block = tuple(s for s in splits if max_chunk_layers(num_layers, f.pp, *s) >= 2)
            mlps = self.mlp_values(f, mb)  # by TP and micro-batch: the same for every SP and recompute value
            for sp in self.sp_values(f):
                for rc in recomputes:
                    for mlp in mlps:
                        head = tuple.__new__(GroupHead, (f.tp, f.cp, f.pp, f.ep, f.etp, sp, mb, rc, mlp))
                        yield Group(head=head, microbatches=microbatches,
                                    splits=block if rc == BLOCK else splits, dopts=dopts)


GroupHead = NamedTuple("GroupHead", [(name, Candidate.__annotations__[name]) for name in _KEY_FIELDS[:9]])
"""What the candidates of one :class:`Group` share: the first nine fields of their :meth:`Candidate.key` (tp, cp,
pp, ep, etp, sp, micro_batch, recompute, mlp), by :class:`Candidate`'s field names."""


@dataclass(frozen=True, kw_only=True)
class Group:
    """Candidates of one family that share micro-batch, sequence parallelism and recompute (and so their pass
    costs); the pipeline splits and optimizer settings are what varies."""

    head: GroupHead
    """What its candidates share."""
    microbatches: int
    """Micro-batches per step."""
    splits: tuple[tuple[int, int, int, bool], ...]
    """Their ``(vpp, first_stage_layers, last_stage_layers, balanced)`` choices."""
    dopts: tuple[bool, ...]
    """Their distributed-optimizer settings."""

    @property
    def size(self) -> int:
        """Candidates in the group."""
        return len(self.splits) * len(self.dopts)


def build_space(job: JobSpec, world: int, cfp: CfpSpec, *, te_available: bool = True,
                partitions: tuple[PartitionOption, ...] | None = None) -> Space:
    """The families of ``job`` on ``world`` ranks under ``cfp``'s pins and sets, with every value ruled out and why.

    ``partitions``: the model's partition options, as the planner's analysis stage derived them
    (:func:`cfp_megatron.model.derive.partition_options`); ``None`` reads the declared catalogue
    (:func:`~cfp_megatron.model.options.model_options`, equal to the derived one for every preset)."""
    m, t, c = job.model, job.train, job.cluster
    gpn = c.gpus_per_node or world
    domain = c.domain_size(gpn, world)  # the NVLink domain (a node unless cluster.nvlink_domain_size says otherwise),
    # this job's share of it where the job spans several (cluster.nvlink_segment_nodes)
    where = f"nodes of {gpn} GPUs" if domain == gpn else f"NVLink domains of {domain} GPUs"
    rejected: list[Rejection] = []

    options = partitions if partitions is not None else model_options(m)
    sizes_only = SizeContext(seq_length=t.seq_length, micro_batch=1)

    def tp_reasons(tp: int) -> list[str]:
        return size_reasons(options, "tp", m, tp, sizes_only) + (
            [f"a TP group would span {where} (cfp.constraints.tp_within_node=true)"]
            if cfp.constraints.tp_within_node and tp > domain else [])

    def cp_reasons(cp: int) -> list[str]:
        return size_reasons(options, "cp", m, cp, sizes_only) + briefs(sequence.context_needs_te(cp, te_available))

    def pp_reasons(pp: int) -> list[str]:
        if filled := pipeline.stages_filled(m.num_layers, pp):
            return briefs(filled)
        if not cfp.constraints.uneven_stages and m.num_layers % pp:
            return [f"{m.num_layers} layers do not split evenly into {pp} stages (cfp.constraints.uneven_stages="
                    "false)"]
        if not _pipeline_splits(m.num_layers, pp, False):
            return [f"{m.num_layers} layers do not split into {pp} stages, evenly or with the first/last stage up "
                    f"to {MAX_STAGE_DEFICIT} layers lighter"]
        return []

    tps = _screen(cfp, "tp", _divisors(world), tp_reasons, rejected, world)
    cps = _screen(cfp, "cp", _divisors(world), cp_reasons, rejected, world)
    pps = _screen(cfp, "pp", _divisors(world), pp_reasons, rejected, world)

    if m.is_moe:
        eps = _allowed(cfp, "ep", [e for e in _divisors(world) if not size_reasons(options, "ep", m, e, sizes_only)],
                       rejected, world)
        etps = _allowed(cfp, "etp", [e for e in _divisors(world)
                                     if not size_reasons(options, "etp", m, e, sizes_only) and e <= domain],
                        rejected, world)
    else:  # a pin of expert sizes above 1 on a dense model leaves nothing, said as such
        for name in ("ep", "etp"):
            rejected += [Rejection(what=f"{name}={v}", reason=why) for v in cfp.allowed(name) or []
                         for why in briefs(moe.dense_model(model=m.name, a2a_overlap=False, shared_overlap=False,
                                                           **{"ep": 1, "etp": None, name: v}))]
        eps, etps = _allowed(cfp, "ep", [1], rejected, world), _allowed(cfp, "etp", [1], rejected, world)

    families = []
    for tp in tps:
        for cp in cps:
            for pp in pps:
                if batch.model_parallel_world(world, tp, cp, pp):
                    continue
                dp = data_parallel_size(world, tp, cp, pp)
                if why := briefs(batch.global_batch(t.global_batch_size, 1, dp)):  # the micro-batch sizes divide
                    rejected.append(Rejection(what=f"tp{tp} cp{cp} pp{pp}", reason=why[0]))  # what is left
                    continue
                for ep in eps:
                    for etp in etps:
                        if moe.expert_world(world, etp, ep, pp):
                            continue
                        if m.is_moe and etp not in (1, tp) and cfp.allowed("etp") is None:
                            continue  # by default expert TP is 1 or the dense TP (Megatron's usual choices)
                        families.append(Family(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp))
    return Space(world=world, families=tuple(families), rejected=tuple(rejected), job=job, cfp=cfp,
                 te_available=te_available,
                 options=options)


KNOBS = ("tp", "cp", "pp", "ep", "etp", "vpp", "micro_batch", "sp", "recompute", "mlp", "distributed_optimizer", "fsdp")
"""The knobs ``cfp`` may pin (``cfp.tp=2``) or restrict to a set (``cfp.constraints.tp=[2,4]``)."""


def has_layout(space: Space) -> bool:
    """Whether any candidate is left (stops at the first group that holds one)."""
    return any(g.size for f in space.families for g in space.groups(f))


def only_knob(cfp: CfpSpec, name: str | None) -> CfpSpec:
    """``cfp`` with every pin and set cleared but those of knob ``name`` (``None``: all cleared); the search's global
    limits (``max_micro_batch``, ``tp_within_node``, ``uneven_stages``) stay."""
    others = {k: None for k in KNOBS if k != name}
    return dataclasses.replace(cfp, **others, constraints=dataclasses.replace(cfp.constraints, **others))


def knob_setting(cfp: CfpSpec, name: str) -> tuple[str, object]:
    """The Hydra key and value that restrict knob ``name``: its pin, else its set."""
    def plain(v: object) -> object:
        return getattr(v, "value", v)

    pin = getattr(cfp, name)
    if pin is not None:
        return f"cfp.{name}", plain(pin)
    return f"cfp.constraints.{name}", [plain(v) for v in getattr(cfp.constraints, name)]


def knob_reasons(space: Space, name: str) -> list[str]:
    """Why no candidate of ``space``'s families takes an allowed value of knob ``name`` (the per-layout knobs:
    micro-batch, SP, vpp, MLP, distributed optimizer), one line per distinct cause, with the numbers."""
    allowed = space.cfp.allowed(name) or []
    job, world = space.job, space.world
    gbs = job.train.global_batch_size
    out: dict[str, None] = {}
    per_rank_of: dict[int, dict[int, int]] = {}  # micro-batch -> {DP size: sequences per DP rank} it does not divide
    for f in space.families:
        dp = f.dp(world)
        per_rank = gbs // dp
        for v in allowed:
            if name == "micro_batch":
                if v > space.cfp.constraints.max_micro_batch:
                    out[f"{v} is above cfp.constraints.max_micro_batch={space.cfp.constraints.max_micro_batch}"] = None
                elif per_rank % v:
                    per_rank_of.setdefault(v, {})[dp] = per_rank
            elif name == "sp" and (why := space.sp_problems(f, v)):
                # the TP rule's clause says why for the family; all that are left have TP 1 where it is the reason
                out[why[0] + (", and every layout left has TP 1" if f.tp == 1 else "")] = None
            elif name == "distributed_optimizer" and (why := space.dopt_problems(f, v)):
                out[f"{why[0]}, and tp{f.tp} cp{f.cp} pp{f.pp} leaves DP 1"] = None
            elif name == "vpp" and v > 1:
                out.update(dict.fromkeys(_vpp_reasons(space, f, v)))
            elif name == "mlp" and v is MlpPartition.primepar:
                out["PrimePar's MLP needs a dense model on a TP group of 4^k ranks (4, 16, ...) whose grid side "
                    "divides the hidden and FFN sizes and the tokens per micro-batch"] = None
    for v, counts in per_rank_of.items():
        sizes = sorted(counts.items(), reverse=True)
        if len(sizes) == 1:
            out[f"{v} does not divide the {sizes[0][1]} sequences of a step per data-parallel rank "
                f"(train.global_batch_size={gbs} over DP {sizes[0][0]})"] = None
            continue
        out[f"{v} does not divide the sequences of a step per data-parallel rank (train.global_batch_size={gbs}: "
            + ", ".join(f"{n} at DP {dp}" for dp, n in sizes) + ")"] = None
    return list(out)


def _vpp_reasons(space: Space, f: Family, vpp: int) -> list[str]:
    """Why ``vpp`` model chunks per rank do not fit family ``f`` at any micro-batch size."""
    layers = space.job.model.num_layers
    if why := briefs(pipeline.interleave_needs_pp(vpp, f.pp)):
        return [f"{why[0]}, and tp{f.tp} cp{f.cp} has PP 1"]
    gbs, dp = space.job.train.global_batch_size, f.dp(space.world)
    counts = {gbs // (dp * mb) for mb in _divisors(gbs // dp)}
    if all(pipeline.interleaved_microbatches(microbatches=n, pp=f.pp, vpp=vpp, global_batch=gbs, per_step=gbs // n)
           for n in counts):
        return [f"the interleaved schedule needs the micro-batches per step ({', '.join(map(str, sorted(counts)))}) "
                f"to be a multiple of PP {f.pp}"]
    return [f"{layers} layers do not split into {f.pp} stages x {vpp} chunks"]


def no_layout_issues(job: JobSpec, world: int, cfp: CfpSpec, *, te_available: bool = True,
                     partitions: tuple[PartitionOption, ...] | None = None) -> list[ConfigIssue]:
    """Why ``cfp``'s pins and sets leave no layout of ``job`` on ``world`` ranks (empty when one is left): each pin
    or set that removes every layout on its own, named by its key with the reasons (``cfp.micro_batch=3: 3 does not
    divide the 8 sequences of a step per data-parallel rank ...``); where none does alone, the combination."""
    space = build_space(job, world, cfp, te_available=te_available, partitions=partitions)
    if has_layout(space):
        return []
    free = build_space(job, world, only_knob(cfp, None), te_available=te_available, partitions=partitions)
    known = {(r.what, r.reason) for r in free.rejected}
    subject = f"no layout of {job.model.name} on {world} rank{'s' if world > 1 else ''}"
    asked = [n for n in KNOBS if cfp.allowed(n) is not None]
    issues = []
    for name in asked:
        alone = build_space(job, world, only_knob(cfp, name), te_available=te_available, partitions=partitions)
        if has_layout(alone):
            continue
        key, value = knob_setting(cfp, name)
        pinned = {f"{name}={_value(v)}" for v in cfp.allowed(name) or []}
        why = [f"{r.what}: {r.reason}" for r in alone.rejected
               if r.what in pinned or ((r.what, r.reason) not in known and not r.what.startswith(f"{name}="))]
        why += knob_reasons(alone, name)
        issues.append(ConfigIssue(key=key, value=value,
                                  problem=f"{subject} takes it: " + ("; ".join(why[:6]) or "see the search's reasons")
                                  + ".",
                                  fix=f"choose another value, or remove {key} and let the search choose."))
    if issues or not has_layout(free):
        if not issues:  # the model, the batch and the world size leave nothing, whatever is pinned
            issues = [ConfigIssue(key="cfp", value="-", problem=f"{subject} is valid: " + "; ".join(
                f"{r.what}: {r.reason}" for r in free.rejected[:8]) + ".",
                fix="start another number of ranks, or change train.global_batch_size or the model.")]
        return issues
    settings = dict(knob_setting(cfp, n) for n in asked)
    why = [f"{r.what}: {r.reason}" for r in space.rejected if (r.what, r.reason) not in known]
    why += [w for n in asked for w in knob_reasons(space, n)]
    if not space.families:
        why.append(f"TP x CP x PP{' (and EP x expert TP x PP)' if job.model.is_moe else ''} must divide the {world} "
                   "ranks, and the global batch the data-parallel size they leave")
    return [ConfigIssue(key="cfp", value=settings,
                        problem=f"each of {', '.join(settings)} leaves layouts on its own, but together {subject} "
                                "is left" + (": " + "; ".join(why[:6]) if why else "") + ".",
                        fix="relax one of these pins or sets.")]
