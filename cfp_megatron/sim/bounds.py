"""Lower bounds on the step time of a group of plans that share their pass costs: what the search prunes with
(:mod:`cfp_megatron.search.search` enumerates, this module bounds). Each cost term bounds its own lanes per layer
(:meth:`~cfp_megatron.sim.terms.CostTerm.lower_bound`: its lanes less what an overlap a candidate may turn on can
hide; :meth:`~cfp_megatron.sim.terms.CostTerm.chunk_floor`: what it adds to each layer of a kind where it sets its
lanes per model chunk); this module adds them up per layer kind (:func:`group_costs`) and composes them along the
pipeline schedule (docs/simulator.md, "Cost terms").

The host term's part is each synchronising MoE layer's own stretch (docs/simulator.md, "Host time"): on a GPU
cluster whose MoE layers make the host wait for their token counts (dropless, or token-drop without padding), a MoE
layer's forward costs its dispatcher's syncs more per micro-batch (and its launches beyond its GPU time where no
overlap may change that time), and each recomputed MoE layer under full recomputation its syncs again. The simulator
adds them to every forward (and recomputation) pass that holds the layer whatever the schedule, the combined 1F1B
one of the expert overlap included, so they only raise the MoE kind's cost; the launches a chunk's layers share one
maximum with its embedding and head add nothing here.

With ``m`` micro-batches, ``v`` chunks per rank and a stage of ``n`` layers,

    chunk(n) = n / v x the cheaper layer's forward + backward + recompute
    rank r   >= m x v x chunk(n_r) (+ m x (embedding + 2 x per-pass cost) on the first, + m x (head + 2 x per-pass
                cost) on the last) + chunk(n_s) for every stage s before r (+ the embedding and 2 x per-pass once)

A rank runs its ``m x v`` chunk passes one after another; a later rank cannot start before micro-batch 0 went
forward through the stages before it, and after its last backward the same micro-batch still goes backward through
them. The bound is the largest of the first, the last middle and the last rank's (the middle stages hold equal counts,
so the last middle one bounds them all; a first/last stage of its own size is what ``n_r`` follows; a balanced
layout's stages hold fewer layers the later they come and each rank's first chunk at least its mean, so its lightest
middle stage stands for them). The first and the last rank's own passes also count their dense and MoE layers at
each kind's cost (``m x (dense_r x dense + moe_r x MoE)``), where that is more than their count at the cheaper
kind's (a DeepSeek-V3 stage is mostly MoE layers, its first three dense), and so do the last middle rank's, at the
lightest middle rank's counts (each rank's passes are at least the lightest's). The simulated
step is the slowest rank's schedule plus its gradient sync and optimizer step, all non-negative, so the bound never
exceeds it. Without pipelining the one rank runs everything, its layers counted at each kind's cost too; on a CPU
with fewer cores than ranks the simulated schedule is bounded below by the mean rank's work only, which the bound
then uses. Block recomputation (the search
takes the fewest layers per chunk that fit) counts one recomputed layer per chunk.

With measurements the simulator also adds the pipelined probe's ``fixed_s`` to every rank's schedule (clamped at
zero; docs/simulator.md, "Pipeline exchanges"): any sign, the same for every split, micro-batch count and recompute
choice of a partition, micro-batch size and pipeline placement. A negative one shortens every pipelined step below
its passes, so every pipelined bound here adds it too (and is clamped at zero as the schedule is): the step is at
least ``max(schedule + fixed_s, 0)`` plus its after-schedule lanes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cfp_megatron.sim.layer_cost import LayerCost
from cfp_megatron.sim.pass_costs import PassCosts
from cfp_megatron.sim.terms import TERMS, Overlaps


@dataclass(frozen=True, kw_only=True)
class GroupCosts:
    """What the bounds of a group of candidates with equal pass costs are built from."""

    layer_s: float
    """Forward + backward + recompute seconds of the cheaper layer kind, per micro-batch."""
    fb_s: float
    """Forward + backward seconds of the cheaper layer kind, per micro-batch."""
    recompute_s: float
    """Recompute seconds of the cheaper layer kind, per micro-batch."""
    dense_params: float
    """Parameters of one dense layer on a rank, at least (the search's memory bound reads it)."""
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
    kind_s: tuple[float, float] = (0.0, 0.0)
    """:attr:`layer_s` of each layer kind (dense, MoE): a rank's layers cost at least their counts times these."""
    kind_fb_s: tuple[float, float] = (0.0, 0.0)
    """:attr:`fb_s` of each layer kind (dense, MoE)."""
    fixed_s: float = 0.0
    """What the simulator adds to every rank's pipeline schedule whatever its split and micro-batches (the pipelined
    probe's calibration, :func:`~cfp_megatron.sim.simulate.schedule_fixed_s`; any sign, zero without a pipeline)."""


def group_costs(parts: PassCosts, overlaps: Overlaps, *, hidden: int, shared_cores: bool,
                fixed_s: float = 0.0) -> GroupCosts:
    """The costs a group's bound counts, from its representative's pass costs ``parts`` (no overlaps), for
    candidates that may turn on ``overlaps``: each layer kind's time less what every term says those overlaps can
    hide of its lanes (:meth:`~cfp_megatron.sim.terms.CostTerm.hideable`), plus what every term adds to each layer
    of the kind beyond its cost (:meth:`~cfp_megatron.sim.terms.CostTerm.chunk_floor`: the host's syncs); ``hidden``:
    the model's hidden size;
    ``shared_cores``: whether the simulator may take the shared-cores schedule; ``fixed_s``: what it adds to every
    pipelined schedule (:attr:`GroupCosts.fixed_s`)."""
    return group_costs_pair(parts, overlaps, hidden=hidden, shared_cores=shared_cores, fixed_s=fixed_s,
                            without_expert_overlap=False)[0]


def group_costs_pair(parts: PassCosts, overlaps: Overlaps, *, hidden: int, shared_cores: bool, fixed_s: float = 0.0,
                     without_expert_overlap: bool = True, floor_overlaps: Overlaps | None = None
                     ) -> tuple[GroupCosts, GroupCosts | None]:
    """:func:`group_costs` under ``overlaps`` and, where they may overlap the expert all-to-all and
    ``without_expert_overlap``, under the same without it (``None`` otherwise): a pipelined group's splits of one
    chunk per rank do not overlap it. The layer kinds' times and the terms that read no expert overlap are counted
    once for both. ``floor_overlaps``: the overlaps the per-chunk floors read in place of each variant's
    (:func:`paired_costs`)."""
    # the biases and norms the count leaves out add at least -2 h (cfp_megatron.sim.memory.layer_extra_params)
    slack = 2.0 * hidden
    # A PrimePar candidate runs Megatron's MLP on some layers only where PrimePar's layer is the faster
    # (search._primepar_layers): the plan's own dense layer still bounds it.
    # Layers kept in bf16 at the stack's ends (PassCosts.bf16_ends) bound their kind too: a layer is at least the
    # faster of the format's and bf16's.
    kinds = [(parts.dense, False), (parts.moe, True)]
    if parts.bf16_ends is not None:
        kinds += [(parts.bf16_ends[0], False), (parts.bf16_ends[1], True)]
    variants = [overlaps]
    if without_expert_overlap and overlaps.expert_a2a:
        variants.append(Overlaps(tp=overlaps.tp, tp_comm=overlaps.tp_comm, expert_a2a=False))
    # per variant and kind: (seconds a layer, forward + backward, recomputation), less what the overlaps can hide
    floors: list[list[tuple[float, float, float, bool]]] = [[] for _ in variants]
    for kind, moe in kinds:
        fb_s, rec_s = kind.forward.total_s + kind.backward.total_s, kind.recompute.total_s
        for found, variant in zip(floors, variants, strict=True):
            hideable = hideable_rec = 0.0
            for term in TERMS.hiding():  # the others hide nothing
                fb, rec = term.hideable(kind, variant)
                hideable += fb
                hideable_rec += rec
            for term in TERMS.floored():  # the others set nothing per chunk
                fb, rec = term.chunk_floor(parts, moe, floor_overlaps or variant)
                hideable -= fb
                hideable_rec -= rec
            found.append((fb_s + rec_s - hideable - hideable_rec, fb_s - hideable, rec_s - hideable_rec, moe))
    shared = {"dense_params": max(parts.dense.params - slack, 0.0), "moe_params": max(parts.moe.params - slack, 0.0),
              "pass_s": parts.per_pass.total_s, "embedding_s": sum(p.total_s for p in parts.embedding),
              "head_s": sum(p.total_s for p in parts.head), "shared_cores": shared_cores, "fixed_s": fixed_s}
    out = [GroupCosts(
        layer_s=min(f[0] for f in found), fb_s=min(f[1] for f in found), recompute_s=min(f[2] for f in found),
        kind_s=tuple(min(f[0] for f in found if f[3] is moe) for moe in (False, True)),
        kind_fb_s=tuple(min(f[1] for f in found if f[3] is moe) for moe in (False, True)), **shared)
        for found in floors]
    return out[0], out[1] if len(out) > 1 else None


def paired_costs(parts: PassCosts, overlaps: Overlaps, *, hidden: int, shared_cores: bool,
                 fixed_s: float = 0.0) -> GroupCosts:
    """:func:`group_costs` for the candidates that turn ``moe_a2a_overlap`` on (``overlaps``: what they may turn on
    besides), their expert exchange at what the combined 1F1B schedule leaves of it in a paired pass instead of the
    share any overlap leaves: a bound tighter than :func:`group_costs`' under the expert overlap.

    Why it holds for such a candidate (without measurements): its layer passes are the representative's but for
    its TP and expert communication; its expert exchange is the representative's block beside the same attention
    and expert windows (:func:`~cfp_megatron.sim.terms.expert_dispatch.paired_exchange`, which is
    :attr:`~cfp_megatron.sim.layer_cost.LayerCost.ep_paired_s`), and the passes the schedule cannot pair pay more
    (``simulate._unpaired_exchange``); its recomputation's exchange is at zero or above (counted at zero here); what
    the TP overlap and the host add or hide is :func:`group_costs`' own under ``overlaps`` less the expert overlap
    (the host's floor: its syncs only where an overlap may shorten the MoE forward)."""
    def paired(cost: LayerCost) -> LayerCost:
        if cost.ep_paired_s == (0.0, 0.0) and not cost.forward.ep_comm_s:
            return cost  # a dense layer
        return dataclasses.replace(
            cost, forward=dataclasses.replace(cost.forward, ep_comm_s=cost.ep_paired_s[0]),
            backward=dataclasses.replace(cost.backward, ep_comm_s=cost.ep_paired_s[1]),
            recompute=dataclasses.replace(cost.recompute, ep_comm_s=0.0))

    ends = None if parts.bf16_ends is None else (parts.bf16_ends[0], paired(parts.bf16_ends[1]))
    found = dataclasses.replace(parts, moe=paired(parts.moe), bf16_ends=ends)
    expert_free = Overlaps(tp=overlaps.tp, tp_comm=overlaps.tp_comm, expert_a2a=False)
    # the host's floor as under the expert overlap: its syncs only (no overlap may shorten the forward further)
    floor = Overlaps(tp=overlaps.tp, tp_comm=True, expert_a2a=False) if overlaps.expert_a2a else expert_free
    return group_costs_pair(found, expert_free, hidden=hidden, shared_cores=shared_cores, fixed_s=fixed_s,
                            without_expert_overlap=False, floor_overlaps=floor)[0]


def layer_terms(costs: GroupCosts, block: bool) -> tuple[float, float]:
    """Seconds per layer and per chunk a bound counts: block recomputation (``block``) recomputes at least one layer
    per chunk, the others run forward and backward only."""
    return (costs.fb_s, costs.recompute_s) if block else (costs.layer_s, 0.0)


def time_bound(costs: GroupCosts, layer_s: float, chunk_s: float, m: int, pp: int, vpp: int, num_layers: int,
               first: int, middle: int, last: int, first_busy_s: float = 0.0, last_busy_s: float = 0.0,
               middle_busy_s: float = 0.0) -> float:
    """A lower bound on the step time of ``m`` micro-batches over ``pp`` stages of ``vpp`` chunks holding ``first``,
    ``middle`` and ``last`` layers, each layer taking ``layer_s`` and each chunk ``chunk_s`` more (see the module
    docstring); ``first_busy_s`` / ``last_busy_s`` / ``middle_busy_s``: what the first / last / lightest middle
    rank's layers take per micro-batch at least by their kinds (a dense layer is cheaper than a MoE one), where
    more than their count x ``layer_s``."""
    # One chunk's passes of a stage with n layers, at least: n * per_layer + chunk_s, and the per-pass cost on the
    # first stage's first chunk and the last stage's last (inlined: the search calls this for every split of every
    # group it expands).
    per_layer, ends = layer_s / vpp, 2 * costs.pass_s
    if pp == 1:  # the one rank's layers at their kinds' costs where more than their count at the cheaper one's
        return m * (max(num_layers * per_layer, first_busy_s) + chunk_s + ends + costs.embedding_s + costs.head_s)
    if costs.shared_cores:
        return max(m * (num_layers / pp * layer_s + vpp * chunk_s + (costs.embedding_s + costs.head_s + 2 * ends) / pp)
                   + costs.fixed_s, 0.0)
    # The first rank runs all its passes; a later rank also waits for micro-batch 0 to go forward through the stages
    # before it and, after its last backward, for it to go back through them.
    c_first, c_middle = first * per_layer + chunk_s, middle * per_layer + chunk_s
    first_s = costs.embedding_s + ends  # the first chunk's extra per micro-batch
    last_middle = (m * max(vpp * c_middle, middle_busy_s + vpp * chunk_s) + c_first + (pp - 3) * c_middle + first_s
                   if pp > 2 else 0.0)
    first_busy = max(vpp * c_first, first_busy_s + vpp * chunk_s)
    last_busy = max(vpp * (last * per_layer + chunk_s), last_busy_s + vpp * chunk_s)
    schedule = max(m * (first_busy + first_s), last_middle,
                   m * (last_busy + costs.head_s + ends) + c_first + (pp - 2) * c_middle + first_s)
    return max(schedule + costs.fixed_s, 0.0)


def group_bound(costs: GroupCosts, block: bool, m: int, pp: int, num_layers: int, lightest_first: int,
                lightest_last: int, first_busy_s: float = 0.0, last_busy_s: float = 0.0) -> float:
    """A lower bound on the step time of every candidate of a group (``m`` micro-batches over ``pp`` stages, block
    recomputation or not): without pipelining or on shared cores the candidates' own bound at its lowest (one chunk
    per rank), else the first or the last rank's passes with the group's lightest first and last stage
    (``lightest_first``, ``lightest_last`` layers; ``first_busy_s`` / ``last_busy_s``: what the first / last rank's
    layers take per micro-batch at least by their kinds over the group's splits)."""
    layer_s, chunk_s = layer_terms(costs, block)
    if pp == 1 or costs.shared_cores:
        return time_bound(costs, layer_s, chunk_s, m, pp, 1, num_layers, num_layers, num_layers, num_layers,
                          first_busy_s)
    per_pass = chunk_s + 2 * costs.pass_s
    return max(m * max(max(lightest_first * layer_s, first_busy_s) + per_pass + costs.embedding_s,
                       max(lightest_last * layer_s, last_busy_s) + per_pass + costs.head_s) + costs.fixed_s, 0.0)
