"""``python -m cfp_megatron.validate FILE.csv [FILE.csv ...]``: predict published training runs and report the error.

Reads rows of the schema of ``shared/data/published_runs.csv`` (one measured run per row: model shape, GPUs, parallel
layout, measured step time), builds the plan of each row, simulates it on the hardware preset of its GPU, and prints
one line per row (id, model, layout, measured, predicted step time, error, predicted peak memory), the rows it cannot
model with the reason, the coverage (rows modelled of the rows with a step time), the MAPE and largest error per
class (dense, MoE, CP, FSDP; GPU generation), and last ``MAPE <x>% over <n> rows``. The measured step time is
``step_time_s``, else ``derived_step_time_s``, else global batch x sequence / (``tokens_per_s_per_gpu`` x GPUs).

Defaults for fields a row leaves blank (documented, the same for every row):

* ``vocab``: 51200 (GPT-2's BPE padded as Megatron-LM does); ``ffn_hidden``: 4 x hidden; ``kv_heads``: one per head.
* ``dp``: GPUs / (TP x PP x CP); ``cp``, ``ep``, ``vp``, ``micro_batch``: 1; ``global_batch_seqs``: micro-batch x
  DP x ``grad_accum`` when that is given.
* ``sequence_parallel``: on with TP for NeMo / Megatron-Core / Megatron-Bridge (their recipes' default) and where
  Megatron-Core requires it (MoE with TP and EP), else off.
* ``recompute``: none. ``precision``: bf16 (``fp16`` when the row says fp16; FP8 GEMMs when it says FP8).
* ``zero_or_fsdp``: blank means Megatron's distributed optimizer for NeMo / Megatron-Core / Megatron-Bridge (their
  default) and plain data parallelism otherwise; "distributed optimizer" turns it on; "FSDP"/"ZeRO-3" models fully
  sharded data parallelism.
* ``global_batch_seqs`` blank with one layer: a layer-level measurement (one forward and backward of the layer
  alone, no embedding, logits, optimizer or gradient sync).
* MLP: SwiGLU when ``ffn_hidden`` is not 4 x hidden or the model is MoE, else GELU (with dropout 0.1).
* Gradients: accumulated and reduced in fp32 (Megatron-LM forces it for bf16; Megatron-Bridge's recipes keep it),
  except for NeMo rows: NeMo's performance runs keep the gradient buffers and their reduction in bf16 (NeMo 1's
  launcher scripts pass ``optim.grad_sync_dtype=bf16``, NeMo 2's performance recipes ``grad_reduce_in_fp32=False``).
* ``framework`` naming Megatron-LM from before 2023: unfused attention (no FlashAttention) and no overlap of the
  gradient all-reduce with backward, as those versions ran; every other framework: fused attention, overlap on.
  NeMo / Megatron-Core / Megatron-Bridge: TP communication overlapped with the GEMMs (their performance recipes turn
  ``tp_comm_overlap`` on).
* A decoder whose layers do not split into ``pp x vp`` chunks while its layers plus two do: the embedding and the
  loss counted as layers of the split (``account_for_embedding/loss_in_pipeline_split``, as Megatron-Bridge's recipes
  run Qwen3-235B's 94 layers over 8 x 4 chunks).
* GPUs that are not A100/H100/H200/B200, rows without a measured step time, and rows whose layout does not
  multiply out are listed as not modelled, with the reason.
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base.config import JobSpec, job_from_config
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.parallel_dims import data_parallel_size
from cfp_megatron.sim.calibration import generation
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.simulate import simulate

CONF_CLUSTER = Path(__file__).resolve().parent.parent / "conf" / "cluster"
DEFAULT_VOCAB = 51200
"""Vocabulary used when a row leaves it blank."""


class RowError(CfpError, ValueError):
    """A row cannot be modelled; the message says why."""


@dataclass(frozen=True, kw_only=True)
class RowPlan:
    """One row turned into what the simulator needs."""

    row_id: str
    """The row's ``id``."""
    source: str
    """The row's ``source`` (for grouping results)."""
    source_detail: str = ""
    """The row's ``source_detail`` (which table of the source)."""
    model: str
    """The row's model name (for display only)."""
    layout: str
    """Short layout string for display."""
    job: JobSpec
    """The plan."""
    options: SimOptions
    """Simulator options from the row (FP8, FSDP, layer-only)."""
    measured_s: float
    """Measured (or derived from measurements) step time."""


