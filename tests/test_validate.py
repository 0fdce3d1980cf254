"""``python -m cfp_megatron.validate`` against published runs."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from cfp_megatron.base.flops import training_flops_per_token
from cfp_megatron.validate import main, predict_rows, read_rows, row_plan
from cfp_megatron.validation.rows import PUBLISHED_RUNS, PUBLISHED_RUNS_DIR

CSV, MOE_CSV = PUBLISHED_RUNS
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
"""The project's shared data folder beside a development checkout, which the shipped runs are copies of."""


def _final(out: str) -> tuple[float, int]:
    last = out.strip().splitlines()[-1]
    match = re.fullmatch(r"MAPE (\d+(?:\.\d+)?)% over (\d+) rows", last)
    assert match, last
    return float(match.group(1)), int(match.group(2))


def test_cli_meets_the_accuracy_target_on_the_shipped_file(capsys) -> None:
    assert main([str(CSV)]) == 0
    out = capsys.readouterr().out
    value, rows = _final(out)
    # every modellable row of the shipped file (DeepSeek-V3's row 73 through its per-stage layout): a row that stops
    # being modelled is a regression
    assert rows == 66
    # The dense rows (62, the calibrated class) keep the 5% target; the four MoE rows (-10.0% to +0.4%, the MoE
    # cost model's open gap, docs/validation.md) leave the whole file at 4.8%: a regression beyond 5% fails.
    dense = re.search(r"^dense\s+(\d+)\s+(\d+\.\d+)%", out, re.MULTILINE)
    assert dense and int(dense.group(1)) == 62 and float(dense.group(2)) <= 5.0
    assert value <= 5.0
    assert "not modelled" in out and "no measured step time" in out
    # SC21's Table 2 states the model-parallel size only: modelled at TP = one node, PP the rest.
    assert re.search(r"^\s+11\s+GPT 174.6B\s+tp8 pp12 dp4\?", out, re.MULTILINE)


def test_korthikanti_table5_end_to_end_within_3_5_percent() -> None:
    rows = [r for r in read_rows(CSV) if "Table 5" in r["source_detail"] and "present work" in r["source_detail"]]
    assert len(rows) == 4
    results, skipped = predict_rows(rows)
    assert not skipped
    mape = sum(abs(r.error_pct) for r in results) / len(results)
    assert mape <= 3.5


def test_korthikanti_table5_gain_of_sp_and_selective_over_full_recomputation() -> None:
    # Each model's full-recomputation row against its SP + selective row (measured 1.29-1.32x): the predicted gain
    # within 3 points of the measured one, as a planner choosing between them needs.
    rows = [r for r in read_rows(CSV) if "Table 5" in r["source_detail"]]
    results, skipped = predict_rows(rows)
    assert not skipped and len(results) == 8
    by_model: dict[str, dict[bool, object]] = {}
    for result in results:
        by_model.setdefault(result.plan.model, {})[result.plan.job.parallel.sp] = result
    assert len(by_model) == 4
    for pair in by_model.values():
        full, present = pair[False], pair[True]
        measured = full.plan.measured_s / present.plan.measured_s
        predicted = full.predicted_s / present.predicted_s
        assert abs(predicted - measured) <= 0.03, (full.plan.model, measured, predicted)


def test_unmodellable_rows_are_listed_with_a_reason(tmp_path, capsys) -> None:
    fields = ["id", "source", "model", "layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len",
              "gpu", "num_gpus", "tp", "pp", "dp", "micro_batch", "global_batch_seqs", "recompute", "precision",
              "step_time_s", "derived_step_time_s"]
    good = {"id": "1", "source": "x", "model": "GPT small", "layers": "24", "hidden": "2048", "ffn_hidden": "8192",
            "heads": "16", "vocab": "51200", "seq_len": "2048", "gpu": "H100-SXM5-80GB", "num_gpus": "8", "tp": "1",
            "pp": "1", "dp": "8", "micro_batch": "2", "global_batch_seqs": "256", "precision": "bf16",
            "step_time_s": "1.0"}
    rows = [good, {**good, "id": "2", "gpu": "V100-SXM2-32GB"}, {**good, "id": "3", "step_time_s": ""},
            {**good, "id": "4", "tp": "3"}]
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert _final(out)[1] == 1
    assert "V100-SXM2-32GB" in out and "no measured step time" in out and "does not multiply out" in out


