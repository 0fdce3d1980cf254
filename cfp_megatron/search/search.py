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
import functools
import math
import time
from collections import defaultdict
from dataclasses import dataclass

from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.config import JobSpec, OptimizerKind, Recompute
from cfp_megatron.errors import ConfigError, ConfigIssue
from cfp_megatron.parallel_dims import ParallelDims
from cfp_megatron.pipeline_split import chunk_layers, stage_counts
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
    for i, (bound, key, weights) in enumerate(order):
        if not exhaustive and len(best) == k and bound > best[-1][0]:
            stop_at = i  # this and every later candidate is slower than the k-th best
            break
        cand = Candidate.from_key(key)
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
        entry = (prediction.step_time_s, key, Ranked(candidate=cand, job=cjob, prediction=prediction))
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
            options: SimOptions, cache: CostCache) -> tuple[list[tuple[float, tuple, float]], list[Rejection], int]:
    """Every candidate (as its :meth:`~Candidate.key`) with its lower bound on step time and a lower bound on its
    memory per rank (the weights, gradients and, unless sharded, optimizer states of the layers of the heaviest of
    its pipeline ranks), in increasing (bound, key) order; the groups the runtime's validation refuses; the number of
    candidates."""
    world = space.world
    m_spec = job.model
    L = m_spec.num_layers
    first_dense = m_spec.moe_first_dense_layers if m_spec.is_moe else None
    elem = element_bytes(job)
    opt_bytes = (4.0 if elem == 2 else 0.0) + (8.0 if job.train.optimizer is OptimizerKind.adam else 4.0)
    gbs = job.train.global_batch_size
    out: list[tuple[float, tuple, float]] = []
    refused: list[Rejection] = []
    by_key: dict[tuple, _GroupCosts | None] = {}
    gpn = job.cluster.gpus_per_node or world
    size = 0
    for fam in space.families:
        dp = fam.dp(world)
        group: dict[tuple, _GroupCosts | None] = {}
        last_shape: tuple | None = None
        bound = params = 0.0
        for key in space.keys(fam):
            size += 1
            tp, cp, pp, ep, etp, sp, mb, rc, vpp, first_n, last_n, dopt = key
            gkey = (sp, mb, rc)
            if gkey not in group:
                # The pass costs depend on the layout only through cost_key: look them up without building and
                # validating a job per group; compute (and validate) once per key.
                dims = ParallelDims(world_size=world, tp=tp, pp=pp, vpp=1, cp=cp, ep=ep, etp=etp, dp=dp,
                                    expert_dp=max(world // (etp * ep * pp), 1), sp=sp,
                                    num_microbatches=gbs // (dp * mb), order=job.parallel.order)
                layout = dataclasses.replace(place(job, dims, gpn), micro_batch=mb)
                ckey = cost_key(layout, Recompute(rc), options)
                if ckey not in by_key:
                    by_key[ckey] = _group_costs(Candidate.from_key(key), job, measurements, options, world, cache,
                                                refused)
                group[gkey] = by_key[ckey]
            costs = group[gkey]
            if costs is None:
                continue
            shape = (gkey, vpp, first_n, last_n)
            if shape != last_shape:  # candidates that differ only in the optimizer share both bounds' layer terms
                last_shape = shape
                first, middle, last = _stage_layers(L, pp, first_n, last_n)
                bound = _time_bound(costs, gbs // (dp * mb), pp, vpp, L, first, middle, last)
                params = max(d * costs.dense_params + m * costs.moe_params
                             for d, m in _rank_loads(L, pp, vpp, first_n, last_n, first_dense))
            per_param = elem + 4.0 + (0.0 if dopt else opt_bytes)
            out.append((bound, key, 0.0 if options.fsdp else params * per_param))
    out.sort()
    return out, refused, size


@functools.lru_cache(maxsize=4096)
def _rank_loads(num_layers: int, pp: int, vpp: int, first: int, last: int,
                first_dense: int | None) -> frozenset[tuple[int, int]]:
    """The distinct (dense, MoE) layer counts of the pipeline ranks of a split."""
    rows = chunk_layers(num_layers, pp, vpp, first or None, last or None, first_dense=first_dense)
    return frozenset((sum(c.dense for c in row), sum(c.moe for c in row)) for row in rows)


def _time_bound(costs: _GroupCosts, m: int, pp: int, vpp: int, num_layers: int, first: int, middle: int,
                last: int) -> float:
    """A lower bound on the step time of ``m`` micro-batches over ``pp`` stages of ``vpp`` chunks holding ``first``,
    ``middle`` and ``last`` layers (see the module docstring)."""
    def chunk(layers: int) -> float:  # one chunk's passes of a stage with ``layers`` layers, at least
        return layers / vpp * costs.layer_s + 2 * costs.pass_s

    if pp == 1:
        return m * (chunk(num_layers) + costs.embedding_s + costs.head_s)
    if costs.shared_cores:
        return m * (num_layers / pp * costs.layer_s + 2 * vpp * costs.pass_s + (costs.embedding_s + costs.head_s) / pp)
    # The first rank runs all its passes; a later rank also waits for micro-batch 0 to go forward through the stages
    # before it and, after its last backward, for it to go back through them.
    last_middle = m * vpp * chunk(middle) + chunk(first) + (pp - 3) * chunk(middle) + costs.embedding_s
    return max(m * (vpp * chunk(first) + costs.embedding_s), last_middle if pp > 2 else 0.0,
               m * (vpp * chunk(last) + costs.head_s) + chunk(first) + (pp - 2) * chunk(middle) + costs.embedding_s)


def _stage_layers(num_layers: int, pp: int, first: int, last: int) -> tuple[int, int, int]:
    """Layers of the first, a middle (the first's count when there are none) and the last pipeline stage."""
    counts = stage_counts(num_layers, pp, first or None, last or None)
    return counts[0], counts[1] if pp > 2 else counts[0], counts[-1]


@dataclass(frozen=True, kw_only=True)
class _GroupCosts:
    """What the bounds of a group of candidates with equal pass costs are built from."""

    layer_s: float
    """Forward + backward + recompute seconds of the cheaper layer kind, per micro-batch."""
    dense_params: float
    """Parameters of one dense layer on a rank, at least."""
    moe_params: float
    """Parameters of one MoE layer on a rank (its experts' share included), at least."""
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
    # the biases and norms the count leaves out add at least -2 h (cfp_megatron.sim.memory.layer_extra_params)
    slack = 2.0 * job.model.hidden_size
    return _GroupCosts(
        layer_s=parts.min_layer_s(),
        dense_params=max(parts.dense.params - slack, 0.0), moe_params=max(parts.moe.params - slack, 0.0),
        pass_s=parts.per_pass.total_s,
        embedding_s=sum(p.total_s for p in parts.embedding), head_s=sum(p.total_s for p in parts.head),
        shared_cores=measurements is not None and parts.overheads is not None
        and measurements.busy_slowdown() is not None)
