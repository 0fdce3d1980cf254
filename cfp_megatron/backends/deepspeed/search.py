"""Search the DeepSpeed space: ZeRO stage x micro-batch x activation checkpointing x optimizer offload x parameter
offload, every candidate simulated (:func:`cfp_megatron.backends.deepspeed.costs.simulate_zero`); the space is small (a
few hundred plans), so the search is exhaustive and exact. Pins come from the ``backend`` group
(``backend.zero_stage=2``, or concrete values in ``backend.config_file``) and ``cfp.micro_batch``;
``cfp.constraints.micro_batch`` limits the micro-batch sizes and ``cfp.constraints.memory_headroom`` the memory.
Offload is tried on GPU clusters only (on CPU ranks host and device memory are one) unless pinned. Ties break by the
canonical string, so every rank and every run gets the same plan. The enumeration (:func:`zero_candidates`) and the
ranking (:func:`rank_zero_plans`) are shared with the ``deepspeed.initialize`` hook's search over measured passes
(:mod:`cfp_megatron.backends.deepspeed.hook_plan`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.table import Table

from cfp_megatron.backends.deepspeed.costs import ZERO_SIM_OPTIONS, offload_unpriced, simulate_zero
from cfp_megatron.backends.deepspeed.zero_plan import model_job, zero_plan
from cfp_megatron.base.backend_spec import CONFIG_KEYS, BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import ClusterSpec, JobSpec, resolve_precision
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.plan.artifact import Plan, PlanPrediction
from cfp_megatron.search import driver
from cfp_megatron.search.search import no_plan_fix
from cfp_megatron.sim.kernels import target_peak_tflops
from cfp_megatron.sim.pass_costs import CostCache
from cfp_megatron.sim.prediction import GIB
from cfp_megatron.sim.terms import TERMS, LaneKind, Placement
from cfp_megatron.sim.uncertainty import mfu_check

if TYPE_CHECKING:
    from cfp_megatron.backends.deepspeed.costs import ZeroPredictionResult
    from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes

ZeroKnobs = tuple[int, int, bool, bool, bool]
"""One candidate's knobs: ZeRO stage, micro-batch, activation checkpointing, optimizer offload, parameter offload."""


@dataclass(frozen=True, kw_only=True)
class ZeroRanked:
    """A simulated plan."""

    plan: Plan
    """The plan, its prediction attached."""
    result: ZeroPredictionResult
    """The simulator's answer with breakdowns."""


@dataclass(frozen=True, kw_only=True)
class ZeroSearchResult:
    """What the DeepSpeed search found."""

    ranked: tuple[ZeroRanked, ...]
    """The best plans, fastest first."""
    evaluated: int
    """Plans simulated."""
    rejected: tuple[tuple[str, str], ...]
    """(plans, reason) for what was ruled out before or after simulation."""

    @property
    def best(self) -> ZeroRanked:
        """The fastest plan."""
        return self.ranked[0]


def _options(pin: object, values: list) -> list:
    """``[pin]``, or every value when nothing is pinned."""
    return values if pin is None else [pin]


def zero_pins(backend: BackendSpec, cfp: CfpSpec) -> dict[str, Any]:
    """The knobs fixed by hand (:meth:`~cfp_megatron.base.backend_spec.BackendSpec.pins`, and the micro-batch by
    ``cfp.micro_batch``); a :class:`ConfigError` where the two micro-batches differ."""
    pins = backend.pins()
    if cfp.micro_batch is not None:
        if "micro_batch" in pins and pins["micro_batch"] != cfp.micro_batch:
            raise ConfigError(ConfigIssue(key="cfp.micro_batch", value=cfp.micro_batch,
                                          problem=f"contradicts backend.config_file's micro-batch "
                                                  f"{pins['micro_batch']}.", fix="remove one of the two."))
        pins["micro_batch"] = cfp.micro_batch
    return pins