def test_row_defaults_are_documented_choices() -> None:
    row = {"id": "9", "model": "m", "layers": "4", "hidden": "1024", "heads": "16", "seq_len": "1024",
           "gpu": "A100-80GB", "num_gpus": "16", "tp": "2", "pp": "2", "global_batch_seqs": "64",
           "derived_step_time_s": "2.0", "precision": "FP8", "zero_or_fsdp": "FSDP FULL_SHARD"}
    plan = row_plan(row)
    assert plan.job.model.vocab_size == 51200 and plan.job.model.ffn_size == 4096
    assert plan.job.cluster.nodes == 2 and plan.job.parallel.fsdp.value == "optim_grads_params"
    assert plan.job.train.precision.value == "bf16" and "without fp8 tensor cores" in " ".join(plan.approximations)
    assert plan.measured_s == 2.0
    assert plan.job.parallel.grad_reduce_in_fp32  # fp32 gradients unless NeMo's or Megatron-Bridge's perf scripts
    nemo = row_plan({**row, "framework": "NeMo 24.07 (Megatron-Core)", "zero_or_fsdp": ""})
    assert not nemo.job.parallel.grad_reduce_in_fp32 and nemo.job.parallel.distributed_optimizer
    bridge = row_plan({**row, "framework": "Megatron-Bridge / NeMo 25.09", "zero_or_fsdp": ""})
    assert not bridge.job.parallel.grad_reduce_in_fp32 and bridge.job.parallel.distributed_optimizer
    megatron = row_plan({**row, "framework": "Megatron-LM (Megatron-Core 0.12)", "zero_or_fsdp": ""})
    assert megatron.job.parallel.grad_reduce_in_fp32


def test_rows_are_classed_by_what_they_exercise() -> None:
    from cfp_megatron.validate import row_classes

    assert row_classes({"arch_type": "dense", "cp": "1"}) == ("dense",)
    assert row_classes({"arch_type": "moe", "cp": "2", "zero_or_fsdp": "FSDP"}) == ("MoE", "CP", "FSDP")
    assert row_classes({"moe_experts": "8", "zero_or_fsdp": "ZeRO-3"}) == ("MoE", "FSDP")


def test_no_file_validates_both_shipped_files_with_coverage_and_each_class(capsys) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("the published runs that ship with cfp-megatron") and "README.md" in out.splitlines()[0]
    timed = sum(1 for path in (CSV, MOE_CSV) for row in read_rows(path)
                if any((row.get(k) or "").strip() for k in ("step_time_s", "derived_step_time_s",
                                                             "tokens_per_s_per_gpu")))
    _, kept = _final(out)
    # the rows their source superseded (validation/superseded.yaml) are modelled but left out of the figures
    apart = re.search(r"^superseded by their source's re-measurement.*\((\d+) rows", out, re.MULTILINE)
    modelled = kept + (int(apart.group(1)) if apart else 0)
    assert f"coverage: {modelled} of {timed} rows with a step time modelled" in out
    assert f"MAPE over all {modelled} modelled rows" in out or not apart
    classes = dict(re.findall(r"^(dense|MoE|CP|FSDP)\s+(\d+)\s", out, re.MULTILINE))
    assert int(classes["dense"]) + int(classes["MoE"]) == kept and int(classes["MoE"]) > 0
    # the layout sweeps (docs/validation.md, "Layout sweeps"): Korthikanti et al.'s full vs selective recomputation
    # and its single-layer table; Megatron-Bridge's repeated rows are other containers (another job) at one layout
    sweeps = re.findall(r"^  .* rows ([\d, ]+?)\s+\d+ of \d+ pairs ordered", out, re.MULTILINE)
    assert sweeps == ["17, 18", "19, 20", "21, 22", "23, 24", "26, 27, 28, 29, 30"]


def test_deepseek_v3_runs_as_megatron_bridge_lays_it_out() -> None:
    """Row 73 (61 layers over PP=8 x VP=4, which neither the layers nor the layers plus two divide): the per-stage
    layout Megatron-Bridge's DeepSeek-V3 performance recipe sets, with the recipe's one MTP layer."""
    row = next(r for r in read_rows(CSV) if r["id"] == "73")
    plan = row_plan(row)
    assert plan.job.parallel.pipeline_model_parallel_layout == "Et|(tt|)*30mL"
    assert plan.job.model.mtp_num_layers == 1 and "Et|(tt|)*30mL" in plan.layout
    qwen = next(r for r in read_rows(CSV) if r["id"] == "75")  # 94 + 2 over 8 x 4: the embedding and loss counted
    assert row_plan(qwen).job.parallel.pipeline_model_parallel_layout is None


