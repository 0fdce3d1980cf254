"""The search with measurements: on the recorded ProfileDBs of gpt_tiny on this project's 2-core CPU machine (measured
segments, step overheads, the pipelined probe's calibration, shared cores), every candidate's bounds are at most its
simulated step, and the bounded search returns exactly what an exhaustive one does, whatever ``top_k``."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest

from cfp_megatron.base.cfp_spec import CfpSpec, cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import JobSpec, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.cluster.measured import NothingMeasured, partition_name
from cfp_megatron.profile.cluster import measured_cluster, this_device
from cfp_megatron.profile.db import ProfileDB
from cfp_megatron.profile.fingerprint import model_key
from cfp_megatron.search.search import _expand, _groups, _param_bytes, search
from cfp_megatron.search.space import Candidate, build_space
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache
from cfp_megatron.sim.simulate import prepare_costs, schedule_fixed_s, simulate, simulate_unless_slower

DATA = Path(__file__).resolve().parent / "data"

PROFILES = [(2, "profile_gpt_tiny_2ranks_cpu.json"), (2, "profile_gpt_tiny_4ranks_cpu.json"),
            (4, "profile_gpt_tiny_4ranks_cpu.json")]
"""(ranks, recorded ProfileDB): the 4-rank profile also read for 2 ranks, as tests/profiles.py seeds it for the
2-rank launches of tests/test_launch_plan.py."""


def measured_job(world: int, profile: str, *overrides: str, cores: int | None = None
                 ) -> tuple[JobSpec, CfpSpec, ProfileDB]:
    """gpt_tiny (fp32, seq 64) on ``world`` ranks of the machine ``profile`` was recorded on (``cores``: its CPU
    cores, the recorded count by default), its cluster filled from the profile as a launch does
    (:func:`~cfp_megatron.profile.cluster.local_measurements`)."""
    cfg = compose_config(["+cfp=auto", "model=gpt_tiny", "train.global_batch_size=16", "train.seq_length=64",
                          "train.precision=fp32", *overrides])
    job, cfp = job_from_config(cfg), cfp_from_config(cfg)
    data = json.loads((DATA / profile).read_text())
    key = model_key(job, on_gpu=False)
    for section in ("collectives", "gemms", "segments", "overheads", "rounds"):
        data[section] = [{**r, "model": key} if r.get("model") else r for r in data[section]]
    fingerprint = data["fingerprint"]
    data["fingerprint"] = {**fingerprint, "device_count": world, "gpus_per_node": world,
                           "cpu_cores": cores or fingerprint["cpu_cores"]}
    db = ProfileDB.from_json(data).for_model(key)
    cluster = measured_cluster(this_device(job.cluster, ranks_per_node=world), db, gpus_per_node=world)
    return dataclasses.replace(job, cluster=cluster), cfp, db


@pytest.mark.parametrize(("world", "profile", "cores"), [(w, p, None) for w, p in PROFILES] + [
    (2, "profile_gpt_tiny_4ranks_cpu.json", 1), (4, "profile_gpt_tiny_4ranks_cpu.json", 4)])
def test_bounds_never_exceed_the_simulated_step_with_measurements(world: int, profile: str, cores: int | None) -> None:
    """Every candidate's bound and its group's are at most its simulated step, and the second bound never prunes a
    plan at its own step time, with the recorded cores and with fewer or more (the shared-cores schedule or not);
    where the pipelined probe's calibration shortens every schedule (a negative
    ``fixed_s``: the probe measured one micro-batch's schedule shorter than the simulator prices it), the bounds
    count that too."""
    job, cfp, db = measured_job(world, profile, cores=cores)
    options = SimOptions()
    cache = CostCache.for_job(job, db, options)
    space = build_space(job, world, cfp, te_available=False)
    groups, _, size = _groups(space, job, db, options, cache)
    checked = shortened = 0
    for bounded in groups:
        for bound, _, key, _ in _expand(bounded, job, options, _param_bytes(job, space)):
            cand = Candidate.from_key(key)
            try:
                plan = cand.job(job)
                p = simulate(plan, measurements=db, world_size=world, cache=cache)
            except ConfigError:
                continue
            assert bounded.bound <= bound * (1 + 1e-12), cand.describe(world)
            assert bound <= p.step_time_s * (1 + 1e-12), cand.describe(world)
            assert simulate_unless_slower(plan, p.step_time_s * (1 + 1e-12), measurements=db, world_size=world,
                                          cache=cache) is not None
            shortened += schedule_fixed_s(plan, measurements=db, world_size=world, cache=cache) < 0
            checked += 1
    assert checked == size  # the whole space
    if profile.startswith("profile_gpt_tiny_4ranks"):
        assert shortened  # what the bounds once left out


@pytest.mark.parametrize(("world", "profile"), PROFILES)
def test_search_with_measurements_equals_exhaustive_for_every_top_k(world: int, profile: str) -> None:
    job, cfp, db = measured_job(world, profile)
    full = search(job, world, dataclasses.replace(cfp, top_k=20), measurements=db, te_available=False,
                  exhaustive=True)
    assert len(full.ranked) == 20
    for k in (1, 3, 5, 8, 20):
        fast = search(job, world, dataclasses.replace(cfp, top_k=k), measurements=db, te_available=False)
        assert [r.candidate for r in fast.ranked] == [r.candidate for r in full.ranked[:k]], k
        assert [r.prediction.step_time_s for r in fast.ranked] == [r.prediction.step_time_s
                                                                  for r in full.ranked[:k]]


@pytest.mark.parametrize("seed", range(6))
def test_bounded_search_equals_exhaustive_with_measurements(seed: int) -> None:
    """Random jobs on the recorded profiles: their batch, micro-batch limit, ``top_k`` and the machine's cores (a
    core per rank or fewer: the shared-cores schedule)."""
    rng = random.Random(seed)
    world, profile = rng.choice(PROFILES)
    job, cfp, db = measured_job(world, profile, f"train.global_batch_size={rng.choice([8, 16, 32])}",
                                f"cfp.top_k={rng.choice([1, 3, 5, 10])}",
                                f"cfp.constraints.max_micro_batch={rng.choice([4, 64])}",
                                cores=rng.choice([1, 2, 4]))
    fast = search(job, world, cfp, measurements=db, te_available=False)
    full = search(job, world, cfp, measurements=db, te_available=False, exhaustive=True)
    assert [r.candidate for r in fast.ranked] == [r.candidate for r in full.ranked]
    assert fast.ranked


class _TpOneLayersTimed(NothingMeasured):
    """Measurements that time moe_tiny's decoder layers under TP 1 only (forward, backward seconds per micro-batch
    size): those plans' layer times hold the host's launches and syncs (no host priced apart), the others' are
    priced with the host term's."""

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        if segment == "moe" and partition == partition_name(1):
            return 2e-3 + 1e-4 * micro_batch, 3e-3 + 2e-4 * micro_batch
        return None

    def segment_micro_batches(self, segment: str, partition: str) -> tuple[int, ...]:
        return (1, 2, 4) if self.segment_seconds(segment, partition, 1) is not None else ()