@dataclass(frozen=True, kw_only=True)
class RowResult:
    """Prediction for one row."""

    plan: RowPlan
    """The row."""
    predicted_s: float
    """Predicted step time."""
    memory_gib: float
    """Predicted peak memory per GPU."""

    @property
    def error_pct(self) -> float:
        """Signed relative error of the prediction, percent."""
        return 100.0 * (self.predicted_s - self.plan.measured_s) / self.plan.measured_s


def gpu_preset(gpu: str) -> str:
    """Cluster preset for a row's ``gpu`` column."""
    g = gpu.upper()
    for key, preset in (("A100", "dgx_a100"), ("H100", "dgx_h100"), ("H200", "h200"), ("B200", "b200")):
        if key in g:
            return preset
    raise RowError(f"GPU {gpu!r} has no hardware preset (known: A100, H100, H200, B200)")


def load_preset(name: str) -> dict:
    """The preset YAML as a dict."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(CONF_CLUSTER / f"{name}.yaml"), resolve=True)


def _int(row: dict, key: str, default: int | None = None) -> int | None:
    raw = (row.get(key) or "").strip()
    if not raw:
        return default
    try:
        return int(float(raw))
    except ValueError:
        raise RowError(f"column {key} is not a number: {raw!r}") from None


def _float(row: dict, key: str) -> float | None:
    raw = (row.get(key) or "").strip()
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


def _yes(raw: str) -> bool | None:
    raw = raw.strip().lower()
    if not raw:
        return None
    return raw.startswith(("y", "true", "on", "1"))


def row_plan(row: dict, presets: dict[str, dict] | None = None) -> RowPlan:
    """Build the plan of one CSV row, or raise :class:`RowError` with the reason it cannot be modelled."""
    rid = row.get("id", "?")
    measured = _float(row, "step_time_s") or _float(row, "derived_step_time_s")
    preset_name = gpu_preset(row.get("gpu", ""))
    presets = presets if presets is not None else {}
    if preset_name not in presets:
        presets[preset_name] = load_preset(preset_name)
    cluster = dict(presets[preset_name])
    gpus = _int(row, "num_gpus")
    if not gpus:
        raise RowError("num_gpus is blank")
    layers, hidden, heads = _int(row, "layers"), _int(row, "hidden"), _int(row, "heads")
    seq = _int(row, "seq_len")
    if not (layers and hidden and heads and seq):
        raise RowError("the model shape (layers, hidden, heads, seq_len) is incomplete")
    tp, pp, cp = _int(row, "tp", 1), _int(row, "pp", 1), _int(row, "cp", 1)
    if not row.get("tp", "").strip() or not row.get("pp", "").strip():
        raise RowError("the layout (tp, pp) is not stated")
    dp = _int(row, "dp") or data_parallel_size(gpus, tp, cp, pp)
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
    experts = _int(row, "moe_experts")
    ep = _int(row, "ep", 1) if experts else 1
    micro = _int(row, "micro_batch", 1)
    gbs = _int(row, "global_batch_seqs")
    layer_only = gbs is None and layers == 1
    accum = _int(row, "grad_accum")
    if gbs is None and accum and not layer_only:
        gbs = micro * dp * accum
    if gbs is None and not layer_only:
        raise RowError("global_batch_seqs is blank")
    tokens_per_gpu = _float(row, "tokens_per_s_per_gpu")
    if not measured and tokens_per_gpu and gbs:
        measured = gbs * seq / (tokens_per_gpu * gpus)
    if not measured:
        raise RowError("no measured step time (step_time_s, derived_step_time_s and tokens_per_s_per_gpu are blank)")
    if layer_only:
        gbs = micro * dp
    vp = _int(row, "vp", 1) or 1
    recompute_raw = (row.get("recompute") or "").strip().lower()
    recompute = "full" if recompute_raw.startswith("full") else "selective" if recompute_raw.startswith(
        "selective") else "none"
    precision_raw = (row.get("precision") or "").lower()
    fp8 = "fp8" in precision_raw
    precision = "fp16" if "fp16" in precision_raw and "bf16" not in precision_raw else "fp32" if (
        "fp32" in precision_raw and "16" not in precision_raw) else "bf16"
    year = re.search(r"\b(20\d\d)\b", row.get("framework") or "")
    framework = (row.get("framework") or "").lower()
    legacy = year is not None and int(year.group(1)) < 2023 and "megatron" in framework
    modern = not legacy and any(name in framework for name in ("nemo", "megatron-core", "megatron-bridge"))
    nemo = framework.startswith("nemo")  # NeMo itself, not Megatron-Bridge (which keeps fp32 gradients)
    sharding = (row.get("zero_or_fsdp") or "").lower()
    fsdp = "fsdp" in sharding or "zero-3" in sharding or "zero3" in sharding
    dist_opt = "distributed optimizer" in sharding or "zero-1" in sharding or (not sharding and modern)
    sp = _yes(row.get("sequence_parallel") or "")
    if sp is None:
        sp = modern or bool(experts and ep > 1)
    sp = sp and tp > 1
    ffn = _int(row, "ffn_hidden")
    kv = _int(row, "kv_heads")
    vocab = _int(row, "vocab", DEFAULT_VOCAB)
    swiglu = bool(experts) or (ffn is not None and ffn != 4 * hidden)
    model = {
        "name": f"row{rid}", "num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn,
        "num_attention_heads": heads, "num_query_groups": kv, "vocab_size": vocab,
        "make_vocab_size_divisible_by": 128 * tp, "max_position_embeddings": max(seq, 4096),
        "activation": "swiglu" if swiglu else "gelu", "tie_embeddings": False,
        "hidden_dropout": 0.0 if swiglu else 0.1, "attention_dropout": 0.0 if swiglu else 0.1,
    }
    if heads and hidden % heads:
        model["kv_channels"] = 128
    if experts:
        topk = _int(row, "moe_topk", 2)
        model.update(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=_int(row, "moe_expert_ffn"))
    # Megatron-Bridge's recipes count the embedding and the loss as layers of the pipeline split where the decoder
    # alone does not split (Qwen3-235B's 94 layers over 8 x 4 chunks: 96 units, 3 per chunk).
    counted = pp > 1 and layers % (pp * vp) != 0 and (layers + 2) % (pp * vp) == 0
    if vp > 1 and layers % (pp * vp) and not counted:
        raise RowError(f"{layers} layers do not split into pp x vp = {pp} x {vp} chunks, nor with the embedding and "
                       "the loss counted as layers")
    cfg = {
        "model": model, "cluster": cluster,
        "parallel": {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "vpp": vp if vp > 1 else None, "sp": sp,
                     "recompute": recompute, "distributed_optimizer": dist_opt, "overlap_grad_reduce": not legacy,
                     "recompute_num_layers": 1, "grad_reduce_in_fp32": not nemo,
                     "account_for_embedding_in_pipeline_split": counted,
                     "account_for_loss_in_pipeline_split": counted},
        "train": {"global_batch_size": gbs, "micro_batch_size": micro, "seq_length": seq, "precision": precision},
    }
    try:
        job = job_from_config(cfg)
    except CfpError as err:
        raise RowError(f"invalid plan: {err}") from None
    layout = f"tp{tp} pp{pp} dp{dp}" + (f" cp{cp}" if cp > 1 else "") + (f" ep{ep}" if ep > 1 else "")
    layout += (f" vp{vp}" if vp > 1 else "") + (" emb+loss" if counted else "") + (" sp" if sp else "")
    layout += f" mb{micro} gbs{gbs} {recompute}" + (" fp8" if fp8 else "") + (" fsdp" if fsdp else "")
    options = SimOptions(fp8=fp8, fsdp=fsdp, measured_layer_only=layer_only, flash_attention=not legacy,
                         tp_comm_overlap=modern)
    return RowPlan(row_id=rid, source=row.get("source", ""), source_detail=row.get("source_detail", ""),
                   model=row.get("model", ""), layout=layout, job=job, options=options, measured_s=measured)


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a CSV file as dicts."""
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def predict_rows(rows: list[dict], efficiencies=None) -> tuple[list[RowResult], list[tuple[dict, str]]]:
    """Predict every row; returns (results, [(row, reason)] for rows not modelled).

    ``efficiencies`` maps a GPU generation to :class:`~cfp_megatron.sim.calibration.Efficiency` to override the
    fitted ones (used by the fitting script)."""
    presets: dict[str, dict] = {}
    results, skipped = [], []
    for row in rows:
        try:
            plan = row_plan(row, presets)
        except CfpError as err:
            skipped.append((row, str(err).replace("\n", " ")))
            continue
        except (ValueError, ArithmeticError, KeyError, TypeError) as err:  # malformed row: list it, keep going
            skipped.append((row, f"{type(err).__name__}: {err}"))
            continue
        eff = efficiencies.get(generation(plan.job.cluster)) if efficiencies else None
        try:
            pred = simulate(plan.job, options=plan.options, efficiency=eff)
        except CfpError as err:  # a layout the simulator refuses; a bug in the simulator is raised, not hidden
            skipped.append((row, str(err).replace("\n", " ")))
            continue
        results.append(RowResult(plan=plan, predicted_s=pred.step_time_s, memory_gib=pred.memory.total_gib))
    return results, skipped


