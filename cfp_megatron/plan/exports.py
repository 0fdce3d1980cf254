"""A :class:`~cfp_megatron.plan.artifact.Plan` rendered for the tools that run it.

- :func:`megatron_lm_args`: the arguments of Megatron-LM's ``pretrain_gpt.py`` that reproduce the layout (flag names
  as in Megatron-LM's ``megatron/training/arguments.py``).
- :func:`deepspeed_config`: the batch, ZeRO and precision part of a DeepSpeed JSON config. The layout (TP, PP, CP,
  EP) is deliberately left out: DeepSpeed's config has no keys for it (it comes from the model's ``mpu``, i.e. the
  Megatron arguments above), and every key in the returned dict is one DeepSpeed reads.
- :func:`torchrun_command`: the exact shell command that trains the plan with this repository's ``launch/train.py``,
  as Hydra overrides covering every ``ParallelSpec`` field.

``auto`` precision means bf16 here (Megatron-LM and DeepSpeed runs are GPU runs, where the runtime resolves ``auto``
to bf16); the torchrun command passes ``auto`` through so the runtime resolves it itself.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import re
import shlex
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from cfp_megatron.base.config import (
    JobSpec,
    MlpPartition,
    MoeTokenPolicy,
    ParallelSpec,
    Precision,
    Recompute,
    layout_keys,
    recompute_modules,
    resolve_precision,
)
from cfp_megatron.base.files import write_atomic
from cfp_megatron.model.layer_spec import is_spec, load_target
from cfp_megatron.plan.artifact import PLAN_FILE_SETTING, Plan
from cfp_megatron.plan.backend_part import DeepSpeedPart
from cfp_megatron.plan.errors import PlanError

RDZV_PORT = 29500
"""Port of the c10d rendezvous endpoint in multi-node torchrun commands."""

_MEGATRON_ORDERS: dict[str, list[str]] = {
    "tp-cp-ep-dp-pp": [],
    "tp-cp-ep-pp-dp": ["--use-tp-pp-dp-mapping"],
}
"""Rank orders Megatron-LM's arguments can express, and the flags that select them."""

def _precision(plan: Plan) -> Precision:
    """The plan's precision of weights and activations with ``auto`` resolved to bf16 (GPU runs; FP8 and FP4 keep
    bf16 weights)."""
    return resolve_precision(plan.number_format.precision, on_gpu=True)


def megatron_lm_args(plan: Plan, *, num_layers: int | None = None) -> list[str]:
    """Megatron-LM ``pretrain_gpt.py`` arguments that reproduce the plan's layout, batch and precision.

    Each ParallelSpec field with a Megatron-LM flag in its :class:`~cfp_megatron.base.config.LayoutKey` is written
    from it (a switch for a bool, else the flag and the value); the pipeline split, recomputation, rank order and
    gradient precision by the rules below. With interleaving (vpp > 1) and ``num_layers`` (the model's layer count)
    given, the chunking is written as ``--num-layers-per-virtual-pipeline-stage``; without it, or with a first/last
    stage of its own size (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``), as
    ``--num-virtual-stages-per-pipeline-rank``; a custom layer's ``model.spec`` as ``--spec <module> <name>``.
    Model shape, data and optimizer arguments are not included. Raises
    :class:`PlanError` for what Megatron-LM's arguments cannot express (PrimePar layers, a ``model.spec`` function, a
    rank order other than
    tp-cp-ep-dp-pp / tp-cp-ep-pp-dp, layers that do not split evenly).
    """
    p = plan.parallel
    if isinstance(plan.backend_part, DeepSpeedPart):
        raise PlanError(f"the plan is a {plan.backend.value} plan ({plan.describe()}); Megatron-LM's arguments do "
                        "not configure DeepSpeed's ZeRO.", fix="use its DeepSpeed config (deepspeed_config) and "
                        "torchrun command instead.", setting="backend")
    if p.mlp is not MlpPartition.megatron:
        raise PlanError(f"parallel.mlp={p.mlp.value}: Megatron-LM's pretrain_gpt.py has no PrimePar layers, so no "
                        "arguments of its reproduce this plan.",
                        fix="train it with the plan's torchrun command (launch/train.py builds PrimePar's MLP), or "
                            "plan with cfp.constraints.mlp=[megatron] for Megatron-LM.", setting="parallel.mlp")
    defaults = ParallelSpec()
    args: list[str] = []
    for name, lk in layout_keys().items():
        value = getattr(p, name)
        if lk.megatron is None:
            if value != getattr(defaults, name):
                raise PlanError(f"Megatron-LM has no argument for parallel.{name}={value!r}.",
                                fix="train it with the plan's torchrun command.", setting=f"parallel.{name}")
        elif lk.megatron == "":
            args += _MEGATRON_RULES[name](plan, num_layers)
        elif isinstance(value, bool):
            args += [lk.megatron] if value else []
        elif lk.optional and value == getattr(defaults, name):
            continue  # an option added later, at its default: Megatron-LM's own default
        elif isinstance(value, enum.Enum):
            args += [lk.megatron, str(value.value)]
        else:  # explicit sizes (Megatron-LM's default expert TP is the TP size)
            args += [lk.megatron, str(lk.none_means if value is None else value)]
    args += ["--micro-batch-size", str(plan.micro_batch_size), "--global-batch-size", str(plan.global_batch_size),
             "--seq-length", str(plan.seq_length)]
    return args + _token_policy_args(plan) + _precision_args(plan) + _spec_args(plan)