def test_bounds_hold_where_measurements_time_some_partitions_of_a_synchronising_moe() -> None:
    """A dropless MoE on GPUs whose measurements time some partitions' layers: the host term's floor counts where
    the host is priced apart and not where a measured layer time stands in, and every candidate's bound stays at
    most its simulated step; the bounded search returns the exhaustive one's plans."""
    cfg = compose_config(["+cfp=auto", "model=moe_tiny", "cluster=dgx_h100", "cluster.nodes=1",
                          "cluster.gpus_per_node=4", "train.global_batch_size=16", "train.seq_length=256",
                          "cfp.ep=2", "cfp.top_k=3", "cfp.constraints.max_micro_batch=4"])
    job, cfp, db, world = job_from_config(cfg), cfp_from_config(cfg), _TpOneLayersTimed(), 4
    options = SimOptions()
    cache = CostCache.for_job(job, db, options)
    space = build_space(job, world, cfp)
    groups, _, _ = _groups(space, job, db, options, cache)
    priced = set()
    for bounded in groups:
        for bound, _, key, _ in _expand(bounded, job, options, _param_bytes(job, space)):
            plan = Candidate.from_key(key).job(job)
            try:
                p = simulate(plan, measurements=db, world_size=world, cache=cache)
            except ConfigError:
                continue
            assert bound <= p.step_time_s * (1 + 1e-12), Candidate.from_key(key).describe(world)
            priced.add(prepare_costs(plan, measurements=db, world_size=world, cache=cache).host is not None)
    assert priced == {True, False}
    fast = search(job, world, cfp, measurements=db)
    full = search(job, world, cfp, measurements=db, exhaustive=True)
    assert fast.ranked and [r.candidate for r in fast.ranked] == [r.candidate for r in full.ranked]
    assert [r.prediction.step_time_s for r in fast.ranked] == [r.prediction.step_time_s for r in full.ranked]
