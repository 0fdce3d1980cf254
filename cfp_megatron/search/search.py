"""Branch and bound over the layouts of :mod:`cfp_megatron.search.space`, with the simulator as the objective.

Every candidate gets a lower bound on its step time that costs a few arithmetic operations once the pass costs of its
(TP, SP, CP, EP, micro-batch, recompute) group are known (:class:`~cfp_megatron.sim.pass_costs.CostCache`, one
computation per group however many pipeline splits, interleaving and optimizer variants share it). The bound and
why it holds: :mod:`cfp_megatron.sim.bounds`.

Candidates are visited in increasing (bound, key) order from a queue that holds whole groups until their own bound
(the lightest first and last stage over the group's splits, at their layers' kinds) reaches its head; each candidate
is first checked for memory (a bound from the heaviest rank's weights, gradients and optimizer states, or the first
rank's with the activations its in-flight micro-batches keep at least, then the memory model), then
simulated unless a second bound with its exact passes, gradient sync and optimizer already exceeds the k-th best
(:func:`~cfp_megatron.sim.simulate.simulate_unless_slower`). The visit stops at the first bound above the k-th best
step time found, since every later candidate is provably slower. The result equals an exhaustive search's (tested on
random spaces). Ties are broken by the candidate's key, so the answer is the same in every process. Which of the
top-k runs (the fastest, unless a plan inside its error band rests on more evidence) is decided after the search, on
the top-k alone: :mod:`cfp_megatron.search.choice`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import FsdpStrategy, JobSpec, MlpPartition, ParallelSpec, Recompute
from cfp_megatron.base.errors import CfpError, ConfigError, ConfigIssue
from cfp_megatron.base.layout_rules.batch import fsdp_checkpoints, fsdp_settings
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.base.parallel_dims import (
    ParallelDims,
    data_parallel_size,
    expert_data_parallel_size,
    recompute_problems,
)
from cfp_megatron.base.pipeline_layout import balanced_layout
from cfp_megatron.base.pipeline_split import chunk_layers
from cfp_megatron.cluster.measured import Measurements, partition_name, unmeasured_partitions
from cfp_megatron.model.options import PartitionOption
from cfp_megatron.search import driver
from cfp_megatron.search.choice import Choice, choose
from cfp_megatron.search.formats import FormatOutcome, format_options, format_reason, set_formats, with_format
from cfp_megatron.search.plan_options import (
    OptionOutcome,
    PlanOption,
    option_index,
    option_reason,
    plan_options,
    searched,
    tie_order,
)
from cfp_megatron.search.space import (
    BLOCK,
    FAMILY_FIELDS,
    KNOBS,
    Candidate,
    Family,
    Group,
    GroupHead,
    Rejection,
    Space,
    build_space,
    family_of_key,
    knob_setting,
    max_chunk_layers,
    recompute_parts,
    split_stage_counts,
)
from cfp_megatron.sim.bounds import (
    GroupCosts,
    group_bound,
    group_costs_pair,
    layer_terms,
    paired_costs,
    time_bound,
)
from cfp_megatron.sim.format_costs import bf16_twin
from cfp_megatron.sim.layout import Layout, build_layout, place
from cfp_megatron.sim.memory import in_flight, layer_activation_bytes, memory_band
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache, PassCosts, cost_key
from cfp_megatron.sim.prediction import GIB, MemoryBreakdown, Prediction
from cfp_megatron.sim.primepar_cost import megatron_twin
from cfp_megatron.sim.sharding import Sharded, StateBytes, megatron_sharded
from cfp_megatron.sim.simulate import predict_memory, prepare_costs, schedule_fixed_s, simulate_unless_slower
from cfp_megatron.sim.terms import Overlaps

_CANDIDATE, _OverMemory, _FAMILY_KEY = driver.CANDIDATE, driver.OverMemory, len(FAMILY_FIELDS)
"""The driver's candidate entry kind and over-memory outcome (local names: the search makes hundreds of thousands)."""
_MISSING = object()
"""A dictionary lookup's default where ``None`` is a value (a refused group)."""


@dataclass(frozen=True, kw_only=True)
class Ranked:
    """One evaluated plan."""

    candidate: Candidate
    """Its layout."""
    job: JobSpec
    """The job under that layout."""
    prediction: Prediction
    """The simulator's prediction."""
    unmeasured: tuple[str, ...] = ()
    """What its prediction reads that the profile lacks (``dense tp2-sp``), priced by the analytical model instead
    (:func:`~cfp_megatron.cluster.measured.unmeasured_partitions`); empty when all measured or without a profile."""


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """What a search found and how much work it took."""

    ranked: tuple[Ranked, ...]
    """The best plans that fit, fastest first (at most ``cfp.top_k``); :attr:`best` is the one chosen to run."""
    rejected: tuple[Rejection, ...]
    """Knob values and families ruled out, with reasons."""
    space_size: int
    """Candidates in the space."""
    simulated: int
    """Candidates simulated in full."""
    memory_checked: int
    """Candidates whose memory was predicted."""
    over_memory: int
    """Candidates that did not fit."""
    invalid: int
    """Candidates the runtime's validation refused."""
    pruned: int
    """Candidates not simulated in full because a lower bound on their step time exceeded the k-th best."""
    memory_limit_gib: float | None
    """Peak memory a plan may predict per GPU (HBM less the headroom, or over the allocator band's upper end where
    that leaves less); ``None`` without a known capacity."""
    least_over_gib: float | None
    """The least memory per GPU (GiB) a candidate over the limit was found to need (a lower bound where its weights
    alone were over); ``None`` when none was over."""
    seconds: float
    """Wall time of the search."""
    world: int
    """Ranks."""
    choice: Choice | None = None
    """Which of :attr:`ranked` to run and why (:func:`~cfp_megatron.search.choice.choose`); ``None`` without plans
    (the fastest is then :attr:`best`)."""
    pinned: tuple[str, ...] = ()
    """The Hydra keys of the cfp pins and sets the search kept to (``cfp.tp``, ``cfp.constraints.pp``)."""
    formats: tuple[FormatOutcome, ...] = ()
    """With a set of number formats (``cfp.constraints.precision``): each format searched, fastest GEMMs first,
    and its best plan's step time; empty without a set."""

    @property
    def format_reason(self) -> str | None:
        """Why the chosen plan's number format (``None`` without a set, or without plans)."""
        if not self.formats or not self.ranked:
            return None
        return format_reason(list(self.formats), NumberFormat.of(self.best.job.train).name)

    options: tuple[OptionOutcome, ...] = ()
    """With a set of CUDA graph implementations or MoE token policies (``cfp.constraints.cuda_graph_impl``,
    ``moe_token_policy``): each combination searched and its best plan's step time; empty without a set."""
    option_choices: tuple[PlanOption, ...] = ()
    """The combinations searched (:func:`~cfp_megatron.search.plan_options.plan_options`); empty without a set."""

    @property
    def option_reason(self) -> str | None:
        """Why the chosen plan's CUDA graphs and MoE token policy (``None`` without a set, or without plans)."""
        if not self.options or not self.ranked:
            return None
        choices = list(self.option_choices)
        return option_reason(list(self.options), choices[option_index(self.best.job, choices)].name,
                             self.best.prediction.step_time_s)

    @property
    def best(self) -> Ranked:
        """The chosen plan (:attr:`choice`: the fastest unless a plan inside its error band rests on more evidence);
        raises :class:`~cfp_megatron.base.errors.ConfigError` naming what ruled the layouts out (families that held
        plans first) when none fits."""
        if not self.ranked:
            once: dict[tuple[str, str], Rejection] = {}
            for r in sorted(self.rejected, key=lambda r: r.count == 0):  # families that held plans first
                once.setdefault((r.what, r.reason), r)  # each value and reason once
            first = list(once.values())[:8]
            raise nothing_left([(r.what, r.reason) for r in first], no_plan_fix(self.pinned))
        return self.ranked[self.choice.index if self.choice is not None else 0]

    @property
    def preferred(self) -> tuple[Ranked, ...]:
        """:attr:`ranked` with the chosen plan first, the others fastest first (the order plans are offered in)."""
        first = self.choice.index if self.choice is not None else 0
        return self.ranked[first:first + 1] + self.ranked[:first] + self.ranked[first + 1:]


SIZES_FIX = "plan another number of GPUs (cluster.nodes; cfp size compares several)"
"""The last fix :func:`no_plan_fix` offers without pins, where ``cfp size`` sizes the backend (Megatron-Core's)."""


def no_plan_fix(pinned: tuple[str, ...], *, more_gpus: str = SIZES_FIX) -> str:
    """What to change where no layout is left: the pins and sets ``pinned`` (their keys) where there are any, else
    what the reasons name, the headroom, or ``more_gpus`` (how this backend takes another number of GPUs)."""
    if pinned:
        return (f"relax the cfp pins and constraints ({', '.join(pinned)}), lower cfp.constraints.memory_headroom, "
                "or add GPUs.")
    return ("no cfp pin or constraint is set: change what the reasons name (train.global_batch_size, "
            f"train.seq_length, the model's settings), lower cfp.constraints.memory_headroom, or {more_gpus}.")