def _custom_spec(plan: Plan) -> str | None:
    """The ``model.spec`` of the job the plan was made for (its custom decoder layer), ``None`` without one."""
    return dict(plan.job_inputs).get("model.spec")


def _spec_args(plan: Plan) -> list[str]:
    """Megatron-LM's ``--spec <module> <name>`` of a plan made for a custom layer (``model.spec``): Megatron-LM's
    ``pretrain_gpt.py`` passes the object it imports as the layer spec itself, so ``model.spec`` must name a
    ``ModuleSpec`` there; a function of the config has no Megatron-LM argument (:class:`PlanError`)."""
    value = _custom_spec(plan)
    if value is None:
        return []
    module, _, name = value.partition(":")
    if not is_spec(load_target(value)):
        raise PlanError(f"model.spec={value} names a function; Megatron-LM's --spec {module} {name} imports the "
                        "object it names and uses it as the layer spec itself.",
                        fix=f"define a module-level ModuleSpec of the layer in {module} and plan with model.spec="
                            f"{module}:<its name>, or train with the plan's torchrun command.", setting="model.spec")
    return ["--spec", module, name]


TOKEN_POLICY_KEYS = ("model.moe_expert_capacity_factor", "model.moe_pad_expert_input_to_capacity")
"""The job inputs that say how a MoE plan's experts take their tokens (dropless, token-drop, padded to capacity):
the plan was priced for them, so its exports carry them."""


def _token_policy(plan: Plan) -> dict[str, Any]:
    """The MoE token policy of the job the plan was made for (:data:`TOKEN_POLICY_KEYS` of its job inputs); empty
    for a dense model or a plan without job inputs."""
    inputs = dict(plan.job_inputs)
    if not inputs.get("model.num_experts"):
        return {}
    return {key: inputs[key] for key in TOKEN_POLICY_KEYS if key in inputs}


def with_searched_token_policy(plan: Plan, job: JobSpec, allowed: list[MoeTokenPolicy] | None) -> JobSpec:
    """``job`` with the MoE token policy ``plan`` was searched for, where the user let the search choose it from
    ``allowed`` (``cfp.constraints.moe_token_policy``) and it is one of them; else ``job`` as given (a plan for
    another policy is then refused by :meth:`Plan.apply` as made for another job)."""
    policy = _token_policy(plan)
    if allowed is None or not policy or not job.model.is_moe:
        return job
    model = dataclasses.replace(job.model, moe_expert_capacity_factor=policy.get(TOKEN_POLICY_KEYS[0]),
                                moe_pad_expert_input_to_capacity=bool(policy.get(TOKEN_POLICY_KEYS[1])))
    return dataclasses.replace(job, model=model) if MoeTokenPolicy.of(model) in allowed else job