def mape(results: list[RowResult]) -> float:
    """Mean absolute percentage error of the step time."""
    return sum(abs(r.error_pct) for r in results) / len(results) if results else math.nan


def row_classes(row: dict) -> tuple[str, ...]:
    """The classes a row's error is reported under: ``MoE`` or ``dense``, and ``CP`` (context parallel) and ``FSDP``
    (fully sharded data parallel) where they apply."""
    moe = (row.get("arch_type") or "").strip().lower() == "moe" or bool((row.get("moe_experts") or "").strip())
    classes = ["MoE" if moe else "dense"]
    if (_int(row, "cp", 1) or 1) > 1:
        classes.append("CP")
    if re.search(r"fsdp|zero-?3", row.get("zero_or_fsdp") or "", re.IGNORECASE):
        classes.append("FSDP")
    return tuple(classes)


def has_step_time(row: dict) -> bool:
    """Whether a row measured a step time (``step_time_s``, ``derived_step_time_s`` or ``tokens_per_s_per_gpu``)."""
    return any((row.get(k) or "").strip() for k in ("step_time_s", "derived_step_time_s", "tokens_per_s_per_gpu"))


def class_errors(results: list[RowResult], rows_by_id: dict[str, dict]) -> dict[str, list[float]]:
    """Absolute percentage errors by class: each row's :func:`row_classes` and its GPU generation."""
    by_class: dict[str, list[float]] = {}
    for r in results:
        row = rows_by_id.get(r.plan.row_id, {})
        for name in (*row_classes(row), f"GPU {generation(r.plan.job.cluster)}"):
            by_class.setdefault(name, []).append(abs(r.error_pct))
    return by_class


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cfp_megatron.validate", description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="runs in the schema of shared/data/published_runs.csv")
    args = parser.parse_args(argv)
    rows = [row for path in args.csv for row in read_rows(path)]
    results, skipped = predict_rows(rows)
    print(f"{'id':>5}  {'model':<28} {'layout':<52} {'measured s':>11} {'predicted s':>11} {'error':>8} "
          f"{'mem GiB':>8}")
    for r in results:
        name = re.sub(r"\s+", " ", r.plan.model)[:28]
        print(f"{r.plan.row_id:>5}  {name:<28} {r.plan.layout:<52} {r.plan.measured_s:>11.4g} "
              f"{r.predicted_s:>11.4g} {r.error_pct:>+7.1f}% {r.memory_gib:>8.1f}")
    if skipped:
        print(f"\nnot modelled ({len(skipped)} rows):")
        for row, reason in skipped:
            print(f"  {row.get('id', '?'):>5}  {row.get('model', '')[:28]:<28} {reason}")
    timed = [row for row in rows if has_step_time(row)]
    print(f"\ncoverage: {len(results)} of {len(timed)} rows with a step time modelled")
    print(f"{'class':<12} {'rows':>5} {'MAPE':>7} {'max error':>10}")
    for name, errors in sorted(class_errors(results, {row.get("id", ""): row for row in rows}).items()):
        print(f"{name:<12} {len(errors):>5} {sum(errors) / len(errors):>6.2f}% {max(errors):>9.1f}%")
    print(f"\nMAPE {mape(results):.2f}% over {len(results)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