def test_megatron_bridge_moe_rows_run_the_preset_of_their_container_and_layout() -> None:
    """A 26.x Megatron-Bridge row with the layout of an H100 preset takes its MoE settings; the same row from a 25.x
    container, or with another global batch, ran an earlier configuration and keeps the defaults."""
    base = next(r for r in read_rows(CSV) if r["id"] == "75")  # Qwen3-235B, TP2 PP8 VP4 EP32 on 256 H100s
    row = {**base, "framework": "Megatron-Bridge / NeMo 26.02", "source_detail": "26.02 NeMo container",
           "global_batch_seqs": "8192"}
    preset = row_plan(row).job
    assert preset.parallel.moe_a2a_overlap and not preset.parallel.tp_comm_overlap
    assert preset.model.moe_token_dispatcher.value == "alltoall"
    for other in ({"source_detail": "25.11 NeMo container", "framework": "Megatron-Bridge / NeMo 25.11"},
                  {"global_batch_seqs": "2048"}, {"framework": "NeMo 26.02"}):
        plain = row_plan({**row, **other}).job
        assert not plain.parallel.moe_a2a_overlap and plain.parallel.tp_comm_overlap
    small = {**row, "model": "Qwen3_30B_a3B", "num_gpus": "16", "tp": "1", "pp": "1", "vp": "", "ep": "16",
             "dp": "", "global_batch_seqs": "1024", "layers": "48", "hidden": "2048", "heads": "32",
             "moe_expert_ffn": "768"}
    flex = row_plan(small)
    assert flex.job.model.moe_token_dispatcher.value == "flex" and not flex.job.parallel.moe_a2a_overlap
    assert flex.job.parallel.moe_flex_dispatcher_backend.value == "hybridep" and " flex=hybridep" in flex.layout
    assert not flex.options.flex_backend_unstated


def test_megatron_bridge_rows_run_their_releases_cuda_graphs_and_overlaps() -> None:
    """The recipe facts of ``recipes.yaml`` by release: 25.11's Qwen3-235B H100 preset overlaps the all-to-all
    without TP overlap; 26.02's Qwen3-30B H100 preset (PP=2 x VP=12) runs DeepEP with the overlap, and its BF16
    preset alone captures the router and preprocessing in Transformer Engine CUDA graphs, as the later EP=16 one."""
    qwen = next(r for r in read_rows(CSV) if r["id"] == "75")  # Qwen3-235B, TP2 PP8 VP4 EP32 on 256 H100s
    row = {**qwen, "framework": "Megatron-Bridge / NeMo 25.11", "source_detail": "25.11 NeMo container"}
    preset = row_plan(row).job.parallel
    assert preset.moe_a2a_overlap and not preset.tp_comm_overlap and preset.cuda_graph_impl.value == "none"
    small = {**qwen, "framework": "Megatron-Bridge / NeMo 26.02", "source_detail": "26.02 NeMo container",
             "model": "Qwen3_30B_a3B", "num_gpus": "16", "tp": "1", "pp": "2", "vp": "12", "ep": "8", "dp": "",
             "global_batch_seqs": "1024", "layers": "48", "hidden": "2048", "heads": "32", "moe_expert_ffn": "768",
             "precision": "FP8", "notes": ""}
    fp8 = row_plan(small).job
    assert fp8.model.moe_token_dispatcher.value == "flex" and fp8.parallel.moe_a2a_overlap
    assert fp8.parallel.moe_flex_dispatcher_backend.value == "deepep"  # v0.3.0's moe_flex_dispatcher_backend
    assert fp8.parallel.cuda_graph_impl.value == "none"
    for bf16 in (small, {**small, "pp": "1", "vp": "", "ep": "16", "framework": "Megatron-Bridge / NeMo 26.04",
                         "source_detail": "26.04.01 NeMo container"}):
        plan = row_plan({**bf16, "precision": "BF16"})
        assert plan.job.parallel.cuda_graph_impl.value == "transformer_engine"
        assert plan.job.parallel.graph_scopes() == ("moe_router", "moe_preprocess")
        assert "cg=transformer_engine[moe_router+moe_preprocess]" in plan.layout