def search_zero(job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec, *,
                measurements: Measurements | None = None, probes: EngineProbes | None = None,
                on_gpu: bool = False) -> ZeroSearchResult:
    """The top ``cfp.top_k`` DeepSpeed plans for ``job`` on ``world`` ranks (module docstring), with the engine's
    measured costs where ``probes`` has them. Raises a :class:`ConfigError` naming the pins when nothing is left."""

    pins = zero_pins(backend, cfp)
    t = job.train
    precision = resolve_precision(t.precision, on_gpu or not job.cluster.on_cpu)
    if t.global_batch_size % world:
        raise ConfigError(ConfigIssue(key="train.global_batch_size", value=t.global_batch_size,
                                      problem=f"is not a multiple of the {world} data-parallel ranks.",
                                      fix=f"use a multiple of {world}, or start another number of ranks."))
    per_rank = t.global_batch_size // world
    allowed_mb = cfp.constraints.micro_batch
    micro = [m for m in range(1, min(per_rank, cfp.constraints.max_micro_batch) + 1) if per_rank % m == 0
             and (allowed_mb is None or m in allowed_mb)]
    if "micro_batch" in pins:
        m = int(pins["micro_batch"])
        if per_rank % m:
            raise ConfigError(ConfigIssue(key="cfp.micro_batch", value=m,
                                          problem=f"does not divide the {per_rank} sequences per rank per step "
                                                  f"(train.global_batch_size={t.global_batch_size} over {world}).",
                                          fix=f"use a divisor of {per_rank}."))
        micro = [m]
    candidates, rejected = zero_candidates(pins, micro, cluster=job.cluster,
                                           offload_pins="backend.offload_optimizer/offload_param")
    if not micro:
        rejected.append((f"cfp.constraints.micro_batch={list(allowed_mb or ())}", f"none of them divides the "
                         f"{per_rank} sequences per rank per step (train.global_batch_size={t.global_batch_size} "
                         f"over {world} ranks) within cfp.constraints.max_micro_batch="
                         f"{cfp.constraints.max_micro_batch}"))
    cache: list[CostCache] = []

    def plan_of(knobs: ZeroKnobs) -> Plan:
        stage, mb, ckpt, oopt, oparam = knobs
        return zero_plan(job, world=world, zero_stage=stage, micro_batch=mb, activation_checkpointing=ckpt,
                                 offload_optimizer=oopt, offload_param=oparam,
                                 bucket_elements=backend.bucket_elements, precision=precision)

    def evaluate(plan: Plan) -> ZeroPredictionResult:
        if not cache:
            cache.append(CostCache.for_job(model_job(plan, job), measurements, ZERO_SIM_OPTIONS))
        return simulate_zero(job, plan, measurements, cache=cache[0], probes=probes)

    return rank_zero_plans(candidates, plan_of, evaluate, hbm_gib=job.cluster.hbm_gib,
                           headroom=cfp.constraints.memory_headroom, peak_tflops=target_peak_tflops(job),
                           top_k=cfp.top_k, rejected=rejected, subject=f"{job.model.name} on {world} ranks",
                           key="backend", pins=pins, pinned=pin_keys(pins, backend, cfp))


ZERO_MORE_GPUS = "start more ranks (cluster.nodes; ZeRO-3 shards the model's states over every rank)"
"""How the DeepSpeed search's no-plan fix offers another number of GPUs (``cfp size`` does not size ZeRO plans)."""


def pin_keys(pins: dict[str, Any], backend: BackendSpec, cfp: CfpSpec) -> tuple[str, ...]:
    """The settings behind ``pins`` (:meth:`~cfp_megatron.base.backend_spec.BackendSpec.pins` and ``cfp.micro_batch``)
    and ``cfp.constraints.micro_batch`` where set: ``backend.zero_stage``, ``cfp.micro_batch``, or the
    ``backend.config_file`` key that fixes the knob."""
    keys = []
    for knob in pins:
        if knob == "micro_batch" and cfp.micro_batch is not None:
            keys.append("cfp.micro_batch")
        elif getattr(backend, knob, None) is not None:
            keys.append(f"backend.{knob}")
        else:
            keys.append(f"backend.config_file's {CONFIG_KEYS[knob]}")
    if cfp.constraints.micro_batch is not None:
        keys.append("cfp.constraints.micro_batch")
    return tuple(keys)


