"""``python -m cfp_megatron.validate``: rows it cannot model faithfully are refused or flagged with the reason, and
its files (``--bands``, ``--plot``, ``--json``) are written whole or not at all."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfp_megatron.base.config import MAX_LAYERS, MAX_WORLD_SIZE
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.validate import InputFileError, RowError, main, predict_rows, read_rows, row_plan

FIELDS = ["id", "model", "layers", "hidden", "heads", "seq_len", "gpu", "num_gpus", "tp", "pp", "dp", "micro_batch",
          "global_batch_seqs", "step_time_s"]
GOOD = {"id": "1", "model": "GPT 1.7B", "layers": "24", "hidden": "2304", "heads": "24", "seq_len": "2048",
        "gpu": "A100-80GB", "num_gpus": "32", "tp": "1", "pp": "1", "dp": "32", "micro_batch": "1",
        "global_batch_seqs": "512", "step_time_s": "3.5"}
"""Row 1 of the shared file (SC21's GPT 1.7B on 32 A100s), in the columns these tests need."""


def _csv(path: Path, rows: list[dict], *, fields: list[str] = FIELDS, encoding: str = "utf-8") -> Path:
    with open(path, "w", newline="", encoding=encoding) as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path: Path, capsys) -> None:
    path = _csv(tmp_path / "excel.csv", [GOOD], encoding="utf-8-sig")
    assert path.read_bytes().startswith(b"\xef\xbb\xbfid,")
    assert [row["id"] for row in read_rows(path)] == ["1"]
    assert main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("over 1 rows") and "\n    1  GPT 1.7B" in out


@pytest.mark.parametrize("column, value, said", [
    ("num_gpus", "32.5", "column num_gpus=32.5: a count of GPUs is a whole number"),
    ("layers", "24.5", "column layers=24.5: a count of layers is a whole number"),
    ("tp", "1.5", "column tp=1.5: a count of ranks"),
    ("micro_batch", "0.5", "column micro_batch=0.5"),
    ("global_batch_seqs", "inf", "column global_batch_seqs=inf"),
    ("heads", "-24", "must be from 1 to"),
    ("num_gpus", str(MAX_WORLD_SIZE + 1), f"must be from 1 to {MAX_WORLD_SIZE:,} (MAX_WORLD_SIZE"),
    ("layers", str(MAX_LAYERS + 1), f"must be from 1 to {MAX_LAYERS:,} (MAX_LAYERS"),
    ("pp", "two", "column pp is not a number: 'two'"),
])
def test_a_count_is_a_whole_number_within_the_training_bounds(column: str, value: str, said: str) -> None:
    with pytest.raises(RowError) as caught:
        row_plan({**GOOD, column: value})
    assert said in str(caught.value)


def test_whole_numbers_written_as_decimals_still_count() -> None:
    assert row_plan({**GOOD, "num_gpus": "32.0", "layers": "2.4e1"}).job.model.num_layers == 24


@pytest.mark.parametrize("change, said", [
    ({"hidden": "2300"}, "column hidden (model.hidden_size=2300): is not divisible by model.num_attention_heads=24"),
    ({"tp": "16", "dp": "2"}, "column tp (parallel.tp=16): model.num_attention_heads=24 is not divisible by"),
    ({"kv_heads": "5"}, "column kv_heads (model.num_query_groups=5): must divide model.num_attention_heads=24"),
])
def test_shapes_the_training_config_refuses_are_refused_with_its_reason(change: dict, said: str) -> None:
    rows, skipped = predict_rows([{**GOOD, **change}])
    assert not rows and said in skipped[0][1]


def test_repeated_ids_are_counted_once_naming_both_lines(tmp_path: Path, capsys) -> None:
    path = _csv(tmp_path / "runs.csv", [GOOD, {**GOOD, "id": "2", "num_gpus": "64", "dp": "64",
                                               "global_batch_seqs": "1024"}, {**GOOD, "step_time_s": "9.0"}])
    results, skipped = predict_rows(read_rows(path))
    assert [r.plan.row_id for r in results] == ["1", "2"]
    assert f"id 1 at {path} line 4 is also the id of {path} line 2" in skipped[0][1]
    report = tmp_path / "report.json"
    assert main([str(path), "--json", str(report)]) == 0
    assert capsys.readouterr().out.strip().endswith("over 2 rows")
    data = json.loads(report.read_text())
    assert [row["line"] for row in data["rows"]] == [2, 3]
    assert data["refused"][0]["line"] == 4 and "also the id of" in data["refused"][0]["reason"]
    assert data["mape"] is not None and data["coverage"] == {"modelled": 2, "with_step_time": 3}