def test_rows_of_a_preset_shape_run_its_architecture_and_the_preset_of_their_container() -> None:
    """Row 73 (25.09) takes DeepSeek-V3's architecture from ``conf/model/deepseek_v3.yaml`` (its shape is the
    preset's) and the 25.x H100 preset: DeepEP with the all-to-all overlap, no gradient-reduce overlap; a 26.x row
    of the same layout runs HybridEP without the overlap; another global batch keeps the defaults."""
    row = next(r for r in read_rows(CSV) if r["id"] == "73")
    plan = row_plan(row)
    model, parallel = plan.job.model, plan.job.parallel
    assert model.attention.value == "mla" and (model.q_lora_rank, model.kv_lora_rank) == (1536, 512)
    assert model.moe_shared_expert_intermediate_size == 2048 and model.moe_first_dense_layers == 3
    assert model.moe_token_dispatcher.value == "flex" and parallel.moe_a2a_overlap
    assert parallel.moe_flex_dispatcher_backend.value == "deepep" and " flex=deepep" in plan.layout
    assert not parallel.overlap_grad_reduce and " as deepseek_v3 " in plan.layout
    assert parallel.recompute.value == "selective" and parallel.recompute_modules == "mla_up_proj+mlp"
    later = row_plan({**row, "source_detail": "26.02 NeMo container", "framework": "Megatron-Bridge / NeMo 26.02"}).job
    assert later.model.moe_token_dispatcher.value == "flex" and not later.parallel.moe_a2a_overlap
    assert later.parallel.moe_flex_dispatcher_backend.value == "hybridep"
    other = row_plan({**row, "global_batch_seqs": "4096"}).job
    assert other.model.moe_token_dispatcher.value == "alltoall" and other.parallel.overlap_grad_reduce
    assert other.model.attention.value == "mla"  # the architecture is the model's, whatever the preset
    oss = next(r for r in read_rows(CSV) if r["id"] == "79")  # GPT-OSS 120B: 64 heads of 64 channels on 2880
    assert row_plan(oss).job.model.kv_channels == 64 and " as gpt_oss_120b " in row_plan(oss).layout
    # 25.11: its own preset (v0.2.0): micro-batch 1 with layernorm+moe_act, since the row's MBS 4 x GA 2 x DP 16 is
    # not its global batch of 512; figures that agree keep the row's micro-batch
    v011 = row_plan(oss).job
    assert (v011.parallel.recompute.value, v011.parallel.recompute_modules) == ("selective", "moe_act+layernorm")
    assert v011.train.micro_batch_size == 1
    assert row_plan({**oss, "grad_accum": "8"}).job.train.micro_batch_size == 4
    v2_row = {**oss, "source_detail": "26.02 NeMo container", "framework": "Megatron-Bridge / NeMo 26.02",
              "micro_batch": "1", "global_batch_seqs": "1280"}
    v2 = row_plan(v2_row).job.parallel
    assert (v2.recompute.value, v2.recompute_modules) == ("selective", "moe_act+layernorm")
    stated = row_plan({**v2_row, "recompute": "full"}).job.parallel  # a row's own recomputation wins
    assert stated.recompute.value == "full" and stated.recompute_modules is None
    wider = row_plan({**row, "hidden": "4096"}).job  # not the preset's shape: nothing borrowed
    assert wider.model.attention.value != "mla" and wider.model.moe_first_dense_layers == 0


def test_each_row_runs_the_architecture_its_reported_flop_rate_counts() -> None:
    """Where a row reports both TFLOP/s and tokens/s per GPU, their ratio is the reporter's FLOPs per token, which
    fixes the architecture: the model the validator builds must give it to 1% (PaLM's convention for the dense rows;
    Megatron-Bridge's, which counts causal attention half, for its Qwen3 rows). Nemotron's 256k vocabulary and
    Qwen3's 128-channel heads, which no column states, are what this caught (``validation/model_families.yaml``).
    Left out: GPT-OSS (Megatron-Bridge's formula counts its gated experts as ungated) and DeepSeek-V3 (MTP and MLA
    counted its own way)."""
    checked = []
    for path in (CSV, MOE_CSV):
        for row in read_rows(path):
            if not (row.get("tflops_per_gpu") and row.get("tokens_per_s_per_gpu")):
                continue
            if re.search(r"oss|deepseek", row["model"], re.IGNORECASE):
                continue
            job = row_plan(row).job
            model, seq = job.model, job.train.seq_length
            ours = training_flops_per_token(model, seq)
            if model.is_moe:
                head = model.kv_channels or model.hidden_size // model.num_attention_heads
                ours -= 6.0 * model.num_layers * model.num_attention_heads * head * seq
            reported = float(row["tflops_per_gpu"]) * 1e12 / float(row["tokens_per_s_per_gpu"])
            checked.append(row["id"])
            assert ours == pytest.approx(reported, rel=0.01), (row["id"], row["model"], ours, reported)
    assert {"49", "50", "51", "74", "75", "80", "223"} <= set(checked)
    nemotron = row_plan(next(r for r in read_rows(CSV) if r["id"] == "49")).job.model
    assert (nemotron.vocab_size, nemotron.hidden_dropout) == (256000, 0.0)
    stated = row_plan({**next(r for r in read_rows(CSV) if r["id"] == "49"), "vocab": "32000"}).job.model
    assert stated.vocab_size == 32000  # a stated vocabulary wins
    # A row that leaves them blank still runs its family's vocabulary, KV heads and (its shape then matching) preset.
    llama = next(r for r in read_rows(CSV) if r["id"] == "53")
    blank = row_plan({**llama, "vocab": "", "kv_heads": ""}).job.model
    assert (blank.vocab_size, blank.num_query_groups) == (128256, 8)
    deepseek = next(r for r in read_rows(CSV) if r["id"] == "73")
    assert row_plan({**deepseek, "vocab": ""}).job.model.attention.value == "mla"


