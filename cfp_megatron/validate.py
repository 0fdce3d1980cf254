"""``python -m cfp_megatron.validate [FILE.csv ...]``: predict published training runs and report the error.

Reads rows of the schema of the published runs that ship with the package (one measured run per row: model shape,
GPUs, parallel layout, measured step time; without a file, those runs themselves:
``cfp_megatron/validation/published_runs/``, whose README names the sources), builds the plan of each row,
simulates it on the hardware preset of its GPU, and prints one line per row (id, model, layout, measured, predicted
step time, error, predicted peak memory), the rows it cannot model with the reason, the coverage (rows modelled of
the rows with a step time), the MAPE and largest error per
class (dense, MoE, CP, FSDP; GPU generation), the layout sweeps (one job's rows at several layouts: the pairs
ordered as measured and the regret of trusting the predicted favourite, :mod:`cfp_megatron.validation.sweeps`), and
last ``MAPE <x>% over <n> rows``. The measured step time is
``step_time_s``, else ``derived_step_time_s``, else global batch x sequence / (``tokens_per_s_per_gpu`` x GPUs).

What a blank or silent column means depends on what the row ran, and is data with its source, not code
(:mod:`cfp_megatron.validation.data`, docs/validation.md):

* ``cfp_megatron/validation/source_settings.yaml``, by the row's columns (its source, table and model): what its
  source states outside its tables (the run scripts it ships), read as the row's blank cells (SC21 Table 1's
  micro-batches and interleaved chunks, ``vp``) and in place of its framework's readings (SC21's data-parallel
  implementation and fp16 gradients); a cell the row states wins.
* ``cfp_megatron/validation/frameworks.yaml``, by the ``framework`` column (Megatron-DeepSpeed, Megatron-LM
  before 2023, Megatron-Bridge, NeMo, Megatron-Core, any other): what a blank ``sequence_parallel``,
  ``zero_or_fsdp`` and ``recompute`` mean, the attention kernel, gradient-reduce and TP-communication overlap, the
  gradients' precision, MTP layers, tied embeddings, DeepSpeed's engine (``ds`` in the layout column).
* ``cfp_megatron/validation/model_families.yaml``, by ``model`` / ``arch_source``: a blank ``vocab`` (51,200 for a
  model no family names) and ``kv_heads``, and what no column holds (Nemotron's dropout-free rotary layers, Qwen3's
  128-channel heads, MPT's ALiBi).
* ``cfp_megatron/validation/recipes.yaml``: Megatron-Bridge's performance presets by container release; a row
  whose release, model, GPU, layout and precision are a preset's runs its dispatcher (``flex`` in the layout column,
  ``flex=deepep`` / ``flex=hybridep`` where the preset's source names the backend),
  expert all-to-all overlap (``a2ao``), TP and gradient-reduce overlap and recomputation; Megatron-Bridge's dense
  Llama 3 70B presets on GB200, GB300 and B200: their activation offloading (``offload=<n>L``), unless the row
  states its recomputation.

The same for every row:

* ``ffn_hidden``: 4 x hidden; ``kv_heads``: one per head (unless the family fixes it). ``dp``: GPUs / (TP x PP x
  CP); ``cp``, ``ep``, ``vp``, ``micro_batch``: 1 (``micro_batch``: the rank's whole batch, global batch / DP, where the
  framework accumulates no gradients unless told and the row states no ``grad_accum`` nor a pipeline);
  ``global_batch_seqs``: micro-batch x DP x ``grad_accum`` when that is given. ``recompute``: none.
  ``precision``: 16-bit (bf16).
* ``interconnect``, ``pp_schedule``, ``precision`` and a power limit (:mod:`cfp_megatron.validation.columns`): the
  fabric (``cfp_megatron/cluster/fabrics.yaml``: kind, links per node, Gb/s per link) as the row's network, the
  schedule (``schedules.yaml``) as its model chunks, the precision variant (``precisions.yaml``); what the simulator
  prices only approximately or cannot read is listed per row, and the row stays in the figures.
* ``sequence_parallel`` with no framework reading: off, except where Megatron-Core requires it (MoE with TP).
  Stated: off where its first word says no (``no``, ``none``, ``off``, ``false``, ``0``), else on (a cell naming
  it in words, ``SequenceParallel norms``, states it); ``unknown`` or ``?``: as blank.
  ``zero_or_fsdp``: "distributed optimizer" turns it on; "FSDP"/"ZeRO-3" models fully sharded data parallelism.
* ``global_batch_seqs`` blank with one layer: a layer-level measurement (one forward and backward of the layer
  alone, no embedding, logits, optimizer or gradient sync).
* MLP: SwiGLU when ``ffn_hidden`` is not 4 x hidden or the model is MoE, else GELU (with dropout 0.1); positions
  rotary with SwiGLU (the LLaMA-family convention), learned with GELU (GPT-3's).
* A decoder whose layers do not split into ``pp x vp`` chunks while its layers plus two do: the embedding and the
  loss counted as layers of the split (``account_for_embedding/loss_in_pipeline_split``, as Megatron-Bridge's recipes
  run Qwen3-235B's 94 layers over 8 x 4 chunks). One that splits neither way: Megatron-Core's per-stage layout
  (``pipeline_model_parallel_layout``) counting the embedding, each MTP layer and the loss as a layer, spread evenly
  (:func:`~cfp_megatron.base.pipeline_layout.balanced_layout`; ``Et|(tt|)*30mL`` for DeepSeek-V3 at PP=8 x VP=4, the
  string Megatron-Bridge's 1,024-H100 recipe sets).
* MoE rows whose shape is that of a model preset in ``conf/model``: that preset's architecture, which no column
  states (:func:`~cfp_megatron.validation.defaults.preset_architecture`); the layout column shows ``as <preset>``.
* A power limit stated in the ``gpu`` column, or next to "power", "cap", "limit" or "TDP" in ``notes``,
  ``source_detail`` or ``other_measured``: ``cluster.power_limit_w`` (the layout column shows ``500W``), said as an
  approximation (the cap's clock is an upper bound); at or above the preset's TDP it changes nothing.
* ``tp``, ``pp`` blank where ``dp`` is given (SC21's Table 2): TP as wide as a node allows where it divides that size
  and the heads, PP the rest (:func:`unstated_split`); the layout column marks such rows with ``?``.
* A GPU no hardware preset names (``conf/cluster``, :func:`gpu_preset`), a row without a measured step time, and a
  layout that does not multiply out are listed as not modelled, with the reason.
* Rows it cannot model as they ran are refused with the reason and left out of the figures: a count that is not a
  whole number or is outside the training config's bounds (:func:`~cfp_megatron.validation.rows.count_cell`), a shape
  or layout the training config refuses (:func:`refusal`), an id given before, a blank id, a line whose fields do not
  match the header, a measured step time no GPU could have run
  (:func:`~cfp_megatron.validation.plausible.implausible_step_time`), a MoE row without its experts' fields or
  experts' fields without ``moe_experts`` (:func:`~cfp_megatron.validation.rows.experts_cell`), a predicted peak
  memory over :data:`MEMORY_REFUSE_FACTOR` times the GPU's; one above the GPU's
  memory but within that factor is kept and flagged. A row its own source re-measured
  (``cfp_megatron/validation/superseded.yaml``, :mod:`~cfp_megatron.validation.superseded`) is predicted and
  printed with the reason but set apart from the figures and the bands; the MAPE over all modelled rows is printed
  beside the last line's, which is over the rows kept. Exit status 0 when a row is modelled, 1 when none is, 2 for a
  file it cannot read or write (``--bands``, ``--plot``, ``--json``: written atomically,
  :mod:`cfp_megatron.base.files`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from cfp_megatron.base.compose import CONF_DIR
from cfp_megatron.base.config import JobSpec, Precision, job_from_config
from cfp_megatron.base.errors import CfpError, ConfigError
from cfp_megatron.base.files import FileWriteError, write_atomic
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.base.parallel_dims import data_parallel_size
from cfp_megatron.base.pipeline_layout import balanced_layout
from cfp_megatron.cluster.presets import known_gpus, preset_for_gpu
from cfp_megatron.sim.calibration import generation
from cfp_megatron.sim.options import SimOptions, WeightGradAccumulation
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.uncertainty import BAND_QUANTILE
from cfp_megatron.validation.bands import band_table, sources_problem
from cfp_megatron.validation.columns import (
    interconnect_reading,
    memory_reading,
    power_reading,
    precision_reading,
    preset_precision,
    schedule_reading,
)
from cfp_megatron.validation.data import Framework, ValidationData, ValidationDataError, load_data
from cfp_megatron.validation.defaults import (
    SHAPE_FIELDS,
    apex_adam_states,
    blank_reading,
    family_fields,
    layer_checkpoint_every,
    mtp_layers,
    performance_recipe,
    preset_architecture,
    row_framework,
    row_release,
    source_setting,
    stated_row,
)
from cfp_megatron.validation.memory_failures import memory_failure_lines
from cfp_megatron.validation.moe_routing import routing as moe_routing
from cfp_megatron.validation.outputs import (
    check_bands_path,
    check_json_path,
    check_plot_path,
    same_output_problem,
    write_plot,
)
from cfp_megatron.validation.plausible import implausible_step_time
from cfp_megatron.validation.report import (
    class_errors,
    has_step_time,
    report,
    row_classes,
    rows_by_id,
)
from cfp_megatron.validation.results import RowPlan, RowResult, mape
from cfp_megatron.validation.rows import (
    PUBLISHED_RUNS,
    PUBLISHED_RUNS_DIR,
    SCHEMA_FILE,
    CsvRow,
    InputFileError,
    RowError,
    count_cell,
    experts_cell,
    figure_cell,
    read_rows,
    unread_columns,
    where,
    yes_cell,
)
from cfp_megatron.validation.superseded import set_apart
from cfp_megatron.validation.sweeps import find_sweeps, sweep_lines

__all__ = ["CsvRow", "InputFileError", "RowError", "RowPlan", "RowResult", "check_bands_path", "check_json_path",
           "class_errors", "gpu_preset", "has_step_time", "load_preset", "main", "mape", "predict_rows", "read_rows",
           "row_classes", "row_plan", "unstated_split"]

CONF_CLUSTER = CONF_DIR / "cluster"
SETTING_COLUMNS = {**{f"model.{key}": column for column, key in SHAPE_FIELDS}, "model.ffn_hidden_size": "ffn_hidden",
                   "model.num_query_groups": "kv_heads", "train.seq_length": "seq_len",
                   "train.global_batch_size": "global_batch_seqs", "train.micro_batch_size": "micro_batch",
                   **{f"parallel.{key}": key for key in ("tp", "pp", "cp", "ep")}, "parallel.vpp": "vp",
                   "cluster.nodes": "num_gpus"}
"""The CSV column each training setting of a row's plan comes from, for the reason a row is refused."""


