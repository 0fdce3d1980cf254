"""A DeepSpeed plan: the ZeRO stage, micro-batch and gradient accumulation, activation checkpointing and offload of
one job, with its canonical string, hash and JSON form, and the ``ds_config.json`` that runs it.

The canonical string (parses back with :meth:`ZeroPlan.parse`)::

    gpt_tiny@localx1x4:zero=2,dp=4,mb=2,ga=1,gbs=8,seq=64,ckpt=0,oopt=0,oparam=0,bucket=50000000,prec=fp32
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.base.config import JobSpec, LRSchedule, OptimizerKind, ParallelSpec, Precision, Recompute
from cfp_megatron.base.files import write_new
from cfp_megatron.plan.errors import PlanError

ZERO_SCHEMA_VERSION = 1
"""Version of zero_plan.json's layout."""

_LINE = re.compile(r"^(?P<model>[A-Za-z0-9_.+-]+)@(?P<cluster>[A-Za-z0-9_.+-]+)x(?P<nodes>\d+)x(?P<gpn>\d+):"
                   r"(?P<body>.+)$")
_KEYS = ("zero", "dp", "mb", "ga", "gbs", "seq", "ckpt", "oopt", "oparam", "bucket", "prec")


@dataclass(frozen=True, kw_only=True)
class ZeroPrediction:
    """What the simulator predicted for a DeepSpeed plan (per optimizer step)."""

    step_time_s: float
    """Seconds per optimizer step."""
    peak_memory_gib: float
    """Peak device memory per rank in GiB."""
    tokens_per_s_per_gpu: float
    """Trained tokens per second per GPU."""
    mfu: float | None
    """Model FLOPs utilisation (0..1), ``None`` when the peak is unknown."""
    exposed_comm_s: float
    """ZeRO communication (and offload transfers) not hidden behind compute, per step."""


