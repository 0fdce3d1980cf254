"""The overheads round's pipelined probe: which probes it adds, how the ProfileDB keeps them apart from the others,
and how the simulator prices a pipeline's exchanges and per-step costs from it (pure: no process group)."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.cluster.measured import (
    Collective,
    CollectiveFit,
    NothingMeasured,
    PipelineProbe,
    Span,
    StepOverheads,
)
from cfp_megatron.profile.db import ProfileDB
from cfp_megatron.profile.fingerprint import Fingerprint
from cfp_megatron.profile.overheads import PIPELINE_STAGES, overhead_cases, overhead_steps
from cfp_megatron.profile.records import OverheadRecord, overhead_entry
from cfp_megatron.profile.runner import rounds_needed
from cfp_megatron.profile.segments import segment_cases
from cfp_megatron.sim import SimOptions, simulate
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.simulate import OUTSIDE_LANES, _probe_calibration, _simulate

FP = Fingerprint(device_name="Test CPU", device_count=4, nodes=1, gpus_per_node=4, backend="gloo", torch="2.13.0",
                 megatron_core="0.16.1", cpu_cores=2)


def test_the_overheads_round_adds_a_pipelined_probe_where_the_world_has_room() -> None:
    """On 4 ranks: tp1 (dp2) and tp2 with and without SP (dp1) get the larger probe over two stages, tp4 none; its
    entries and set-up steps say ``pp2``."""
    job = compose_job([])
    cases = overhead_cases(segment_cases(job, 4)[0], 4, job.model.num_layers)
    piped = [c for c in cases if c.pp > 1]
    assert {(c.tp, c.dims.sp) for c in piped} == {(1, False), (2, False), (2, True)}
    assert all(c.pp == PIPELINE_STAGES and c.dims.pp == PIPELINE_STAGES and c.layers % PIPELINE_STAGES == 0
               for c in piped)
    assert all(c.dims.dp == 4 // (c.tp * PIPELINE_STAGES) for c in piped)
    steps, meaning = overhead_steps(piped[:1], [1, 4], repeats=1)
    assert [s.label for s in steps] == ["overheads build tp1 pp2 L4", overhead_entry("tp1", 4, 1, 2),
                                        overhead_entry("tp1", 4, 4, 2)]
    assert overhead_entry("tp1", 4, 4, 2) == "overheads tp1 pp2 L4 mbs=4"
    assert meaning[overhead_entry("tp1", 4, 4, 2)] == ("tp1", 1, 4, 4, 2)
    # a world without room for two stages beside each TP size: no pipelined probe
    assert not [c for c in overhead_cases(segment_cases(job, 1)[0], 1, job.model.num_layers) if c.pp > 1]


def _record(layers: int, mb: int, *, pp: int = 1, schedule_s: float = 0.05) -> OverheadRecord:
    return OverheadRecord(model="m", partition="tp1", tp=1, layers=layers, pp=pp, params=10_000 * layers,
                          micro_batch=mb, microbatches=4, schedule_s=schedule_s, rest_s=0.01, finalize_s=0.005,
                          single_schedule_s=0.02 if pp > 1 else None)


def test_the_db_keeps_pipelined_probes_apart() -> None:
    """A pipelined probe of the same layers and size as a plain one is its own record and entry; the step overheads
    read only the plain probes; old files (no ``pp``) load as plain probes."""
    plain = [_record(layers, mb) for layers in (1, 4) for mb in (1, 4)]
    db = ProfileDB(fingerprint=FP).merged(overheads=plain)
    both = db.merged(overheads=[_record(4, 4, pp=2, schedule_s=0.09)])
    assert len(both.overheads) == len(plain) + 1  # not a replacement of the plain L4 probe
    assert both.pipeline_probe("tp1", 4) == PipelineProbe(tp=1, sp=False, pp=2, layers=4, micro_batch=4,
                                                           microbatches=4, schedule_s=0.09, rest_s=0.01,
                                                           finalize_s=0.005, single_schedule_s=0.02)
    assert both.pipeline_probe("tp1", 1) is None and db.pipeline_probe("tp1", 4) is None
    assert NothingMeasured().pipeline_probe("tp1", 4) is None
    assert both.step_overheads("tp1", 4) == db.step_overheads("tp1", 4)
    planned = {"overheads": [overhead_entry("tp1", 4, 4), overhead_entry("tp1", 4, 4, 2)]}
    assert rounds_needed(db, "m", planned, force=False)["overheads"] == planned["overheads"][1:]
    assert "overheads" not in rounds_needed(both, "m", planned, force=False)
    old = both.to_json()
    for row in old["overheads"]:
        if row["pp"] == 1:
            del row["pp"], row["single_schedule_s"]
    again = ProfileDB.from_json(old)
    assert again.overheads == both.overheads


class _Measured(NothingMeasured):
    """A profiled 4-rank node: segments, step overheads, a send/receive fit and (optionally) a pipelined probe;
    ``slowdown`` where its ranks share cores."""

    def __init__(self, probe: PipelineProbe | None = None, slowdown: float | None = None) -> None:
        self.probe = probe
        self.slowdown = slowdown

    def collective(self, op: Collective, group_size: int, span: Span) -> CollectiveFit | None:
        return CollectiveFit(op=op, group_size=group_size, span=span, latency_s=0.004, bandwidth_bytes_per_s=1e9,
                             points=6, max_rel_error=0.1)

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        return {"embedding": (0.001, 0.001), "dense": (0.002, 0.004), "head": (0.002, 0.001)}.get(segment)

    def step_overheads(self, partition: str, micro_batch: int) -> StepOverheads | None:
        return StepOverheads(partition=partition, micro_batch=micro_batch, layer_s=0.012, per_microbatch_s=0.003,
                             step_base_s=0.005, step_per_param_s=1e-8, finalize_share=1.5)

    def pipeline_probe(self, partition: str, micro_batch: int) -> PipelineProbe | None:
        found = self.probe
        return found if found is not None and (partition, micro_batch) == ("tp1", found.micro_batch) else None

    def busy_slowdown(self) -> float | None:
        return self.slowdown


EXCHANGE, FIXED, OUTSIDE = 0.0015, 0.006, 0.003
"""The pipeline the synthetic probe measured: seconds per exchange, per step in the schedule, per step outside it."""


def _plan(mb: int = 4, gbs: int = 8, pp: int = 2):
    return compose_job([f"parallel.pp={pp}", f"train.micro_batch_size={mb}", f"train.global_batch_size={gbs}",
                        "cluster.gpus_per_node=4"])


def _outside(found) -> float:
    """Seconds of a prediction's gradient finalisation and optimizer step: what follows its schedule."""
    return sum(found.time.seconds(lane) for lane in OUTSIDE_LANES)