def test_blackwell_moe_rows_run_their_precisions_preset() -> None:
    """A 26.x Megatron-Bridge row on Blackwell whose layout is one of its presets takes that preset's dispatcher
    (HybridEP, as ``flex``), overlap, recomputation and CUDA graphs, which differ by precision and release (v0.3.0
    for 26.02, v0.4.1 for 26.04, v0.5.0 for 26.06); an earlier container or another layout keeps the defaults."""
    base = next(r for r in read_rows(CSV) if r["id"] == "73")  # DeepSeek-V3
    row = {**base, "gpu": "GB200 NVL72", "num_gpus": "256", "tp": "1", "pp": "4", "vp": "4", "ep": "64", "dp": "",
           "global_batch_seqs": "4096", "framework": "Megatron-Bridge / NeMo 26.02",
           "source_detail": "26.02 NeMo container, GB200", "precision": "FP8 current scaling"}
    cs = row_plan(row).job
    assert cs.model.moe_token_dispatcher.value == "flex" and not cs.parallel.moe_a2a_overlap
    # every Blackwell DeepSeek-V3 function of deepseek_llm_pretrain.py overlaps the gradient reduction
    assert cs.parallel.recompute_modules == "mla_up_proj" and cs.parallel.overlap_grad_reduce
    assert cs.parallel.graph_scopes() == ("attn", "moe_router", "moe_preprocess")
    later = {**row, "framework": "Megatron-Bridge / NeMo 26.04", "source_detail": "26.04.01 NeMo container, GB200"}
    assert row_plan(later).job.parallel.recompute_modules == "mlp"  # v0.4.x: recompute_modules=["mlp"]
    # MXFP8 ran the FP8 preset up to 26.04; 26.06's overlaps the all-to-all under full-iteration CUDA graphs
    for release, container in (("26.02", "26.02"), ("26.04", "26.04.01")):
        early = row_plan({**row, "precision": "MXFP8", "framework": f"Megatron-Bridge / NeMo {release}",
                          "source_detail": f"{container} NeMo container, GB200"}).job.parallel
        assert not early.moe_a2a_overlap and early.cuda_graph_impl.value == "transformer_engine"
    mx = row_plan({**row, "precision": "MXFP8", "framework": "Megatron-Bridge / NeMo 26.06",
                   "source_detail": "26.06 NeMo container, GB200"}).job
    assert mx.parallel.moe_a2a_overlap and mx.parallel.recompute_modules == "mla_up_proj"
    assert (mx.parallel.cuda_graph_impl.value, mx.parallel.graph_scopes()) == ("local", ("full_iteration",))
    assert row_plan({**row, "precision": "BF16"}).job.parallel.recompute_modules == "mla_up_proj"
    for other in ({"source_detail": "25.11 NeMo container", "framework": "Megatron-Bridge / NeMo 25.11"},
                  {"global_batch_seqs": "8192"}):
        plain = row_plan({**row, **other}).job
        assert plain.model.moe_token_dispatcher.value == "alltoall" and plain.parallel.recompute.value == "none"
    qwen = next(r for r in read_rows(CSV) if r["id"] == "74")
    small = {**qwen, "gpu": "B200", "num_gpus": "8", "tp": "1", "pp": "1", "vp": "", "ep": "8", "dp": "",
             "micro_batch": "4", "global_batch_seqs": "512", "framework": "Megatron-Bridge / NeMo 26.02",
             "source_detail": "26.02 NeMo container, B200", "precision": "BF16"}
    assert row_plan(small).job.model.moe_token_dispatcher.value == "flex"
    for gpu, scopes in (("GB300", ("moe_router", "moe_preprocess")),
                        ("GB200", ("attn", "moe_router", "moe_preprocess"))):
        fp8 = row_plan({**small, "gpu": gpu, "precision": "FP8"}).job.parallel
        assert fp8.cuda_graph_impl.value == "transformer_engine" and fp8.graph_scopes() == scopes
        mx26 = row_plan({**small, "gpu": gpu, "precision": "MXFP8", "framework": "Megatron-Bridge / NeMo 26.06",
                         "source_detail": f"26.06 NeMo container, {gpu}"}).job.parallel
        assert mx26.moe_a2a_overlap and mx26.graph_scopes() == ("full_iteration",)
    oss = {**next(r for r in read_rows(CSV) if r["id"] == "79"), "gpu": "GB200 NVL72", "tp": "1", "pp": "1", "vp": "",
           "ep": "64", "dp": "", "global_batch_seqs": "1280", "framework": "Megatron-Bridge / NeMo 26.02",
           "source_detail": "26.02 NeMo container, GB200", "precision": "BF16"}
    bf16 = row_plan(oss).job  # 26.02 (v0.3.0): GPT_OSS_120B_GB200_BF16_V2 sets neither HybridEP nor the overlap
    assert bf16.model.moe_token_dispatcher.value == "alltoall" and not bf16.parallel.moe_a2a_overlap
    assert bf16.parallel.recompute_modules == "moe_act+layernorm"  # Megatron-Core's order
    oss26 = {**oss, "framework": "Megatron-Bridge / NeMo 26.06", "source_detail": "26.06 NeMo container, GB200"}
    assert row_plan(oss26).job.parallel.moe_a2a_overlap
    mxfp8 = row_plan({**oss26, "precision": "MXFP8"}).job
    assert mxfp8.model.moe_token_dispatcher.value == "flex" and mxfp8.parallel.recompute.value == "none"


