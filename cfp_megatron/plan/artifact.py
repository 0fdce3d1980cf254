"""The Plan: the one artifact the planner hands to everything downstream.

A :class:`Plan` fixes the parallel layout of one job (a :class:`~cfp_megatron.base.config.ParallelSpec`, the batch and
the sequence length) for one model preset on one cluster shape, and carries the simulator's prediction for it and a
fingerprint of the inputs it was computed from. It has three forms:

- the **canonical string** (:meth:`Plan.canonical`), short, deterministic and readable, which parses back
  (:meth:`Plan.parse`) and is what :meth:`Plan.plan_hash` hashes::

      gpt3_175b@dgx_a100x128x8:tp=8,sp=1,pp=16,vpp=2,cp=1,ep=1,etp=1,dp=8,mb=1,gbs=1536,seq=2048,rc=none,rcn=1,
      rcm=uniform,do=1,ogr=0,opg=0,gf32=1,order=tp-cp-ep-dp-pp,mlp=megatron,mlpn=null,prec=bf16

  (one line). The head is ``<model>@<cluster>x<nodes>x<gpus_per_node>``; then every ``ParallelSpec`` field under a
  short name (``tp sp pp vpp cp ep etp``, the derived ``dp``, ``mb gbs seq``, then ``rc rcn rcm do ogr opg gf32 order
  mlp mlpn``; a field added to ParallelSpec later appears under its own name before ``prec``), then the precision.
  Booleans are 1/0, enums their value, ``vpp``/``etp`` their effective size (``None`` means 1), another ``None`` is
  ``null``. The prediction and the inputs' fingerprint are not part of it: a parsed plan has ``predicted=None`` and
  ``inputs_fingerprint=""``, and two plans with the same layout have the same hash whatever they were computed from.
- **plan.json** (:meth:`Plan.to_json`, :func:`save_plan`, :func:`load_plan`), versioned by :data:`SCHEMA_VERSION`,
  with the canonical string and the hash stored next to the fields, and a hash of the whole content (prediction and
  fingerprint included, :func:`content_hash`), so that a hand edit is caught on load.
- the exports in :mod:`cfp_megatron.plan.exports` (Megatron-LM arguments, a DeepSpeed config, the torchrun command).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cfp_megatron.base.backend_spec import BackendKind, ZeroSpec, zero_keys
from cfp_megatron.base.config import JobSpec, ParallelSpec, Precision, Recompute, build_spec, layout_keys
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import DuplicateKeyError, NotRegularFileError, json_loads_unique, open_regular, write_new
from cfp_megatron.base.jsonio import json_plain, json_type_problem
from cfp_megatron.base.number_format import NumberFormat, format_names
from cfp_megatron.base.parallel_dims import data_parallel_size
from cfp_megatron.plan.backend_part import BackendPart, DeepSpeedPart, MegatronPart, backend_part
from cfp_megatron.plan.errors import PlanError
from cfp_megatron.sim.prediction import GIB, Prediction, mfu
from cfp_megatron.sim.terms import exposed_comm_s
from cfp_megatron.sim.uncertainty import ErrorBand

SCHEMA_VERSION = 2
"""Version of plan.json's layout; bump it when a field changes meaning or is removed. Version 2 requires the
:func:`content_hash` and adds the job's inputs (``inputs``: :attr:`Plan.job_inputs`); a version-1 file is read as
version 1 was (its content hash checked where it has one, no inputs)."""

CONTENT_HASH_SINCE = 2
"""The first schema version whose plan.json must carry its :func:`content_hash` (version 1 files were written both
before and after the content hash, so for them it is checked only where present)."""

PLAN_FILE_SETTING = "cfp.plan_file"
"""The Hydra key that says where plan.json goes (named in errors about the file)."""

_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
"""Model and cluster preset names the canonical string can carry (no ``@``, ``:``, ``,``, ``=`` or spaces)."""

_BATCH_KEYS: tuple[str, ...] = ("dp", "mb", "gbs", "seq")
"""Keys written after the head fields: derived data-parallel size, micro-batch, global batch, sequence length."""

_PRECISION_KEY = "prec"
"""Key of the precision, written last in a Megatron plan's string."""

_BACKEND_KEY = "backend"
"""Key of the backend, written after the precision in a DeepSpeed plan's string, before its ZeRO options."""

_SEPARATORS = set(",=:@ \t\n")

_FSDP_ZERO_STAGE = {"optim": 1, "optim_grads": 2, "optim_grads_params": 3}
"""The ZeRO stage each Megatron-FSDP sharding strategy (``parallel.fsdp``) matches."""
"""Characters a value in the canonical string must not contain."""


_PREDICTION_RANGES: dict[str, tuple[str, Any]] = {
    "step_time_s": ("a finite number above zero", lambda v: math.isfinite(v) and v > 0),
    "tokens_per_s_per_gpu": ("a finite number above zero", lambda v: math.isfinite(v) and v > 0),
    "mfu": ("a finite number at or above zero", lambda v: math.isfinite(v) and v >= 0),
    "peak_memory_gib": ("a finite number above zero", lambda v: math.isfinite(v) and v > 0),
    "bubble_fraction": ("a fraction from 0 up to (not including) 1", lambda v: 0 <= v < 1),
    "exposed_comm_s": ("a finite number at or above zero", lambda v: math.isfinite(v) and v >= 0),
    "error_band_pct": ("a finite number at or above zero", lambda v: math.isfinite(v) and v >= 0),
}
"""The range of each number of a stored prediction (what it must be, as said in the error, and the test)."""