def _token_policy_args(plan: Plan) -> list[str]:
    """Megatron-LM's ``--moe-expert-capacity-factor`` (and ``--moe-pad-expert-input-to-capacity``) of a token-drop
    plan; nothing for a dropless one (Megatron-LM's default)."""
    policy = _token_policy(plan)
    factor = policy.get("model.moe_expert_capacity_factor")
    if factor is None:
        return []
    pad = policy.get("model.moe_pad_expert_input_to_capacity")
    return ["--moe-expert-capacity-factor", str(factor)] + (["--moe-pad-expert-input-to-capacity"] if pad else [])


def _pipeline_split_args(plan: Plan, num_layers: int | None) -> list[str]:
    """The first/last stage's layers and the interleaving (see :func:`megatron_lm_args`); nothing with a per-stage
    layout (``--pipeline-model-parallel-layout``, written from its LayoutKey), from whose stage count Megatron-LM
    derives the virtual pipeline size and beside which it refuses the interleaving flags."""
    p = plan.parallel
    if p.pipeline_model_parallel_layout is not None:
        return []
    args: list[str] = []
    uneven = p.pp > 1 and (p.first_stage_layers is not None or p.last_stage_layers is not None)
    if uneven and p.first_stage_layers is not None:
        args += ["--decoder-first-pipeline-num-layers", str(p.first_stage_layers)]
    if uneven and p.last_stage_layers is not None:
        args += ["--decoder-last-pipeline-num-layers", str(p.last_stage_layers)]
    if p.virtual_stages > 1:
        if num_layers is not None and not uneven:
            chunks = p.pp * p.virtual_stages
            if num_layers < 1 or num_layers % chunks:
                raise PlanError(f"num_layers={num_layers} does not split into pp x vpp = {p.pp} x "
                                f"{p.virtual_stages} = {chunks} equal model chunks.",
                                fix="pass the model's layer count, or plan a vpp that divides it.",
                                setting="parallel.vpp")
            args += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // chunks)]
        else:
            args += ["--num-virtual-stages-per-pipeline-rank", str(p.virtual_stages)]
    return args


def _recompute_args(plan: Plan, num_layers: int | None) -> list[str]:
    """Recompute granularity, method and layer count."""
    p = plan.parallel
    if p.recompute is Recompute.selective:
        return ["--recompute-granularity", "selective", "--recompute-modules",
                *(m.value for m in recompute_modules(p.recompute_modules))]
    if p.recompute is Recompute.full:
        return ["--recompute-granularity", "full", "--recompute-method", p.recompute_method.value,
                "--recompute-num-layers", str(p.recompute_num_layers)]
    return []


def _order_args(plan: Plan, num_layers: int | None) -> list[str]:
    """The flag that selects the plan's rank order."""
    order = plan.parallel.order
    if order not in _MEGATRON_ORDERS:
        raise PlanError(f"Megatron-LM's arguments cannot express the rank order {order!r}.",
                        fix=f"use one of {sorted(_MEGATRON_ORDERS)}.", setting="parallel.order")
    return _MEGATRON_ORDERS[order]


def _precision_args(plan: Plan) -> list[str]:
    """``--bf16`` / ``--fp16`` and, for fp16, fp32 gradient reduction (bf16 always reduces in fp32); under FP8 and
    FP4 also the format and recipe (``--fp8-format hybrid --fp8-recipe delayed``, ``--fp4-format e2m1 --fp4-recipe
    nvfp4``: :meth:`~cfp_megatron.base.number_format.NumberFormat.megatron_args`)."""
    p, precision = plan.parallel, _precision(plan)
    if precision is Precision.bf16:
        if not p.grad_reduce_in_fp32:
            raise PlanError("parallel.grad_reduce_in_fp32=false with bf16: Megatron-LM's arguments cannot express it "
                            "(pretrain_gpt.py always accumulates and reduces bf16 gradients in fp32).",
                            fix="train it with the plan's torchrun command (launch/train.py passes it to Megatron-"
                                "Core's DistributedDataParallelConfig), or plan with parallel.grad_reduce_in_fp32="
                                "true for Megatron-LM.", setting="parallel.grad_reduce_in_fp32")
        reuse = plan.number_format.param_fields(p.fp8_param_gather)["reuse_grad_buf_for_mxfp8_param_ag"]
        return ["--bf16", *plan.number_format.megatron_args(),
                *(["--reuse-grad-buf-for-mxfp8-param-ag"] if reuse else [])]  # MXFP8 parameters (fp8_param_gather)
    if precision is Precision.fp16:
        return ["--fp16"] + (["--accumulate-allreduce-grads-in-fp32"] if p.grad_reduce_in_fp32 else [])
    return []


