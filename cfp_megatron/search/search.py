"""Branch and bound over the layouts of :mod:`cfp_megatron.search.space`, with the simulator as the objective.

Every candidate gets a lower bound on its step time that costs a few arithmetic operations once the pass costs of its
(TP, SP, CP, EP, micro-batch, recompute) group are known (:class:`~cfp_megatron.sim.pass_costs.CostCache`, one
computation per group however many pipeline, interleaving and optimizer variants share it):

    chunk = layers per model chunk x the cheaper layer's forward + backward + recompute + 2 x the per-pass cost
    bound = micro-batches x (chunks per rank x chunk + head) + (pipeline ranks - 1) x chunk + embedding

The last pipeline rank runs at least ``micro-batches x chunks`` such passes and the head's, one after another; it
cannot start before micro-batch 0 went forward through the ``pp - 1`` stages before it (the first with the
embedding), and after its last backward the same micro-batch still goes backward through them. The simulated step is
the slowest rank's schedule plus its gradient sync and optimizer step, all non-negative, so the bound never exceeds
it. (Without pipelining the one rank runs everything: ``micro-batches x (chunk + embedding + head)``. On a CPU with
fewer cores than ranks the simulated schedule is bounded below by the mean rank's work only, which the bound then
uses.) Candidates are visited in increasing bound; each is first checked for memory
(cheap), then simulated; the visit stops at the first candidate whose bound exceeds the k-th best step time found,
since every later one is provably slower. The result equals an exhaustive search's (tested on random spaces).
Ties are broken by the candidate's field order, so the answer is the same in every process.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time
from collections import defaultdict
from dataclasses import dataclass

from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.config import JobSpec, OptimizerKind, Recompute
from cfp_megatron.errors import ConfigError, ConfigIssue
from cfp_megatron.parallel_dims import ParallelDims
from cfp_megatron.search.space import Candidate, Family, Rejection, Space, build_space
from cfp_megatron.search.spec import CfpSpec
from cfp_megatron.sim.layout import place
from cfp_megatron.sim.memory import element_bytes
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache, cost_key
from cfp_megatron.sim.prediction import GIB, Prediction
from cfp_megatron.sim.simulate import predict_memory, prepare_costs, simulate_unless_slower


@dataclass(frozen=True, kw_only=True)
class Ranked:
    """One evaluated plan."""

    candidate: Candidate
    """Its layout."""
    job: JobSpec
    """The job under that layout."""
    prediction: Prediction
    """The simulator's prediction."""


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """What a search found and how much work it took."""

    ranked: tuple[Ranked, ...]
    """The best plans that fit, fastest first (at most ``cfp.top_k``)."""
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
    """Peak memory a plan may predict per GPU (HBM less the headroom); ``None`` without a known capacity."""
    seconds: float
    """Wall time of the search."""
    world: int
    """Ranks."""

    @property
    def best(self) -> Ranked:
        """The fastest plan that fits; raises :class:`~cfp_megatron.errors.ConfigError` naming what ruled the
        layouts out (families that held plans first) when none does."""
        if not self.ranked:
            first = sorted(self.rejected, key=lambda r: r.count == 0)[:8]
            raise ConfigError([ConfigIssue(key="cfp", value=r.what, problem=r.reason, fix=_NO_PLAN_FIX)
                               for r in first] or [ConfigIssue(key="cfp", value="", problem="no layout is left.",
                                                               fix=_NO_PLAN_FIX)])
        return self.ranked[0]


_NO_PLAN_FIX = "relax the cfp pins and constraints, lower cfp.constraints.memory_headroom, or add GPUs."