@dataclass(frozen=True, kw_only=True)
class ZeroPlan:
    """One DeepSpeed configuration of one job on one cluster shape (data parallel over every rank)."""

    model: str
    """Model preset name."""
    cluster: str
    """Cluster preset name."""
    nodes: int
    """Nodes."""
    gpus_per_node: int
    """Ranks per node; ``nodes x gpus_per_node`` is the data-parallel size."""
    zero_stage: int
    """ZeRO stage 0-3."""
    micro_batch_size: int
    """Sequences per forward/backward pass on one rank (``train_micro_batch_size_per_gpu``)."""
    global_batch_size: int
    """Sequences per optimizer step (``train_batch_size``)."""
    seq_length: int
    """Tokens per sequence."""
    activation_checkpointing: bool
    """Each transformer layer recomputed in the backward pass."""
    offload_optimizer: bool
    """Optimizer states and the step on the host (ZeRO-Offload)."""
    offload_param: bool
    """Parameters on the host, fetched per layer (stage 3)."""
    bucket_elements: int
    """Elements per reduce/all-gather/prefetch bucket."""
    precision: str
    """``fp32``, ``bf16`` or ``fp16`` (resolved)."""
    predicted: ZeroPrediction | None = None
    """The simulator's prediction (not part of the canonical string)."""

    def __post_init__(self) -> None:
        world = self.nodes * self.gpus_per_node
        if self.global_batch_size % (self.micro_batch_size * world):
            raise PlanError(f"train.global_batch_size={self.global_batch_size} is not a multiple of micro-batch "
                            f"{self.micro_batch_size} x {world} data-parallel ranks.",
                            fix="pick a micro-batch size that divides global batch / ranks.",
                            setting="train.global_batch_size")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero stage {self.zero_stage} is not 0-3.", fix="use 0, 1, 2 or 3.",
                            setting="backend.zero_stage")
        if self.offload_param and self.zero_stage != 3:
            raise PlanError("parameter offload needs ZeRO stage 3.", fix="use zero=3 or oparam=0.",
                            setting="backend.offload_param")
        if self.offload_optimizer and self.zero_stage == 0:
            raise PlanError("optimizer offload needs ZeRO stage 1-3.", fix="use zero>=1 or oopt=0.",
                            setting="backend.offload_optimizer")

    @property
    def dp(self) -> int:
        """Data-parallel size (every rank)."""
        return self.nodes * self.gpus_per_node

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-batches per rank per optimizer step."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def describe(self) -> str:
        """A short human label: ``zero2 mb2 ga1 ckpt offload=opt``."""
        offload = "+".join(n for n, on in (("opt", self.offload_optimizer), ("param", self.offload_param)) if on)
        return (f"zero{self.zero_stage} mb{self.micro_batch_size} ga{self.gradient_accumulation_steps}"
                f"{' ckpt' if self.activation_checkpointing else ''}{f' offload={offload}' if offload else ''}")

    def canonical(self) -> str:
        """The one-line canonical string (module docstring)."""
        values = (self.zero_stage, self.dp, self.micro_batch_size, self.gradient_accumulation_steps,
                  self.global_batch_size, self.seq_length, int(self.activation_checkpointing),
                  int(self.offload_optimizer), int(self.offload_param), self.bucket_elements, self.precision)
        body = ",".join(f"{k}={v}" for k, v in zip(_KEYS, values, strict=True))
        return f"{self.model}@{self.cluster}x{self.nodes}x{self.gpus_per_node}:{body}"

    def plan_hash(self) -> str:
        """SHA-256 of the canonical string, first 16 hex digits."""
        return hashlib.sha256(self.canonical().encode()).hexdigest()[:16]

    @classmethod
    def parse(cls, text: str) -> ZeroPlan:
        """The plan of a canonical string; :class:`PlanError` naming what is wrong otherwise."""
        match = _LINE.match(text.strip())
        if match is None:
            raise PlanError(f"{text!r} is not a DeepSpeed plan string.",
                            fix="use the form model@clusterxNODESxGPUS:zero=..,dp=..,... as zero_plan.json holds it.",
                            setting="cfp.plan")
        fields: dict[str, str] = {}
        for part in match["body"].split(","):
            key, sep, value = part.partition("=")
            if not sep or key not in _KEYS or key in fields:
                raise PlanError(f"{part!r} in the DeepSpeed plan string is not a known key=value.",
                                fix=f"keys are {', '.join(_KEYS)}.", setting="cfp.plan")
            fields[key] = value
        missing = [k for k in _KEYS if k not in fields]
        if missing:
            raise PlanError(f"the DeepSpeed plan string lacks {missing}.", fix=f"keys are {', '.join(_KEYS)}.",
                            setting="cfp.plan")
        try:
            ints = {k: int(fields[k]) for k in _KEYS if k != "prec"}
        except ValueError as err:
            raise PlanError(f"a value in the DeepSpeed plan string is not an integer ({err}).",
                            fix="write integers (booleans as 0/1).", setting="cfp.plan") from None
        plan = cls(model=match["model"], cluster=match["cluster"], nodes=int(match["nodes"]),
                   gpus_per_node=int(match["gpn"]), zero_stage=ints["zero"], micro_batch_size=ints["mb"],
                   global_batch_size=ints["gbs"], seq_length=ints["seq"], activation_checkpointing=bool(ints["ckpt"]),
                   offload_optimizer=bool(ints["oopt"]), offload_param=bool(ints["oparam"]),
                   bucket_elements=ints["bucket"], precision=fields["prec"])
        if plan.dp != ints["dp"] or plan.gradient_accumulation_steps != ints["ga"]:
            raise PlanError(f"dp={ints['dp']} and ga={ints['ga']} do not follow from the string's sizes "
                            f"(dp={plan.dp}, ga={plan.gradient_accumulation_steps}).",
                            fix="re-plan, or correct the string.", setting="cfp.plan")
        return plan

    @classmethod
    def from_job(cls, job: JobSpec, *, world: int, zero_stage: int, micro_batch: int, activation_checkpointing: bool,
                 offload_optimizer: bool, offload_param: bool, bucket_elements: int, precision: Precision,
                 predicted: ZeroPrediction | None = None) -> ZeroPlan:
        """The plan of ``job`` on ``world`` ranks with the given knobs."""
        gpn = job.cluster.gpus_per_node or max(world // max(job.cluster.nodes, 1), 1)
        nodes = max(world // gpn, 1)
        return cls(model=job.model.name, cluster=job.cluster.name, nodes=nodes, gpus_per_node=world // nodes,
                   zero_stage=zero_stage, micro_batch_size=micro_batch, global_batch_size=job.train.global_batch_size,
                   seq_length=job.train.seq_length, activation_checkpointing=activation_checkpointing,
                   offload_optimizer=offload_optimizer, offload_param=offload_param, bucket_elements=bucket_elements,
                   precision=precision.value, predicted=predicted)

    def to_json(self) -> dict[str, Any]:
        """zero_plan.json's content: schema version, canonical string, hash, fields, prediction."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "predicted"}
        return {"schema_version": ZERO_SCHEMA_VERSION, "canonical": self.canonical(), "hash": self.plan_hash(),
                "plan": fields,
                "predicted": None if self.predicted is None else dataclasses.asdict(self.predicted)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ZeroPlan:
        """Rebuild from :meth:`to_json`; a hand edit that breaks the string or hash is a :class:`PlanError`."""
        if not isinstance(data, dict) or data.get("schema_version") != ZERO_SCHEMA_VERSION:
            raise PlanError("zero_plan.json has no or another schema_version.", fix="re-plan to write a fresh one.",
                            setting="cfp.plan_file")
        try:
            predicted = None if data.get("predicted") is None else ZeroPrediction(**data["predicted"])
            plan = cls(**data["plan"], predicted=predicted)
        except TypeError as err:
            raise PlanError(f"zero_plan.json's fields do not match ({err}).", fix="re-plan to write a fresh one.",
                            setting="cfp.plan_file") from None
        if plan.canonical() != data.get("canonical") or plan.plan_hash() != data.get("hash"):
            raise PlanError("zero_plan.json's fields do not give its canonical string and hash (edited by hand?).",
                            fix="re-plan, or edit the canonical string and the fields alike.",
                            setting="cfp.plan_file")
        return plan


def ds_config(plan: ZeroPlan, job: JobSpec, *, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config that runs ``plan`` for ``job``: ``base`` (a user's config, copied) with the batch,
    ZeRO, offload, precision, clipping, optimizer and LR-schedule keys set. Keys of ``base`` the plan does not
    choose are kept; a user's own ``optimizer`` or ``scheduler`` section is kept as well."""
    t = job.train
    config = json.loads(json.dumps(base or {}))
    config.update({
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.gradient_accumulation_steps,
        "gradient_clipping": float(t.clip_grad),
        "bf16": {"enabled": plan.precision == "bf16"},
        "fp16": {"enabled": plan.precision == "fp16"},
        "steps_per_print": 10**9,  # the trainer logs each step itself
    })
    zero: dict[str, Any] = dict(config.get("zero_optimization") or {})
    zero = {k: v for k, v in zero.items() if v != "auto"}
    zero.update({"stage": plan.zero_stage, "reduce_bucket_size": plan.bucket_elements,
                 "allgather_bucket_size": plan.bucket_elements,
                 "overlap_comm": plan.zero_stage >= 2, "contiguous_gradients": plan.zero_stage >= 2})
    if plan.zero_stage == 3:
        zero.update({"stage3_prefetch_bucket_size": plan.bucket_elements,
                     "stage3_max_live_parameters": plan.bucket_elements * 2,
                     "stage3_param_persistence_threshold": 10_000})
    zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True} if plan.offload_optimizer else {"device": "none"}
    if plan.zero_stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True} if plan.offload_param else {"device": "none"}
    else:
        zero.pop("offload_param", None)
    config["zero_optimization"] = zero
    if "optimizer" not in config:
        kind = "AdamW" if t.optimizer is OptimizerKind.adam else "SGD"
        params: dict[str, Any] = {"lr": t.lr, "weight_decay": t.weight_decay}
        if t.optimizer is OptimizerKind.adam:
            params.update(betas=[t.adam_beta1, t.adam_beta2], eps=t.adam_eps)
            # torch's AdamW without the CPU/fused builds (ZeRO-Offload uses DeepSpeedCPUAdam whatever this says)
            params["torch_adam"] = not plan.offload_optimizer
        config["optimizer"] = {"type": kind, "params": params}
    if "scheduler" not in config:
        config["scheduler"] = _scheduler(job)
    return config