LLAMA3_70B_GB200 = {
    "id": "x1", "model": "Llama3 70B", "source": "made up for the test", "layers": "80", "hidden": "8192",
    "ffn_hidden": "28672", "heads": "64", "kv_heads": "8", "vocab": "128256", "seq_len": "8192", "gpu": "GB200",
    "num_gpus": "64", "framework": "Megatron-Bridge / NeMo 26.02", "tp": "1", "pp": "1", "cp": "1",
    "zero_or_fsdp": "Megatron-FSDP optim_grads_params", "micro_batch": "2", "global_batch_seqs": "256",
    "precision": "FP8 current scaling", "step_time_s": "8"}
"""Megatron-Bridge's Llama 3 70B GB200 FP8 preset as a row states it (placeholder step time)."""


def test_megatron_bridge_dense_fsdp_rows_offload_as_their_preset_and_fit() -> None:
    """A Megatron-Bridge Llama 3 70B row on GB200, GB300 or B200 whose layout is its Megatron-FSDP preset's
    offloads the preset's layers' activations (recipes.yaml), and so is predicted inside the GPU it ran on; a row
    stating its recomputation, another layout (the TP 2 x PP 4 MXFP8 preset) or a container before the presets
    offloads none."""
    def offloaded(**changes: str) -> int:
        return row_plan({**LLAMA3_70B_GB200, **changes}).job.parallel.cpu_offloading_num_layers

    assert offloaded() == 40 and offloaded(precision="BF16", micro_batch="1") == 20
    assert offloaded(gpu="GB300") == 20 and offloaded(gpu="GB300", precision="BF16") == 30
    assert offloaded(gpu="B200", num_gpus="64") == 5 and offloaded(global_batch_seqs="128") == 40
    assert offloaded(recompute="full") == 0 and offloaded(precision="FP8 delayed scaling") == 0
    assert offloaded(tp="2", pp="4", vp="5", precision="MXFP8") == 0
    assert offloaded(framework="Megatron-Bridge / NeMo 25.07") == 0
    plan = row_plan(LLAMA3_70B_GB200)
    assert "offload=40L" in plan.layout
    (result,), skipped = predict_rows([LLAMA3_70B_GB200])
    assert not skipped and not result.flag and result.memory_gib <= plan.job.cluster.hbm_gib
    (whole,), _ = predict_rows([{**LLAMA3_70B_GB200, "framework": "Megatron-Bridge / NeMo 25.07"}])
    assert whole.memory_gib > plan.job.cluster.hbm_gib  # every layer's activations on the GPU: it would not fit


def test_megatron_bridge_fsdp_presets_run_their_fsdp_buffers_and_no_fusion_from_25_11() -> None:
    """From v0.2.0 (25.11) Megatron-Bridge's Llama 3 70B Megatron-FSDP presets set gradient_accumulation_fusion off,
    fsdp_double_buffer and an 800M-parameter communication unit (recipes.yaml); 25.09 ran the fusion and the double
    buffer alone. Without the fusion Transformer Engine hands autograd the weight gradient itself, so no placeholder
    is held (3.55 GiB with it: one tensor of each linear's shape and the output layer's, bf16), and the double buffer
    holds two layers' gradients where Megatron-FSDP's default queue holds four."""
    from cfp_megatron.sim.options import WeightGradAccumulation
    from cfp_megatron.sim.simulate import simulate

    plan = row_plan(LLAMA3_70B_GB200)  # 26.02
    assert plan.options.weight_grad_accumulation is WeightGradAccumulation.main_grad_hook
    assert plan.options.fsdp_double_buffer and plan.options.fsdp_unit_size == 800_000_000
    early = row_plan({**LLAMA3_70B_GB200, "framework": "Megatron-Bridge / NeMo 25.09"})
    assert early.options.weight_grad_accumulation is WeightGradAccumulation.fused
    assert early.options.fsdp_double_buffer and early.options.fsdp_unit_size is None
    # Transformer Engine 2.10 (26.02 runs 2.12) made OffloadSynchronizer the default offload handler; 25.09 and
    # 25.11 ran 2.7 and 2.9, whose handler has the last offloaded layer back beside the last layer's passes
    assert not plan.options.offload_v1 and early.options.offload_v1
    assert row_plan({**LLAMA3_70B_GB200, "framework": "Megatron-Bridge / NeMo 25.11"}).options.offload_v1
    before = row_plan({**LLAMA3_70B_GB200, "framework": "Megatron-Bridge / NeMo 25.07"})  # no preset
    assert not before.options.offload_v1
    assert not before.options.fsdp_double_buffer and before.options.fsdp_unit_size is None
    parts = {name: dict(simulate(p.job, options=p.options).memory.parts) for name, p in
             (("ran", plan), ("early", early), ("before", before))}
    hidden, vocab = 8192, 128256
    shapes = hidden * (vocab + (8192 + 2 * 1024) + 8192 + 2 * 28672 + 28672)  # output layer, QKV, proj, FC1, FC2
    assert parts["ran"]["dummy_wgrads"] == 0.0 and parts["early"]["dummy_wgrads"] == pytest.approx(shapes * 2)
    # two layers' FP8 weights either way (their gradients are the backward's, in its working set), and the modules
    # outside Megatron-FSDP's units, gathered in bf16 and never released: the embedding, the output layer, the norm
    outside = 2 * vocab * hidden + 2 * hidden  # the final norm as the row reads it (LayerNorm: weight and bias)
    assert parts["before"]["fsdp_buffers"] == parts["ran"]["fsdp_buffers"] == pytest.approx(
        2 * 855_670_784 * 1.0 + outside * 2.0)


