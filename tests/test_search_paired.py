"""The bound of a candidate that fits, before its overlaps are tried (``search._fitting_bound``): the expert
exchange at what the combined 1F1B schedule leaves of it (``bounds.paired_costs``) for the candidates that turn the
expert overlap on, the whole exchange for those that do not. It never exceeds the simulated step under any of the
overlaps, it is what a candidate's own costs hold, and the search returns the same plans and rejections with it."""

from __future__ import annotations

import dataclasses
import random

import pytest

import cfp_megatron.search.search as searching
from cfp_megatron.base.cfp_spec import CfpSpec, cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import JobSpec, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.search.search import _expand, _fitting_bound, _groups, _param_bytes, search
from cfp_megatron.search.space import Candidate, build_space
from cfp_megatron.sim.bounds import group_costs, paired_costs
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache
from cfp_megatron.sim.simulate import prepare_costs, simulate
from cfp_megatron.sim.terms import TERMS, Overlaps


def compose_job(*overrides: str) -> tuple[JobSpec, CfpSpec]:
    cfg = compose_config(["+cfp=auto", *overrides])
    return job_from_config(cfg), cfp_from_config(cfg)


def _case(seed: int) -> tuple[JobSpec, CfpSpec, int]:
    rng = random.Random(2100 + seed)
    gpn = rng.choice([4, 8])
    job, cfp = compose_job("model=moe_tiny", f"model.num_layers={rng.choice([4, 6, 8])}",
                           f"model.moe_first_dense_layers={rng.choice([0, 1])}", "cluster=dgx_h100",
                           "cluster.nodes=1", f"cluster.gpus_per_node={gpn}",
                           f"cluster.hbm_gib={rng.choice([0.05, 80.0])}",
                           f"train.global_batch_size={rng.choice([16, 32])}", "train.seq_length=256",
                           f"cfp.ep={rng.choice([2, 4])}", f"cfp.top_k={rng.choice([1, 3])}",
                           "cfp.constraints.max_micro_batch=2")
    return job, cfp, gpn


@pytest.mark.parametrize("seed", range(3))
def test_the_fitting_bound_never_exceeds_the_simulated_step_under_any_overlap(seed: int) -> None:
    """For candidates without a pipeline or interleaved, in groups whose candidates may overlap the expert
    all-to-all: the bound is at most the simulated step with each TP and expert overlap setting, and tighter than
    the queue's bound for some (else it would prune nothing)."""
    job, cfp, world = _case(seed)
    space = build_space(job, world, cfp)
    options = SimOptions()
    cache = CostCache.for_job(job, None, options)
    param_bytes = _param_bytes(job, space)
    rng = random.Random(seed)
    checked = tighter = 0
    for bounded in _groups(space, job, None, options, cache)[0]:
        if bounded.paired is None:
            continue
        for queue_bound, _, key, _ in _expand(bounded, job, options, param_bytes):
            cand = Candidate.from_key(key)
            if cand.pp > 1 and cand.vpp == 1 or rng.random() > 0.5:
                continue
            bound = _fitting_bound(bounded, job, key[9:13])
            tighter += bound > queue_bound * (1 + 1e-9)
            assert bound >= queue_bound * (1 - 1e-12)
            for tp_on in (False, True):
                for a2a_on in (False, True):
                    plan = dataclasses.replace(cand, tp_overlap=tp_on, a2a_overlap=a2a_on)
                    try:
                        step = simulate(plan.job(job), world_size=world, options=options, cache=cache).step_time_s
                    except ConfigError:
                        continue
                    assert bound <= step * (1 + 1e-12), plan.describe(world)
                    checked += 1
    assert checked > 0 and tighter > 0


def test_a_candidates_exchange_under_the_expert_overlap_is_its_representatives_paired_one() -> None:
    """What ``paired_costs`` reads: a candidate with the expert overlap on pays, in its MoE layer's forward and
    backward, exactly its layout without the overlap's paired exchange (``LayerCost.ep_paired_s``), with the TP
    overlap on or off; without the overlap it pays more."""
    job, cfp = compose_job("model=moe_tiny", "cluster=dgx_h100", "cluster.nodes=1", "cluster.gpus_per_node=4",
                           "train.global_batch_size=16", "train.seq_length=256")
    base = Candidate(tp=2, sp=True, pp=1, cp=1, ep=2, etp=1, micro_batch=1, recompute="none", vpp=1,
                     distributed_optimizer=True)
    plain = prepare_costs(base.job(job), world_size=4).moe
    for tp_on in (False, True):
        paired = prepare_costs(dataclasses.replace(base, a2a_overlap=True, tp_overlap=tp_on).job(job),
                               world_size=4).moe
        assert (paired.forward.ep_comm_s, paired.backward.ep_comm_s) == plain.ep_paired_s
        assert paired.ep_paired_s == plain.ep_paired_s
    assert sum(plain.ep_paired_s) < plain.forward.ep_comm_s + plain.backward.ep_comm_s
    # the bound's MoE kind is that candidate's forward and backward (TP overlap off), plus the host's floor
    parts = prepare_costs(base.job(job), world_size=4)
    overlaps = Overlaps(tp=2, tp_comm=False, expert_a2a=True)
    paired = paired_costs(parts, overlaps, hidden=job.model.hidden_size, shared_cores=False)
    own = prepare_costs(dataclasses.replace(base, a2a_overlap=True).job(job), world_size=4).moe
    floor = sum(term.chunk_floor(parts, True, Overlaps(tp=2, tp_comm=True, expert_a2a=False))[0]
                for term in TERMS.floored())
    assert paired.kind_fb_s[1] == pytest.approx(own.forward.total_s + own.backward.total_s + floor, rel=1e-12)
    assert paired.kind_fb_s[1] < group_costs(parts, overlaps, hidden=job.model.hidden_size,
                                             shared_cores=False).kind_fb_s[1] + sum(plain.ep_alone_s)


@pytest.mark.parametrize("seed", range(3))
def test_the_fitting_bound_leaves_the_plans_and_rejections_as_they_were(seed: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The search with the bound gives the ranked plans, choice, rejections and counts of the search without it
    (its bound at zero), but for fewer memory predictions."""
    job, cfp, world = _case(seed)
    fast = search(job, world, cfp)
    monkeypatch.setattr(searching, "_fitting_bound", lambda *args: 0.0)
    full = search(job, world, cfp)
    for field in ("ranked", "rejected", "choice", "space_size", "simulated", "over_memory", "invalid", "pruned",
                  "least_over_gib"):
        assert getattr(fast, field) == getattr(full, field), field
    assert fast.memory_checked <= full.memory_checked