def _scheduler(job: JobSpec) -> dict[str, Any]:
    """DeepSpeed's LR schedule closest to ``train``'s: linear warm-up, then cosine, linear or constant."""
    t = job.train
    decay = max(t.lr_decay_steps or t.steps, t.warmup_steps + 1)
    if t.lr_schedule is LRSchedule.cosine:
        # DeepSpeed's cosine schedule needs a warm-up step: without warm-up it is one step at the full rate.
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": decay, "warmup_num_steps": max(t.warmup_steps, 1),
            "warmup_min_ratio": 0.0 if t.warmup_steps else 1.0,
            "warmup_type": "linear", "cos_min_ratio": t.min_lr / t.lr if t.lr else 0.0}}
    if t.lr_schedule is LRSchedule.linear:
        return {"type": "WarmupDecayLR", "params": {
            "total_num_steps": decay, "warmup_num_steps": t.warmup_steps, "warmup_min_lr": 0.0,
            "warmup_max_lr": t.lr, "warmup_type": "linear"}}
    return {"type": "WarmupLR", "params": {"warmup_num_steps": t.warmup_steps, "warmup_min_lr": 0.0,
                                           "warmup_max_lr": t.lr, "warmup_type": "linear"}}


def write_json_file(config: dict[str, Any], path: Path) -> Path:
    """Write ``config`` (ds_config.json, zero_plan.json) as JSON to ``path`` and return where it went. A file
    already there is never overwritten:
    one with the same content is reused, otherwise ``<stem>-<hash><suffix>`` next to it is written."""
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    path = Path(path)
    for target in (path, path.with_name(f"{path.stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
                                        f"{path.suffix}")):
        if target.exists() and target.read_text() == text:
            return target
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            return write_new(target, text)
        except FileExistsError:
            continue
    raise PlanError(f"{path} and its hashed sibling exist with other content.", fix="choose another run directory.",
                    setting="hydra.run.dir")


def model_job(plan: ZeroPlan, job: JobSpec) -> JobSpec:
    """``job`` as the Megatron-Core model under ``plan`` is built and simulated: no model parallelism (DeepSpeed's
    data parallelism spans every rank), the plan's micro-batch and global batch, and full per-layer recomputation
    where the plan checkpoints activations."""
    parallel = ParallelSpec(recompute=Recompute.full if plan.activation_checkpointing else Recompute.none,
                            recompute_num_layers=1, distributed_optimizer=plan.zero_stage >= 1)
    train = dataclasses.replace(job.train, micro_batch_size=plan.micro_batch_size,
                                global_batch_size=plan.global_batch_size, precision=Precision(plan.precision))
    return dataclasses.replace(job, parallel=parallel, train=train)