_MEGATRON_RULES: dict[str, Callable[[Plan, int | None], list[str]]] = {
    "vpp": _pipeline_split_args,
    "first_stage_layers": lambda plan, num_layers: [],  # written with vpp (the split decides how vpp is written)
    "last_stage_layers": lambda plan, num_layers: [],
    "recompute": _recompute_args,
    "recompute_num_layers": lambda plan, num_layers: [],  # written with recompute
    "recompute_modules": lambda plan, num_layers: [],  # written with recompute
    "recompute_method": lambda plan, num_layers: [],
    "order": _order_args,
    "grad_reduce_in_fp32": lambda plan, num_layers: [],  # written with the precision
    # Megatron-LM's switch and its layer count (its launch scripts pass both: --cpu-offloading
    # --cpu-offloading-num-layers N); Megatron-Core offloads activations, not weights, by default.
    "cpu_offloading_num_layers": lambda plan, num_layers: (
        ["--cpu-offloading", "--cpu-offloading-num-layers", str(plan.parallel.cpu_offloading_num_layers)]
        if plan.parallel.cpu_offloading_num_layers else []),
    "cuda_graph_scope": lambda plan, num_layers: (["--cuda-graph-scope", *plan.parallel.graph_scopes()]
                                                  if plan.parallel.cuda_graph_scope is not None else []),
    # Transformer Engine's bf16 layers at the stack's ends: Megatron-LM's switch and both counts (its counts default
    # to 1 under the switch, so both are written).
    "num_layers_at_start_in_bf16": lambda plan, num_layers: (
        ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(plan.parallel.num_layers_at_start_in_bf16),
         "--num-layers-at-end-in-bf16", str(plan.parallel.num_layers_at_end_in_bf16)]
        if plan.parallel.num_layers_at_start_in_bf16 or plan.parallel.num_layers_at_end_in_bf16 else []),
    "num_layers_at_end_in_bf16": lambda plan, num_layers: [],  # written with num_layers_at_start_in_bf16
    # Megatron-FSDP's switch and its strategy (and the checkpoint format Megatron-LM requires with it).
    "fsdp": lambda plan, num_layers: (
        ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", plan.parallel.fsdp.value,
         "--ckpt-format", "fsdp_dtensor"] if plan.parallel.fsdp.value != "none" else []),
    "dp_shard_size": lambda plan, num_layers: (
        ["--num-distributed-optimizer-instances", str(plan.dp * plan.parallel.cp // plan.parallel.dp_shard_size)]
        if plan.parallel.dp_shard_size is not None else []),
}
"""How the ParallelSpec fields whose LayoutKey says ``megatron=""`` become Megatron-LM arguments."""


def deepspeed_config(plan: Plan, *, gradient_clipping: float = 1.0) -> dict[str, Any]:
    """The batch, ZeRO and precision keys of a DeepSpeed config for the plan.

    ``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp`` holds by construction
    (dp = world / (tp x cp x pp), the data-parallel size DeepSpeed sees under model parallelism). A DeepSpeed plan
    gives its ZeRO stage, buckets and offload; a Megatron plan ZeRO stage 1 with the distributed optimizer, else 0.
    The parallel layout is not in the dict (see the module docstring).
    """
    if gradient_clipping < 0:
        raise PlanError(f"gradient_clipping={gradient_clipping} must not be negative.",
                        fix="use 0 to disable clipping.", setting="train.clip_grad")
    precision = _precision(plan)
    return {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_microbatches,
        "zero_optimization": _zero_section(plan),
        "bf16": {"enabled": precision is Precision.bf16},
        "fp16": {"enabled": precision is Precision.fp16},
        "gradient_clipping": float(gradient_clipping),
    }


ZERO3_PERSISTENCE_THRESHOLD = 10_000
"""``stage3_param_persistence_threshold`` of an exported ZeRO-3 config: parameters of at most this many elements
stay whole on every rank. Below DeepSpeed's default (100,000, :data:`~cfp_megatron.backends.deepspeed.hook_config.
DEEPSPEED_PERSISTENCE_THRESHOLD`) so that the linears of small models (``gpt_tiny``'s 64 x 192 QKV weight, 12,288
elements) are partitioned as the ZeRO-3 memory model counts them; on models of hidden size 1024 and more both keep
the same parameters whole (norms and biases). The ZeRO-3 cost model counts its fetches with this figure
(:func:`~cfp_megatron.backends.deepspeed.costs.zero3_fetches`)."""


def _zero_section(plan: Plan) -> dict[str, Any]:
    """``zero_optimization``: the stage, and for a DeepSpeed plan its buckets, overlap and offload devices."""
    stage = plan.zero_stage
    if not isinstance(plan.backend_part, DeepSpeedPart):
        return {"stage": stage}
    bucket = plan.bucket_elements
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket,
                            "overlap_comm": stage >= 2, "contiguous_gradients": stage >= 2}
    if stage == 3:
        zero.update({"stage3_prefetch_bucket_size": bucket, "stage3_max_live_parameters": bucket * 2,
                     "stage3_param_persistence_threshold": ZERO3_PERSISTENCE_THRESHOLD,
                     "offload_param": {"device": "cpu", "pin_memory": True} if plan.offload_param
                     else {"device": "none"}})
    zero["offload_optimizer"] = ({"device": "cpu", "pin_memory": True} if plan.offload_optimizer
                                 else {"device": "none"})
    return zero