def zero_candidates(pins: dict[str, Any], micro: list[int], *, cluster: ClusterSpec,
                    offload_pins: str) -> tuple[list[ZeroKnobs], list[tuple[str, str]]]:
    """Every (stage, micro-batch, checkpointing, optimizer offload, parameter offload) the ``pins`` (keys of
    :data:`~cfp_megatron.base.backend_spec.PLANNED_KEYS`) and the ``micro`` sizes leave, in a fixed order;
    and what was left out, with why. Offload is left out unless pinned (``offload_pins`` names the settings that pin
    it) on CPU ranks, and where ``cluster`` lacks a host figure its terms need
    (:func:`~cfp_megatron.backends.deepspeed.costs.offload_unpriced`; pinned, its pricing refuses it)."""
    on_cpu = cluster.on_cpu
    rejected: list[tuple[str, str]] = []
    if on_cpu and ("offload_optimizer" not in pins or "offload_param" not in pins):
        rejected.append(("offload", f"on CPU ranks host and device memory are the same memory; pin "
                                    f"{offload_pins} to run it anyway"))
    choices = {}
    for knob, optimizer in (("offload_optimizer", True), ("offload_param", False)):
        missing = offload_unpriced(cluster, optimizer=optimizer)
        choices[knob] = [False] if on_cpu or missing else [False, True]
        if missing and not on_cpu and knob not in pins:
            rejected.append((knob, f"the cluster states no {' or '.join(f'cluster.{k}' for k in missing)}, which "
                                   f"its pricing needs; set it to try {knob}"))
    stages = _options(pins.get("zero_stage"), [0, 1, 2, 3])
    ckpts = _options(pins.get("activation_checkpointing"), [False, True])
    oopts = _options(pins.get("offload_optimizer"), choices["offload_optimizer"])
    oparams = _options(pins.get("offload_param"), choices["offload_param"])
    candidates = [(stage, mb, ckpt, oopt, oparam)
                  for stage, mb, ckpt, oopt, oparam in itertools.product(stages, micro, ckpts, oopts, oparams)
                  if not (oparam and stage != 3) and not (oopt and stage == 0)]
    return candidates, rejected


def rank_zero_plans(candidates: list[ZeroKnobs], plan_of: Callable[[ZeroKnobs], Plan],
                    evaluate: Callable[[Plan], ZeroPredictionResult], *, hbm_gib: float | None,
                    headroom: float, peak_tflops: float | None, top_k: int, rejected: list[tuple[str, str]],
                    subject: str, key: str, pins: dict[str, Any],
                    pinned: tuple[str, ...] = ()) -> ZeroSearchResult:
    """Simulate every candidate (``plan_of`` builds its plan, ``evaluate`` simulates it), drop those over the
    memory limit (``hbm_gib`` GiB less ``headroom``; none when ``hbm_gib`` is ``None``), and rank the rest by step
    time, ties broken by the canonical string. Raises a :class:`ConfigError` under ``key`` naming ``subject`` and
    the reasons when nothing is left, and the settings that pinned or limited the knobs (``pinned``) where any did
    (:func:`~cfp_megatron.search.search.no_plan_fix`)."""
    limit = None if hbm_gib is None else hbm_gib * GIB * (1.0 - headroom)
    space = _ZeroSpace(candidates=candidates, plan_of=plan_of, simulate=evaluate, limit=limit,
                       peak_tflops=peak_tflops)
    found = driver.run(space, top_k)
    for stage, peaks in sorted(found.over.items()):
        if stage not in space.fitting_stages:
            rejected.append((f"zero{stage}", f"needs at least {min(peaks):.1f} GiB per GPU, over "
                                    f"{limit / GIB if limit else 0:.1f} GiB ({hbm_gib:.4g} GiB less "
                                    f"{headroom:.0%} headroom)"))
    if not found.ranked:
        raise ConfigError([ConfigIssue(key=key, value=pins or "-",
                                       problem=f"no DeepSpeed plan of {subject} fits (the reasons follow).",
                                       fix=no_plan_fix(pinned, more_gpus=ZERO_MORE_GPUS)),
                           *[ConfigIssue(key=key, value=what, problem=why, fix="see the problem.")
                             for what, why in rejected]])
    return ZeroSearchResult(ranked=tuple(r.result for r in found.ranked), evaluated=found.visited,
                            rejected=tuple(rejected))