def test_a_blank_id_and_a_misaligned_row_are_refused(tmp_path: Path) -> None:
    path = _csv(tmp_path / "runs.csv", [GOOD, {**GOOD, "id": ""}])
    with open(path, "a") as fh:
        fh.write("3,GPT 1.7B,24,2304,24,2048,A100-80GB,32,1,1,32,1,512,3.5,extra\n4,GPT,24\n")
    results, skipped = predict_rows(read_rows(path))
    assert len(results) == 1
    reasons = [reason for _, reason in skipped]
    assert "line 3: the id is blank" in reasons[0]
    assert f"{path} line 4 has 15 fields where the header has 14" in reasons[1]
    assert f"{path} line 5 has 3 fields" in reasons[2]


def test_a_run_that_cannot_fit_its_gpus_is_refused_and_one_slightly_over_is_flagged(tmp_path: Path, capsys) -> None:
    absurd = {**GOOD, "id": "2", "num_gpus": "1", "dp": "1", "micro_batch": "65536", "global_batch_seqs": "65536",
              "step_time_s": "20000"}  # 22% of the GPU's peak: a step time it could have run, a memory it could not
    results, skipped = predict_rows([GOOD, absurd])
    assert [r.plan.row_id for r in results] == ["1"] and not results[0].flag
    assert "GiB per GPU is over 4 times the GPU's 80 GiB" in skipped[0][1]
    over = {**GOOD, "id": "3", "num_gpus": "8", "dp": "8", "micro_batch": "16", "global_batch_seqs": "128"}
    flagged = predict_rows([over])[0][0]
    assert 80 < flagged.memory_gib < 320 and "above the GPU's 80 GiB" in flagged.flag
    assert main([str(_csv(tmp_path / "runs.csv", [GOOD, absurd, over]))]) == 0
    out = capsys.readouterr().out
    assert "flagged, kept in the figures (1 rows" in out and out.strip().endswith("over 2 rows")


@pytest.mark.parametrize("header, said", [
    (["micro_batch_size" if name == "micro_batch" else name for name in FIELDS], "rename it 'micro_batch'"),
    ([*FIELDS, "layers"], "column 'layers' appears twice in the header (columns 3 and 15)"),
])
def test_a_header_that_would_leave_a_column_unread_is_refused(tmp_path: Path, header: list[str], said: str) -> None:
    path = tmp_path / "runs.csv"
    path.write_text(",".join(header) + "\n" + ",".join(GOOD.get(name, "24") for name in header) + "\n")
    with pytest.raises(InputFileError) as caught:
        read_rows(path)
    assert str(path) in str(caught.value) and said in str(caught.value)


def test_columns_outside_the_schema_are_named_as_not_read(tmp_path: Path, capsys) -> None:
    path = _csv(tmp_path / "runs.csv", [{**GOOD, "cluster_name": "selene"}], fields=[*FIELDS, "cluster_name"])
    assert main([str(path)]) == 0
    assert f"note: {path}: column(s) cluster_name are not in the runs schema" in capsys.readouterr().out


def test_no_good_row_is_an_error_exit_that_writes_no_bands(tmp_path: Path, capsys) -> None:
    path = _csv(tmp_path / "runs.csv", [{**GOOD, "num_gpus": "32.5"}])
    bands = tmp_path / "bands.json"
    assert main([str(path), "--bands", str(bands)]) == 1
    err = capsys.readouterr().err
    assert f"no row could be modelled (the 1 rows of {path}" in err and "no --bands" in err and not bands.exists()


@pytest.mark.parametrize(("step", "says"), [
    ("1e-9", "faster than the hardware (its fastest peak for this precision is 312 TFLOP/s)"),
    ("0.3", "faster than the hardware"),  # 41 ms per step of 32 A100s would be 118% of their peak
    ("3500", "below 1%: far slower than any published run (a step time in milliseconds"),
])
def test_a_step_time_no_gpu_could_have_run_is_refused(step: str, says: str) -> None:
    results, skipped = predict_rows([GOOD, {**GOOD, "id": "2", "step_time_s": step}])
    assert [r.plan.row_id for r in results] == ["1"] and says in skipped[0][1]
    assert "model FLOPs utilisation" in skipped[0][1]