def nothing_left(rejected: list[tuple[str, str]], fix: str) -> ConfigError:
    """The error of a search that left no plan: one issue of ``+cfp=auto`` listing what ruled the layouts out
    (``(value or family, reason)`` pairs; each a value the search tried, not a setting the user gave)."""
    why = "; ".join(f"{what}: {reason.rstrip('.')}" for what, reason in rejected)
    return ConfigError(ConfigIssue(key="cfp", value="auto", problem="the search left no layout" + (
        f" (what ruled them out: {why})" if why else "") + ".", fix=fix))


def search(job: JobSpec, world: int, cfp: CfpSpec, *, measurements: Measurements | None = None,
           options: SimOptions | None = None, te_available: bool = True,
           exhaustive: bool = False, cache: CostCache | None = None,
           partitions: tuple[PartitionOption, ...] | None = None) -> SearchResult:
    """The ``cfp.top_k`` fastest layouts of ``job`` on ``world`` ranks that fit in memory (see the module docstring),
    searched by the one driver (:func:`cfp_megatron.search.driver.run`) over :class:`MegatronSpace`; ``partitions``:
    the model's partition options (:func:`~cfp_megatron.search.space.build_space`).

    ``exhaustive`` simulates every candidate that fits (no bound): the reference the bounded search is tested
    against. ``cache``: the pass costs of an earlier search of the same model on a cluster of the same kind (any
    node count; :meth:`~cfp_megatron.sim.pass_costs.CostCache.resized`), which this one reads and adds to: the same
    plans as without it; a group validated at an earlier size is not validated again as a group (its candidates
    still are, one by one), so :attr:`SearchResult.rejected` may lack it."""
    started = time.perf_counter()
    formats, left_out = set_formats(job, cfp, te_available=te_available)
    choices, choices_left = plan_options(job, cfp, te_available=te_available)  # CUDA graphs, MoE token policy
    rejected: list[Rejection] = [*left_out, *choices_left]
    found_all: list[driver.Ranked] = []
    outcomes: list[FormatOutcome] = []
    option_best: dict[str, float | None] = {}
    size = visited = slower = simulated = checked = over_memory = refused = 0
    over: dict = defaultdict(list)
    limit: float | None = None
    merged_order = functools.partial(_merged_order, choices=choices)
    for fmt in formats:  # fastest GEMMs first: the later formats start from the k-th best found (driver cutoff)
        format_best: float | None = None
        for choice in choices:  # graphed first: the others start from the k-th best found likewise
            cutoff = found_all[cfp.top_k - 1].step_time_s if len(found_all) >= cfp.top_k and not exhaustive \
                else math.inf
            with driver.gc_paused():
                fjob = with_format(job, fmt) if cfp.constraints.precision is not None else job
                cjob = choice.apply(fjob)
                space = MegatronSpace.build(cjob, world, choice.narrowed(cfp, cjob), measurements=measurements,
                                            options=format_options(job, fmt, measurements, options),
                                            te_available=te_available,
                                            cache=cache if len(formats) * len(choices) == 1 else None,
                                            partitions=partitions)
                found = driver.run(space, cfp.top_k, exhaustive=exhaustive, cutoff=cutoff)
            rejected += [r for r in (*space.space.rejected, *space.invalid_groups) if r not in rejected]  # once
            for prefix, sizes in found.over.items():
                over[prefix] += sizes
            found_all = sorted([*found_all, *found.ranked], key=merged_order)[:cfp.top_k]
            best_s = found.ranked[0].step_time_s if found.ranked else None
            format_best = _smaller(format_best, best_s)
            option_best[choice.name] = _smaller(option_best.get(choice.name), best_s)
            size += space.size
            visited += found.visited
            slower += found.slower
            simulated += found.simulated
            checked += found.checked
            over_memory += found.over_memory
            refused += found.refused
            limit = space.limit
        outcomes.append(FormatOutcome(name=fmt.name, best_s=format_best))
    for prefix, sizes in sorted(over.items()):  # by family, in Family's order
        rejected.append(Rejection(what=_family_label(Family.of_prefix(prefix), world), count=len(sizes),
                                  reason=f"{len(sizes)} plan(s) checked need {min(sizes):.1f} GiB or more per GPU, "
                                         f"over the {limit:.1f} GiB allowed"))
    ranked = tuple(r.result for r in found_all)
    return SearchResult(ranked=ranked, rejected=tuple(rejected), choice=choose(ranked, world, space.options),
                        space_size=size, simulated=simulated, memory_checked=checked,
                        over_memory=over_memory, invalid=refused,
                        pruned=size - visited + slower, memory_limit_gib=limit,
                        least_over_gib=min((min(s) for s in over.values() if s), default=None),
                        seconds=time.perf_counter() - started, world=world,
                        formats=tuple(outcomes) if cfp.constraints.precision is not None else (),
                        options=tuple(OptionOutcome(name=name, best_s=best) for name, best in option_best.items())
                        if searched(cfp) else (), option_choices=tuple(choices) if searched(cfp) else (),
                        pinned=tuple(knob_setting(cfp, name)[0] for name in KNOBS if cfp.allowed(name) is not None))