def refusal(err: ConfigError) -> str:
    """The reason a row whose plan the training config's checks refuse (:class:`ModelSpec`, :class:`ParallelDims`:
    the same rules a training run meets) is not modelled: each problem on one line, named by the row's column where
    one holds the setting (``column hidden (model.hidden_size=1000): is not divisible by ...``)."""
    return "; ".join(f"column {SETTING_COLUMNS[issue.key]} ({issue.key}={issue.value!r}): {issue.problem}"
                     if issue.key in SETTING_COLUMNS else f"{issue.key}={issue.value!r}: {issue.problem}"
                     for issue in err.issues) + " Fix: correct the row."


def gpu_preset(gpu: str) -> str:
    """Cluster preset for a row's ``gpu`` column: the preset with the longest alias (``conf/cluster``'s ``aliases``)
    the column contains (:func:`~cfp_megatron.cluster.presets.preset_for_gpu`: GB300 wins over B300, H100 NVL over
    H100, H200 over H20, A100-40GB over A100), so an "A100" or "H100" of unstated variant stays the 80 GB SXM
    preset."""
    preset = preset_for_gpu(gpu)
    if preset is None:
        raise RowError(f"GPU {gpu!r} has no hardware preset (known: {', '.join(known_gpus())})")
    return preset


def load_preset(name: str) -> dict:
    """The preset YAML as a dict."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(CONF_CLUSTER / f"{name}.yaml"), resolve=True)


def row_plan(row: dict, presets: dict[str, dict] | None = None, *, split: tuple[int, int] | None = None,
             data: ValidationData | None = None) -> RowPlan:
    """Build the plan of one CSV row, or raise :class:`RowError` with the reason it cannot be modelled; ``split``:
    the (tp, pp) to model a row that states only its data-parallel size (:func:`unstated_split`); ``data``: what
    blank columns mean (:mod:`cfp_megatron.validation.data`; the shipped files unless given)."""
    data = data if data is not None else load_data()
    setting = source_setting(row, data)  # what its source states outside its tables (source_settings.yaml)
    row = stated_row(row, setting)  # its blank cells filled so
    framework = row_framework(row, data, setting)
    compiled = runs_compiled(row, framework)
    rid = (row.get("id") or "?").strip()
    measured = figure_cell(row, "step_time_s") or figure_cell(row, "derived_step_time_s")
    preset_name = gpu_preset(row.get("gpu", ""))
    presets = presets if presets is not None else {}
    if preset_name not in presets:
        presets[preset_name] = load_preset(preset_name)
    cluster = dict(presets[preset_name])
    fabric, power = interconnect_reading(row, cluster), power_reading(row, cluster)
    memory = memory_reading(row, cluster)
    cluster.update({**fabric.cluster, **power.cluster, **memory.cluster})
    gpus = count_cell(row, "num_gpus")
    if not gpus:
        raise RowError("num_gpus is blank")
    layers, hidden, heads = count_cell(row, "layers"), count_cell(row, "hidden"), count_cell(row, "heads")
    seq = count_cell(row, "seq_len")
    if not (layers and hidden and heads and seq):
        raise RowError("the model shape (layers, hidden, heads, seq_len) is incomplete")
    tp, pp, cp = count_cell(row, "tp", 1), count_cell(row, "pp", 1), count_cell(row, "cp", 1)
    if split is not None:
        tp, pp = split
    elif not row.get("tp", "").strip() or not row.get("pp", "").strip():
        raise RowError("the layout (tp, pp) is not stated")
    dp = count_cell(row, "dp") or data_parallel_size(gpus, tp, cp, pp)
    if tp * pp * cp * dp != gpus:
        raise RowError(f"tp x pp x cp x dp = {tp}x{pp}x{cp}x{dp} does not multiply out to {gpus} GPUs")
    per_node = cluster["gpus_per_node"]
    if gpus % per_node:
        if gpus < per_node:
            cluster["gpus_per_node"], cluster["nodes"] = gpus, 1
        else:
            raise RowError(f"{gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    else:
        cluster["nodes"] = gpus // per_node
    experts = experts_cell(row)
    ep = count_cell(row, "ep", 1) if experts else 1
    micro = count_cell(row, "micro_batch", 1)
    gbs = count_cell(row, "global_batch_seqs")
    layer_only = gbs is None and layers == 1
    accum = count_cell(row, "grad_accum")
    if gbs is None and accum and not layer_only:
        gbs = micro * dp * accum
    if gbs is None and not layer_only:
        raise RowError("global_batch_seqs is blank")
    if (framework.rank_batch_micro and not (row.get("micro_batch") or "").strip() and not accum
            and pp == 1 and gbs and gbs % dp == 0):
        micro = gbs // dp  # the rank's whole batch is one micro-batch: no accumulation stated, none by default
    tokens_per_gpu = figure_cell(row, "tokens_per_s_per_gpu")
    if not measured and tokens_per_gpu and gbs:
        measured = gbs * seq / (tokens_per_gpu * gpus)
    if not measured:
        raise RowError("no measured step time (step_time_s, derived_step_time_s and tokens_per_s_per_gpu are blank)")
    if layer_only:
        gbs = micro * dp
    schedule = schedule_reading(row, pp, count_cell(row, "vp"), data.schedules)
    vp = schedule.vp
    recompute_raw = blank_reading(row, "recompute", framework).lower()
    recompute = "full" if recompute_raw.startswith("full") else "selective" if recompute_raw.startswith(
        "selective") else "none"
    # Layer-wise selective checkpointing: every Nth block of each chunk recomputed whole, as full recomputation's
    # block method counts them (the first of each chunk, not every Nth: the same time and memory).
    every = layer_checkpoint_every(recompute_raw)
    block_layers = layers // (pp * vp) // every if every else 0
    if every:
        recompute = "full" if block_layers else "none"
    numbers = precision_reading(row, cluster, data.precisions)
    number_format = NumberFormat.parse(numbers.number_format)
    sharding = blank_reading(row, "zero_or_fsdp", framework).lower()
    fsdp = "fsdp" in sharding or "zero-3" in sharding or "zero3" in sharding
    dist_opt = "distributed optimizer" in sharding or "zero-1" in sharding
    sp = yes_cell(row.get("sequence_parallel") or "")  # blank or unstated: the framework's reading
    sp = yes_cell(framework.blank.get("sequence_parallel", "")) if sp is None else sp
    if sp is None:
        sp = bool(experts)  # Megatron-Core requires sequence parallelism for MoE layers with TP
    sp = sp and tp > 1
    ffn = count_cell(row, "ffn_hidden")
    swiglu = bool(experts) or (ffn is not None and ffn != 4 * hidden)
    model = {
        "name": f"row{rid}", "num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn,
        "num_attention_heads": heads, "num_query_groups": count_cell(row, "kv_heads"),
        "vocab_size": count_cell(row, "vocab"),
        "make_vocab_size_divisible_by": 128 * tp, "max_position_embeddings": max(seq, 4096),
        "activation": "swiglu" if swiglu else "gelu", "tie_embeddings": framework.tie_embeddings,
        "position_embedding": "rope" if swiglu else "learned_absolute",
        "hidden_dropout": 0.0 if swiglu else 0.1, "attention_dropout": 0.0 if swiglu else 0.1,
    }
    model.update(family_fields(row, data))  # its vocabulary and KV heads only where the row leaves them blank
    recipe = performance_recipe(row, framework, preset_name, (gpus, tp, pp, vp, ep, gbs or 0), data)
    if recipe and recipe.fp8_format:  # the FP8 recipe its preset ran, where the row names none
        numbers = preset_precision(numbers, recipe.fp8_format, data.precisions)
        number_format = NumberFormat.parse(numbers.number_format)
    if experts:
        topk = count_cell(row, "moe_topk", 2)
        model.update(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=count_cell(row, "moe_expert_ffn"))
        # dropless or token-drop (validation/moe_routing.yaml)
        model.update(moe_routing(row).model_fields(flex=bool(recipe and recipe.dispatcher == "flex"
                                                             and recipe.flex_backend != "hybridep")))
    architecture, fields = preset_architecture({**row, "vocab": str(model["vocab_size"])}) if experts else ("", {})
    model.update(fields)
    if experts:  # the router and its loss as its framework's recipes run them (frameworks.yaml)
        model["moe_router_fusion"] = _model_matches(row, framework.router_fusion)
        coefficient = next((c for pattern, c in framework.load_balancing_loss
                            if re.search(pattern, row.get("model") or "", re.IGNORECASE)), None)
        if coefficient is not None:
            model["moe_aux_loss_coeff"] = coefficient
    modules, offloaded = None, 0
    if recipe:
        if experts:
            model["moe_token_dispatcher"] = recipe.dispatcher
        if recipe.recompute_modules and not recompute_raw:
            recompute, modules = "selective", recipe.recompute_modules
        if not recompute_raw:  # Megatron-Core offloads no activations of a recomputed layer
            offloaded = recipe.cpu_offloading_num_layers
        if recipe.micro_batch and accum and gbs and micro * dp * accum != gbs:
            micro = recipe.micro_batch  # the row's micro-batch, accumulation and DP contradict its global batch
    # Megatron-Bridge's recipes count the embedding and the loss as layers of the pipeline split where the decoder
    # alone does not split (Qwen3-235B's 94 layers over 8 x 4 chunks: 96 units, 3 per chunk).
    counted = pp > 1 and layers % (pp * vp) != 0 and (layers + 2) % (pp * vp) == 0
    mtp = mtp_layers(row, framework)
    model["mtp_num_layers"] = mtp
    # Where neither splits, a per-stage layout as Megatron-Bridge writes DeepSeek-V3's at PP=8 x VP=4
    # (Et|(tt|)*30mL): the embedding, the MTP layers and the loss each counted as a layer, spread evenly.
    stages = (balanced_layout(layers, pp, vp, mtp_layers=mtp, ends_counted=True)
              if pp > 1 and layers % (pp * vp) and not counted else None)
    cfg = {
        "model": model, "cluster": cluster,
        "parallel": {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "vpp": vp if vp > 1 else None, "sp": sp,
                     "recompute": recompute, "recompute_modules": modules, "distributed_optimizer": dist_opt or fsdp,
                     "fsdp": "optim_grads_params" if fsdp else "none",
                     "overlap_grad_reduce": framework.overlap_grad_reduce and (recipe is None
                                                                               or recipe.overlap_grad_reduce),
                     "overlap_param_gather": framework.overlap_param_gather and dist_opt and not fsdp,
                     "tp_comm_overlap": (recipe.tp_comm_overlap if recipe else framework.tp_comm_overlap) and sp,
                     "moe_a2a_overlap": bool(recipe and recipe.a2a_overlap),
                     "moe_flex_dispatcher_backend": (recipe and recipe.flex_backend) or "deepep",
                     "cuda_graph_impl": recipe.cuda_graph_impl if recipe else "none",
                     "cuda_graph_scope": recipe.cuda_graph_scope if recipe else None,
                     "recompute_num_layers": block_layers or 1,
                     "recompute_method": "block" if block_layers else "uniform", "cpu_offloading_num_layers": offloaded,
                     "grad_reduce_in_fp32": framework.grad_reduce_in_fp32 and not (
                         framework.deepspeed_engine and number_format.precision is Precision.fp16),
                     "fp8_param_gather": (dist_opt or fsdp) and number_format.name in framework.fp8_param_gather,
                     "account_for_embedding_in_pipeline_split": counted,
                     "account_for_loss_in_pipeline_split": counted, "pipeline_model_parallel_layout": stages},
        "train": {"global_batch_size": gbs, "micro_batch_size": micro, "seq_length": seq,
                  **{key: value.value for key, value in number_format.with_train().items()}},
    }
    try:
        job = job_from_config(cfg)
    except ConfigError as err:
        raise RowError(refusal(err)) from None
    layout = f"tp{tp} pp{pp} dp{dp}" + ("?" if split is not None else "")
    layout += (f" cp{cp}" if cp > 1 else "") + (f" ep{ep}" if ep > 1 else "")
    layout += (f" vp{vp}" if vp > 1 else "") + (" emb+loss" if counted else "") + (f" {stages}" if stages else "")
    layout += " sp" if sp else ""
    layout += f" as {architecture}" if architecture else ""
    if recipe:
        layout += (" flex" + (f"={recipe.flex_backend}" if recipe.flex_backend else "")
                   if recipe.dispatcher == "flex" else "")
        layout += " a2ao" if recipe.a2a_overlap else ""
        layout += (f" cg={recipe.cuda_graph_impl}[{recipe.cuda_graph_scope or 'layer'}]"
                   if recipe.cuda_graph_impl != "none" else "")
    layout += f" {moe_routing(row).tag}" if experts and moe_routing(row).tag else ""
    layout += f" mb{micro} gbs{gbs} {recompute}" + (f"[{job.parallel.recompute_modules}]" if modules else "")
    layout += f"[{block_layers} of {layers // (pp * vp)} a chunk]" if block_layers else ""
    layout += f" offload={offloaded}L" if offloaded else ""
    layout += " fsdp" if fsdp else ""
    layout += " fp8-params" if job.parallel.fp8_param_gather else ""
    layout += " ds" if framework.deepspeed_engine else ""
    readings = (fabric, schedule, numbers, power, memory)
    layout += "".join(f" {reading.tag}" for reading in readings if reading.tag)
    options = SimOptions(measured_layer_only=layer_only, attention=framework.attention,
                         pipeline_schedule=schedule.schedule,
                         weight_grad_accumulation=(WeightGradAccumulation.main_grad_hook
                                                   if recipe and not recipe.gradient_accumulation_fusion
                                                   else framework.weight_grad_accumulation),
                         fsdp_double_buffer=bool(recipe and recipe.fsdp_double_buffer),
                         fsdp_unit_size=recipe.fsdp_unit_size if recipe else None,
                         offload_v1=bool(offloaded and recipe and recipe.offload_v1_until
                                         and (row_release(row) or (0, 0)) <= recipe.offload_v1_until),
                         pipeline_scatter_gather=framework.pipeline_scatter_gather,
                         blocking_interleaved=framework.blocking_interleaved,
                         te_cross_entropy=framework.te_cross_entropy,
                         async_tp_backward=framework.async_tp_backward,
                         global_memory_buffer=framework.global_memory_buffer,
                         wgrad_placeholder=framework.wgrad_placeholder, torch_fsdp=framework.torch_fsdp and fsdp,
                         torch_fused_adamw=framework.torch_fused_adamw, moe_layer_syncs=framework.moe_layer_syncs,
                         torch_op_sac=framework.torch_op_sac, torch_moe_combine=framework.torch_moe_combine,
                         torchao_low_precision=framework.torchao_low_precision,
                         torch_swiglu=framework.torch_swiglu and not compiled, dtensor_tp=framework.dtensor_tp,
                         flex_backend_unstated=bool(experts and recipe and recipe.dispatcher == "flex"
                                                    and recipe.flex_backend is None),
                         eager_torch_loss=framework.eager_loss and not compiled
                         and not _model_matches(row, framework.compiled_loss),
                         rope_fusion=not _model_matches(row, framework.unfused_rope),
                         deepspeed_engine=framework.deepspeed_engine,
                         apex_adam=apex_adam_states(row, framework) if dist_opt and not fsdp else None)
    return RowPlan(row_id=rid, source=row.get("source", ""), source_detail=row.get("source_detail", ""),
                   model=row.get("model", ""), layout=layout, job=job, options=options, measured_s=measured,
                   approximations=tuple(reading.approximation for reading in readings if reading.approximation)
                   + ((setting.approximation,) if setting and setting.approximation else ()))


def runs_compiled(row: dict, framework: Framework) -> bool:
    """Whether the row's model ran under ``torch.compile``: its recipe compiles it
    (:attr:`~cfp_megatron.validation.data.Framework.compiled_model`), or its notes or framework say so
    (:attr:`~cfp_megatron.validation.data.Framework.compiled_notes`)."""
    words = framework.compiled_notes
    stated = f"{row.get('notes') or ''} {row.get('framework') or ''}"
    return _model_matches(row, framework.compiled_model) or bool(words and re.search(words, stated, re.IGNORECASE))


def _model_matches(row: dict, patterns: tuple[str, ...]) -> bool:
    """Whether the row's ``model`` matches one of ``patterns`` (case-insensitive)."""
    return any(re.search(pattern, row.get("model") or "", re.IGNORECASE) for pattern in patterns)