def test_a_moe_row_without_its_expert_fields_and_experts_without_a_count_are_refused() -> None:
    moe = {**GOOD, "moe_experts": "8", "moe_topk": "2", "moe_expert_ffn": "9216"}
    rows = [{**moe, "id": "2", "moe_topk": ""}, {**moe, "id": "3", "moe_expert_ffn": " "},
            {**GOOD, "id": "4", "moe_topk": "2"}, {**GOOD, "id": "5", "ep": "4"},
            {**GOOD, "id": "6", "arch_type": "MoE"}]
    results, skipped = predict_rows([moe, *rows])
    assert [r.plan.row_id for r in results] == ["1"]
    said = [reason for _, reason in skipped]
    assert "a MoE row (moe_experts=8) with moe_topk blank" in said[0]
    assert "with moe_expert_ffn blank" in said[1]
    for reason, stated in zip(said[2:], ("moe_topk=2", "ep=4", "arch_type=MoE"), strict=True):
        assert f"states experts ({stated}) but moe_experts is blank" in reason


def test_bands_of_one_source_and_two_options_on_one_file_are_refused(tmp_path: Path, capsys) -> None:
    runs = _csv(tmp_path / "runs.csv", [GOOD, {**GOOD, "id": "2", "num_gpus": "64", "dp": "64"}])
    bands = tmp_path / "bands.json"
    assert main([str(runs), "--bands", str(bands)]) == 2  # no row names a source: one source, none to fit on
    assert "leaving each source out, which leaves no rows to fit on" in capsys.readouterr().err
    assert not bands.exists()
    assert main([str(runs), "--json", str(bands), "--bands", str(tmp_path / "." / "bands.json")]) == 2
    assert "--bands names the same file, so one would replace the other" in capsys.readouterr().err
    assert not bands.exists()


def test_a_gpu_whose_model_number_goes_on_is_not_the_preset_inside_its_name() -> None:
    from cfp_megatron.cluster.presets import preset_for_gpu

    for name in ("NVIDIA RTX A1000", "H1000", "B2000"):  # other cards: A100, H100 and B200 are not their models
        assert preset_for_gpu(name) is None
    for name, preset in (("A100-80GB (DGX A100, Selene)", "dgx_a100"), ("8xH100 SXM", "dgx_h100"),
                         ("H20 96GB", "h20"), ("H200 SXM 141GB", "h200")):
        assert preset_for_gpu(name) == preset
    results, skipped = predict_rows([GOOD, {**GOOD, "id": "2", "gpu": "NVIDIA RTX A1000"}])
    assert [r.plan.row_id for r in results] == ["1"]
    assert "GPU 'NVIDIA RTX A1000' has no hardware preset" in skipped[0][1]


def test_a_file_with_another_separator_is_named_as_such(tmp_path: Path) -> None:
    tabs = _csv(tmp_path / "runs.tsv", [GOOD])
    tabs.write_text(tabs.read_text().replace(",", "\t"))
    with pytest.raises(InputFileError, match="separated by tabs, not commas"):
        read_rows(tabs)


def test_json_replaces_its_own_report_and_nothing_else(tmp_path: Path, capsys) -> None:
    runs = _csv(tmp_path / "runs.csv", [GOOD])
    mine = tmp_path / "notes.json"
    mine.write_text('{"my": "notes"}\n')
    assert main([str(runs), "--json", str(mine)]) == 2
    assert "--json" in capsys.readouterr().err and mine.read_text() == '{"my": "notes"}\n'
    report = tmp_path / "report.json"
    assert main([str(runs), "--json", str(report)]) == 0 and main([str(runs), "--json", str(report)]) == 0
    assert json.loads(report.read_text())["rows"][0]["id"] == "1"


# ---------------------------------------------------------------------------------------- full and read-only disks
@contextlib.contextmanager
def _tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``folder`` (skips the test where this user may not mount)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                              text=True, check=False)
    except OSError as err:  # no mount command
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)


def _fill(folder: Path) -> None:
    """Fill the file system of ``folder`` until it refuses another byte."""
    with contextlib.suppress(OSError), open(folder / "filler", "wb", buffering=0) as fh:
        while True:
            fh.write(b"\0" * 4096)