@dataclass(kw_only=True)
class MegatronSpace:
    """The Megatron backend's layouts as the driver searches them (:class:`cfp_megatron.search.driver.SearchSpace`):
    groups of candidates that share their pass costs, bounded; each candidate checked for memory, then simulated."""

    job: JobSpec
    """The searched job."""
    world: int
    """Ranks."""
    space: Space
    """The families and knob values."""
    measurements: Measurements | None
    """The profile the search predicts from."""
    options: SimOptions
    """The simulator's options."""
    cache: CostCache
    """Pass costs shared by the candidates."""
    limit: float | None
    """Peak memory a plan may predict per GPU in GiB (HBM less the headroom); ``None`` without a known capacity."""
    groups: list[_Bounded]
    """The bounded groups."""
    invalid_groups: list[Rejection]
    """Groups the runtime's validation refused."""
    size: int
    """Candidates in the space."""
    param_bytes: StateBound
    """Bytes per parameter with and without the distributed optimizer (:func:`_param_bytes`)."""
    least_over: dict[tuple, float] = dataclasses.field(default_factory=dict)
    """Family key -> the least GiB per GPU recorded so far for its candidates over the limit (what its no-fit
    figure reports at least)."""
    pending: list[_Deferred] = dataclasses.field(default_factory=list)
    """Groups validated but not costed yet, under their siblings' bound (:class:`_Deferred`); their queue entries'
    items are ``-1 - index``."""

    @classmethod
    def build(cls, job: JobSpec, world: int, cfp: CfpSpec, *, measurements: Measurements | None,
              options: SimOptions | None, te_available: bool, cache: CostCache | None = None,
              partitions: tuple[PartitionOption, ...] | None = None) -> MegatronSpace:
        """The space of ``job`` on ``world`` ranks under ``cfp``, its groups bounded (pass costs from ``cache``
        where it serves this job: :meth:`~cfp_megatron.sim.pass_costs.CostCache.resized`)."""
        options = options or SimOptions()
        space = build_space(job, world, cfp, te_available=te_available, partitions=partitions)
        if not space.fsdp_values():  # the strategies pinned do not train here (layout_rules.batch)
            key, value = knob_setting(cfp, "fsdp")
            pinned = (cfp.allowed("fsdp") or [FsdpStrategy.optim_grads])[0].value
            why = (fsdp_settings(fsdp=pinned, distributed_optimizer=True, shard_size=None)
                   + fsdp_checkpoints(pinned, job.train.checkpoint_dir))[0]
            raise ConfigError(ConfigIssue(key=key, value=value, problem=why.problem, fix=why.fix))
        if measurements is not None:  # PrimePar's MLP only where profiling timed its layer (see Space.primepar)
            timed = frozenset(f.tp for f in space.families if measurements.segment_micro_batches(
                "dense", partition_name(f.tp, mlp=MlpPartition.primepar)))
            space = dataclasses.replace(space, primepar=timed)
        cache = CostCache.for_job(job, measurements, options) if cache is None else \
            cache.resized(job, measurements, options)
        limit = None
        if job.cluster.hbm_gib is not None:  # the headroom, and the prediction's upper band (the allocator's share)
            # in the GPU's memory: two reserves for one thing (the headroom names fragmentation), the larger applies
            limit = job.cluster.hbm_gib * min(1.0 - cfp.constraints.memory_headroom,
                                              1.0 / memory_band(job.cluster).high)
        pending: list[_Deferred] = []
        groups, invalid_groups, size = _groups(space, job, measurements, options, cache, pending)
        return cls(job=job, world=world, space=space, measurements=measurements, options=options, cache=cache,
                   limit=limit, groups=groups, invalid_groups=invalid_groups, size=size,
                   param_bytes=_param_bytes(job, space), pending=[d for d in pending if d.groups])

    def entries(self) -> list[driver.Entry]:
        """Every group, at its bound, and every deferred set of groups at the least of their siblings' bounds:
        groups are expanded when they reach the queue's head, so most never are."""
        return [*((g.bound, driver.GROUP, i, 0.0) for i, g in enumerate(self.groups)),
                *((d.bound, driver.GROUP, -1 - i, 0.0) for i, d in enumerate(self.pending))]

    def expand(self, item: int, cut: float) -> list[driver.Entry]:
        """The group's candidates bounded at ``cut`` or less, with the group and their split (:func:`_time_entries`;
        their memory is bounded when they are evaluated); for a deferred set (``item`` below zero), its groups
        bounded at ``cut`` or less, costed now (at their siblings' bound or above: the queue's order holds)."""
        if item >= 0:
            return _time_entries(self.groups[item], self.job, cut, item)
        start = len(self.groups)
        self.pending[-1 - item].resolve(self.groups)
        return [(self.groups[i].bound, driver.GROUP, i, 0.0) for i in range(start, len(self.groups))
                if self.groups[i].bound <= cut]

    def _overlaps(self, cand: Candidate, cjob: JobSpec, memory: MemoryBreakdown) -> tuple[
            Candidate, JobSpec, MemoryBreakdown, int]:
        """``cand`` with the GPU communication overlaps on (:attr:`Space.gpu_overlap`): the data-parallel ones
        always, the TP and expert ones most first where their memory fits (whatever it is under ``cfp.overlap=true``);
        its job, memory, and the memory predictions it took."""
        space, job, limit = self.space, self.job, self.limit
        if not space.gpu_overlap:
            return cand, cjob, memory, 0
        cand = dataclasses.replace(cand, dp_overlap=True)
        cjob, tries = cand.screened_job(job), 0
        for tp, a2a in _overlap_choices(space, cand):
            trial = dataclasses.replace(cand, tp_overlap=tp, a2a_overlap=a2a)
            tjob = trial.screened_job(job)
            if (tp, a2a) == (False, False):
                return trial, tjob, memory, tries  # the overlaps without a memory cost: as predicted already
            tmemory = predict_memory(tjob, job.cluster, self.measurements, options=self.options,
                                     world_size=self.world, cache=self.cache)
            tries += 1
            if limit is None or tmemory.total / GIB <= limit or space.cfp.overlap:
                return trial, tjob, tmemory, tries
        return cand, cjob, memory, tries

    def _sharded(self, cand: Candidate, cjob: JobSpec | None, memory: MemoryBreakdown | None,
                 bounds: tuple[float, ...] | None) -> tuple[Candidate, JobSpec, MemoryBreakdown, int]:
        """``cand`` with the least data-parallel sharding of :meth:`Space.sharding_ladder
        <cfp_megatron.search.space.Space.sharding_ladder>` whose memory fits (Megatron-FSDP's only where Megatron-Core's
        DDP does not fit or the ``cfp`` pins leave it out: each step shards more and communicates more), else the
        most sharded; its job, memory, and the memory predictions it took. ``memory`` ``None``: the unsharded
        candidate was not predicted (over on its ``bounds``, the memory bounds under each strategy, which skip a
        strategy over the limit on its states alone)."""
        ladder = self.space.sharding_ladder(cand)
        limit = self.limit
        fits = memory is not None and (limit is None or memory.total / GIB <= limit)
        if not ladder or (ladder[0] == (FsdpStrategy.none.value, 0) and fits):
            return cand, cjob, memory, 0
        tries = 0
        over = dict(zip(self.space.fsdp_values(), bounds or (), strict=False))
        last = ladder[-1]
        for fsdp, shard in ladder:
            if fsdp == FsdpStrategy.none.value:
                continue
            if limit is not None and over.get(fsdp, 0.0) / GIB > limit and (fsdp, shard) != last:
                continue  # over on its states alone (a hybrid group keeps more than the full one's bound)
            cand = dataclasses.replace(cand, fsdp=fsdp, dp_shard=shard)
            cjob = cand.screened_job(self.job)
            memory = predict_memory(cjob, self.job.cluster, self.measurements, options=self.options,
                                    world_size=self.world, cache=self.cache)
            tries += 1
            if limit is None or memory.total / GIB <= limit:
                break
        return cand, cjob, memory, tries

    def _over(self, family: tuple, gib: float, tries: int) -> driver.OverMemory:
        """The outcome of a candidate of ``family`` over the limit at ``gib`` GiB per GPU (:attr:`least_over`)."""
        if gib < self.least_over.get(family, math.inf):
            self.least_over[family] = gib
        return _OverMemory(family, gib, tries)

    def evaluate(self, item: tuple, extra: tuple[int, tuple[int, int, int, bool]], kth: float) -> driver.Outcome:
        """The candidate of key ``item`` (``extra``: its group's index and its split, :meth:`expand`): its memory
        bounds (:func:`_memory_bounds`), its memory (block recomputation and PrimePar's layer count chosen to fit,
        then the overlaps that fit on top), then the simulator unless slower than ``kth`` seconds.

        A candidate over the limit on its first bound reports that bound; one over only on its second reports the
        second where its family already reported as little or less (the family's figure, its least, stays what the
        memory model would give), else its predicted memory."""
        job, limit = self.job, self.limit
        bounds = None  # the memory bounds under each Megatron-FSDP strategy (with a limit only)
        if limit is not None:
            weights, by_kind, bounds = _memory_bounds(self.groups[extra[0]], job, self.param_bytes, extra[1],
                                                      item[-1])
            weights, by_kind = weights / GIB, by_kind / GIB
            if weights > limit:  # its weights, gradients and optimizer states alone
                return self._over(item[:_FAMILY_KEY], weights, 0)  # family_of_key, inlined
            if by_kind > limit and by_kind >= self.least_over.get(item[:_FAMILY_KEY], math.inf):
                return self._over(item[:_FAMILY_KEY], by_kind, 0)
        cand = Candidate.from_key(item)
        try:
            if bounds is not None and limit is not None and bounds[0] / GIB > limit and cand.recompute != BLOCK:
                # the distributed optimizer alone is over on its states: straight to the sharding that may fit
                cand, cjob, memory, tries = self._sharded(cand, None, None, bounds)
            elif cand.recompute == BLOCK:
                cand, memory, tries = _fewest_block_layers(cand, job, limit, self.measurements, self.options,
                                                           self.world, self.cache)
                cjob = cand.screened_job(job)
            else:
                cjob, tries = cand.screened_job(job), 1
                memory = predict_memory(cjob, job.cluster, self.measurements, options=self.options,
                                        world_size=self.world, cache=self.cache)
                if cand.mlp == MlpPartition.primepar.value and limit is not None:
                    cand, memory, more = _primepar_layers(cand, cjob, memory, job, limit, self.measurements,
                                                          self.options, self.world, self.cache)
                    cjob, tries = cand.screened_job(job), tries + more
            # After the counts above: the sharding that fits, then the overlaps' buffers on top of its memory.
            if cand.fsdp == FsdpStrategy.none.value:
                cand, cjob, memory, more = self._sharded(cand, cjob, memory, bounds)
                tries += more
            if limit is not None and memory.total / GIB > limit and not self.space.cfp.overlap:
                # every overlap costs memory (_overlaps): none of them fits either, and none would be kept
                return self._over(family_of_key(item), memory.total / GIB, tries)
            bounded = self.groups[extra[0]]
            if (bounded.paired is not None and (cand.pp == 1 or cand.vpp > 1) and not self.space.cfp.overlap
                    and _fitting_bound(bounded, job, extra[1]) > kth):
                # it fits, and whichever of its overlaps fits it is slower than the k-th best
                return driver.Slower(checked=tries)
            cand, cjob, memory, more = self._overlaps(cand, cjob, memory)
            tries += more
        except ConfigError:
            return driver.Refused()
        if limit is not None and memory.total / GIB > limit:
            return self._over(family_of_key(item), memory.total / GIB, tries)
        prediction = simulate_unless_slower(cjob, kth, job.cluster, self.measurements, options=self.options,
                                            world_size=self.world, cache=self.cache)
        if prediction is None:  # its bound with the exact passes, gradient sync and optimizer exceeds the k-th best
            return driver.Slower(checked=tries)
        return driver.Ranked(step_time_s=prediction.step_time_s, tie=item, checked=tries,
                             result=Ranked(candidate=cand, job=cjob, prediction=prediction,
                                           unmeasured=_unmeasured(cjob, self.measurements)))


def _merged_order(r: driver.Ranked, choices: list[PlanOption]) -> tuple:
    """The order of the plans of several formats' and options' searches: step time, then the format's name, then
    the options' order on a tie (:func:`~cfp_megatron.search.plan_options.tie_order`), then the key."""
    return r.step_time_s, NumberFormat.of(r.result.job.train).name, tie_order(r.result.job, choices), r.tie


def _smaller(a: float | None, b: float | None) -> float | None:
    """The smaller of two best step times, either ``None`` (none found)."""
    return b if a is None else a if b is None else min(a, b)


def _unmeasured(job: JobSpec, measurements: Measurements | None) -> tuple[str, ...]:
    """What ``job``'s layout reads that the profile lacks (:class:`Ranked`'s ``unmeasured``)."""
    m, p = job.model, job.parallel
    kinds = ("dense", "moe") if m.is_moe and m.moe_first_dense_layers > 0 else ("moe",) if m.is_moe else ("dense",)
    return unmeasured_partitions(measurements, tp=p.tp, sp=p.sp, mlp=p.mlp, recompute=p.recompute, layer_kinds=kinds,
                                 recompute_modules=p.recompute_modules)