def _probe_measured(measured: _Measured) -> PipelineProbe:
    """What the pipelined probe (the plan's model at 4 layers, tp1 pp2 dp2, micro-batch 4) measures where the true
    pipeline is :data:`EXCHANGE`, :data:`FIXED` and :data:`OUTSIDE`: the simulator's own schedule with that
    exchange, plus the rest."""
    def run(microbatches: int):
        job = _plan(gbs=4 * microbatches * 2)
        found = _simulate(job, None, measured, None, None, 4, False, None, None, EXCHANGE)
        return found.step_time_s - _outside(found), found
    many, priced = run(4)
    one, _ = run(1)
    return PipelineProbe(tp=1, sp=False, pp=2, layers=4, micro_batch=4, microbatches=4, schedule_s=many + FIXED,
                         single_schedule_s=one + FIXED, finalize_s=0.002,
                         rest_s=_outside(priced) + OUTSIDE - 0.002)


@pytest.mark.parametrize("slowdown", [None, 2.0])
def test_a_pipelined_probe_gives_back_the_pipeline_it_measured(slowdown: float | None) -> None:
    """From a probe measured on a known pipeline (an exchange far below the 4 ms the send/receive fit says, a fixed
    cost per step, a cost outside the schedule), the calibration finds those three again, on devices and on shared
    cores; a plan of the probe's partition and size then pays them, and a plan the probe did not measure (another
    micro-batch size, no pipeline) is priced as without it."""
    bare = _Measured(slowdown=slowdown)
    probe = _probe_measured(bare)
    measured = _Measured(probe, slowdown=slowdown)
    job = _plan()
    calibration = _probe_calibration(dataclasses.replace(job, cluster=job.cluster), probe, 4, measured,
                                     SimOptions(), efficiency_for(job.cluster))
    assert calibration is not None
    assert calibration.exchange_s == pytest.approx(EXCHANGE, rel=1e-6)
    assert calibration.fixed_s == pytest.approx(FIXED, rel=1e-6)
    assert calibration.outside_s == pytest.approx(OUTSIDE, rel=1e-6)
    assert calibration.fit_s == pytest.approx(0.004 + 4 * 64 * 64 * 4 / 1e9)
    # the plan (one micro-batch of 4 per DP rank): its schedule with the probe's exchange, plus the fixed and
    # outside costs; the probe's own layout at 4 micro-batches, as measured
    plan = simulate(job, measurements=measured, world_size=4)
    with_exchange = _simulate(job, None, bare, None, None, 4, False, None, None, EXCHANGE)
    assert plan.step_time_s == pytest.approx(with_exchange.step_time_s + FIXED + OUTSIDE, rel=1e-6)
    assert simulate(_plan(gbs=32), measurements=measured, world_size=4).step_time_s == pytest.approx(
        probe.schedule_s + probe.finalize_s + probe.rest_s, rel=1e-6)
    # no probe at this size, or no pipeline: as before
    for other in (_plan(mb=2), _plan(pp=1, gbs=16)):
        assert simulate(other, measurements=measured, world_size=4).step_time_s == pytest.approx(
            simulate(other, measurements=bare, world_size=4).step_time_s)