@dataclass(kw_only=True)
class _ZeroSpace:
    """The DeepSpeed plans as the one driver searches them (:class:`cfp_megatron.search.driver.SearchSpace`): a few
    hundred candidates, no bound, every one simulated."""

    candidates: list[ZeroKnobs]
    """The knobs to try, in order."""
    plan_of: Callable[[ZeroKnobs], Plan]
    """The plan of a candidate's knobs."""
    simulate: Callable[[Plan], ZeroPredictionResult]
    """The simulator."""
    limit: float | None
    """Bytes a plan may take per GPU (``None``: no limit)."""
    peak_tflops: float | None
    """The cluster's peak, for the plans' MFU."""
    fitting_stages: set[int] = dataclasses.field(default_factory=set)
    """ZeRO stages with a plan that fits (filled while the driver evaluates)."""

    def entries(self) -> list[driver.Entry]:
        """Every candidate, unbounded."""
        return [(0.0, driver.CANDIDATE, i, knobs) for i, knobs in enumerate(self.candidates)]

    def expand(self, item: int, cut: float) -> list[driver.Entry]:
        """No groups: nothing to expand."""
        return []

    def evaluate(self, item: int, extra: ZeroKnobs, kth: float) -> driver.Outcome:
        """Simulate the plan of the knobs ``extra``; over the limit, or ranked by its step time and canonical
        string."""
        plan = self.plan_of(extra)
        result = self.simulate(plan)
        if self.limit is not None and result.memory.total > self.limit:
            return driver.OverMemory(label=plan.zero_stage, gib=result.memory.total / GIB)
        self.fitting_stages.add(plan.zero_stage)
        ranked = ZeroRanked(plan=dataclasses.replace(plan, predicted=_prediction(result, self.peak_tflops)),
                            result=result)
        return driver.Ranked(step_time_s=result.step_time_s, tie=plan.canonical(), result=ranked)


def _prediction(result: ZeroPredictionResult, peak: float | None) -> PlanPrediction:
    t = result.time
    return PlanPrediction(bubble_fraction=0.0, step_time_s=result.step_time_s,
                          peak_memory_gib=result.memory.total / GIB,
                          tokens_per_s_per_gpu=result.tokens_per_s_per_gpu,
                          mfu=result.model_tflops_per_gpu / peak if peak else None,
                          exposed_comm_s=sum(t.seconds(lane.name) for lane in TERMS.lanes()
                                             if lane.kind is LaneKind.comm))


def _after_passes_s(result: ZeroPredictionResult) -> float:
    """The step's compute after its passes (the registry's after-schedule compute lanes: the optimizer step) and the
    engine's measured costs."""
    t = result.time
    return sum(t.seconds(lane.name) for lane in TERMS.lanes()
               if lane.kind is LaneKind.compute and lane.placement is Placement.after) + t.engine_s


def ranking_table(result: ZeroSearchResult, job: JobSpec | None = None) -> Table:
    """The top plans as a rich table; with the ``job`` (its model and cluster), an MFU above every comparable
    published run is marked ``!`` (:func:`~cfp_megatron.sim.uncertainty.mfu_check`)."""
    check = mfu_check(job) if job is not None else None
    table = Table(title=f"Top {len(result.ranked)} of {result.evaluated} DeepSpeed plans")
    for col in ("#", "plan", "step s", "tokens/s/GPU", "MFU", "peak GiB", "host GiB", "exposed comm s",
                "engine+optimizer s"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for i, r in enumerate(result.ranked, 1):
        p = r.plan.predicted
        if p is None:  # the search attaches one to every plan it ranks
            continue
        table.add_row(str(i), r.plan.describe(), f"{p.step_time_s:.4f}", f"{p.tokens_per_s_per_gpu:,.0f}",
                      f"{p.mfu:.1%}" + (" !" if check and check.above_all(p.mfu) else "") if p.mfu is not None
                      else "-", f"{p.peak_memory_gib:.2f}", f"{r.result.host_bytes / GIB:.2f}",
                      f"{p.exposed_comm_s:.4f}", f"{_after_passes_s(r.result):.4f}")
    return table