def _overlap_choices(space: Space, cand: Candidate) -> list[tuple[bool, bool]]:
    """(TP overlap, expert all-to-all overlap) settings to try for ``cand``, most overlapped first: each is never
    slower in the simulator, and each costs memory (buffers, a micro-batch in flight)."""
    tp = space.tp_overlap(tp=cand.tp, sp=cand.sp)
    a2a = space.a2a_overlap(ep=cand.ep, pp=cand.pp, vpp=cand.vpp, recompute=cand.recompute)
    return [(t, a) for t in ((True, False) if tp else (False,)) for a in ((True, False) if a2a else (False,))]


def _fewest_block_layers(cand: Candidate, job: JobSpec, limit: float | None, measurements: Measurements | None,
                         options: SimOptions, world: int, cache: CostCache) -> tuple[Candidate, MemoryBreakdown, int]:
    """``cand`` (``recompute=block``) with the fewest recomputed layers per chunk that fit in ``limit`` GiB (one
    without a limit), below the largest chunk's layer count (that many is full recomputation, a candidate of its
    own), its memory and the number of memory predictions made. Each recomputed layer keeps only its input, so memory
    falls and the step time grows with the count (tests/test_search.py checks both): the fewest that fit is the
    fastest block plan. Repeated layers are alike, so the count is found by bisection over one number, not per layer.
    Where even the most does not fit, returns that count and its (over-limit) memory."""
    m = job.model
    hi = max_chunk_layers(m.num_layers, cand.pp, cand.vpp, cand.first_stage_layers, cand.last_stage_layers,
                          cand.balanced) - 1
    memory = _CountedMemory(cand, "recompute_layers", job, measurements, options, world, cache)
    if limit is None:
        return dataclasses.replace(cand, recompute_layers=1), memory(1), memory.tries
    found = memory(hi)
    if found.total / GIB <= limit:
        hi, found = _furthest_fitting(hi, found, 1, memory, limit)
    return dataclasses.replace(cand, recompute_layers=hi), found, memory.tries


@dataclass
class _CountedMemory:
    """The predicted memory of ``cand`` with its count field ``field`` (``recompute_layers``, ``primepar_layers``)
    set to the argument, counting the predictions made (``tries``) for the search's statistics."""

    cand: Candidate
    """The candidate whose count is varied."""
    field: str
    """The :class:`Candidate` field that holds the count."""
    job: JobSpec
    """The searched job."""
    measurements: Measurements | None
    """The profile the search predicts from."""
    options: SimOptions
    """The simulator's options."""
    world: int
    """Ranks."""
    cache: CostCache
    """The search's cost cache."""
    tries: int = 0
    """Predictions made so far."""

    def __call__(self, count: int) -> MemoryBreakdown:
        self.tries += 1
        plan = dataclasses.replace(self.cand, **{self.field: count}).screened_job(self.job)
        return predict_memory(plan, self.job.cluster, self.measurements, options=self.options, world_size=self.world,
                              cache=self.cache)


def _furthest_fitting(fits_at: int, found: MemoryBreakdown, toward: int, memory: Callable[[int], MemoryBreakdown],
                      limit: float) -> tuple[int, MemoryBreakdown]:
    """The count from ``fits_at`` (which fits: ``found`` is its memory) to ``toward`` furthest from ``fits_at``
    whose memory fits in ``limit`` GiB, and that memory, by bisection: memory grows from ``fits_at`` toward
    ``toward``, so the counts that fit run from ``fits_at`` to a boundary."""
    step = 1 if toward > fits_at else -1
    good, far = fits_at, toward
    while good != far:
        mid = (good + far + (step > 0)) // 2  # strictly past good, at most as far as far
        at = memory(mid)
        if at.total / GIB <= limit:
            good, found = mid, at
        else:
            far = mid - step
    return good, found


def _primepar_layers(cand: Candidate, cjob: JobSpec, every: MemoryBreakdown, job: JobSpec, limit: float,
                     measurements: Measurements | None, options: SimOptions, world: int,
                     cache: CostCache) -> tuple[Candidate, MemoryBreakdown, int]:
    """``cand`` (``mlp=primepar``, ``cjob`` its job, ``every``: its memory with every layer PrimePar's) with the
    number of layers per chunk that run PrimePar's MLP, the others Megatron's (``parallel.primepar_layers``), its
    memory and the number of memory predictions made.

    This is the dynamic programme over the chain of a chunk's dense MLP segments, each PrimePar's or Megatron's,
    with repeated layers solved once: the layers are alike, and neither choice costs the neighbours anything (under
    SP the resharding to and from Megatron's sequence split is part of PrimePar's segment, whatever its neighbour
    runs), so a chain's time and memory are a count of PrimePar layers times one layer's difference, and the
    optimum is a count, not an arrangement. Where PrimePar's layer is the faster and every layer's does not fit,
    memory grows with the count and the fastest plan that fits is the most PrimePar layers that do, found by
    bisection; its step is at least every layer PrimePar's, so the group's bound holds. Otherwise the candidate is
    left as it is (a slower PrimePar layer that saves memory would need the fewest PrimePar layers that fit, whose
    bound is Megatron's layer: not offered, see the README)."""
    hi = max_chunk_layers(job.model.num_layers, cand.pp, cand.vpp, cand.first_stage_layers, cand.last_stage_layers,
                          cand.balanced)
    if hi < 2 or every.total / GIB <= limit:
        return cand, every, 0
    own = prepare_costs(cjob, job.cluster, measurements, options=options, world_size=world, cache=cache)
    twin = prepare_costs(megatron_twin(cjob), job.cluster, measurements, options=options, world_size=world,
                         cache=cache)
    if own.dense.total_s >= twin.dense.total_s:
        return cand, every, 0
    memory = _CountedMemory(cand, "primepar_layers", job, measurements, options, world, cache)
    first = memory(1)
    if first.total / GIB > limit:
        return cand, first, memory.tries
    most, found = _furthest_fitting(1, first, hi - 1, memory, limit)
    return dataclasses.replace(cand, primepar_layers=most), found, memory.tries


def _family_label(f: Family, world: int) -> str:
    label = f"dp{f.dp(world)} tp{f.tp} pp{f.pp}"
    label += f" cp{f.cp}" if f.cp > 1 else ""
    label += f" ep{f.ep}" if f.ep > 1 else ""
    label += f" etp{f.etp}" if f.etp > 1 else ""
    return label


@dataclass(frozen=True, kw_only=True)
class _Bounded:
    """A :class:`~cfp_megatron.search.space.Group` with its pass costs' bound terms and a lower bound on the step
    time of each of its candidates (the first or last rank's passes with the group's lightest split)."""

    group: Group
    """The candidates."""
    costs: GroupCosts
    """Their pass costs' bound terms."""
    bound: float
    """The group's bound."""
    kept: _KeptBytes | None = None
    """Activation bytes a dense and a MoE decoder layer keep per micro-batch on a rank, at least
    (:func:`_layer_kept_bytes`), computed when the group is first expanded; ``None``: not counted."""
    serial: GroupCosts | None = None
    """The bound terms of its splits of one chunk per rank where they differ from :attr:`costs` (a pipelined MoE
    group whose interleaved splits may overlap the expert all-to-all, which Megatron-Core does not under the plain
    schedule: :meth:`~cfp_megatron.search.space.Space.a2a_overlap`); ``None``: :attr:`costs` for every split."""
    paired: tuple[_Paired, GroupCosts] | None = None
    """Where its candidates may turn the expert overlap on (without measurements): the bound terms of those that do
    (:func:`~cfp_megatron.sim.bounds.paired_costs`) and of those that do not; what :meth:`MegatronSpace.evaluate`
    bounds a candidate by once it fits, before trying its overlaps (:func:`_fitting_bound`)."""


@dataclass(kw_only=True)
class _KeptBytes:
    """:func:`_layer_kept_bytes` of the groups that share what a layer's activations depend on, computed once, when
    the first of them is expanded (most groups never are)."""

    head: GroupHead
    """The first such group's head."""
    placed: Layout
    """Where its family sits."""
    job: JobSpec
    """The searched job."""
    measurements: Measurements | None
    """The profile the search predicts from."""
    options: SimOptions
    """The simulator's options."""
    key: tuple
    """What the bytes depend on (TP, SP, CP, expert TP, micro-batch, recomputation, MLP partition)."""
    store: dict[tuple, tuple[float, float]]
    """The bytes by :attr:`key` that searches of several node counts share
    (:attr:`~cfp_megatron.sim.pass_costs.CostCache.kept_bytes`)."""
    value: tuple[float, float] | None = None
    """The bytes, once computed."""

    def __call__(self) -> tuple[float, float]:
        if self.value is None:
            self.value = self.store.get(self.key)
        if self.value is None:
            self.value = _layer_kept_bytes(self.head, self.placed, self.job, self.measurements, self.options)
            self.store[self.key] = self.value
        return self.value