def test_without_the_one_micro_batch_timing_the_exchange_carries_the_schedule() -> None:
    """A probe from before the one-micro-batch timing: the exchange alone makes the simulated schedule last the
    measured one, and no fixed cost is assumed."""
    bare = _Measured()
    probe = dataclasses.replace(_probe_measured(bare), single_schedule_s=None)
    job = _plan()
    calibration = _probe_calibration(job, probe, 4, _Measured(probe), SimOptions(), efficiency_for(job.cluster))
    assert calibration is not None and calibration.fixed_s == 0.0
    assert calibration.exchange_s > EXCHANGE  # the fixed cost spread over the exchanges
    found = _simulate(_plan(gbs=32), None, bare, None, None, 4, False, None, None, calibration.exchange_s)
    assert found.step_time_s - _outside(found) == pytest.approx(probe.schedule_s, rel=1e-6)


def test_a_probe_faster_than_its_pricing_without_exchanges_costs_none() -> None:
    """Where the simulated schedule without any exchange already lasts longer than the probe measured, the
    exchange is zero (never negative) and the plan's exchange the fit less the probe's fit, never below zero."""
    bare = _Measured()
    probe = dataclasses.replace(_probe_measured(bare), schedule_s=1e-4, single_schedule_s=None)
    job = _plan()
    calibration = _probe_calibration(job, probe, 4, _Measured(probe), SimOptions(), efficiency_for(job.cluster))
    assert calibration is not None and calibration.exchange_s == 0.0
    plan = simulate(job, measurements=_Measured(probe), world_size=4)
    assert plan.step_time_s == pytest.approx(
        _simulate(job, None, bare, None, None, 4, False, None, None, 0.0).step_time_s + calibration.outside_s)