def unstated_split(row: dict, presets: dict[str, dict]) -> tuple[int, int]:
    """The (tp, pp) of a row that states its GPUs and data-parallel size but not how the model-parallel ranks divide
    into TP and PP (SC21's Table 2): TP as wide as a node allows where it divides the model-parallel size and the
    heads (the same source's Table 1 runs every model above 8B at TP = 8, one node), PP the rest. Raises
    :class:`RowError` where the row states too little to know the model-parallel size."""
    gpus, dp, cp = count_cell(row, "num_gpus"), count_cell(row, "dp"), count_cell(row, "cp", 1) or 1
    heads = count_cell(row, "heads")
    if not (gpus and dp and heads) or gpus % (dp * cp):
        raise RowError("the layout (tp, pp) is not stated, nor the data-parallel size it leaves")
    model_parallel = gpus // (dp * cp)
    preset = gpu_preset(row.get("gpu", ""))
    if preset not in presets:
        presets[preset] = load_preset(preset)
    per_node = presets[preset]["gpus_per_node"]
    tp = max(t for t in range(1, per_node + 1) if model_parallel % t == 0 and heads % t == 0)
    return tp, model_parallel // tp


def predict_rows(rows: list[dict], efficiencies=None, *,
                 data: ValidationData | None = None) -> tuple[list[RowResult], list[tuple[dict, str]]]:
    """Predict every row; returns (results, [(row, reason)] for rows not modelled).

    ``efficiencies`` maps a GPU generation to :class:`~cfp_megatron.sim.calibration.Efficiency` to override the
    fitted ones (used by the fitting script); ``data``: as :func:`row_plan`'s (a data file that cannot be read raises
    :class:`~cfp_megatron.validation.data.ValidationDataError` before any row)."""
    data = data if data is not None else load_data()
    presets: dict[str, dict] = {}
    results, skipped = [], []
    first: dict[str, dict] = {}
    for row in rows:
        rid = (row.get("id") or "").strip()
        problem = getattr(row, "problem", None)
        if problem is None and not rid:
            problem = f"{where(row)}: the id is blank. Fix: give each row its own id"
        elif problem is None and rid in first:
            problem = (f"id {rid} at {where(row)} is also the id of {where(first[rid])} (modelled there, counted "
                       "once). Fix: give each run its own id, or remove the repeated row")
        first.setdefault(rid, row)
        if problem is not None:
            skipped.append((row, problem))
            continue
        try:
            stated = bool((row.get("tp") or "").strip() and (row.get("pp") or "").strip())
            plan = row_plan(row, presets, split=None if stated else unstated_split(row, presets), data=data)
            problem = implausible_step_time(plan)
            if problem is not None:
                raise RowError(problem)
        except CfpError as err:
            skipped.append((row, str(err).replace("\n", " ")))
            continue
        except (ValueError, ArithmeticError, KeyError, TypeError) as err:  # malformed row: list it, keep going
            skipped.append((row, f"{type(err).__name__}: {err}"))
            continue
        eff = efficiencies.get(generation(plan.job.cluster)) if efficiencies else None
        try:
            pred = simulate(plan.job, options=plan.options, efficiency=eff)
        except ConfigError as err:  # a layout the training config's checks refuse (ParallelDims)
            skipped.append((row, refusal(err)))
            continue
        except CfpError as err:  # a layout the simulator refuses; a bug in the simulator is raised, not hidden
            skipped.append((row, str(err).replace("\n", " ")))
            continue
        memory = pred.memory.total_gib
        flag, refused = memory_problem(plan.job, memory)
        if refused:
            skipped.append((row, flag))
            continue
        results.append(RowResult(plan=plan, predicted_s=pred.step_time_s, memory_gib=memory, flag=flag))
    return results, skipped