def _groups(space: Space, job: JobSpec, measurements: Measurements | None, options: SimOptions,
            cache: CostCache, pending: list[_Deferred] | None = None) -> tuple[list[_Bounded], list[Rejection], int]:
    """The candidate groups of ``space`` with their bounds, the groups the runtime's validation refuses, and the
    number of candidates. With ``pending`` (a list), the groups with recomputation whose pass costs no group
    computed yet are validated but not costed where their sibling without recomputation bounds them
    (:class:`_Deferred`, appended to it; without measurements only): the search costs them when that bound reaches
    its queue's head."""
    world = space.world
    L = job.model.num_layers
    first_dense = job.model.moe_first_dense_layers if job.model.is_moe else None
    defer = pending is not None and measurements is None
    out: list[_Bounded] = []
    refused: list[Rejection] = []
    by_key: dict[tuple, GroupCosts | None] = {}
    by_fast: dict[tuple, _Costs | None] = {}  # by_key's values by plain values
    kept: dict[tuple, _KeptBytes] = {}
    may_overlap: dict[tuple, tuple[bool, bool]] = {}  # (TP overlap, expert overlap) allowed, by what they read
    specs: dict[tuple, ParallelSpec] = {}  # the representatives' checked ParallelSpec, by their fields
    layouts: dict[tuple, Layout] = {}  # their validated layouts, by the representative's key without recomputation
    gpn = job.cluster.gpus_per_node or world
    size = 0
    mlps = {p.value: p for p in MlpPartition}
    for fam in space.families:
        placed: Layout | None = None
        siblings: dict[tuple, tuple[float, tuple[bool, bool]]] = {}  # (mb, SP, MLP) -> its bound, overlaps without rc
        for g in space.groups(fam):
            size += g.size
            if not g.size:
                continue
            h = g.head
            pp, recompute = h.pp, h.recompute
            # The pass costs depend on the layout only through cost_key: look them up without building and
            # validating a job per group; compute (and validate) once per key.
            if placed is None:  # where the family's groups sit on nodes (not moved by SP or the micro-batch)
                family = ParallelSpec(tp=h.tp, pp=h.pp, cp=h.cp, ep=h.ep, etp=h.etp, sp=h.sp,
                                      order=job.parallel.order)
                dims = ParallelDims(parallel=family, world_size=world, num_microbatches=g.microbatches)
                placed = place(job, dims, gpn)
            okey = (h.tp, h.sp, h.ep, pp, recompute)
            overlaps = may_overlap.get(okey)
            if overlaps is None:  # what they read: the same for many groups
                overlaps = may_overlap[okey] = (space.tp_overlap(tp=h.tp, sp=h.sp),
                                                space.a2a_overlap(ep=h.ep, pp=pp, vpp=None, recompute=recompute))
            # What cost_key reads of the group and its family's placement, as plain values (quick to hash): the
            # full key is built once per distinct one.
            fkey = (h.tp, h.cp, h.ep, h.etp, h.sp, h.micro_batch, recompute, h.mlp, placed.tp_per_node,
                    placed.cp_per_node, placed.ep_per_node, placed.domain_size, overlaps)
            if measurements is not None:  # the pipelined probe's term (GroupCosts.fixed_s) depends on the stages too
                fkey += (pp, placed.pp_intra_node)
            # where its sibling without recomputation bounds it (the same passes, only recomputation added)
            sibling = siblings.get((h.micro_batch, h.sp, h.mlp)) if defer and recompute != _NO_RECOMPUTE else None
            lower = sibling[0] * (1.0 - SIBLING_MARGIN) if sibling is not None and sibling[1] == overlaps else None
            costs = by_fast.get(fkey, _MISSING)
            if costs is _MISSING:
                granularity, modules = recompute_parts(recompute, job.parallel.recompute_modules)
                ckey = cost_key(placed, granularity, options, mlps[h.mlp], sp=h.sp, micro_batch=h.micro_batch,
                                recompute_modules=modules) + overlaps
                if measurements is not None:
                    ckey += (pp, placed.pp_intra_node)
                if ckey not in by_key:  # the bound's costs read the key alone: a search of another size may have them
                    found = cache.groups.get(ckey)
                    if found is None and lower is not None and pending is not None:
                        # validated now (a refusal is named in order), costed when its bound reaches the head
                        rep = _representative(h, job, world, refused, specs=specs, layouts=layouts, place=False)
                        if rep is not None:
                            found = _Deferred(head=h, rep_job=rep[0], layout=rep[1], key=ckey, overlaps=overlaps,
                                              job=job, options=options, world=world, cache=cache, refused=refused)
                            pending.append(found)
                    elif found is None:
                        found = _group_costs(h, job, measurements, options, world, cache, refused,
                                             may_overlap=overlaps, specs=specs, layouts=layouts)
                        if found is not None:  # a refusal is this size's: checked again at another
                            cache.groups[ckey] = found
                    by_key[ckey] = found
                costs = by_fast[fkey] = by_key[ckey]
            if costs is None:
                continue
            # what a layer's activations depend on (fewer distinct values than the pass costs' keys)
            akey = (h.tp, h.sp, h.cp, h.etp, h.micro_batch, recompute, h.mlp)
            if akey not in kept:
                kept[akey] = _KeptBytes(head=h, placed=placed, job=job, measurements=measurements, options=options,
                                        key=akey, store=cache.kept_bytes)
            if isinstance(costs, _Deferred):
                if costs.value is None and lower is not None:
                    costs.add(g, kept[akey], lower)
                    continue
                costs = costs.resolve(out)  # needed now: its deferred groups are bounded too
                if costs is None:
                    continue
            bounded = _bounded(g, costs, kept[akey], L, first_dense)
            if recompute == _NO_RECOMPUTE:
                siblings[(h.micro_batch, h.sp, h.mlp)] = (bounded.bound, overlaps)
            out.append(bounded)
    return out, refused, size


_Costs = tuple[GroupCosts, GroupCosts | None, "_Paired | None"]
"""A group's bound terms (:func:`_group_costs`): under the overlaps its candidates may turn on, without the expert
overlap where they may turn it on, and for those that turn it on (:func:`~cfp_megatron.sim.bounds.paired_costs`,
without measurements; else ``None``)."""

_NO_RECOMPUTE = Recompute.none.value
"""A group head's recompute value without recomputation."""

SIBLING_MARGIN = 1e-9
"""What a deferred group's bound takes off its sibling's (:class:`_Deferred`): far more than the rounding of the few
additions that make a layer's seconds, which may put the two a unit in the last place the wrong way round."""


def _bounded(g: Group, costs: _Costs, kept: _KeptBytes, num_layers: int,
             first_dense: int | None) -> _Bounded:
    """``g`` with its bound from its group's costs (:func:`~cfp_megatron.sim.bounds.group_bound`); ``first_dense``:
    a MoE model's dense layers in front (``None`` for a dense model)."""
    L, pp, block = num_layers, g.head.pp, g.head.recompute == BLOCK
    found, serial, paired = costs  # pipelined, the all-to-all overlaps under the interleaved schedule only
    ends = (L, L) if pp == 1 or found.shared_cores else _lightest_ends(L, pp, g.splits)
    busy = (0.0, 0.0)
    # a MoE model's layers by kind (the bound's layer cost is the cheaper kind's)
    if not found.shared_cores and first_dense is not None:
        kind_s = found.kind_fb_s if block else found.kind_s
        loads = _lightest_end_loads(L, pp, g.splits, first_dense)
        k0, k1 = kind_s
        busy = (min([d * k0 + n * k1 for d, n in loads[0]]), min([d * k0 + n * k1 for d, n in loads[1]]))
    bound = group_bound(found, block, g.microbatches, pp, L, *ends, *busy)
    return _Bounded(group=g, costs=found, bound=bound, kept=kept, serial=serial if pp > 1 else None,
                    paired=None if paired is None or serial is None else (paired, serial))