def search(job: JobSpec, world: int, cfp: CfpSpec, *, measurements: Measurements | None = None,
           options: SimOptions | None = None, te_available: bool = True,
           exhaustive: bool = False) -> SearchResult:
    """The ``cfp.top_k`` fastest layouts of ``job`` on ``world`` ranks that fit in memory (see the module docstring).

    ``exhaustive`` simulates every candidate that fits (no bound): the reference the bounded search is tested
    against."""
    started = time.perf_counter()
    cluster = job.cluster
    options = options or SimOptions()
    space = build_space(job, world, cfp, te_available=te_available)
    cache = CostCache.for_job(job, measurements, options)
    limit = None
    if cluster.hbm_gib is not None:
        limit = cluster.hbm_gib * (1.0 - cfp.constraints.memory_headroom)
    order, invalid_groups, size = _bounds(space, job, measurements, options, cache)
    k = cfp.top_k
    best: list[tuple[float, tuple, Ranked]] = []  # the k best so far, by (step time, candidate key)
    over: dict[Family, list[float]] = defaultdict(list)
    checked = simulated = over_memory = invalid = bounded = 0
    stop_at = len(order)
    for i, (bound, cand, weights) in enumerate(order):
        if not exhaustive and len(best) == k and bound > best[-1][0]:
            stop_at = i  # this and every later candidate is slower than the k-th best
            break
        if limit is not None and weights / GIB > limit:  # its weights, gradients and optimizer states alone
            over_memory += 1
            over[_family(cand)].append(weights / GIB)
            continue
        cjob = cand.job(job)
        try:
            memory = predict_memory(cjob, cluster, measurements, options=options, world_size=world, cache=cache)
        except ConfigError:
            invalid += 1
            continue
        checked += 1
        if limit is not None and memory.total / GIB > limit:
            over_memory += 1
            over[_family(cand)].append(memory.total / GIB)
            continue
        kth = best[-1][0] if len(best) == k and not exhaustive else math.inf
        prediction = simulate_unless_slower(cjob, kth, cluster, measurements, options=options, world_size=world,
                                            cache=cache)
        if prediction is None:  # its bound with the exact passes, gradient sync and optimizer exceeds the k-th best
            bounded += 1
            continue
        simulated += 1
        entry = (prediction.step_time_s, _key(cand), Ranked(candidate=cand, job=cjob, prediction=prediction))
        bisect.insort(best, entry, key=lambda e: e[:2])
        del best[k:]
    ranked = tuple(r for _, _, r in best)
    rejected = list(space.rejected) + invalid_groups
    for fam, sizes in sorted(over.items(), key=lambda kv: _family_key(kv[0])):
        rejected.append(Rejection(what=_family_label(fam, world), count=len(sizes),
                                  reason=f"{len(sizes)} plan(s) checked need {min(sizes):.1f} GiB or more per GPU, "
                                         f"over the {limit:.1f} GiB allowed"))
    return SearchResult(ranked=ranked, rejected=tuple(rejected), space_size=size, simulated=simulated,
                        memory_checked=checked, over_memory=over_memory, invalid=invalid,
                        pruned=len(order) - stop_at + bounded, memory_limit_gib=limit,
                        seconds=time.perf_counter() - started, world=world)


def _key(c: Candidate) -> tuple:
    return (c.tp, c.cp, c.pp, c.ep, c.etp, c.sp, c.micro_batch, c.recompute, c.vpp, c.distributed_optimizer)


def _family(c: Candidate) -> Family:
    return Family(tp=c.tp, cp=c.cp, pp=c.pp, ep=c.ep, etp=c.etp)


def _family_key(f: Family) -> tuple[int, ...]:
    return (f.tp, f.cp, f.pp, f.ep, f.etp)


def _family_label(f: Family, world: int) -> str:
    label = f"dp{f.dp(world)} tp{f.tp} pp{f.pp}"
    label += f" cp{f.cp}" if f.cp > 1 else ""
    label += f" ep{f.ep}" if f.ep > 1 else ""
    label += f" etp{f.etp}" if f.etp > 1 else ""
    return label