MEMORY_REFUSE_FACTOR = 4.0
"""A row whose predicted peak memory per GPU is more than this many times its GPU's memory is refused: a measured
run fit its GPUs, and the simulator's memory is not that far off (its largest over-estimate on the shared files is
1.4x, GPT-OSS 120B's row 79): the row's sizes do not describe what ran (a million GPUs' batch on each GPU)."""


def memory_problem(job: JobSpec, memory_gib: float) -> tuple[str, bool]:
    """(what to say, refused) about a row's predicted peak memory per GPU against its GPU's memory: nothing where
    it fits; a flag where it does not (kept in the figures: a gap of the memory model, or a setting the row leaves
    out, such as recomputation); a refusal beyond :data:`MEMORY_REFUSE_FACTOR` times the GPU's memory."""
    hbm = job.cluster.hbm_gib
    if not hbm or memory_gib <= hbm:
        return "", False
    if memory_gib > MEMORY_REFUSE_FACTOR * hbm:
        return (f"predicted peak memory {memory_gib:,.0f} GiB per GPU is over {MEMORY_REFUSE_FACTOR:g} times the "
                f"GPU's {hbm:g} GiB: no measured run needed that, so the row's sizes (GPUs, layout, batch, model) do "
                "not describe what ran. Fix: correct the row"), True
    return (f"predicted peak memory {memory_gib:.1f} GiB per GPU is above the GPU's {hbm:g} GiB (a gap of the "
            "memory model, or a setting the row leaves out, such as recomputation)"), False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cfp_megatron.validate", description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="*", help=f"runs in the schema of {SCHEMA_FILE} (default: the published runs "
                        "that ship with the package, dense and MoE: " + ", ".join(p.name for p in PUBLISHED_RUNS) + ")")
    parser.add_argument("--bands", metavar="FILE", help="also write the error bands the planner reports with, out "
                        "of sample (leave-one-source-out), and each run's MFU (cfp_megatron/sim/error_bands.json) to "
                        "FILE (needs scipy)")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw predicted vs measured step time per row "
                        "(log axes, a colour per class with its MAPE, y = x and a +-10%% band) to FILE.png, a new file")
    parser.add_argument("--json", metavar="FILE", dest="json_path", help="also write the report as JSON to FILE: "
                        "each row's prediction, each row not modelled with its reason, the coverage, the MAPE and the "
                        "layout sweeps")
    args = parser.parse_args(argv)
    if not args.csv:
        args.csv = [str(p) for p in PUBLISHED_RUNS]
        print(f"the published runs that ship with cfp-megatron ({PUBLISHED_RUNS_DIR}; its README.md names the "
              "sources)")
    problem = check_plot_path(args.plot) if args.plot else None
    problem = problem or (check_bands_path(args.bands) if args.bands else None)
    problem = problem or (check_json_path(args.json_path) if args.json_path else None)
    problem = problem or same_output_problem({"--plot": args.plot, "--bands": args.bands, "--json": args.json_path})
    if problem:
        print(f"validate: {problem}", file=sys.stderr)
        return 2
    try:
        rows = [row for path in args.csv for row in read_rows(path)]
    except InputFileError as err:
        print(f"validate: {err}", file=sys.stderr)
        return 2
    try:
        return _report(args, rows)
    except (FileWriteError, ValidationDataError) as err:  # a full or read-only disk met while writing: the file is
        # left as it was; a data file of cfp_megatron/validation/ that cannot be read: no row is predicted
        print(f"validate: {err}", file=sys.stderr)
        return 2