@dataclass(kw_only=True)
class _Deferred:
    """The groups with recomputation that share one cost key no group costed yet, validated, with a lower bound on
    their bounds from their siblings without recomputation (:func:`_groups`), costed when it reaches the queue's
    head (:meth:`MegatronSpace.expand`).

    Why the sibling's bound holds (without measurements, where the representatives run no Megatron-FSDP): both
    representatives share their layer passes (:class:`~cfp_megatron.sim.pass_costs.AnalyticalParts`), embedding,
    head and per-pass cost; recomputation keeps each layer kind's forward and backward as they are
    (:func:`~cfp_megatron.sim.layer_cost.with_recompute`) and adds a recompute pass of fields at zero or above. Of
    :func:`~cfp_megatron.sim.bounds.group_costs_pair`'s terms per kind, the forward and backward less what the
    same overlaps hide plus the host's floor are the same; the recompute pass adds its seconds less the TP overlap's
    share of its TP communication (at most those seconds) plus the host's recomputed syncs (at zero or above). So
    the layer kinds' seconds, with and without the recompute pass, are at least the sibling's seconds with it (which
    has none), and :func:`~cfp_megatron.sim.bounds.group_bound` grows with each of them: a group's bound is at least
    its sibling's (same family, micro-batch, SP and MLP, so the same micro-batches and splits; block recomputation
    keeps a subset of the splits, whose lightest stages and ranks are at least the whole set's), less
    :data:`SIBLING_MARGIN` for rounding. Groups whose sibling may turn on other overlaps are not deferred."""

    head: GroupHead
    """The first such group's head (what its costs are computed from)."""
    rep_job: JobSpec
    """Its representative's job, validated."""
    layout: Layout | Callable[[], Layout]
    """Its representative's layout, or what places it (:func:`_representative`)."""
    key: tuple
    """The cost key (:attr:`~cfp_megatron.sim.pass_costs.CostCache.groups`' key)."""
    overlaps: tuple[bool, bool]
    """Whether its candidates may overlap their TP communication and their expert all-to-all."""
    job: JobSpec
    """The searched job."""
    options: SimOptions
    """The simulator's options."""
    world: int
    """Ranks."""
    cache: CostCache
    """The search's costs."""
    refused: list[Rejection]
    """The space's refused groups (where its costs could not be computed)."""
    groups: list[tuple[Group, _KeptBytes]] = dataclasses.field(default_factory=list)
    """The groups waiting for its costs, with their activation bytes."""
    bound: float = math.inf
    """The least of its groups' lower bounds."""
    value: _Costs | None = None
    """Its costs, once computed (after which no group waits)."""
    failed: bool = False
    """Whether computing its costs was refused."""

    def add(self, g: Group, kept: _KeptBytes, lower: float) -> None:
        """Let ``g`` wait for the costs, its bound at least ``lower``."""
        self.groups.append((g, kept))
        self.bound = min(self.bound, lower)

    def resolve(self, out: list[_Bounded]) -> _Costs | None:
        """Its costs (``None`` where refused), computed once; the groups that waited appended to ``out``, bounded."""
        if self.value is None and not self.failed:
            layout = self.layout() if callable(self.layout) else self.layout
            found = _representative_costs(self.head, self.rep_job, layout, self.job, None, self.options,
                                          self.world, self.cache, self.refused, self.overlaps)
            self.failed = found is None
            if found is not None:
                self.value = self.cache.groups[self.key] = found
                L, m = self.job.model.num_layers, self.job.model
                first_dense = m.moe_first_dense_layers if m.is_moe else None
                for g, kept in self.groups:
                    bounded = _bounded(g, found, kept, L, first_dense)
                    if bounded.bound < self.bound:
                        raise SearchBoundError(f"group {g.head} bounded at {bounded.bound} s, below its "
                                               f"sibling's bound {self.bound} s")
                    out.append(bounded)
            self.groups = []
        return self.value


class SearchBoundError(CfpError, RuntimeError):
    """A deferred group's bound came out below the bound it waited under (:class:`_Deferred`): the search's order
    would no longer be its exhaustive search's."""


@functools.lru_cache(maxsize=4096)
def _lightest_end_loads(num_layers: int, pp: int, splits: tuple[tuple[int, int, int, bool], ...],
                        first_dense: int | None) -> tuple[_Loads, _Loads]:
    """The (dense, MoE) layer counts of the first and of the last pipeline rank over ``splits`` that no other
    split's count undercuts in both (a weighted sum with weights at zero or above is least at one of them)."""
    ends = [_end_rank_loads(num_layers, pp, *split, first_dense)[:2] for split in splits]
    return _least({end[0] for end in ends}), _least({end[1] for end in ends})


@functools.lru_cache(maxsize=4096)
def _lightest_ends(num_layers: int, pp: int, splits: tuple[tuple[int, int, int, bool], ...]) -> tuple[int, int]:
    """The fewest layers the first and the last pipeline stage hold over ``splits``."""
    counts = [split_stage_counts(num_layers, pp, *split) for split in splits]
    return min(c[0] for c in counts), min(c[-1] for c in counts)


def _expand(bounded: _Bounded, job: JobSpec, options: SimOptions, param_bytes: StateBound,
            cut: float = math.inf, sharded: dict[tuple, tuple[float, ...]] | None = None
            ) -> list[tuple[float, int, tuple, tuple[float, float]]]:
    """Queue entries of the group's candidates whose time bound is ``cut`` or less (:func:`_time_entries`) with
    their memory bounds (:func:`_memory_bounds`): ``(time bound, CANDIDATE, key, memory bounds)``; ``sharded``
    gets the bounds under each Megatron-FSDP strategy by key. The search itself bounds memory when it takes a
    candidate from the queue (:meth:`MegatronSpace.evaluate`): most are never taken."""
    out = []
    for bound, kind, key, split in _time_entries(bounded, job, cut):
        weights, by_kind, strategies = _memory_bounds(bounded, job, param_bytes, split, key[-1])
        out.append((bound, kind, key, (weights, by_kind)))
        if sharded is not None and strategies is not None:
            sharded[key] = strategies
    return out


def _time_entries(bounded: _Bounded, job: JobSpec, cut: float = math.inf, extra: object = None
                  ) -> list[tuple[float, int, tuple, object]]:
    """Queue entries of the group's candidates whose time bound is ``cut`` or less: ``(time bound, CANDIDATE, key,
    (extra, split))``, or ``(..., split)`` where ``extra`` is ``None``; the bound is
    :func:`~cfp_megatron.sim.bounds.time_bound` at the split's stages (:func:`_split_facts`)."""
    m = job.model
    L = m.num_layers
    moe_model = m.is_moe
    first_dense = m.moe_first_dense_layers if moe_model else None
    g, interleaved, serial = bounded.group, bounded.costs, bounded.serial
    head, dopts, microbatches = g.head, g.dopts, g.microbatches
    pp = head.pp
    block = head.recompute == BLOCK
    # each costs' terms, looked up once (the splits of one chunk per rank may take the serial costs)
    terms = {id(c): (c, *layer_terms(c, block), c.kind_fb_s if block else c.kind_s)
             for c in (interleaved, serial) if c is not None}
    out: list[tuple[float, int, tuple, object]] = []
    for split in g.splits:
        vpp = split[0]
        costs, layer_s, chunk_s, kind_s = terms[id(serial if vpp == 1 and serial is not None else interleaved)]
        first, middle, last, dense_0, moe_0, dense_n, moe_n, _, middles = _split_facts(L, pp, split, first_dense)
        bound = time_bound(costs, layer_s, chunk_s, microbatches, pp, vpp, L, first, middle, last,
                           dense_0 * kind_s[0] + moe_0 * kind_s[1], dense_n * kind_s[0] + moe_n * kind_s[1],
                           # a dense model's layers are of one kind: its middle ranks' count bounds them already
                           min([d * kind_s[0] + n * kind_s[1] for d, n in middles]) if middles and moe_model else 0.0)
        if bound > cut:
            continue
        tag = split if extra is None else (extra, split)
        prefix = head + split
        out.extend([(bound, _CANDIDATE, prefix + (dopt,), tag) for dopt in dopts])
    return out


def _split_bound(costs: GroupCosts, g: Group, split: tuple[int, int, int, bool], job: JobSpec) -> float:
    """:func:`~cfp_megatron.sim.bounds.time_bound` of the group's candidate of ``split`` under ``costs``, as
    :func:`_time_entries` bounds it."""
    m = job.model
    L, pp, block = m.num_layers, g.head.pp, g.head.recompute == BLOCK
    layer_s, chunk_s = layer_terms(costs, block)
    kind_s = costs.kind_fb_s if block else costs.kind_s
    first, middle, last, dense_0, moe_0, dense_n, moe_n, _, middles = _split_facts(
        L, pp, split, m.moe_first_dense_layers if m.is_moe else None)
    return time_bound(costs, layer_s, chunk_s, g.microbatches, pp, split[0], L, first, middle, last,
                      dense_0 * kind_s[0] + moe_0 * kind_s[1], dense_n * kind_s[0] + moe_n * kind_s[1],
                      min([d * kind_s[0] + n * kind_s[1] for d, n in middles]) if middles and m.is_moe else 0.0)


def _fitting_bound(bounded: _Bounded, job: JobSpec, split: tuple[int, int, int, bool]) -> float:
    """A lower bound on the step time of the group's candidate of ``split`` (one without a pipeline, or
    interleaved) whether it turns the expert overlap on or not (:attr:`_Bounded.paired`): the lesser of the two
    bounds. Tighter than its queue bound, which takes the share any overlap leaves of the expert exchange; the
    search takes it once the candidate is known to fit (a candidate over memory is recorded as such)."""
    if bounded.paired is None:
        return 0.0
    paired, alone = bounded.paired
    return min(_split_bound(paired(), bounded.group, split, job), _split_bound(alone, bounded.group, split, job))