@dataclass(frozen=True, kw_only=True)
class PlanPrediction:
    """What the simulator predicted for a plan (per optimizer step)."""

    step_time_s: float
    """Predicted time of one optimizer step in seconds."""
    tokens_per_s_per_gpu: float
    """Predicted training throughput per GPU in tokens per second."""
    mfu: float | None
    """Model FLOPs utilisation as a fraction of the cluster's peak (0..1); ``None`` when the peak is unknown."""
    peak_memory_gib: float
    """Predicted peak device memory of the most-loaded rank in GiB."""
    bubble_fraction: float
    """Share of the step the pipeline schedule leaves idle (0 without pipeline parallelism)."""
    exposed_comm_s: float
    """Communication time per step that is not hidden behind computation, in seconds."""
    error_band_pct: float | None = None
    """How far the step time may be off, in percent: the error that 80% of published runs of the plan's class stay
    within (:func:`~cfp_megatron.sim.uncertainty.error_band`); ``None`` where no band is known."""
    analytical: tuple[str, ...] = ()
    """What the prediction reads that the profile did not measure (``dense tp2-sp``), priced by the analytical
    model instead; empty when all was measured (or nothing was: a preflight without a profile)."""
    choice: tuple[str, ...] = ()
    """Why the planner chose this plan among the top plans, one sentence each (the fastest, or one whose margin
    behind it is inside the error band and whose prediction rests on more evidence:
    :mod:`cfp_megatron.search.choice`); empty for the plans it did not choose and in older plan.json files."""

    def to_json(self) -> dict[str, Any]:
        """The prediction as a JSON-ready mapping."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "analytical": list(self.analytical), "choice": list(self.choice)}

    @classmethod
    def of(cls, prediction: Prediction, peak_tflops: float | None,
           band: ErrorBand | None = None, analytical: tuple[str, ...] = (),
           choice: tuple[str, ...] = ()) -> PlanPrediction:
        """What plan.json keeps of a simulator prediction (MFU against ``peak_tflops``, TFLOP/s per GPU), its
        error ``band``; ``choice``: why the planner chose it (empty for the plans it did not choose)."""
        return cls(step_time_s=prediction.step_time_s, tokens_per_s_per_gpu=prediction.tokens_per_s_per_gpu,
                   mfu=mfu(prediction, peak_tflops), peak_memory_gib=prediction.memory.total / GIB,
                   bubble_fraction=prediction.bubble_fraction, exposed_comm_s=exposed_comm_s(prediction),
                   error_band_pct=band.pct if band is not None else None, analytical=tuple(analytical),
                   choice=tuple(choice))

    @classmethod
    def from_json(cls, d: Any) -> PlanPrediction:
        """Rebuild from :meth:`to_json`'s mapping; raise :class:`PlanError` naming a missing, unknown or bad key."""
        if not isinstance(d, dict):
            raise PlanError(f"plan.json's prediction must be a mapping or null, not {type(d).__name__}.",
                            fix="re-plan to write a fresh plan.json.")
        names = [f.name for f in dataclasses.fields(cls)]
        later = ["error_band_pct", "analytical", "choice"]  # added after plans were saved: older files lack them
        _check_keys(d, required=[n for n in names if n not in later], where="plan.json's prediction", optional=later)
        values: dict[str, Any] = {}
        for name in names:
            value = d.get(name)
            if name in ("analytical", "choice"):
                if not isinstance(value, list | type(None)) or not all(isinstance(v, str) for v in value or []):
                    raise PlanError(f"plan.json's prediction.{name}={value!r} is not a list of strings.",
                                    fix="re-plan to write a fresh plan.json.")
                values[name] = tuple(value or ())
                continue
            if value is None and name in ("mfu", *later):
                values[name] = None
            elif isinstance(value, int | float) and not isinstance(value, bool):
                values[name] = float(value)
            else:
                raise PlanError(f"plan.json's prediction.{name}={value!r} is not a number.",
                                fix="re-plan to write a fresh plan.json.")
            if values[name] is not None and not _PREDICTION_RANGES[name][1](values[name]):
                raise PlanError(f"plan.json's prediction.{name}={value!r} is not {_PREDICTION_RANGES[name][0]}; "
                                "the simulator never predicts it.", fix="re-plan to write a fresh plan.json.")
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One parallel layout for one model on one cluster shape, with its prediction.

    ``parallel`` is stored normalised: ``vpp`` and ``etp`` of 1 become ``None`` (which means 1), so every plan has a
    single form and ``Plan.parse(p.canonical()) == p`` up to ``predicted`` and ``inputs_fingerprint``.
    """

    schema_version: int = SCHEMA_VERSION
    """Version of the plan.json layout this plan was written with."""
    model: str
    """Model preset name (``job.model.name``, the Hydra ``model`` option)."""
    cluster: str
    """Cluster preset name (``job.cluster.name``, the Hydra ``cluster`` option)."""
    nodes: int
    """Number of nodes."""
    gpus_per_node: int
    """Ranks (GPUs) per node; ``nodes x gpus_per_node`` is the world size."""
    parallel: ParallelSpec
    """The parallel layout; data parallelism is what is left: ``world / (tp x cp x pp)``."""
    micro_batch_size: int
    """Sequences per forward/backward pass on one rank."""
    global_batch_size: int
    """Sequences per optimizer step over all data-parallel ranks."""
    seq_length: int
    """Tokens per sequence."""
    precision: str
    """The number format (:attr:`~cfp_megatron.base.number_format.NumberFormat.name`): ``auto``, ``fp32``,
    ``bf16``, ``fp16``, or FP8/FP4 with its recipe (``fp8-delayed``, ``fp8-tensorwise``, ``fp8-blockwise``,
    ``fp8-mxfp8``, ``fp4-nvfp4``)."""
    backend_part: BackendPart = MegatronPart()
    """What only the plan's backend has (:mod:`cfp_megatron.plan.backend_part`): nothing for Megatron-Core, the ZeRO
    options for DeepSpeed."""
    predicted: PlanPrediction | None = None
    """The simulator's prediction; ``None`` for a plan parsed from its canonical string or not simulated."""
    inputs_fingerprint: str = ""
    """A hash of what the plan was computed from (model, cluster, profile, search settings); ``""`` if unknown."""
    requires: tuple[str, ...] = ()
    """What running the plan needs beyond Megatron-Core on PyTorch (Transformer Engine for context parallelism...,
    :func:`cfp_megatron.plan.requirements.plan_requirements`); not part of the canonical string or the hash."""
    job_inputs: tuple[tuple[str, Any], ...] = field(default=(), compare=False)
    """The settings of the job the plan was made for that the plan does not set itself, as ``(Hydra key, JSON
    value)`` pairs sorted by key: every ``model.*`` field and ``train.optimizer`` (:func:`job_inputs`); a job it is
    applied to must have the same (:func:`job_mismatches`). Empty for a plan parsed from its canonical string or
    read from a version-1 plan.json. Not part of the canonical string, the hash or equality (plan.json's content
    hash covers it)."""

    def __post_init__(self) -> None:
        if isinstance(self.parallel, ParallelSpec):
            normal = {k: None for k, lk in layout_keys().items()
                      if lk.none_means is not None and getattr(self.parallel, k) == lk.none_means}
            if normal:
                object.__setattr__(self, "parallel", dataclasses.replace(self.parallel, **normal))
        problems = self._problems()
        if problems:
            raise PlanError("invalid plan: " + " ".join(problems),
                            fix="build plans with Plan.from_job, Plan.parse or load_plan from a valid job.")

    def _problems(self) -> list[str]:
        """Every inconsistency of the plan's fields, one sentence each."""
        out: list[str] = []
        for name in ("model", "cluster"):
            value = getattr(self, name)
            if not isinstance(value, str) or not _NAME.match(value):
                out.append(f"{name}={value!r} must be a preset name of letters, digits and _ . + -.")
        for name in ("schema_version", "nodes", "gpus_per_node", "micro_batch_size", "global_batch_size",
                     "seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(f"{name}={value!r} must be a positive integer.")
        if not isinstance(self.parallel, ParallelSpec):
            out.append(f"parallel must be a ParallelSpec, not {type(self.parallel).__name__}.")
        if not isinstance(self.precision, str) or self.precision not in format_names():
            out.append(f"precision={self.precision!r} must be one of {format_names()}.")
        if not isinstance(self.inputs_fingerprint, str) or _SEPARATORS & set(self.inputs_fingerprint):
            out.append(f"inputs_fingerprint={self.inputs_fingerprint!r} must be a string without spaces or , = : @.")
        if self.predicted is not None and not isinstance(self.predicted, PlanPrediction):
            out.append(f"predicted must be a PlanPrediction or None, not {type(self.predicted).__name__}.")
        if not isinstance(self.job_inputs, tuple) or not all(
                isinstance(kv, tuple) and len(kv) == 2 and isinstance(kv[0], str) for kv in self.job_inputs):
            out.append("job_inputs must be a tuple of (Hydra key, value) pairs.")
        out += self._backend_problems()
        if out:
            return out
        p, world = self.parallel, self.world_size
        model_ranks = p.tp * p.cp * p.pp
        if world % model_ranks:
            out.append(f"world size {world} ({self.nodes} x {self.gpus_per_node}) is not divisible by "
                       f"tp x cp x pp = {model_ranks}.")
        expert_ranks = p.expert_tp * p.ep * p.pp
        if world % expert_ranks:
            out.append(f"world size {world} is not divisible by etp x ep x pp = {expert_ranks}.")
        if not out and self.global_batch_size % (self.micro_batch_size * self.dp):
            out.append(f"global_batch_size={self.global_batch_size} is not a multiple of micro_batch_size x dp = "
                       f"{self.micro_batch_size} x {self.dp}.")
        return out

    def _backend_problems(self) -> list[str]:
        """What the backend asks of the other fields: a DeepSpeed plan is data parallel over every rank, with ZeRO
        options, its sharded optimizer from stage 1 and activation checkpointing as full recomputation."""
        part = self.backend_part
        if not isinstance(part, MegatronPart | DeepSpeedPart):
            return [f"backend_part must be a MegatronPart or a DeepSpeedPart, not {type(part).__name__}."]
        if isinstance(part, MegatronPart):
            return []
        if not isinstance(part.zero, ZeroSpec):
            return ["a DeepSpeed plan needs its ZeRO options (zero)."]
        p, out = self.parallel, []
        if not isinstance(p, ParallelSpec):
            return out
        split = {k: getattr(p, k) for k in ("tp", "pp", "cp", "ep") if getattr(p, k) != 1}
        if split or p.sp or p.virtual_stages > 1:
            out.append(f"a DeepSpeed plan is data parallel over every rank, not {split or 'sp/vpp'}.")
        if p.distributed_optimizer != (self.zero.stage >= 1):
            out.append(f"ZeRO stage {self.zero.stage} shards the optimizer states iff it is 1 or more "
                       f"(distributed_optimizer={p.distributed_optimizer}).")
        if p.recompute is Recompute.selective:
            out.append("DeepSpeed's activation checkpointing recomputes whole layers (recompute=full), not selective.")
        return out

    # ---------------------------------------------------------------------------------------------------- derived

    @property
    def backend(self) -> BackendKind:
        """The engine that trains the plan."""
        return self.backend_part.kind

    @property
    def zero(self) -> ZeroSpec | None:
        """With ``backend=deepspeed``: the ZeRO options (``None`` for Megatron plans)."""
        return self.backend_part.zero

    @property
    def number_format(self) -> NumberFormat:
        """The number format :attr:`precision` names."""
        return NumberFormat.parse(self.precision)

    @property
    def world_size(self) -> int:
        """Total ranks: ``nodes x gpus_per_node``."""
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        """Data-parallel size: ``world / (tp x cp x pp)``."""
        p = self.parallel
        return data_parallel_size(self.world_size, p.tp, p.cp, p.pp)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per optimizer step on each data-parallel rank: ``gbs / (mb x dp)``."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    @property
    def gradient_accumulation_steps(self) -> int:
        """DeepSpeed's name for :attr:`num_microbatches`."""
        return self.num_microbatches

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage: the DeepSpeed plan's, or what Megatron-FSDP's strategy shards (1-3), or 1 for Megatron's
        distributed optimizer (else 0)."""
        if self.zero is not None:
            return self.zero.stage
        return _FSDP_ZERO_STAGE.get(self.parallel.fsdp.value, int(self.parallel.distributed_optimizer))

    @property
    def activation_checkpointing(self) -> bool:
        """Whether every layer is recomputed in the backward pass (``recompute=full``)."""
        return self.parallel.recompute is Recompute.full

    @property
    def offload_optimizer(self) -> bool:
        """Optimizer states on the host (DeepSpeed's ZeRO-Offload)."""
        return self.zero is not None and self.zero.offload_optimizer

    @property
    def offload_param(self) -> bool:
        """Parameters on the host (DeepSpeed's ZeRO-3 offload)."""
        return self.zero is not None and self.zero.offload_param

    @property
    def bucket_elements(self) -> int:
        """Elements per ZeRO bucket (DeepSpeed plans; DeepSpeed's planner default otherwise)."""
        return (self.zero or ZeroSpec()).bucket_elements

    def describe(self) -> str:
        """A short label: ``zero2 mb2 ga1 ckpt offload=opt`` for a DeepSpeed plan, ``dp2 tp2 pp2 mb4`` (and what
        differs from the defaults) for a Megatron one."""
        p = self.parallel
        if self.backend is BackendKind.deepspeed:
            offload = "+".join(n for n, on in (("opt", self.offload_optimizer), ("param", self.offload_param)) if on)
            return (f"zero{self.zero_stage} mb{self.micro_batch_size} ga{self.num_microbatches}"
                    f"{' ckpt' if self.activation_checkpointing else ''}{f' offload={offload}' if offload else ''}")
        parts = [f"dp{self.dp}", f"tp{p.tp}" + (" sp" if p.sp else ""), f"pp{p.pp}"]
        parts += [f"vpp{p.virtual_stages}"] if p.virtual_stages > 1 else []
        parts += [f"layout={p.pipeline_model_parallel_layout}"] if p.pipeline_model_parallel_layout else []
        parts += [f"{k}{getattr(p, k)}" for k in ("cp", "ep") if getattr(p, k) > 1]
        modules = f"[{p.recompute_modules}]" if p.recompute_modules is not None else ""
        parts += [f"mb{self.micro_batch_size}", f"rc={p.recompute.value}{modules}"]
        if p.cuda_graph_impl.value != "none":
            parts.append(f"cg={p.cuda_graph_impl.value}" + (f"[{p.cuda_graph_scope}]" if p.cuda_graph_scope else ""))
        if p.cpu_offloading_num_layers:
            parts.append(f"offload={p.cpu_offloading_num_layers}L")
        parts += [f"fsdp={p.fsdp.value}"] if p.fsdp.value != "none" else []
        parts += [f"shard{p.dp_shard_size}"] if p.dp_shard_size is not None else []
        return " ".join(parts + (["dopt"] if p.distributed_optimizer else []))

    # ------------------------------------------------------------------------------------------------- building

    @classmethod
    def from_job(cls, job: JobSpec, *, world_size: int, prediction: PlanPrediction | None,
                 inputs_fingerprint: str) -> Plan:
        """The plan of ``job`` as it would run on ``world_size`` ranks.

        ``gpus_per_node`` is ``job.cluster.gpus_per_node``, or ``world_size / nodes`` when the cluster leaves it to
        torchrun; a world size that does not match the cluster raises :class:`PlanError`.
        """
        nodes = job.cluster.nodes
        gpus = job.cluster.gpus_per_node
        if gpus is None:
            if world_size < 1 or world_size % nodes:
                raise PlanError(f"world size {world_size} is not a positive multiple of cluster.nodes={nodes}.",
                                fix="start the same number of ranks on every node.", setting="cluster.nodes")
            gpus = world_size // nodes
        if nodes * gpus != world_size:
            raise PlanError(f"world size {world_size} differs from cluster.nodes x cluster.gpus_per_node = "
                            f"{nodes} x {gpus} = {nodes * gpus}.",
                            fix="plan for the cluster's size, or set cluster.nodes / cluster.gpus_per_node to match.",
                            setting="cluster.gpus_per_node")
        return cls(model=job.model.name, cluster=job.cluster.name, nodes=nodes, gpus_per_node=gpus,
                   parallel=job.parallel, micro_batch_size=job.train.micro_batch_size,
                   global_batch_size=job.train.global_batch_size, seq_length=job.train.seq_length,
                   precision=NumberFormat.of(job.train).name, predicted=prediction,
                   inputs_fingerprint=inputs_fingerprint,
                   job_inputs=job_inputs(job))

    @classmethod
    def for_deepspeed(cls, job: JobSpec, *, world: int, zero: ZeroSpec, micro_batch: int,
                      activation_checkpointing: bool, precision: Precision,
                      predicted: PlanPrediction | None = None) -> Plan:
        """The DeepSpeed plan of ``job`` on ``world`` data-parallel ranks with the given ZeRO options, micro-batch,
        activation checkpointing and (resolved) precision; the nodes follow from the cluster's GPUs per node (or
        torchrun's world on one node)."""
        gpn = job.cluster.gpus_per_node or max(world // max(job.cluster.nodes, 1), 1)
        nodes = max(world // gpn, 1)
        parallel = ParallelSpec(recompute=Recompute.full if activation_checkpointing else Recompute.none,
                                distributed_optimizer=zero.stage >= 1)
        return cls(model=job.model.name, cluster=job.cluster.name, nodes=nodes, gpus_per_node=world // nodes,
                   parallel=parallel, micro_batch_size=micro_batch, global_batch_size=job.train.global_batch_size,
                   seq_length=job.train.seq_length, precision=precision.value, backend_part=DeepSpeedPart(zero=zero),
                   predicted=predicted, job_inputs=job_inputs(job))

    def apply(self, job: JobSpec) -> JobSpec:
        """``job`` with this plan's parallel spec, micro and global batch, sequence length and precision (a plan's
        ``auto`` leaves the job's; everything else stays as the job has it). Raises :class:`PlanError` if the plan
        is for another model, a :class:`ConfigError` naming each key where the job's model (or optimizer) differs
        from the one the plan was made for (:func:`job_mismatches`)."""
        if job.model.name != self.model:
            raise PlanError(f"the plan is for model {self.model!r} but the job's model is {job.model.name!r}.",
                            fix=f"run with model={self.model}, or plan again for model={job.model.name}.",
                            setting="model")
        issues = job_mismatches(self, job)
        if issues:
            raise ConfigError(issues)
        fmt = self.number_format
        train = dataclasses.replace(job.train, micro_batch_size=self.micro_batch_size,
                                    global_batch_size=self.global_batch_size, seq_length=self.seq_length,
                                    **(fmt.train_fields() if fmt.precision is not Precision.auto else {}))
        return dataclasses.replace(job, parallel=self.parallel, train=train)

    # ------------------------------------------------------------------------------------------ canonical string

    def canonical(self) -> str:
        """The short, deterministic string of the layout-defining fields (see the module docstring)."""
        items: list[tuple[str, str]] = []
        keys = _parallel_keys()
        for name, lk in layout_keys().items():
            if lk.head:
                items.append((keys[name], _encode(name, getattr(self.parallel, name))))
        items += [("dp", str(self.dp)), ("mb", str(self.micro_batch_size)), ("gbs", str(self.global_batch_size)),
                  ("seq", str(self.seq_length))]
        defaults = ParallelSpec()
        for name, lk in layout_keys().items():
            if lk.optional and getattr(self.parallel, name) == getattr(defaults, name):
                continue
            if not lk.head:
                items.append((keys[name], _encode(name, getattr(self.parallel, name))))
        items.append((_PRECISION_KEY, self.precision))
        if self.zero is not None:  # a Megatron plan's string ends here (its hash predates the DeepSpeed plans)
            items.append((_BACKEND_KEY, self.backend.value))
            items += [(lk.key, _encode(name, getattr(self.zero, name))) for name, lk in zero_keys().items()]
        body = ",".join(f"{k}={v}" for k, v in items)
        return f"{self.model}@{self.cluster}x{self.nodes}x{self.gpus_per_node}:{body}"

    @classmethod
    def parse(cls, text: str) -> Plan:
        """Rebuild a plan from :meth:`canonical`'s string (``predicted=None``, ``inputs_fingerprint=""``).

        Raises :class:`PlanError` naming what is wrong: the head, a missing, unknown, repeated or unreadable key, a
        layout ParallelSpec rejects, or a ``dp`` that does not follow from the world size.
        """
        if not isinstance(text, str):
            raise PlanError(f"a plan string must be a str, not {type(text).__name__}.")
        text = text.strip()
        fmt = "<model>@<cluster>x<nodes>x<gpus_per_node>:key=value,..."
        head, colon, body = text.partition(":")
        if not colon:
            raise PlanError(f"plan string {text!r} has no ':' between the head and the fields.",
                            fix=f"write it as {fmt}.")
        model, at, where = head.partition("@")
        parts = where.rsplit("x", 2)
        if not at or len(parts) != 3 or not all(x.isdigit() for x in parts[1:]):
            raise PlanError(f"plan string head {head!r} is not <model>@<cluster>x<nodes>x<gpus_per_node>.",
                            fix=f"write it as {fmt}, e.g. gpt3_175b@dgx_a100x128x8:...")
        cluster, nodes, gpus = parts[0], int(parts[1]), int(parts[2])
        if body.startswith("zero="):  # a DeepSpeed plan string written before plans were one artifact
            return _legacy_deepspeed(model, cluster, nodes, gpus, _legacy_fields(body))
        values: dict[str, str] = {}
        for item in body.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise PlanError(f"plan string field {item!r} is not key=value.", fix=f"write it as {fmt}.")
            if key in values:
                raise PlanError(f"plan string repeats the key {key!r}.", fix="give every key once.")
            values[key] = value
        keys = _parallel_keys()
        by_key = {short: name for name, short in keys.items()}
        zero_by_key = {lk.key: name for name, lk in zero_keys().items()}
        deepspeed = values.get(_BACKEND_KEY) == BackendKind.deepspeed.value
        optional = {lk.key for lk in layout_keys().values() if lk.optional}
        _check_keys(values, required=[*(k for k in by_key if k not in optional), *_BATCH_KEYS, _PRECISION_KEY,
                                      *([_BACKEND_KEY, *zero_by_key] if deepspeed else [])],
                    optional=[_BACKEND_KEY, *optional], where="the plan string")
        zero = None
        if deepspeed:
            zero_hints = typing.get_type_hints(ZeroSpec)
            try:
                zero = ZeroSpec(**{name: _decode(name, zero_hints[name], values[key])
                                   for key, name in zero_by_key.items()})
            except ConfigError as err:
                raise PlanError(f"the plan string's ZeRO options are invalid: {err}") from err
        elif _BACKEND_KEY in values and values[_BACKEND_KEY] != BackendKind.megatron.value:
            raise PlanError(f"plan string backend={values[_BACKEND_KEY]!r} is not one of "
                            f"{[b.value for b in BackendKind]}.")
        hints = typing.get_type_hints(ParallelSpec)
        parallel_values = {name: _decode(name, hints[name], values[short]) for short, name in by_key.items()
                           if short in values}
        ints = {k: _decode_int(k, values[k]) for k in _BATCH_KEYS}
        try:
            parallel = ParallelSpec(**parallel_values)
        except ConfigError as err:
            raise PlanError(f"the plan string's layout is invalid: {err}") from err
        plan = cls(model=model, cluster=cluster, nodes=nodes, gpus_per_node=gpus, parallel=parallel,
                   micro_batch_size=ints["mb"], global_batch_size=ints["gbs"], seq_length=ints["seq"],
                   precision=values[_PRECISION_KEY],
                   backend_part=DeepSpeedPart(zero=zero) if zero is not None else MegatronPart())
        if ints["dp"] != plan.dp:
            raise PlanError(f"plan string says dp={ints['dp']} but world / (tp x cp x pp) = {plan.world_size} / "
                            f"{plan.parallel.tp * plan.parallel.cp * plan.parallel.pp} = {plan.dp}.",
                            fix=f"write dp={plan.dp} (data parallelism is what the other sizes leave).")
        return plan

    def plan_hash(self) -> str:
        """First 16 hex digits of the SHA-256 of :meth:`canonical`."""
        return hashlib.sha256(self.canonical().encode("utf-8")).hexdigest()[:16]

    # ----------------------------------------------------------------------------------------------------- JSON

    def to_json(self) -> dict[str, Any]:
        """The plan as a JSON-ready mapping: version, canonical string, hash, fingerprint, prediction, the fields,
        (for people; ignored on load) the derived world size, dp and micro-batch count, and the
        :func:`content_hash` of all of them."""
        out = {
            "schema_version": self.schema_version,
            "canonical": self.canonical(),
            "hash": self.plan_hash(),
            "inputs_fingerprint": self.inputs_fingerprint,
            "model": self.model,
            "cluster": self.cluster,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "parallel": json_plain(self.parallel),
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "seq_length": self.seq_length,
            "precision": self.precision,
            "backend": self.backend.value,
            "zero": None if self.zero is None else json_plain(self.zero),
            "prediction": None if self.predicted is None else self.predicted.to_json(),
            "world_size": self.world_size,
            "dp": self.dp,
            "num_microbatches": self.num_microbatches,
        }
        if self.requires:  # written only when there is something, so plans without requirements keep their files
            out["requires"] = list(self.requires)
        if self.schema_version >= 2:
            out["inputs"] = dict(self.job_inputs)
        return {**out, CONTENT_HASH_KEY: content_hash(out)}

    @classmethod
    def from_json(cls, d: Any) -> Plan:
        """Rebuild a plan from :meth:`to_json`'s mapping.

        Raises :class:`PlanError` when the schema version is missing or newer than this code reads, a key is
        missing or unknown, a value is invalid, or the stored hash/canonical string differs from the fields (the
        file was edited by hand).
        """
        if not isinstance(d, dict):
            raise PlanError(f"plan.json must hold a JSON object, not {type(d).__name__}.",
                            fix="re-plan to write a fresh plan.json.")
        if isinstance(d.get("plan"), dict) and "zero_stage" in d["plan"]:  # an earlier DeepSpeed run's zero_plan.json
            return _legacy_zero_plan_json(d)
        version = d.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise PlanError(f"plan.json has no valid schema_version (got {version!r}).",
                            fix="re-plan to write a fresh plan.json.")
        if version > SCHEMA_VERSION:
            raise PlanError(f"plan.json has schema_version {version}; this cfp-megatron reads versions 1 to "
                            f"{SCHEMA_VERSION} (the file was written by a newer cfp-megatron).",
                            fix="upgrade cfp-megatron to the version that wrote it, or re-plan with this one.")
        if version >= CONTENT_HASH_SINCE and CONTENT_HASH_KEY not in d:
            raise PlanError(f"plan.json (schema_version {version}) has no {CONTENT_HASH_KEY}: every plan.json of "
                            f"this version is written with one, so it was removed (a hand edit), and the "
                            "prediction, fingerprint and inputs cannot be trusted.",
                            fix="re-plan to write a fresh plan.json, or pin the layout you want with "
                                "cfp.<knob>=... or parallel.<knob>=... instead of editing the file.")
        fields = ["model", "cluster", "nodes", "gpus_per_node", "parallel", "micro_batch_size", "global_batch_size",
                  "seq_length", "precision"]
        _check_keys(d, required=["schema_version", "canonical", "hash", *fields],
                    optional=["inputs_fingerprint", "prediction", "world_size", "dp", "num_microbatches",
                              "backend", "zero", CONTENT_HASH_KEY, "requires",
                              *(["inputs"] if version >= 2 else [])], where=f"plan.json (schema_version {version})")
        parallel = _parallel_from_json(d["parallel"])
        zero = None if d.get("zero") is None else _spec_from_json(ZeroSpec, d["zero"], "zero", what="ZeRO options")
        try:
            backend = BackendKind(d.get("backend", BackendKind.megatron.value))
            part = backend_part(backend, zero)
        except (ConfigError, TypeError, ValueError) as err:
            raise PlanError(f"plan.json's backend or ZeRO options are invalid: {err}",
                            fix="re-plan to write a fresh plan.json.") from err
        prediction = d.get("prediction")
        plan = cls(schema_version=version, model=d["model"], cluster=d["cluster"], nodes=d["nodes"],
                   gpus_per_node=d["gpus_per_node"], parallel=parallel, micro_batch_size=d["micro_batch_size"],
                   global_batch_size=d["global_batch_size"], seq_length=d["seq_length"], precision=d["precision"],
                   backend_part=part,
                   predicted=None if prediction is None else PlanPrediction.from_json(prediction),
                   inputs_fingerprint=d.get("inputs_fingerprint", ""),
                   requires=_requires_from_json(d.get("requires")),
                   job_inputs=_inputs_from_json(d.get("inputs", {})))
        stored, actual = d["hash"], plan.plan_hash()
        if stored != actual or d["canonical"] != plan.canonical():
            raise PlanError(f"plan.json was edited: hash mismatch (stored hash {stored!r}, canonical "
                            f"{d['canonical']!r}; the fields give {actual!r}, {plan.canonical()!r}). A hand edit, "
                            "or a file written by a cfp-megatron with other layout fields, causes this.",
                            fix="re-plan to write a fresh plan.json, or pin the layout you want with cfp.<knob>=... "
                                "or parallel.<knob>=... instead of editing the file.")
        # Required since schema version 2; a version-1 file from before the prediction was hashed has none and is
        # read with its prediction range-checked only (docs/plan.md).
        if CONTENT_HASH_KEY in d:
            stored = d[CONTENT_HASH_KEY]
            actual = content_hash({k: v for k, v in d.items() if k != CONTENT_HASH_KEY})
            if stored != actual:
                raise PlanError(f"plan.json was edited: content hash mismatch (the fields, prediction and "
                                f"fingerprint give {CONTENT_HASH_KEY} {actual!r}, the file stores {stored!r}). A "
                                "hand edit or a damaged file causes this.",
                                fix="re-plan to write a fresh plan.json, or pin the layout you want with "
                                    "cfp.<knob>=... or parallel.<knob>=... instead of editing the file.")
        return plan


# ------------------------------------------------------------------------------------------------------- files

CONTENT_HASH_KEY = "content_hash"
"""plan.json's key of :func:`content_hash` (absent in files written before predictions were hashed)."""


def content_hash(content: dict[str, Any]) -> str:
    """First 16 hex digits of the SHA-256 of ``content`` (plan.json's mapping without :data:`CONTENT_HASH_KEY`) as
    sorted, compact JSON: every field, the prediction and the inputs' fingerprint, so an edit of any is caught."""
    text = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def save_plan(plan: Plan, path: str | os.PathLike[str], *, key: str = PLAN_FILE_SETTING) -> Path:
    """Write ``plan.to_json()`` to ``path`` atomically and return the path. An existing file is never overwritten:
    :class:`PlanError` names ``cfp.plan_file``, the path and the fix; a disk that refuses the write is a
    :class:`~cfp_megatron.base.files.FileWriteError` naming ``key`` (the setting or option that chose the path)."""
    try:
        return write_new(path, json.dumps(plan.to_json(), indent=2) + "\n", key=key)
    except FileExistsError:
        raise PlanError(f"{path} already exists; an existing plan file is never overwritten.",
                        fix=f"choose another path with {PLAN_FILE_SETTING}=..., or remove {path} first.",
                        setting=PLAN_FILE_SETTING) from None


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan written by :func:`save_plan`; :class:`PlanError` for a missing file, invalid JSON, or any
    problem :meth:`Plan.from_json` finds."""
    source = Path(path)
    try:
        with open_regular(source, "r") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise PlanError(f"plan file {source} does not exist.",
                        fix="check the path, or plan first (+cfp=auto) to write one.") from None
    except IsADirectoryError:
        raise PlanError(f"plan file {source} is a directory.", fix="point at the plan.json inside it.") from None
    except NotRegularFileError as err:
        if source.is_dir():
            raise PlanError(f"plan file {source} is a directory.", fix="point at the plan.json inside it.") from None
        raise PlanError(f"plan file {err.strerror}", fix="point at a plan.json file the planner wrote (copy it out "
                        "of the pipe or device first).", setting=PLAN_FILE_SETTING) from None
    except UnicodeDecodeError as err:
        raise PlanError(f"plan file {source} is not a plan.json: not UTF-8 text (byte {err.start} is "
                        f"{err.object[err.start:err.start + 1]!r}); a binary or damaged file.",
                        fix="point at a plan.json the planner wrote, or re-plan to write a fresh one.") from None
    except OSError as err:
        raise PlanError(f"plan file {source} cannot be read: {err.strerror or err}.",
                        fix="check the file's permissions.") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark an editor added: the content (and its hash) follows
    try:
        data = json_loads_unique(text)
    except DuplicateKeyError as err:
        raise PlanError(f"plan file {source} is ambiguous: {err}.",
                        fix=f"re-plan to write a fresh plan file (or keep one {err.key!r} and re-plan: a hand edit "
                            "also breaks the content hash).", setting=PLAN_FILE_SETTING) from None
    except json.JSONDecodeError as err:
        # the text ends inside the plan: at the failing position, or inside a string that runs to the end
        cut = text.strip() and not text.rstrip().endswith("}") and (
            err.pos >= len(text.rstrip()) or err.msg.startswith("Unterminated string"))
        end = "; it stops before the closing '}' (truncated?)" if cut else \
            "; more text follows the plan's closing '}'" if err.msg == "Extra data" else ""
        raise PlanError(f"plan file {source} is not valid JSON: {err.msg} at line {err.lineno} column "
                        f"{err.colno}{end}.", fix="re-plan to write a fresh plan file.") from None
    try:
        return Plan.from_json(data)
    except PlanError as err:
        if str(source) in str(err):
            raise
        raise PlanError(f"plan file {source}: {err.problem}", fix=err.fix, setting=err.setting) from None


# ----------------------------------------------------------------------------------------------- job inputs

_TRAIN_INPUTS: tuple[str, ...] = ("optimizer",)
"""``train`` fields a plan depends on and does not set (it sets the batch, the sequence and the precision)."""


def job_inputs(job: JobSpec) -> tuple[tuple[str, Any], ...]:
    """What a plan of ``job`` is made for and does not set itself: every ``model.*`` field and ``train.optimizer``,
    as ``(Hydra key, JSON value)`` pairs sorted by key (:attr:`Plan.job_inputs`)."""
    values = {f"model.{k}": v for k, v in json_plain(job.model).items()}
    values.update({f"train.{k}": json_plain(getattr(job.train, k)) for k in _TRAIN_INPUTS})
    return tuple(sorted(values.items()))


def _hydra_text(value: Any) -> str:
    """``value`` as it is typed on the command line."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def job_mismatches(plan: Plan, job: JobSpec, *, source: str = "the plan") -> list[ConfigIssue]:
    """One issue per setting of :attr:`Plan.job_inputs` whose value in ``job`` differs from the plan's (a key one of
    them lacks, from an older or newer cfp-megatron, is not compared); empty for a plan without inputs. ``source``
    names the plan in the problem."""
    current = dict(job_inputs(job))
    return [ConfigIssue(key=key, value=current[key],
                        problem=f"{source} was made for {key}={_hydra_text(planned)}, not {_hydra_text(current[key])}: "
                                "its layout, batch and memory were chosen for that job.",
                        fix=f"run the plan with {key}={_hydra_text(planned)}, or plan again for this job (+cfp=auto, "
                            "or python -m cfp_megatron.plan with the same settings).")
            for key, planned in plan.job_inputs if key in current and current[key] != planned]


def _requires_from_json(value: Any) -> tuple[str, ...]:
    """:attr:`Plan.requires` from plan.json's ``requires`` list (absent: nothing)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PlanError(f"plan.json's requires={value!r} is not a list of strings.",
                        fix="re-plan to write a fresh plan.json.")
    return tuple(value)


def _inputs_from_json(value: Any) -> tuple[tuple[str, Any], ...]:
    """:attr:`Plan.job_inputs` from plan.json's ``inputs`` mapping."""
    if not isinstance(value, dict):
        raise PlanError(f"plan.json's inputs must be a mapping of settings, not {type(value).__name__}.",
                        fix="re-plan to write a fresh plan.json.")
    return tuple(sorted(value.items()))


# ----------------------------------------------------------------------------------------------------- helpers

_LEGACY_ZERO_PLAN_FIELDS = ("model", "cluster", "nodes", "gpus_per_node", "zero_stage", "micro_batch_size",
                            "global_batch_size", "seq_length", "activation_checkpointing", "offload_optimizer",
                            "offload_param", "bucket_elements", "precision")
"""The ``plan`` fields of an earlier DeepSpeed run's zero_plan.json (schema version 1 of that file)."""


def _legacy_zero_plan_json(d: dict[str, Any]) -> Plan:
    """The Plan of an earlier DeepSpeed run's zero_plan.json, checked as that file's version 1 was written: the
    schema version, the hash of its canonical string, and its fields against the string."""
    where = "zero_plan.json (a DeepSpeed plan file from before plan.json)"
    if d.get("schema_version") != 1 or isinstance(d.get("schema_version"), bool):
        raise PlanError(f"{where} has schema_version {d.get('schema_version')!r}; those files have version 1.",
                        fix="re-plan (+cfp=auto) to write a current plan.json.")
    _check_keys(d, required=["schema_version", "canonical", "hash", "plan"], optional=["predicted"], where=where)
    text = d["canonical"]
    actual = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16] if isinstance(text, str) else None
    if actual is None or d["hash"] != actual:
        raise PlanError(f"{where} was edited: hash mismatch (stored hash {d['hash']!r}; its canonical string "
                        f"{text!r} gives {actual!r}).", fix="re-plan (+cfp=auto) to write a fresh plan.json.")
    plan = Plan.parse(text)
    fields = d["plan"]
    _check_keys(fields, required=list(_LEGACY_ZERO_PLAN_FIELDS), where=f"{where}'s plan")
    string = {"model": plan.model, "cluster": plan.cluster, "nodes": plan.nodes, "gpus_per_node": plan.gpus_per_node,
              "zero_stage": plan.zero_stage, "micro_batch_size": plan.micro_batch_size,
              "global_batch_size": plan.global_batch_size, "seq_length": plan.seq_length,
              "activation_checkpointing": plan.activation_checkpointing,
              "offload_optimizer": plan.offload_optimizer, "offload_param": plan.offload_param,
              "bucket_elements": plan.bucket_elements, "precision": plan.precision}
    differ = {k: (fields[k], v) for k, v in string.items() if fields[k] != v or type(fields[k]) is not type(v)}
    if differ:
        said = ", ".join(f"{k}={a!r} (the string says {b!r})" for k, (a, b) in differ.items())
        raise PlanError(f"{where} was edited: its fields do not give its canonical string: {said}.",
                        fix="re-plan (+cfp=auto) to write a fresh plan.json.")
    predicted = d.get("predicted")
    return plan if predicted is None else dataclasses.replace(
        plan, predicted=PlanPrediction.from_json({"bubble_fraction": 0.0, **predicted}))


_LEGACY_DEEPSPEED_KEYS = ("zero", "dp", "mb", "ga", "gbs", "seq", "ckpt", "oopt", "oparam", "bucket", "prec")
"""The keys of a DeepSpeed plan string from before DeepSpeed plans were Plans (``zero=2,dp=4,...,prec=fp32``)."""


def _legacy_fields(body: str) -> dict[str, str]:
    fields = dict(part.partition("=")[::2] for part in body.split(","))
    if sorted(fields) != sorted(_LEGACY_DEEPSPEED_KEYS):
        raise PlanError(f"the DeepSpeed plan string {body!r} does not have the keys {list(_LEGACY_DEEPSPEED_KEYS)}.",
                        fix="re-plan (+cfp=auto) to get a current plan string.", setting="cfp.plan")
    return fields


def _legacy_deepspeed(model: str, cluster: str, nodes: int, gpus: int, fields: dict[str, str]) -> Plan:
    """The Plan of an earlier DeepSpeed plan string (its canonical string, and so its hash, is the current form)."""
    try:
        ints = {k: int(v) for k, v in fields.items() if k != "prec"}
        zero = ZeroSpec(stage=ints["zero"], offload_optimizer=bool(ints["oopt"]), offload_param=bool(ints["oparam"]),
                        bucket_elements=ints["bucket"])
    except (ValueError, ConfigError) as err:
        raise PlanError(f"the DeepSpeed plan string's values are invalid: {err}", setting="cfp.plan") from err
    parallel = ParallelSpec(recompute=Recompute.full if ints["ckpt"] else Recompute.none,
                            distributed_optimizer=zero.stage >= 1)
    plan = Plan(model=model, cluster=cluster, nodes=nodes, gpus_per_node=gpus, parallel=parallel,
                micro_batch_size=ints["mb"], global_batch_size=ints["gbs"], seq_length=ints["seq"],
                precision=fields["prec"], backend_part=DeepSpeedPart(zero=zero))
    if plan.dp != ints["dp"] or plan.num_microbatches != ints["ga"]:
        raise PlanError(f"dp={ints['dp']} and ga={ints['ga']} do not follow from the string's sizes "
                        f"(dp={plan.dp}, ga={plan.num_microbatches}).", fix="re-plan, or correct the string.",
                        setting="cfp.plan")
    return plan



def _parallel_keys() -> dict[str, str]:
    """ParallelSpec field name -> canonical key (:class:`~cfp_megatron.base.config.LayoutKey`), in canonical order;
    a key given twice, or one the batch or precision use, is a :class:`PlanError`."""
    keys = {name: lk.key for name, lk in layout_keys().items()}
    reserved = {*_BATCH_KEYS, _PRECISION_KEY}
    clashes = sorted(set(keys.values()) & reserved) + sorted(
        {k for k in keys.values() if list(keys.values()).count(k) > 1})
    if clashes:
        raise PlanError(f"ParallelSpec fields give the canonical keys {clashes} twice.",
                        fix="give the new field a distinct key in its layout_field(key=...).")
    return keys


def _encode(name: str, value: Any) -> str:
    """A ParallelSpec value as the canonical string writes it."""
    if value is None:
        one = layout_keys()[name].none_means
        return "null" if one is None else str(one)
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, enum.Enum):
        value = value.value
    if not isinstance(value, int | float | str):
        raise PlanError(f"parallel.{name}={value!r} has a type the canonical string cannot write.",
                        fix="extend cfp_megatron.plan.artifact._encode/_decode for it.")
    text = str(value)
    if not text or _SEPARATORS & set(text) or text == "null":
        raise PlanError(f"parallel.{name}={value!r} cannot be written in the canonical string (empty, 'null', or it "
                        "contains one of , = : @ or a space).", fix=f"use a plainer value for parallel.{name}.")
    return text


def _decode(name: str, hint: Any, text: str) -> Any:
    """Read one ParallelSpec value written by :func:`_encode`, by the field's type hint."""
    args = typing.get_args(hint)
    optional = type(None) in args
    kinds = [a for a in args if a is not type(None)] if args else [hint]
    if optional and text == "null":
        return None
    if len(kinds) != 1:
        raise PlanError(f"parallel.{name} has a type ({hint}) the canonical string cannot read.",
                        fix="extend cfp_megatron.plan.artifact._decode for it.")
    kind = kinds[0]
    where = f"plan string value parallel.{name}={text!r}"
    if kind is bool:
        if text not in ("0", "1"):
            raise PlanError(f"{where} must be 1 or 0.")
        return text == "1"
    if kind is int:
        value: Any = _decode_int(name, text)
    elif kind is float:
        try:
            value = float(text)
        except ValueError:
            raise PlanError(f"{where} is not a number.") from None
    elif kind is str:
        value = text
    elif isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            value = kind(text)
        except ValueError:
            raise PlanError(f"{where} is not one of {[m.value for m in kind]}.") from None
    else:
        raise PlanError(f"parallel.{name} has a type ({hint}) the canonical string cannot read.",
                        fix="extend cfp_megatron.plan.artifact._decode for it.")
    if optional and value == layout_keys()[name].none_means:
        return None
    return value


def _decode_int(key: str, text: str) -> int:
    """An integer field of the canonical string."""
    if not re.fullmatch(r"-?\d+", text):
        raise PlanError(f"plan string value {key}={text!r} is not an integer.")
    return int(text)


def _parallel_from_json(d: Any) -> ParallelSpec:
    """ParallelSpec from plan.json's ``parallel`` mapping (:func:`_spec_from_json`); fields missing from the file
    take their defaults."""
    return _spec_from_json(ParallelSpec, d, "parallel", what="parallel layout")


def _spec_from_json(cls: type, d: Any, name: str, *, what: str) -> Any:
    """The spec ``cls`` from plan.json's mapping ``name``: a mapping whose every value has its field's JSON type
    (:func:`~cfp_megatron.base.jsonio.json_type_problem`: ``"tp": true`` or ``"tp": "2"`` is refused by name, not
    read as a number), then the config loader's own conversion (enums from their values, unknown keys refused)."""
    if not isinstance(d, dict):
        raise PlanError(f"plan.json's {name} must be a mapping, not {type(d).__name__}.",
                        fix="re-plan to write a fresh plan.json.")
    hints = typing.get_type_hints(cls)
    wrong = [f"{name}.{key}={value!r} must be {kind}" for key, value in d.items()
             if key in hints and (kind := json_type_problem(hints[key], value)) is not None]
    if wrong:
        raise PlanError(f"plan.json's {what} is invalid: " + "; ".join(wrong) + ".",
                        fix="re-plan to write a fresh plan.json.")
    try:
        return build_spec(cls, d)
    except (ConfigError, TypeError, ValueError) as err:
        raise PlanError(f"plan.json's {what} is invalid: {err}", fix="re-plan to write a fresh plan.json.") from err


def _check_keys(d: dict[str, Any], *, required: list[str], where: str, optional: list[str] | None = None) -> None:
    """Raise :class:`PlanError` naming missing and unknown keys of ``d``."""
    known = set(required) | set(optional or [])
    missing = [k for k in required if k not in d]
    unknown = sorted(k for k in d if k not in known)
    problems = []
    if missing:
        problems.append(f"{where} lacks {missing}.")
    if unknown:
        problems.append(f"{where} has unknown keys {unknown} (known: {sorted(known)}).")
    if problems:
        raise PlanError(" ".join(problems), fix="write it with Plan.canonical()/save_plan, or re-plan.")