def test_torchtitan_70b_tp8_under_full_recomputation_keeps_each_layers_input_split_over_tp() -> None:
    """torchtitan's Llama 3.1 70B under FSDP2 + TP 8 with its SequenceParallel norms, 16 x 8k tokens a rank, full
    recomputation: a sequence_parallel cell that names the norms in words states SP on, so each of the 80
    checkpointed layers keeps only its input split over TP (2 GiB / 8), and the rank fits its 80 GiB; a cell that
    says no reads off, one that states nothing as blank."""
    from cfp_megatron.sim.simulate import simulate

    row = {**LLAMA3_70B_GB200, "model": "Llama 3.1 70B", "gpu": "H100", "num_gpus": "256", "framework": "torchtitan",
           "tp": "8", "dp": "32", "zero_or_fsdp": "FSDP2", "micro_batch": "16", "global_batch_seqs": "512",
           "recompute": "full", "precision": "bf16", "sequence_parallel": "SequenceParallel norms + loss parallel"}
    plan = row_plan(row)
    assert plan.job.parallel.sp and row_plan({**row, "sequence_parallel": ""}).job.parallel.sp
    assert not row_plan({**row, "sequence_parallel": "no"}).job.parallel.sp
    assert row_plan({**row, "sequence_parallel": "unknown"}).job.parallel.sp  # as blank: torchtitan's TP reading
    memory = simulate(plan.job, options=plan.options).memory
    tokens, hidden = 16 * 8192, 8192
    assert dict(memory.parts)["layer_activations"] == pytest.approx(80 * tokens * hidden * 2 / 8)
    assert memory.total_gib <= plan.job.cluster.hbm_gib


def test_a_gpu_column_stating_its_memory_is_the_memory_the_run_fit_in() -> None:
    """torchtitan's Grand Teton H100s have 96 GB (HBM2e): a row saying so is judged against 96, not the 80 GB SXM
    preset its alias finds; a figure equal to the preset's, or to a whole node's (8 x 40 GB), keeps the preset's."""
    row = {**LLAMA3_70B_GB200, "model": "Llama 3.1 70B", "gpu": "H100 96GB HBM2e", "num_gpus": "256",
           "framework": "torchtitan", "tp": "8", "dp": "32", "zero_or_fsdp": "FSDP2", "micro_batch": "16",
           "global_batch_seqs": "512", "recompute": "full", "precision": "bf16"}
    plan = row_plan(row)
    assert plan.job.cluster.name == "dgx_h100" and plan.job.cluster.hbm_gib == 96.0 and "96GB" in plan.layout
    assert row_plan({**row, "gpu": "H100-SXM5-80GB"}).job.cluster.hbm_gib == 80.0
    assert row_plan({**row, "gpu": "DGX A100 320GB"}).job.cluster.hbm_gib == 40.0
    assert row_plan({**row, "gpu": "H100"}).job.cluster.hbm_gib == 80.0