def _memory_bounds(bounded: _Bounded, job: JobSpec, param_bytes: StateBound, split: tuple[int, int, int, bool],
                   dopt: bool) -> tuple[float, float, tuple[float, ...] | None]:
    """Lower bounds on the memory per GPU (bytes) of the group's candidate of ``split`` and distributed optimizer
    ``dopt``: the first counts what every rank keeps of the weights, gradients and optimizer states of the heaviest
    pipeline rank's layers at least (``param_bytes``: bytes per parameter with and without the distributed
    optimizer at the group's data-parallel size, :func:`_param_bytes`), or those of the first rank's layers with the
    activations its in-flight micro-batches keep at least (:attr:`_Bounded.kept`, the lighter kind's per layer),
    whichever is more; the second is at least the first and counts the first rank's layers each at its own kind's
    bytes (what the no-fit figures may not record: :meth:`MegatronSpace.evaluate`); the third, with the distributed
    optimizer and Megatron-FSDP strategies to set, the first under each (``None`` otherwise)."""
    m = job.model
    g, costs = bounded.group, bounded.costs
    pp, vpp = g.head.pp, split[0]
    _, _, _, dense_0, moe_0, _, _, loads, _ = _split_facts(m.num_layers, pp, split,
                                                            m.moe_first_dense_layers if m.is_moe else None)
    kept_bytes = bounded.kept() if bounded.kept is not None else (0.0, 0.0)
    per_param = param_bytes.per_param(g.head)
    params = max(d * costs.dense_params + n * costs.moe_params for d, n in loads)
    # The first rank: its layers' weights and the activations of the micro-batches it holds (stage_memory).
    first_params = dense_0 * costs.dense_params + moe_0 * costs.moe_params
    held = dense_0 + moe_0  # less the layers activation offloading keeps on the host (sim/memory.py)
    offloaded = job.parallel.cpu_offloading_num_layers
    held -= min(offloaded, held)  # none of theirs beside the others at the peak (sim/memory.py)
    per_microbatch = in_flight(0, pp, vpp, g.microbatches) / vpp
    activations = min(kept_bytes) * held * per_microbatch
    # each kind's layers at their own bytes (where no layer's activations go to the host)
    by_kind = activations if offloaded > 0 else (dense_0 * kept_bytes[0] + moe_0 * kept_bytes[1]) * per_microbatch
    states = per_param[not dopt]
    weights = max(params * states, first_params * states + activations)
    strategies = None
    if dopt and len(per_param) > 3:  # the bound under each strategy
        strategies = tuple(max(params * b, first_params * b + activations) for b in per_param[2:])
    return weights, max(weights, first_params * states + by_kind), strategies


@dataclass(frozen=True, kw_only=True)
class StateBound:
    """Bytes per parameter of the weights, gradients and optimizer states a rank keeps at least: without the
    distributed optimizer, and with it under each Megatron-FSDP strategy the search may set
    (:meth:`~cfp_megatron.search.space.Space.fsdp_values`, least sharded first): what every rank keeps whatever its
    data-parallel size (:meth:`~cfp_megatron.sim.sharding.StateBytes.replicated`), and the rest over the largest
    group it may be sharded over (DP x CP, or the routed experts' expert-DP group)."""

    world: int
    """Ranks of the search."""
    ddp: tuple[float, float]
    """(kept by every rank, sharded) bytes per parameter without the distributed optimizer."""
    sharded: tuple[tuple[str, float, float], ...]
    """(strategy, kept by every rank, sharded) bytes per parameter with the distributed optimizer, per strategy."""
    pipelined: bool = True
    """Whether the strategies beyond the first apply to pipelined families too
    (:meth:`~cfp_megatron.search.space.Space.sharding_ladder`); else those keep to the first."""
    by_family: dict[tuple, tuple[float, ...]] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    """:meth:`per_param` by family (its head's first five fields), once computed."""

    def per_param(self, head: tuple) -> tuple[float, ...]:
        """Bytes per parameter for a group of ``head``'s family: with the distributed optimizer at the most sharding
        the search may set, without it, then with it under each strategy of :attr:`sharded` (in that order)."""
        family = head[:5]
        found = self.by_family.get(family)
        if found is None:
            found = self.by_family[family] = self._per_param(*family)
        return found

    def _per_param(self, tp: int, cp: int, pp: int, ep: int, etp: int) -> tuple[float, ...]:
        """:meth:`per_param` of a family, computed."""
        widest = max(data_parallel_size(self.world, tp, cp, pp) * cp,
                     expert_data_parallel_size(self.world, etp, ep, pp), 1)
        strategies = self.sharded if self.pipelined or pp == 1 else self.sharded[:1]
        each = tuple(kept + shard / widest for _, kept, shard in strategies)
        return (each[-1], self.ddp[0] + self.ddp[1] / widest, *each)


def _param_bytes(job: JobSpec, space: Space) -> StateBound:
    """The :class:`StateBound` of ``job``'s states in ``space`` (the lesser of its format's and bf16's where it keeps
    layers in bf16 at the stack's ends: their weights hold no quantised copies)."""
    states = [StateBytes.megatron(job)]
    if (job.parallel.num_layers_at_start_in_bf16 or job.parallel.num_layers_at_end_in_bf16) \
            and NumberFormat.of(job.train).low:
        states.append(StateBytes.megatron(bf16_twin(job)))

    def split(sharded: Sharded) -> tuple[float, float]:
        kept = [state.replicated(sharded) for state in states]
        totals = [state.weights + state.gradients + state.main_gradients + state.optimizer_side for state in states]
        return min(kept), min(total - k for total, k in zip(totals, kept, strict=True))

    strategies = space.fsdp_values() or [FsdpStrategy.none.value]
    return StateBound(world=space.world, ddp=split(megatron_sharded(distributed_optimizer=False)),
                      pipelined=space.cfp.allowed("fsdp") is not None,
                      sharded=tuple((s, *split(megatron_sharded(distributed_optimizer=True, fsdp=FsdpStrategy(s))))
                                    for s in strategies))


def _bounds(space: Space, job: JobSpec, measurements: Measurements | None, options: SimOptions,
            cache: CostCache) -> tuple[list[tuple[float, tuple, float]], list[Rejection], int]:
    """Every candidate (as its :meth:`~Candidate.key`) with its lower bounds on step time and memory, in increasing
    (bound, key) order; the groups the runtime's validation refuses; the number of candidates (what the search's
    queue yields, all at once)."""
    groups, refused, size = _groups(space, job, measurements, options, cache)
    param_bytes = _param_bytes(job, space)
    out = [(bound, key, weights) for g in groups for bound, _, key, weights in _expand(g, job, options, param_bytes)]
    out.sort()
    return out, refused, size


@functools.lru_cache(maxsize=4096)
def _rank_loads(num_layers: int, pp: int, vpp: int, first: int, last: int, balanced: bool,
                first_dense: int | None) -> tuple[tuple[int, int], ...]:
    """The (dense, MoE) layer counts of the pipeline ranks of a split that no other rank's count exceeds in both
    (a weighted sum with weights at zero or above, as the memory bound takes, is largest at one of them: a dense
    model has a single one, its heaviest rank)."""
    rows = chunk_layers(num_layers, pp, vpp, first or None, last or None, first_dense=first_dense,
                        layout=balanced_layout(num_layers, pp, vpp) if balanced else None)
    loads = {(sum(c.dense for c in row), sum(c.moe for c in row)) for row in rows}
    return tuple(sorted(a for a in loads if not any(b != a and b[0] >= a[0] and b[1] >= a[1] for b in loads)))


_Loads = tuple[tuple[int, int], ...]
"""(dense, MoE) layer counts of some pipeline ranks."""


@functools.lru_cache(maxsize=8192)
def _split_facts(num_layers: int, pp: int, split: tuple[int, int, int, bool], first_dense: int | None
                 ) -> tuple[int, int, int, int, int, int, int, _Loads, _Loads]:
    """What :func:`_expand` reads of a split, in one lookup: the first, lightest middle and last stage's layers
    (:func:`_stage_layers`), the first and the last rank's (dense, MoE) layers and the middle ranks' distinct ones
    (:func:`_end_rank_loads`), and the ranks' loads (:func:`_rank_loads`)."""
    (dense_0, moe_0), (dense_n, moe_n), middles = _end_rank_loads(num_layers, pp, *split, first_dense)
    return (*_stage_layers(num_layers, pp, *split), dense_0, moe_0, dense_n, moe_n,
            _rank_loads(num_layers, pp, *split, first_dense), middles)


@functools.lru_cache(maxsize=4096)
def _end_rank_loads(num_layers: int, pp: int, vpp: int, first: int, last: int, balanced: bool,
                    first_dense: int | None) -> tuple[tuple[int, int], tuple[int, int], _Loads]:
    """The (dense, MoE) layer counts of the first and of the last pipeline rank of a split, and the distinct ones of
    the ranks between them."""
    rows = chunk_layers(num_layers, pp, vpp, first or None, last or None, first_dense=first_dense,
                        layout=balanced_layout(num_layers, pp, vpp) if balanced else None)
    loads = [(sum(c.dense for c in row), sum(c.moe for c in row)) for row in rows]
    return loads[0], loads[-1], _least(set(loads[1:-1]))


def _least(loads: set[tuple[int, int]]) -> _Loads:
    """The (dense, MoE) counts of ``loads`` that no other undercuts in both (a weighted sum with weights at zero or
    above is least at one of them), in order."""
    return tuple(sorted(a for a in loads if not any(b != a and b[0] <= a[0] and b[1] <= a[1] for b in loads)))


