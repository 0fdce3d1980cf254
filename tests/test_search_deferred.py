"""The groups with recomputation whose pass costs wait under their sibling's bound (``search._Deferred``): that
bound never exceeds the group's own bound nor a candidate's simulated step, the search costs fewer groups and
returns the same plans, rejections and counts as the search that costs every group up front."""

from __future__ import annotations

import random

import pytest

import cfp_megatron.search.search as searching
from cfp_megatron.base.cfp_spec import CfpSpec, cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import JobSpec, Recompute, job_from_config
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.search.search import (
    SIBLING_MARGIN,
    MegatronSpace,
    SearchBoundError,
    _Deferred,
    _expand,
    _groups,
    _param_bytes,
    search,
)
from cfp_megatron.search.space import Candidate, build_space
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache
from cfp_megatron.sim.simulate import simulate


def compose_job(*overrides: str) -> tuple[JobSpec, CfpSpec]:
    cfg = compose_config(["+cfp=auto", *overrides])
    return job_from_config(cfg), cfp_from_config(cfg)


CASES = (
    ("model=llama_tiny", "cluster=dgx_h100", "cluster.nodes=1", "cluster.gpus_per_node=8",
     "train.global_batch_size=32", "train.seq_length=256", "cfp.constraints.max_micro_batch=4"),
    ("model=gpt_tiny", "model.num_layers=6", "cluster=dgx_a100", "cluster.nodes=2", "cluster.gpus_per_node=4",
     "train.global_batch_size=64", "train.seq_length=256", "cluster.hbm_gib=0.2"),
    ("model=moe_tiny", "model.num_layers=5", "model.moe_first_dense_layers=1", "cluster=dgx_h100",
     "cluster.nodes=1", "cluster.gpus_per_node=8", "train.global_batch_size=32", "train.seq_length=256",
     "cfp.ep=2", "cfp.constraints.max_micro_batch=4"),
)


def _eager(*args, **kwargs):
    """``_groups`` without deferral (every group costed as it is built)."""
    return _groups(*args[:5])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_deferred_groups_bound_is_at_most_its_own_and_its_candidates_simulated_steps(case: int) -> None:
    """Every group that waits does so under a bound at most the bound its own costs give, and at most the simulated
    step of its candidates (a sample of them, with the overlaps they may turn on off)."""
    job, cfp = compose_job(*CASES[case])
    world = job.cluster.nodes * job.cluster.gpus_per_node
    space = build_space(job, world, cfp)
    options = SimOptions()
    pending: list[_Deferred] = []
    _groups(space, job, None, options, CostCache.for_job(job, None, options), pending)
    waiting = {g.head: d.bound for d in pending for g, _ in d.groups}
    assert waiting  # some groups wait
    own, _, _ = _groups(space, job, None, options, CostCache.for_job(job, None, options))
    param_bytes = _param_bytes(job, space)
    rng = random.Random(case)
    compared = simulated = 0
    for bounded in own:
        lower = waiting.get(bounded.group.head)
        if lower is None:
            continue
        assert lower <= bounded.bound
        compared += 1
        entries = _expand(bounded, job, options, param_bytes)
        for _, _, key, _ in rng.sample(entries, min(2, len(entries))):
            try:
                step = simulate(Candidate.from_key(key).job(job), world_size=world).step_time_s
            except ConfigError:
                continue
            assert lower <= step
            simulated += 1
    assert compared == len(waiting) and simulated > 0


def test_the_sibling_bound_is_the_recompute_free_groups_less_the_margin() -> None:
    """A waiting group's bound is its sibling's (the same family, micro-batch, SP and MLP without recomputation) less
    :data:`SIBLING_MARGIN`, and the costs of recomputation only add: each recompute choice's group bound is at least
    its sibling's (what :class:`_Deferred` relies on; fails where recomputation could lower a layer kind's
    seconds)."""
    job, cfp = compose_job(*CASES[0])
    world = 8
    space = build_space(job, world, cfp)
    options = SimOptions()
    own, _, _ = _groups(space, job, None, options, CostCache.for_job(job, None, options))
    free = {(b.group.head._replace(recompute="none"), b.group.microbatches): b.bound for b in own
            if b.group.head.recompute == "none"}
    checked = 0
    for b in own:
        sibling = free.get((b.group.head._replace(recompute="none"), b.group.microbatches))
        if sibling is None or b.group.head.recompute == "none":
            continue
        assert b.bound >= sibling * (1.0 - SIBLING_MARGIN)
        assert b.costs.layer_s >= b.costs.fb_s * (1.0 - SIBLING_MARGIN)
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("case", range(len(CASES)))
def test_deferring_costs_fewer_groups_for_the_same_plans(case: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The search with deferral gives the same ranked plans (candidates, jobs, predictions), choice, rejections and
    work counts as the search that costs every group as it is built, and leaves some groups uncosted."""
    job, cfp = compose_job(*CASES[case])
    world = job.cluster.nodes * job.cluster.gpus_per_node
    built: list[MegatronSpace] = []
    build = MegatronSpace.build.__func__

    def recorded(cls, *args, **kwargs):
        space = build(cls, *args, **kwargs)
        built.append(space)
        return space

    monkeypatch.setattr(MegatronSpace, "build", classmethod(recorded))
    fast = search(job, world, cfp)
    assert built and any(d.value is None for d in built[0].pending)  # some never costed
    monkeypatch.setattr(searching, "_groups", _eager)
    full = search(job, world, cfp)
    for field in ("ranked", "rejected", "choice", "space_size", "simulated", "memory_checked", "over_memory",
                  "invalid", "pruned", "least_over_gib"):
        assert getattr(fast, field) == getattr(full, field), field


def test_a_refused_recompute_choice_is_named_in_its_place_with_deferral(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recompute choice the runtime's checks refuse (here: full recomputation with CP over two ranks, refused by
    a stand-in check) is validated as its group is built: the rejections are the eager search's, in the same order,
    and so are the plans."""
    job, cfp = compose_job(*CASES[0])
    build_layout = searching.build_layout

    def refused(job: JobSpec, world: int):
        if job.parallel.recompute is Recompute.full and job.parallel.cp == 2:
            raise ConfigError(ConfigIssue(key="parallel.recompute", value="full", problem="refused here.",
                                          fix="none."))
        return build_layout(job, world)

    monkeypatch.setattr(searching, "recompute_problems", lambda job: [job.parallel.recompute is Recompute.full])
    monkeypatch.setattr(searching, "build_layout", refused)
    fast = search(job, 8, cfp)
    assert any(r.reason == "refused here." for r in fast.rejected)
    monkeypatch.setattr(searching, "_groups", _eager)
    full = search(job, 8, cfp)
    assert fast.rejected == full.rejected
    assert [(r.candidate, r.prediction) for r in fast.ranked] == [(r.candidate, r.prediction) for r in full.ranked]


def test_a_bound_below_the_one_a_group_waited_under_is_an_error() -> None:
    """Resolving a deferred set checks each group's bound against the one it waited under."""
    job, cfp = compose_job(*CASES[0])
    space = build_space(job, 8, cfp)
    options = SimOptions()
    pending: list[_Deferred] = []
    _groups(space, job, None, options, CostCache.for_job(job, None, options), pending)
    deferred = next(d for d in pending if d.groups)
    deferred.bound = float("inf")  # a bound no group's costs can reach
    with pytest.raises(SearchBoundError):
        deferred.resolve([])
