"""Search the DeepSpeed space: ZeRO stage x micro-batch x activation checkpointing x optimizer offload x parameter
offload, every candidate simulated (:func:`cfp_megatron.sim.zero.simulate_zero`); the space is small (a few hundred
plans), so the search is exhaustive and exact. Pins come from the ``backend`` group (``backend.zero_stage=2``, or
concrete values in ``backend.config_file``) and ``cfp.micro_batch``; ``cfp.constraints.micro_batch`` limits the
micro-batch sizes and ``cfp.constraints.memory_headroom`` the memory. Offload is tried on GPU clusters only (on CPU
ranks host and device memory are one) unless pinned. Ties break by the canonical string, so every rank and every run
gets the same plan."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from rich.table import Table

from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes
from cfp_megatron.backends.deepspeed.spec import BackendSpec
from cfp_megatron.backends.deepspeed.zero_plan import ZeroPlan, ZeroPrediction, model_job
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.config import JobSpec, resolve_precision
from cfp_megatron.errors import ConfigError, ConfigIssue
from cfp_megatron.search.spec import CfpSpec
from cfp_megatron.sim.pass_costs import CostCache
from cfp_megatron.sim.prediction import GIB
from cfp_megatron.sim.zero import ZERO_SIM_OPTIONS, ZeroPredictionResult, simulate_zero


@dataclass(frozen=True, kw_only=True)
class ZeroRanked:
    """A simulated plan."""

    plan: ZeroPlan
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


def search_zero(job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec, *,
                measurements: Measurements | None = None, probes: EngineProbes | None = None,
                on_gpu: bool = False) -> ZeroSearchResult:
    """The top ``cfp.top_k`` DeepSpeed plans for ``job`` on ``world`` ranks (module docstring), with the engine's
    measured costs where ``probes`` has them. Raises a :class:`ConfigError` naming the pins when nothing is left."""
    pins = backend.pins()
    if cfp.micro_batch is not None:
        if "micro_batch" in pins and pins["micro_batch"] != cfp.micro_batch:
            raise ConfigError(ConfigIssue(key="cfp.micro_batch", value=cfp.micro_batch,
                                          problem=f"contradicts backend.config_file's micro-batch "
                                                  f"{pins['micro_batch']}.", fix="remove one of the two."))
        pins["micro_batch"] = cfp.micro_batch
    t = job.train
    precision = resolve_precision(t.precision, on_gpu or not job.cluster.on_cpu)
    rejected: list[tuple[str, str]] = []
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
    offload_choices = [False] if job.cluster.on_cpu else [False, True]
    if job.cluster.on_cpu and ("offload_optimizer" not in pins or "offload_param" not in pins):
        rejected.append(("offload", "on CPU ranks host and device memory are the same memory; pin "
                                    "backend.offload_optimizer/offload_param to run it anyway"))
    stages = _options(pins.get("zero_stage"), [0, 1, 2, 3])
    ckpts = _options(pins.get("activation_checkpointing"), [False, True])
    oopts = _options(pins.get("offload_optimizer"), offload_choices)
    oparams = _options(pins.get("offload_param"), offload_choices)
    headroom = cfp.constraints.memory_headroom
    limit = None if job.cluster.hbm_gib is None else job.cluster.hbm_gib * GIB * (1.0 - headroom)
    cache: CostCache | None = None
    found: list[ZeroRanked] = []
    evaluated = 0
    too_big: dict[int, float] = {}  # the smallest peak of each ZeRO stage's plans over the limit
    for stage, mb, ckpt, oopt, oparam in itertools.product(stages, micro, ckpts, oopts, oparams):
        if oparam and stage != 3:
            continue
        if oopt and stage == 0:
            continue
        plan = ZeroPlan.from_job(job, world=world, zero_stage=stage, micro_batch=mb, activation_checkpointing=ckpt,
                                 offload_optimizer=oopt, offload_param=oparam,
                                 bucket_elements=backend.bucket_elements, precision=precision)
        if cache is None:
            cache = CostCache.for_job(model_job(plan, job), measurements, ZERO_SIM_OPTIONS)
        result = simulate_zero(job, plan, measurements, cache=cache, probes=probes)
        evaluated += 1
        if limit is not None and result.memory.total > limit:
            too_big[stage] = min(too_big.get(stage, float("inf")), result.memory.total)
            continue
        found.append(ZeroRanked(plan=dataclasses.replace(plan, predicted=_prediction(result, job)), result=result))
    fitting = {r.plan.zero_stage for r in found}
    for stage, smallest in sorted(too_big.items()):
        if stage not in fitting:
            rejected.append((f"zero{stage}", f"needs at least {smallest / GIB:.1f} GiB per GPU, over "
                                    f"{limit / GIB if limit else 0:.1f} GiB ({job.cluster.hbm_gib} GiB less "
                                    f"{headroom:.0%} headroom)"))
    if not found:
        raise ConfigError([ConfigIssue(key="backend", value=pins or "-",
                                       problem=f"no DeepSpeed plan of {job.model.name} on {world} ranks fits "
                                               f"(the reasons follow).",
                                       fix="relax the pins, allow offload, lower the micro-batch or add ranks."),
                           *[ConfigIssue(key="backend", value=what, problem=why, fix="see the problem.")
                             for what, why in rejected]])
    found.sort(key=lambda r: (r.result.step_time_s, r.plan.canonical()))
    return ZeroSearchResult(ranked=tuple(found[:cfp.top_k]), evaluated=evaluated, rejected=tuple(rejected))


def _prediction(result: ZeroPredictionResult, job: JobSpec) -> ZeroPrediction:
    from cfp_megatron.search.report import target_peak_tflops

    peak = target_peak_tflops(job)
    t = result.time
    return ZeroPrediction(step_time_s=result.step_time_s, peak_memory_gib=result.memory.total / GIB,
                          tokens_per_s_per_gpu=result.tokens_per_s_per_gpu,
                          mfu=result.model_tflops_per_gpu / peak if peak else None,
                          exposed_comm_s=t.grad_reduce_s + t.param_gather_s + t.offload_s)


def ranking_table(result: ZeroSearchResult) -> Table:
    """The top plans as a rich table."""
    table = Table(title=f"Top {len(result.ranked)} of {result.evaluated} DeepSpeed plans")
    for col in ("#", "plan", "step s", "tokens/s/GPU", "MFU", "peak GiB", "host GiB", "exposed comm s",
                "engine+optimizer s"):
        table.add_column(col, justify="left" if col == "plan" else "right")
    for i, r in enumerate(result.ranked, 1):
        p = r.plan.predicted
        if p is None:  # the search attaches one to every plan it ranks
            continue
        table.add_row(str(i), r.plan.describe(), f"{p.step_time_s:.4f}", f"{p.tokens_per_s_per_gpu:,.0f}",
                      f"{p.mfu:.1%}" if p.mfu is not None else "-", f"{p.peak_memory_gib:.2f}",
                      f"{r.result.host_bytes / GIB:.2f}", f"{p.exposed_comm_s:.4f}",
                      f"{r.result.time.optimizer_s + r.result.time.engine_s:.4f}")
    return table