KEPT = {"--bands": '{"quantile": 0.8, "classes": {}}\n',
        "--json": json.dumps({"rows": [], "refused": [], "coverage": {}, "mape": None}) + "\n"}
"""An earlier file of each option that a new run replaces: it must stay as it was when the write fails."""


@pytest.mark.parametrize("option, name", [("--bands", "bands.json"), ("--plot", "scatter.png"),
                                          ("--json", "report.json")])
def test_a_full_disk_is_refused_before_any_row_is_predicted(tmp_path: Path, capsys, option: str, name: str) -> None:
    runs = _csv(tmp_path / "runs.csv", [GOOD])
    with _tmpfs(tmp_path / "full", "size=64k") as full:
        if option in KEPT:
            (full / name).write_text(KEPT[option])
        _fill(full)
        assert main([str(runs), option, str(full / name)]) == 2
        out, err = capsys.readouterr()
        assert f"validate: {option} {full / name}: no file can be written into the folder {full}" in err
        assert out == "" and "Traceback" not in err
        assert sorted(p.name for p in full.iterdir()) == sorted(["filler", *([name] if option in KEPT else [])])
        if option in KEPT:
            assert (full / name).read_text() == KEPT[option]


@pytest.mark.parametrize("option, name, rows", [("--plot", "scatter.png", 1), ("--json", "report.json", 30)])
def test_a_disk_that_fills_while_writing_leaves_nothing_half_written(tmp_path: Path, capsys, option: str, name: str,
                                                                     rows: int) -> None:
    runs = _csv(tmp_path / "runs.csv", [{**GOOD, "id": str(i)} for i in range(rows)])
    with _tmpfs(tmp_path / "full", "size=64k") as full:
        if option in KEPT:
            (full / name).write_text(KEPT[option])
        _fill(full)
        os.truncate(full / "filler", (full / "filler").stat().st_size - 4096)  # room for a name, not the file
        assert main([str(runs), option, str(full / name)]) == 2
        err = capsys.readouterr().err
        assert f"validate: {full / name} ({option}) cannot be written: the disk is full" in err
        assert "Traceback" not in err
        assert sorted(p.name for p in full.iterdir()) == sorted(["filler", *([name] if option in KEPT else [])])
        if option in KEPT:
            assert (full / name).read_text() == KEPT[option]


@pytest.mark.parametrize("option, name", [("--bands", "bands.json"), ("--plot", "scatter.png"),
                                          ("--json", "report.json")])
def test_a_read_only_disk_is_refused_before_any_row_is_predicted(tmp_path: Path, capsys, option: str,
                                                                  name: str) -> None:
    runs = _csv(tmp_path / "runs.csv", [GOOD])
    with _tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
        assert main([str(runs), option, str(ro / name)]) == 2
        out, err = capsys.readouterr()
        assert f"validate: {option} {ro / name}: no file can be written into the folder {ro}" in err
        assert out == "" and not any(ro.iterdir())


# --------------------------------------------------------------------------------------------------------------------
# Every stated column read (issue N, item 6): the fabric, the pipeline schedule, the precision variant, a power limit.


@pytest.mark.parametrize("text, network, links, gbps", [
    ("Selene DGX A100: NVLink/NVSwitch intra-node; 8x200Gb/s HDR InfiniBand per node", "infiniband", 8, 200.0),
    ("4 Omni-Path links per node", "omnipath", 4, 100.0),  # the fabric's 100 Gb/s link (fabrics.yaml)
    ("Omni-Path (4 x 100 Gb/s per node)", "omnipath", 4, 100.0),
    ("1600 Gbps RoCE node-node", "roce", 8, 200.0),  # a node's total over the preset's 8 links
    ("NDR 400 Gb/s InfiniBand", "infiniband", 8, 400.0),
    ("HDR InfiniBand", "infiniband", 8, 200.0),  # the generation's line rate
    ("400 Gbps EFA", "efa", 8, 50.0),  # above EFA's 100 Gb/s link: the node's total (4 x 100 on P4)
    ("Slingshot-11, 4x200 Gbps per node", "slingshot", 4, 200.0),
    ("25 GB/s per GPU InfiniBand", "infiniband", 8, 200.0),  # bytes, per GPU
    ("NVL72 + 4x800G XDR InfiniBand", "infiniband", 4, 800.0),
])
def test_the_interconnect_column_is_the_rows_network(text: str, network: str, links: int, gbps: float) -> None:
    cluster = row_plan({**GOOD, "interconnect": text}).job.cluster
    assert (cluster.network.value, cluster.nics_per_node, cluster.nic_gbps) == (network, links, gbps)