_HYDRA_QUOTED = re.compile(r"[()\[\]{}',=\"\\\s]")
"""Characters Hydra's override grammar reads only inside a quoted value (a pipeline layout's groups, ``(tt|)*30``)."""


def _hydra_value(value: Any) -> str:
    """A value in Hydra's override syntax (a string with parentheses or other grammar characters double-quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, str) and _HYDRA_QUOTED.search(value):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


def hydra_overrides(plan: Plan) -> list[str]:
    """The Hydra overrides of :func:`torchrun_command`: presets, cluster size, every ParallelSpec field, a MoE
    model's token policy, a custom layer's ``model.spec``, batch, sequence length and precision."""
    overrides = [f"model={plan.model}", f"cluster={plan.cluster}", f"cluster.nodes={plan.nodes}",
                 f"cluster.gpus_per_node={plan.gpus_per_node}"]
    if isinstance(plan.backend_part, DeepSpeedPart):  # data parallel: its knobs are the backend group's
        overrides += [f"backend={plan.backend.value}", f"backend.zero_stage={plan.zero_stage}",
                      f"backend.activation_checkpointing={_hydra_value(plan.activation_checkpointing)}",
                      f"backend.offload_optimizer={_hydra_value(plan.offload_optimizer)}",
                      f"backend.offload_param={_hydra_value(plan.offload_param)}",
                      f"backend.bucket_elements={plan.bucket_elements}"]
    else:
        overrides += [f"parallel.{f.name}={_hydra_value(getattr(plan.parallel, f.name))}"
                      for f in dataclasses.fields(plan.parallel)]
    overrides += [f"{key}={_hydra_value(value)}" for key, value in _token_policy(plan).items()]
    spec = _custom_spec(plan)
    overrides += [f"model.spec={spec}"] if spec is not None else []
    overrides += [f"train.micro_batch_size={plan.micro_batch_size}",
                  f"train.global_batch_size={plan.global_batch_size}",
                  f"train.seq_length={plan.seq_length}", *plan.number_format.overrides()]
    return overrides


def torchrun_command(plan: Plan, *, script: str = "launch/train.py") -> str:
    """The shell command that trains the plan: ``torchrun --nnodes=N --nproc_per_node=G [rendezvous] script
    overrides...``. With more than one node it adds ``--rdzv_backend=c10d --rdzv_endpoint=$MASTER_ADDR:29500`` (run
    the same command on every node with ``MASTER_ADDR`` set to the first node)."""
    parts = ["torchrun", f"--nnodes={plan.nodes}", f"--nproc_per_node={plan.gpus_per_node}"]
    if plan.nodes > 1:
        parts += ["--rdzv_backend=c10d", f"--rdzv_endpoint=$MASTER_ADDR:{RDZV_PORT}"]
    parts.append(shlex.quote(script))
    parts += [shlex.quote(o) for o in hydra_overrides(plan)]
    return " ".join(parts)


EXPORTS_MANIFEST = ".cfp-exports.json"
"""File beside the exports recording what cfp-megatron wrote there (name -> content digests): an export it lists
unchanged is its own and is replaced by the next plan's; any other file of an export's name is never written over."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _written_before(folder: Path) -> dict[str, list[str]]:
    """The :data:`EXPORTS_MANIFEST` of ``folder`` (export name -> digests of what cfp-megatron wrote); empty when
    there is none or it cannot be read (then no file there counts as cfp-megatron's)."""
    try:
        files = json.loads((folder / EXPORTS_MANIFEST).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(files, dict):
        return {}
    return {name: [d for d in digests if isinstance(d, str)] for name, digests in files.items()
            if isinstance(name, str) and isinstance(digests, list)}


def check_exports(folder: str | os.PathLike[str], texts: Mapping[str, str]) -> None:
    """Raise :class:`PlanError` naming every file of ``folder`` that writing ``texts`` (export file name ->
    content) would overwrite although cfp-megatron did not write it there (a file of yours, an export of an older
    cfp-megatron, one edited since); exports of an earlier plan that it did write, and files with the very content,
    pass."""
    where = Path(folder)
    before = _written_before(where)
    clashes = []
    for name, text in texts.items():
        path = where / name
        if path.is_dir():
            clashes.append(f"{path} is a folder")
            continue
        if not path.exists():
            continue
        try:
            current = path.read_bytes()
        except OSError as err:
            clashes.append(f"{path} cannot be read ({err.strerror or err})")
            continue
        if current != text.encode("utf-8") and _digest(current) not in before.get(name, ()):
            clashes.append(f"{path} differs from this plan's and was not written by cfp-megatron for an earlier "
                           "plan (or was edited since)")
    if clashes:
        raise PlanError(f"the plan's exports ({', '.join(texts)}) are written beside the plan file, and "
                        + "; ".join(clashes) + ": writing them would lose what is there.",
                        fix=f"move those files away, or write the plan into another folder ({PLAN_FILE_SETTING}="
                            "<folder>/plan.json, or --out).", setting=PLAN_FILE_SETTING)


def write_exports(folder: str | os.PathLike[str], texts: Mapping[str, str], *, plan: Plan,
                  key: str = PLAN_FILE_SETTING) -> list[Path]:
    """Write the exports ``texts`` (file name -> content) of ``plan`` into ``folder`` together: each one replaces
    the export of an earlier plan there (none stays beside a new plan.json), and :data:`EXPORTS_MANIFEST` records
    them; nothing is written when :func:`check_exports` refuses a file there. Returns the paths written. Each file
    is written atomically; a disk that refuses one is a :class:`~cfp_megatron.base.files.FileWriteError` naming
    ``key`` (the setting or option that chose the folder)."""
    where = Path(folder)
    check_exports(where, texts)
    before = _written_before(where)
    new = {name: _digest(text.encode("utf-8")) for name, text in texts.items()}

    def manifest(files: Mapping[str, list[str]]) -> str:
        return json.dumps({"plan": plan.canonical(), "hash": plan.plan_hash(), "files": dict(files)}, indent=1)

    # The manifest names the old and the new contents while the files are replaced, so an interrupted write leaves
    # every file recognised as cfp-megatron's; then only the new ones.
    write_atomic(where / EXPORTS_MANIFEST, manifest({**before, **{n: sorted({*before.get(n, ()), d})
                                                                   for n, d in new.items()}}), key=key)
    paths = [write_atomic(where / name, text, key=key) for name, text in texts.items()]
    write_atomic(where / EXPORTS_MANIFEST, manifest({**before, **{n: [d] for n, d in new.items()}}), key=key)
    return paths