def _layer_kept_bytes(head: GroupHead, placed: Layout, job: JobSpec, measurements: Measurements | None,
                      options: SimOptions) -> tuple[float, float]:
    """Activation bytes one decoder layer keeps for its backward pass, per micro-batch on one rank, at least, for
    the group of ``head`` (its family placed as ``placed``), a dense layer's and a MoE layer's (a dense model's
    twice the dense one's), each (and under PrimePar also
    Megatron's MLP, which layers beyond ``primepar_layers`` run) under the group's recomputation (block
    recomputation: a recomputed layer's input), as :func:`~cfp_megatron.sim.memory.layer_activation_bytes` counts
    it. Zero where measured segment memory may replace the model's activations (it is no bound on those)."""
    if measurements is not None and options.use_measured_segments:
        return 0.0, 0.0
    recompute, modules = recompute_parts(head.recompute, job.parallel.recompute_modules)
    try:
        spec = ParallelSpec(tp=head.tp, sp=head.sp, pp=head.pp, cp=head.cp, ep=head.ep, etp=head.etp,
                            recompute=recompute, recompute_modules=modules, mlp=MlpPartition(head.mlp),
                            order=job.parallel.order)
    except ConfigError:
        return 0.0, 0.0
    # Only the sizes the activations read (TP, SP, CP, expert TP, micro-batch): no world or split needed.
    layout = dataclasses.replace(placed, micro_batch=head.micro_batch,
                                 dims=ParallelDims(parallel=spec, world_size=placed.dims.world_size,
                                                   num_microbatches=placed.dims.num_microbatches))
    plan = dataclasses.replace(job, parallel=spec)
    index = 1 if recompute is Recompute.full else 0  # (kept without, kept with full recomputation)
    plans = [plan, megatron_twin(plan)] if spec.mlp is MlpPartition.primepar else [plan]
    dense, moe = (min(layer_activation_bytes(p, layout, options, moe=moe)[index] for p in plans)
                  for moe in (False, job.model.is_moe))
    return dense, moe


@functools.lru_cache(maxsize=8192)
def _stage_layers(num_layers: int, pp: int, vpp: int, first: int, last: int, balanced: bool) -> tuple[int, int, int]:
    """Layers of the first, the lightest middle (the first's count when there are none) and the last pipeline stage
    of a split. A balanced split's stages hold fewer layers the later they come and each rank's first chunk at
    least its mean, so its lightest middle stage bounds the ones before it as an even split's middle does."""
    counts = split_stage_counts(num_layers, pp, vpp, first, last, balanced)
    return counts[0], min(counts[1:-1]) if pp > 2 else counts[0], counts[-1]


def _group_costs(head: GroupHead, job: JobSpec, measurements: Measurements | None, options: SimOptions, world: int,
                 cache: CostCache, refused: list[Rejection], *,
                 may_overlap: tuple[bool, bool] = (False, False), specs: dict[tuple, ParallelSpec] | None = None,
                 layouts: dict[tuple, Layout] | None = None) -> _Costs | None:
    """The costs a group's bound counts (:func:`~cfp_megatron.sim.bounds.group_costs`), from a representative of
    the group of ``head`` (no overlaps); ``may_overlap``: whether its candidates may overlap their TP communication
    and their expert all-to-all; with those without the all-to-all's overlap where it may (``None`` where it may not:
    the costs of a pipelined group's splits of one chunk per rank, :attr:`_Bounded.serial`); ``None`` (and a
    rejection in ``refused``) where the runtime's validation refuses it; ``specs``: the checked :class:`ParallelSpec`
    of the representatives built so far (:meth:`~cfp_megatron.search.space.Candidate.shared_job`); ``layouts``: the
    validated layouts of the representatives so far, by the :meth:`~cfp_megatron.search.space.Candidate.key` of the
    representative without recomputation (one of another recompute choice is validated by the checks that read the
    recompute choice alone, :func:`~cfp_megatron.base.parallel_dims.recompute_problems`, and placed as it)."""
    # A valid split for the pass costs (they do not depend on the split): the even one, or the balanced one where
    # the stages do not divide the layers; the representative is built from its key (no Candidate to replace).
    rep = _representative(head, job, world, refused, specs=specs, layouts=layouts)
    if rep is None:
        return None
    rep_job, layout = rep
    return _representative_costs(head, rep_job, layout() if callable(layout) else layout, job, measurements,
                                 options, world, cache, refused, may_overlap)


def _refusal(head: GroupHead, world: int, err: ConfigError) -> Rejection:
    """The rejection of the group of ``head`` that the runtime's validation refuses with ``err``."""
    named = Candidate.from_key(head + (1, 0, 0, False, False))  # the group's head as the rejections name it
    return Rejection(what=named.describe(world).rsplit(" rc=", 1)[0], reason="; ".join(i.problem for i in err.issues))


def _representative(head: GroupHead, job: JobSpec, world: int, refused: list[Rejection], *,
                    specs: dict[tuple, ParallelSpec] | None = None, layouts: dict[tuple, Layout] | None = None,
                    place: bool = True) -> tuple[JobSpec, Layout | Callable[[], Layout]] | None:
    """The job and validated layout of the representative of the group of ``head`` (:func:`_group_costs`);
    ``None`` (and a rejection in ``refused``) where the runtime's validation refuses it. ``place`` false: the
    layout may come as a function that places it (as its sibling without recomputation), for later."""
    # A valid split for the pass costs (they do not depend on the split): the even one, or the balanced one where
    # the stages do not divide the layers; the representative is built from its key (no Candidate to replace).
    split = (1, 0, 0, job.model.num_layers % head.pp != 0, False)
    rep = Candidate.from_key(head._replace(recompute=Recompute.full.value if head.recompute == BLOCK
                                           else head.recompute) + split)
    free = head._replace(recompute=Recompute.none.value) + split
    sibling = layouts.get(free) if layouts is not None else None
    try:
        rep_job = rep.job(job) if specs is None else rep.shared_job(job, specs)
        if sibling is not None and not recompute_problems(rep_job):
            placed = functools.partial(_placed_as, sibling, rep_job, world)
            return rep_job, placed() if place else placed
        # what it reads beyond the recompute choice validated here, or an issue to name in full
        layout = build_layout(rep_job, world)
        if layouts is not None and sibling is None:
            layouts[free] = layout
    except ConfigError as err:
        refused.append(_refusal(head, world, err))
        return None
    return rep_job, layout


def _placed_as(sibling: Layout, rep_job: JobSpec, world: int) -> Layout:
    """``rep_job``'s layout, placed as its validated ``sibling`` (the same layout under another recompute choice)."""
    return dataclasses.replace(sibling, dims=ParallelDims(parallel=rep_job.parallel, world_size=world,
                                                          num_microbatches=sibling.dims.num_microbatches))


def _representative_costs(head: GroupHead, rep_job: JobSpec, layout: Layout, job: JobSpec,
                          measurements: Measurements | None, options: SimOptions, world: int, cache: CostCache,
                          refused: list[Rejection], may_overlap: tuple[bool, bool]
                          ) -> _Costs | None:
    """:func:`_group_costs` of the representative ``rep_job`` placed as ``layout`` (:func:`_representative`)."""
    try:
        parts = prepare_costs(rep_job, job.cluster, measurements, options=options, world_size=world, cache=cache,
                              layout=layout)
        # what the pipelined probe's calibration adds to every schedule of the group (it too depends on the
        # partition, the micro-batch and where the stages sit only)
        fixed_s = schedule_fixed_s(rep_job, job.cluster, measurements, options=options, world_size=world, cache=cache)
    except ConfigError as err:
        refused.append(_refusal(head, world, err))
        return None
    shared_cores = (measurements is not None and parts.overheads is not None
                    and measurements.busy_slowdown() is not None)
    overlaps = Overlaps(tp=head.tp, tp_comm=may_overlap[0], expert_a2a=may_overlap[1])
    found, serial = group_costs_pair(parts, overlaps, hidden=job.model.hidden_size, shared_cores=shared_cores,
                                     fixed_s=fixed_s)
    paired = None
    if serial is not None and measurements is None:  # the candidates that turn the expert overlap on, apart
        paired = _Paired(parts=parts, overlaps=overlaps, hidden=job.model.hidden_size, shared_cores=shared_cores,
                         fixed_s=fixed_s)
    return found, serial, paired


@dataclass(kw_only=True)
class _Paired:
    """:func:`~cfp_megatron.sim.bounds.paired_costs` of a group's representative, computed when a candidate of the
    group first fits (few do)."""

    parts: PassCosts
    """The representative's pass costs."""
    overlaps: Overlaps
    """What the group's candidates may turn on."""
    hidden: int
    """The model's hidden size."""
    shared_cores: bool
    """Whether the simulator may take the shared-cores schedule."""
    fixed_s: float
    """What the simulator adds to every pipelined schedule."""
    value: GroupCosts | None = None
    """The costs, once computed."""

    def __call__(self) -> GroupCosts:
        if self.value is None:
            self.value = paired_costs(self.parts, self.overlaps, hidden=self.hidden, shared_cores=self.shared_cores,
                                      fixed_s=self.fixed_s)
        return self.value