def test_a_row_on_four_omni_path_links_runs_slower_than_on_eight_hdr_rails() -> None:
    """4 x 100 Gb/s Omni-Path per node of 8 GPUs is 1/4 of a DGX A100's 8 x 200 Gb/s, and reaches 0.34 of its line rate
    against InfiniBand's 0.85 (cluster/fabrics.yaml): the data-parallel gradient all-reduce across nodes slows."""
    rows = [{**GOOD, "id": "1", "interconnect": "8x200Gb/s HDR InfiniBand per node"},
            {**GOOD, "id": "2", "interconnect": "4 Omni-Path links per node"}, {**GOOD, "id": "3"}]
    (ib, opa, blank), skipped = predict_rows(rows)
    assert not skipped and ib.predicted_s == pytest.approx(blank.predicted_s)  # a blank column: the preset's fabric
    assert opa.predicted_s > 1.05 * ib.predicted_s
    assert opa.plan.job.cluster.network_bandwidth_gbps == pytest.approx(ib.plan.job.cluster.network_bandwidth_gbps / 4)
    assert "omnipath 4x100G" in opa.plan.layout and not ib.plan.approximations


def test_an_interconnect_naming_no_fabric_is_said_with_its_text_and_row(tmp_path: Path, capsys) -> None:
    runs = _csv(tmp_path / "runs.csv", [{**GOOD, "interconnect": "Tofu-D torus"}], fields=[*FIELDS, "interconnect"])
    plan = row_plan(read_rows(runs)[0])
    assert plan.job.cluster.network_bandwidth_gbps == 25.0  # the dgx_a100 preset's network, said not silent
    assert "'Tofu-D torus' names no fabric" in plan.approximations[0] and "dgx_a100" in plan.approximations[0]
    assert main([str(runs), "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "priced approximately or not understood (1 rows" in out and "    1  interconnect 'Tofu-D torus'" in out
    assert "Tofu-D" in json.loads((tmp_path / "r.json").read_text())["rows"][0]["approximations"][0]


def test_a_scale_up_only_interconnect_keeps_the_presets_network() -> None:
    plan = row_plan({**GOOD, "interconnect": "NVLink/NVSwitch intra-node"})
    assert plan.job.cluster.network_bandwidth_gbps == 25.0 and not plan.approximations


PIPELINE = {**GOOD, "layers": "24", "tp": "1", "pp": "4", "dp": "8"}


@pytest.mark.parametrize("schedule, vp, chunks, runs, said", [
    ("interleaved 1F1B (3 stages per rank)", "", 3, "megatron", ""),  # the chunks the text states, where vp is blank
    ("interleaved 1F1B (3 stages per rank)", "2", 2, "megatron", "the vp column 2"),  # the vp column wins, said
    ("1F1B (non-interleaved)", "", 1, "megatron", ""),
    ("GPipe", "", 1, "gpipe", ""),
    ("ZB-H1", "", 1, "zb_h1", "greedy one under the same memory limit"),
    ("ZB-1p", "", 1, "zb_h1", "greedy one under the same memory limit"),
    ("ZB-2p", "", 1, "zb_h2", "greedy one under the same memory limit"),
    ("zero bubble", "", 1, "zb_h1", "does not say its memory limit"),
    ("ZB-2p", "2", 2, "megatron", "runs one model chunk a rank but the vp column says 2"),
    ("ZB-V", "", 1, "megatron", "V-shaped zero-bubble schedules"),
    ("DualPipe", "", 1, "megatron", "DualPipe"),
    ("interleaved", "", 1, "megatron", "neither it nor the vp column states the chunks"),
    ("round robin", "", 1, "megatron", "'round robin' names no schedule"),
])
def test_the_pp_schedule_column_is_the_jobs_schedule(schedule: str, vp: str, chunks: int, runs: str,
                                                     said: str) -> None:
    plan = row_plan({**PIPELINE, "pp_schedule": schedule, "vp": vp})
    assert (plan.job.parallel.vpp or 1) == chunks
    assert plan.options.pipeline_schedule.value == runs
    assert (said in " ".join(plan.approximations)) if said else not plan.approximations


@pytest.mark.parametrize("framework, how", [
    ("Megatron-LM (2021)", "autograd"),  # before its gradient accumulation fusion (frameworks.yaml)
    ("Megatron-LM (2022)", "fused"), ("NeMo 24.07 (Megatron-Core)", "fused"), ("", "fused"),
])
def test_the_framework_says_how_weight_gradients_accumulate(framework: str, how: str) -> None:
    assert row_plan({**GOOD, "framework": framework}).options.weight_grad_accumulation.value == how


def test_a_zero_bubble_row_is_priced_faster_than_its_1f1b_twin_and_gpipe_holds_every_micro_batch() -> None:
    """The schedule column changes the price: ZB-2p below ZB-1p below 1F1B on the same row; GPipe holds the
    activations of all its micro-batches (32 here, 4 stages), 1F1B at most 4."""
    steps, memory = {}, {}
    for schedule in ("1F1B", "ZB-1p", "ZB-2p", "GPipe"):
        plan = row_plan({**PIPELINE, "pp_schedule": schedule})
        prediction = simulate(plan.job, options=plan.options)
        steps[schedule], memory[schedule] = prediction.step_time_s, prediction.memory.activations
    assert steps["ZB-2p"] < steps["ZB-1p"] < steps["1F1B"]
    assert memory["GPipe"] > 4 * memory["1F1B"]


@pytest.mark.parametrize("precision, runs, fp8, said", [
    ("mixed 16-bit", "bf16", False, ""), ("amp_bf16", "bf16", False, ""), ("fp16", "fp16", False, ""),
    ("", "bf16", False, ""), ("tf32", "fp32", False, ""),
    ("FP8", "bf16", True, "without fp8 tensor cores"),  # on the A100 row: priced as bf16, said
    ("NVFP4", "bf16", True, "without nvfp4 tensor cores"), ("MXFP8", "bf16", True, "without mxfp8 tensor cores"),
    ("FP8 current scaling", "bf16", True, "without fp8 tensor cores"),
    ("int4 weights", "bf16", False, "'int4 weights' names no variant"),
])
def test_the_precision_column_is_read_as_a_variant(precision: str, runs: str, fp8: bool, said: str) -> None:
    plan = row_plan({**GOOD, "precision": precision})
    assert plan.job.train.precision.value == runs
    assert (said in " ".join(plan.approximations)) if said else not plan.approximations


@pytest.mark.parametrize(("gpu", "precision", "runs", "said"), [
    ("H100-SXM5-80GB", "FP8", "fp8-delayed", ""), ("H100-SXM5-80GB", "FP8 current scaling", "fp8-tensorwise", ""),
    ("H100-SXM5-80GB", "FP8 blockwise (128x128)", "fp8-blockwise", ""),
    ("H100-SXM5-80GB", "NVFP4", "bf16", "without nvfp4 tensor cores"),
    ("B200", "NVFP4", "fp4-nvfp4", ""), ("GB200", "MXFP8", "fp8-mxfp8", ""),
    ("B200", "MXFP4", "fp4-nvfp4", "priced as NVFP4"),
])
def test_each_format_a_row_states_is_priced_by_the_format_model(gpu: str, precision: str, runs: str,
                                                                said: str) -> None:
    """The row's own format goes through the planner's format model (NVFP4 at Blackwell's FP4 rate, MXFP8 with its
    block scales); said only where it is not what ran."""
    plan = row_plan({**GOOD, "gpu": gpu, "precision": precision})
    assert NumberFormat.of(plan.job.train).name == runs
    assert (said in " ".join(plan.approximations)) if said else not plan.approximations


def test_a_power_limit_below_the_tdp_scales_the_peaks_and_says_how() -> None:
    plan = row_plan({**GOOD, "gpu": "H100-SXM5-80GB", "notes": "GPUs power capped at 500 W"})
    assert plan.job.cluster.power_limit_w == 500.0 and " 500W" in plan.layout
    assert "upper bound" in plan.approximations[0] and "GB300" in plan.approximations[0]
    assert not row_plan({**GOOD, "gpu": "H100-SXM5-80GB", "notes": "power limit 700 W"}).approximations