def _report(args: argparse.Namespace, rows: list[dict]) -> int:
    """Predict ``rows``, print the table, write what ``--json``, ``--bands`` and ``--plot`` ask for; the exit
    status (1 when no row could be modelled)."""
    for path in args.csv:
        read = [row for row in rows if isinstance(row, CsvRow) and row.file == Path(path)]
        unread = unread_columns(list(dict.fromkeys(name for row in read for name in row)))
        if unread:
            print(f"note: {path}: column(s) {', '.join(unread)} are not in the runs schema and are not read")
    modelled, skipped = predict_rows(rows)
    by_id = rows_by_id(rows)
    superseded = set_apart(modelled, by_id)
    results = [r for r in modelled if r.plan.row_id not in superseded]
    print(f"{'id':>5}  {'model':<28} {'layout':<52} {'measured s':>11} {'predicted s':>11} {'error':>8} "
          f"{'mem GiB':>8}")
    for r in modelled:
        name = re.sub(r"\s+", " ", r.plan.model)[:28]
        print(f"{r.plan.row_id:>5}  {name:<28} {r.plan.layout:<52} {r.plan.measured_s:>11.4g} "
              f"{r.predicted_s:>11.4g} {r.error_pct:>+7.1f}% {r.memory_gib:>8.1f}" + (" !" if r.flag else "")
              + (" s" if r.plan.row_id in superseded else ""))
    approximated = [r for r in modelled if r.plan.approximations]
    if approximated:
        print(f"\nstated columns priced approximately or not understood ({len(approximated)} rows, kept in the "
              "figures):")
        for r in approximated:
            for said in r.plan.approximations:
                print(f"  {r.plan.row_id:>5}  {said}")
    flagged = [r for r in modelled if r.flag]
    if flagged:
        print(f"\nflagged, kept in the figures ({len(flagged)} rows, ! above):")
        for r in flagged:
            name = re.sub(r"\s+", " ", r.plan.model)[:28]
            print(f"  {r.plan.row_id:>5}  {name:<28} {r.flag}")
    if superseded:
        print(f"\nsuperseded by their source's re-measurement, set apart from the figures and the bands "
              f"({len(superseded)} rows, s above; cfp_megatron/validation/superseded.yaml):")
        for rid, reason in superseded.items():
            name = re.sub(r"\s+", " ", by_id[rid].get("model", ""))[:28]
            print(f"  {rid:>5}  {name:<28} {reason}")
    if skipped:
        print(f"\nnot modelled, left out of the figures ({len(skipped)} rows):")
        for row, reason in skipped:
            print(f"  {row.get('id', '?'):>5}  {row.get('model', '')[:28]:<28} {reason}")
    timed = [row for row in rows if has_step_time(row)]
    print(f"\ncoverage: {len(modelled)} of {len(timed)} rows with a step time modelled")
    print("\n".join(memory_failure_lines(modelled)))
    print(f"{'class':<12} {'rows':>5} {'MAPE':>7} {'max error':>10}")
    for name, errors in sorted(class_errors(results, by_id).items()):
        print(f"{name:<12} {len(errors):>5} {sum(errors) / len(errors):>6.2f}% {max(errors):>9.1f}%")
    print("\n".join(sweep_lines(find_sweeps(results, by_id))))
    if args.json_path:
        write_atomic(args.json_path, json.dumps(report(modelled, skipped, rows, superseded), indent=1) + "\n",
                     key="--json")
        print(f"\nreport written to {args.json_path}")
    if not results:
        print(f"\nvalidate: no row could be modelled (the {len(rows)} rows of {', '.join(args.csv)}, each listed "
              "above with its reason): no MAPE, and no --bands or --plot written. Fix: correct the rows, or pass "
              f"runs in the schema of {SCHEMA_FILE}.", file=sys.stderr)
        return 1
    if args.bands and (problem := sources_problem([r.plan for r in results])) is not None:
        print(f"validate: {problem}; no --bands written", file=sys.stderr)
        return 2
    if args.bands:
        write_atomic(args.bands, json.dumps(band_table(results, by_id, args.csv), indent=1) + "\n", key="--bands")
        print(f"\nerror bands ({BAND_QUANTILE:.0%} of each class's rows inside, each row predicted with efficiencies "
              f"fitted without its source) written to {args.bands}")
    if args.plot:
        drawn = write_plot(results, by_id, args.plot)
        print(f"\npredicted vs measured step time drawn to {drawn}")
    if superseded:
        print(f"\nMAPE over all {len(modelled)} modelled rows (the {len(superseded)} superseded above included): "
              f"{mape(modelled):.2f}%; over the rows kept:")
    print(f"\nMAPE {mape(results):.2f}% over {len(results)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