def test_unreadable_inputs_are_refused_by_name(tmp_path: Path, capsys) -> None:
    header_only = tmp_path / "header.csv"
    header_only.write_text("id,layers,hidden,heads,seq_len,gpu,num_gpus\n")
    no_columns = tmp_path / "columns.csv"
    no_columns.write_text("id,layers\n1,2\n")
    binary = tmp_path / "binary.csv"
    binary.write_bytes(bytes(range(128, 256)))
    for path, says in ((tmp_path / "missing.csv", "no such file"), (tmp_path, "is a directory"),
                       (binary, "not a readable CSV"), (header_only, "a header and no rows"),
                       (no_columns, "no column hidden, heads, seq_len, gpu, num_gpus")):
        assert main([str(path)]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and says in err and "published_runs.csv" in err


def test_bad_step_times_are_listed_not_averaged(tmp_path: Path, capsys) -> None:
    fields = ["id", "model", "layers", "hidden", "heads", "seq_len", "gpu", "num_gpus", "tp", "pp", "dp",
              "micro_batch", "global_batch_seqs", "step_time_s"]
    good = {"id": "1", "model": "m", "layers": "24", "hidden": "2048", "heads": "16", "seq_len": "2048",
            "gpu": "H100-SXM5-80GB", "num_gpus": "8", "tp": "1", "pp": "1", "dp": "8", "micro_batch": "2",
            "global_batch_seqs": "256", "step_time_s": "1.0"}
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows([{**good, "id": "2", "step_time_s": "-1.5"}, {**good, "id": "3", "step_time_s": "nan"},
                          {**good, "id": "4", "step_time_s": "fast"}])
    assert main([str(path)]) == 1  # nothing modelled: no MAPE printed
    out, err = capsys.readouterr()
    assert "must be a finite positive number, not '-1.5'" in out and "not 'nan'" in out
    assert "step_time_s is not a number: 'fast'" in out and "nan" not in out.split('coverage')[1]
    assert "% over" not in out and "no row could be modelled" in err
    with open(path, "a", newline="") as fh:
        csv.DictWriter(fh, fieldnames=fields).writerow(good)
    assert main([str(path)]) == 0
    assert _final(capsys.readouterr().out)[1] == 1


def test_bands_never_overwrite_a_file_it_did_not_write(tmp_path: Path, capsys) -> None:
    """``--bands FILE`` replaces an error-band table (regenerating the shipped one is its use) but refuses any other
    existing file, and a folder, before predicting anything; the file is left as it was."""
    from cfp_megatron.validate import check_bands_path

    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}\n')
    assert main([str(CSV), "--bands", str(mine)]) == 2
    assert "--bands" in capsys.readouterr().err and mine.read_text() == '{"my": "notes"}\n'
    assert "folder" in (check_bands_path(str(tmp_path)) or "")
    table = tmp_path / "bands.json"
    table.write_text('{"quantile": 0.8, "classes": {}}\n')
    assert check_bands_path(str(table)) is None
    assert check_bands_path(str(tmp_path / "new.json")) is None


def test_a_stated_power_limit_slows_the_row_by_the_clock_it_sustains() -> None:
    row = {"id": "1", "model": "m", "layers": "24", "hidden": "4096", "heads": "32", "seq_len": "4096",
           "gpu": "H100-SXM5-80GB", "num_gpus": "8", "tp": "1", "pp": "1", "dp": "8", "micro_batch": "1",
           "global_batch_seqs": "64", "step_time_s": "3.0", "framework": "Megatron-Core"}  # 39% of the peak
    full = predict_rows([row])[0][0]
    capped = predict_rows([{**row, "notes": "GPUs power-capped to 500 W for the whole run"}])[0][0]
    in_gpu = row_plan({**row, "gpu": "H100 SXM 500W"})
    assert capped.plan.job.cluster.power_limit_w == 500.0 and in_gpu.job.cluster.power_limit_w == 500.0
    assert " 500W" in capped.plan.layout and "W" not in full.plan.layout.split()[-1]
    assert capped.predicted_s > full.predicted_s * 1.05  # (500/700)^(1/3): the compute runs at 89% of the clock
    for harmless in ({"notes": "TDP 700 W"}, {"notes": "500 steps, 3200 Gbps network"}):
        assert row_plan({**row, **harmless}).job.cluster.power_limit_w is None


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="no shared data folder beside this checkout to compare with")
def test_shipped_runs_are_the_shared_data() -> None:
    """The copies in the package are byte for byte the project's shared files, and every runs file there is
    shipped."""
    assert sorted(p.name for p in SHARED_DATA.glob("*.csv")) == sorted(p.name for p in PUBLISHED_RUNS)
    for shipped in PUBLISHED_RUNS:
        assert shipped.read_bytes() == (SHARED_DATA / shipped.name).read_bytes(), f"{shipped} differs"


def test_shipped_readme_counts_the_rows_of_each_source() -> None:
    """The README beside the shipped runs names every source (the ``source`` column) with its rows per file."""
    table = dict(re.findall(r"^\| (.+?) \| (\d+ \| \d+) \|$", (PUBLISHED_RUNS_DIR / "README.md").read_text(), re.M))
    counts: dict[str, list[int]] = {}
    for i, path in enumerate(PUBLISHED_RUNS):
        for row in read_rows(path):
            counts.setdefault(row["source"], [0] * len(PUBLISHED_RUNS))[i] += 1
    assert table == {source: " | ".join(map(str, n)) for source, n in counts.items()}