def _bounds(space: Space, job: JobSpec, measurements: Measurements | None,
            options: SimOptions, cache: CostCache) -> tuple[list[tuple[float, Candidate, float]], list[Rejection], int]:
    """Every candidate with its lower bound on step time and a lower bound on its memory per rank (the layers'
    weights, gradients and, unless sharded, optimizer states), in increasing (bound, candidate) order; the groups the
    runtime's validation refuses; the number of candidates."""
    world = space.world
    L = job.model.num_layers
    elem = element_bytes(job)
    opt_bytes = (4.0 if elem == 2 else 0.0) + (8.0 if job.train.optimizer is OptimizerKind.adam else 4.0)
    gbs = job.train.global_batch_size
    out: list[tuple[float, Candidate, float]] = []
    refused: list[Rejection] = []
    by_key: dict[tuple, _GroupCosts | None] = {}
    gpn = job.cluster.gpus_per_node or world
    size = 0
    for fam in space.families:
        dp = fam.dp(world)
        group: dict[tuple, _GroupCosts | None] = {}
        for cand in space.candidates(fam):
            size += 1
            gkey = (cand.sp, cand.micro_batch, cand.recompute)
            if gkey not in group:
                # The pass costs depend on the layout only through cost_key: look them up without building and
                # validating a job per group; compute (and validate) once per key.
                dims = ParallelDims(world_size=world, tp=cand.tp, pp=cand.pp, vpp=1, cp=cand.cp, ep=cand.ep,
                                    etp=cand.etp, dp=dp, expert_dp=max(world // (cand.etp * cand.ep * cand.pp), 1),
                                    sp=cand.sp, num_microbatches=gbs // (dp * cand.micro_batch),
                                    order=job.parallel.order)
                layout = place(job, dims, gpn)
                layout = dataclasses.replace(layout, micro_batch=cand.micro_batch)
                key = cost_key(layout, Recompute(cand.recompute), options)
                if key not in by_key:
                    by_key[key] = _group_costs(cand, job, measurements, options, world, cache, refused)
                group[gkey] = by_key[key]
            costs = group[gkey]
            if costs is None:
                continue
            m, pp = gbs // (dp * cand.micro_batch), cand.pp
            chunk = L / (pp * cand.vpp) * costs.layer_s + 2 * costs.pass_s  # one chunk's passes, at least
            if pp == 1:
                bound = m * (chunk + costs.embedding_s + costs.head_s)
            elif costs.shared_cores:
                bound = m * (cand.vpp * chunk + (costs.embedding_s + costs.head_s) / pp)
            else:
                bound = m * (cand.vpp * chunk + costs.head_s) + (pp - 1) * chunk + costs.embedding_s
            per_param = elem + 4.0 + (0.0 if cand.distributed_optimizer else opt_bytes)
            out.append((bound, cand, 0.0 if options.fsdp else L / pp * costs.layer_params * per_param))
    out.sort(key=lambda e: (e[0], _key(e[1])))
    return out, refused, size


@dataclass(frozen=True, kw_only=True)
class _GroupCosts:
    """What the bounds of a group of candidates with equal pass costs are built from."""

    layer_s: float
    """Forward + backward + recompute seconds of the cheaper layer kind, per micro-batch."""
    layer_params: float
    """Parameters of one layer on a rank, at least."""
    pass_s: float
    """The schedule's cost per pass."""
    embedding_s: float
    """Embedding forward + backward per micro-batch."""
    head_s: float
    """Head forward + backward per micro-batch."""
    shared_cores: bool
    """Whether the simulator may take the shared-cores schedule (CPU with fewer cores than ranks)."""


def _group_costs(cand: Candidate, job: JobSpec, measurements: Measurements | None,
                 options: SimOptions, world: int, cache: CostCache, refused: list[Rejection]) -> _GroupCosts | None:
    rep = dataclasses.replace(cand, vpp=1, distributed_optimizer=False)
    try:
        parts = prepare_costs(rep.job(job), job.cluster, measurements, options=options, world_size=world, cache=cache)
    except ConfigError as err:
        refused.append(Rejection(what=cand.describe(world).rsplit(" rc=", 1)[0],
                                 reason="; ".join(i.problem for i in err.issues)))
        return None
    return _GroupCosts(
        layer_s=parts.min_layer_s(),
        # the biases and norms the count leaves out add at least -2 h (cfp_megatron.sim.memory.layer_extra_params)
        layer_params=max(min(parts.dense.params, parts.moe.params) - 2.0 * job.model.hidden_size, 0.0),
        pass_s=parts.per_pass.total_s,
        embedding_s=sum(p.total_s for p in parts.embedding), head_s=sum(p.total_s for p in parts.head),
        shared_cores=measurements is not None and parts.overheads is not None
        and measurements.busy_slowdown() is not None)
