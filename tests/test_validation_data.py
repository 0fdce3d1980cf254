"""The validator's data files (``cfp_megatron/validation/*.yaml``): each entry names its source, they ship with the
package, and an entry added to a file changes how a row is read without a change to the code."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

from cfp_megatron.base.compose import CONF_DIR
from cfp_megatron.base.config import FsdpStrategy
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.options import ApexAdamStates
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.validate import row_plan
from cfp_megatron.validation.data import (
    DATA_DIR,
    FAMILIES_FILE,
    FRAMEWORKS_FILE,
    PRECISIONS_FILE,
    RECIPES_FILE,
    SCHEDULES_FILE,
    SETTINGS_FILE,
    ValidationDataError,
    load_data,
    load_families,
    load_frameworks,
    load_precisions,
    load_recipes,
    load_schedules,
    load_source_settings,
)
from cfp_megatron.validation.defaults import framework_of, row_framework, source_setting, stated_row
from cfp_megatron.validation.rows import PUBLISHED_RUNS, read_rows

ROOT = Path(__file__).resolve().parent.parent
ROW = {"id": "1", "model": "GPT 1.7B", "layers": "24", "hidden": "2304", "heads": "24", "seq_len": "2048",
       "gpu": "A100-80GB", "num_gpus": "32", "tp": "2", "pp": "1", "micro_batch": "1", "global_batch_seqs": "512",
       "step_time_s": "3.5"}
"""Row 1 of the shared file (SC21's GPT 1.7B on 32 A100s) at TP=2, with no framework, sharding or SP stated."""


def test_every_entry_of_the_shipped_files_names_its_source() -> None:
    data = load_data()
    families = load_families()
    entries = [*data.frameworks, families.default, *families.families, *data.recipes, *data.settings]
    assert (len(data.frameworks), len(families.families), len(data.recipes)) >= (5, 8, 25)
    assert all(entry.name and len(entry.source) > 20 for entry in entries)
    presets = {path.stem for path in (CONF_DIR / "cluster").glob("*.yaml")}
    assert {name for recipe in data.recipes for name in recipe.hardware} <= presets
    assert {recipe.framework for recipe in data.recipes} <= {framework.name for framework in data.frameworks}


def test_the_data_files_ship_with_the_package() -> None:
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["cfp_megatron"]
    shipped = [path.relative_to(DATA_DIR.parent).as_posix() for path in DATA_DIR.glob("*.yaml")]
    assert {"validation/frameworks.yaml", "validation/model_families.yaml", "validation/precisions.yaml",
            "validation/recipes.yaml", "validation/schedules.yaml",
            SETTINGS_FILE.relative_to(DATA_DIR.parent).as_posix()} <= set(shipped)
    assert all(any(fnmatch.fnmatch(name, glob) for glob in globs) for name in shipped)


@pytest.mark.parametrize("framework, entry", [
    ("Megatron-LM (2021)", "Megatron-LM before 2022"), ("Megatron-LM (2022)", "Megatron-LM before 2023"),
    ("Megatron-Core (2022)", "Megatron-LM before 2023"),
    ("Megatron-Bridge / NeMo 26.02", "Megatron-Bridge"),
    ("NeMo 24.07 (Megatron-Core)", "NeMo 1 (NeMo-Framework-Launcher)"),
    ("NeMo 24.03.01", "NeMo 1 (NeMo-Framework-Launcher)"), ("NeMo 25.02", "NeMo"),
    ("Megatron-Core r0.8.0", "Megatron-Core"), ("Megatron-LM (Megatron-Core 0.12)", "Megatron-Core"),
    ("Megatron-LM", "any other framework"), ("llm-foundry / Composer", "llm-foundry"),
    ("torchtitan", "torchtitan"), ("", "any other framework"),
])
def test_a_framework_column_finds_its_entry_in_file_order(framework: str, entry: str) -> None:
    assert framework_of({"framework": framework}, load_data()).name == entry


def test_the_frameworks_readings_reach_the_plan() -> None:
    legacy = row_plan({**ROW, "framework": "Megatron-LM (2021)"})
    assert legacy.options.attention.value == "fused_softmax" and not legacy.job.parallel.overlap_grad_reduce
    # Megatron-LM's scatter/gather pipeline exchange before Megatron-Core; Megatron-Core sends the whole tensor
    assert legacy.options.pipeline_scatter_gather
    assert not row_plan({**ROW, "framework": "Megatron-Core r0.8.0"}).options.pipeline_scatter_gather
    bridge = row_plan({**ROW, "framework": "Megatron-Bridge / NeMo 25.09"}).job.parallel
    assert bridge.sp and bridge.distributed_optimizer and bridge.tp_comm_overlap and not bridge.grad_reduce_in_fp32
    other = row_plan({**ROW, "framework": "llm-foundry / Composer"}).job.parallel
    assert not (other.sp or other.distributed_optimizer or other.tp_comm_overlap) and other.grad_reduce_in_fp32
    # PyTorch FSDP's fp32 shard is the parameter (memory only), where the row shards; NVIDIA's recipes fuse the loss
    sharded = {**ROW, "framework": "llm-foundry / Composer", "zero_or_fsdp": "FSDP FULL_SHARD"}
    assert row_plan(sharded).options.torch_fsdp and not row_plan({**sharded, "zero_or_fsdp": ""}).options.torch_fsdp
    assert not row_plan(sharded).options.te_cross_entropy
    assert row_plan({**ROW, "framework": "Megatron-Bridge / NeMo 25.09"}).options.te_cross_entropy
    # torchtitan's TP plan always shards its norms over the sequence (SequenceParallel on attention_norm/ffn_norm)
    titan = row_plan({**ROW, "framework": "torchtitan"}).job.parallel
    assert titan.sp and not (titan.distributed_optimizer or titan.tp_comm_overlap) and titan.grad_reduce_in_fp32
    assert not row_plan({**ROW, "framework": "torchtitan", "tp": "1"}).job.parallel.sp  # SP needs TP > 1
    assert not row_plan({**ROW, "framework": "torchtitan", "sequence_parallel": "no"}).job.parallel.sp
    stated = row_plan({**ROW, "framework": "Megatron-Bridge / NeMo 25.09", "sequence_parallel": "no",
                       "zero_or_fsdp": "DDP"}).job.parallel
    assert not (stated.sp or stated.distributed_optimizer)  # a stated column wins over the framework's reading


def test_nemo_1s_apex_optimizer_reaches_the_options_and_prices_its_states() -> None:
    nemo = {**ROW, "framework": "NeMo 24.07 (Megatron-Core)"}
    plans = {name: row_plan(row) for name, row in (
        ("remainders", nemo), ("bf16", {**nemo, "model": "Nemotron-4 340B"}),
        ("megatron", {**nemo, "framework": "Megatron-Core r0.8.0"}))}
    assert plans["remainders"].options.apex_adam is ApexAdamStates.remainders
    assert plans["bf16"].options.apex_adam is ApexAdamStates.bf16  # nemotron_340b.yaml's optim.dtype: bf16
    assert plans["megatron"].options.apex_adam is None
    assert row_plan({**nemo, "zero_or_fsdp": "DDP"}).options.apex_adam is None  # only the distributed optimizer's
    base = plans["remainders"]
    memory = {name: simulate(base.job, options=dataclasses.replace(base.options, apex_adam=plan.options.apex_adam))
              .memory for name, plan in plans.items()}
    # Megatron-Core: fp32 master + two fp32 moments (12 B a parameter over DP); Apex with remainders: int16
    # remainder + fp32 moments (10 B); with bf16 states: two bf16 moments, no master (4 B). Nothing else moves.
    megatron = memory["megatron"].optimizer_states
    assert memory["remainders"].optimizer_states == pytest.approx(megatron * 10 / 12)
    assert memory["bf16"].optimizer_states == pytest.approx(megatron * 4 / 12)
    for name in ("remainders", "bf16"):
        assert memory[name].total - memory["megatron"].total == pytest.approx(
            memory[name].optimizer_states - megatron)


def _with_entry(tmp_path: Path, source: Path, key: str, entry: str) -> Path:
    """A copy of ``source`` in ``tmp_path`` with ``entry`` (YAML, indented as a list item) first under ``key:``."""
    text = source.read_text()
    assert text.count(f"\n{key}:\n") == 1
    path = tmp_path / source.name
    path.write_text(text.replace(f"\n{key}:\n", f"\n{key}:\n{entry}"))
    return path


def test_a_framework_entry_in_a_data_file_changes_how_a_blank_column_is_read(tmp_path: Path) -> None:
    frameworks = _with_entry(tmp_path, FRAMEWORKS_FILE, "frameworks", """\
  - name: torchtitan
    match: {contains: [torchtitan]}
    blank: {sequence_parallel: "yes", zero_or_fsdp: FSDP}
    runs: {attention: flash, overlap_grad_reduce: true, tp_comm_overlap: false, grad_reduce_in_fp32: false}
    source: a test's entry
""")
    row = {**ROW, "framework": "torchtitan"}
    shipped = row_plan(row)
    assert shipped.job.parallel.fsdp is FsdpStrategy.none and shipped.job.parallel.grad_reduce_in_fp32
    read = row_plan(row, data=load_data(frameworks=frameworks))
    assert read.job.parallel.fsdp is FsdpStrategy.optim_grads_params
    assert read.job.parallel.sp and not read.job.parallel.grad_reduce_in_fp32
    assert " fsdp" in read.layout
    ddp = row_plan({**row, "zero_or_fsdp": "DDP"}, data=load_data(frameworks=frameworks))
    assert ddp.job.parallel.fsdp is FsdpStrategy.none


@pytest.mark.parametrize("model, tied", [("GPT 175B (GPT-3)", True), ("GPT3-5B", True), ("MPT-7b", True),
                                         ("GPT OSS 120B", False), ("GPT-NeoX 20B", False), ("LLAMA2-7B", False)])
def test_gpt_and_mpt_tie_their_embeddings(model: str, tied: bool) -> None:
    assert row_plan({**ROW, "model": model}).job.model.tie_embeddings is tied


def test_a_family_entry_in_a_data_file_fills_a_blank_vocabulary(tmp_path: Path) -> None:
    families = _with_entry(tmp_path, FAMILIES_FILE, "families", """\
  - name: Falcon
    pattern: '\\bfalcon'
    blank: {vocab: 65024, kv_heads: 8}
    source: a test's entry
""")
    row = {**ROW, "model": "Falcon 40B"}
    assert row_plan(row).job.model.vocab_size == 51200  # the default entry's
    model = row_plan(row, data=load_data(families=families)).job.model
    assert (model.vocab_size, model.num_query_groups) == (65024, 8)
    assert row_plan({**row, "vocab": "50000"}, data=load_data(families=families)).job.model.vocab_size == 50000


@pytest.mark.parametrize("path, key, entry, said", [
    (FRAMEWORKS_FILE, "frameworks", "  - {name: x, match: {}, runs: {attention: flash, overlap_grad_reduce: true, "
     "tp_comm_overlap: true, grad_reduce_in_fp32: true}}\n", "entry 1 ('x') names no source"),
    (FRAMEWORKS_FILE, "frameworks", "  - {name: x, match: {}, colour: red, source: s}\n", "unknown key(s) colour"),
    (FRAMEWORKS_FILE, "frameworks", "  - {name: x, match: {}, runs: {attention: flash, overlap_grad_reduce: true, "
     "tp_comm_overlap: true, grad_reduce_in_fp32: true, apex_distributed_adam: {'': fp16}}, source: s}\n",
     "apex_distributed_adam={'': 'fp16'}"),
    (FRAMEWORKS_FILE, "frameworks", "  - {name: x, match: {}, runs: {attention: flash, overlap_grad_reduce: true, "
     "tp_comm_overlap: true, grad_reduce_in_fp32: true, weight_grad_accumulation: lazy}, source: s}\n",
     "weight_grad_accumulation='lazy'"),
    (FRAMEWORKS_FILE, "frameworks", "  - {name: x, match: {}, runs: {attention: flash, overlap_grad_reduce: true, "
     "tp_comm_overlap: true, grad_reduce_in_fp32: true, moe_layer_syncs: -1}, source: s}\n", "moe_layer_syncs=-1"),
    (FAMILIES_FILE, "families", "  - {name: x, pattern: '(', source: s}\n", "not a regular expression"),
    (RECIPES_FILE, "recipes", "  - {name: x, releases: ['26.1', null], model: m, hardware: [b200], layouts: "
     "[{gpus: 8, tp: 1, pp: 1, vp: 1, ep: 8, global_batch: 512}], dispatcher: flex, a2a_overlap: false, "
     "source: s}\n", "release '26.1'"),
    (RECIPES_FILE, "recipes", "  - {name: x, releases: ['26.01', null], model: m, hardware: [b200], layouts: "
     "[{gpus: 8, tp: 1, pp: 1, vp: 1, ep: 8, global_batch: 512}], dispatcher: flex, a2a_overlap: false, "
     "cuda_graph_impl: transformer_engine, cuda_graph_scope: moe_routers, source: s}\n",
     "cuda_graph_scope='moe_routers'"),
    (RECIPES_FILE, "recipes", "  - {name: x, releases: ['26.01', null], model: m, hardware: [b200], layouts: "
     "[{gpus: 8, tp: 1, pp: 1, vp: 1, ep: 8, global_batch: 512}], dispatcher: flex, a2a_overlap: false, "
     "cuda_graph_scope: moe_router, source: s}\n", "without a cuda_graph_impl"),
    (RECIPES_FILE, "recipes", "  - {name: x, releases: ['26.01', null], model: m, hardware: [b200], layouts: "
     "[{gpus: 8, tp: 1, pp: 1, vp: 1, ep: 8, global_batch: 512}], dispatcher: flex, a2a_overlap: false, "
     "micro_batch: 0, source: s}\n", "micro_batch=0"),
    (RECIPES_FILE, "recipes", "  - {name: x, releases: ['26.01', null], model: m, hardware: [b200], layouts: "
     "[{gpus: 8, tp: 1, pp: 1, vp: 1, ep: 1, global_batch: 512}], dispatcher: alltoall, a2a_overlap: false, "
     "cpu_offloading_num_layers: -2, source: s}\n", "cpu_offloading_num_layers=-2"),
    (RECIPES_FILE, "recipes", "  - {name: x, releases: ['26.01', null], model: m, hardware: [b200], layouts: "
     "[{gpus: 8, tp: 1, pp: 1, vp: 1, ep: 1, global_batch: 512}], dispatcher: alltoall, a2a_overlap: false, "
     "fp8_format: bf16, source: s}\n", "fp8_format='bf16'"),
    (SCHEDULES_FILE, "schedules", "  - {name: x, words: 'x', runs: zigzag, source: s}\n", "runs='zigzag'"),
    (PRECISIONS_FILE, "precisions", "  - {name: x, words: 'x', runs: fp8}\n", "names no source"),
])
def test_a_malformed_entry_is_refused_naming_the_file_and_entry(tmp_path: Path, path: Path, key: str, entry: str,
                                                                said: str) -> None:
    bad = _with_entry(tmp_path, path, key, entry)
    loader = {FRAMEWORKS_FILE: load_frameworks, FAMILIES_FILE: load_families, RECIPES_FILE: load_recipes,
              SCHEDULES_FILE: load_schedules, PRECISIONS_FILE: load_precisions}[path]
    with pytest.raises(ValidationDataError) as caught:
        loader(bad)
    assert str(bad) in str(caught.value) and said in str(caught.value) and "Fix:" in str(caught.value)


def test_a_file_that_is_not_yaml_is_refused_naming_it(tmp_path: Path) -> None:
    """A YAML syntax error (PyYAML's, which OmegaConf lets through) is the data's error, not a traceback."""
    bad = tmp_path / "frameworks.yaml"
    bad.write_text("version: 1\nframeworks: [{name: x\n")
    with pytest.raises(ValidationDataError, match="cannot be read as YAML") as caught:
        load_frameworks(bad)
    assert str(bad) in str(caught.value) and "Fix:" in str(caught.value)


def test_a_frameworks_file_without_a_last_entry_for_any_framework_is_refused(tmp_path: Path) -> None:
    text = FRAMEWORKS_FILE.read_text()
    last = text.index("  - name: any other framework")
    bad = tmp_path / "frameworks.yaml"
    bad.write_text(text[:last])
    with pytest.raises(ValidationDataError, match="end with an entry of 'match: {}'"):
        load_frameworks(bad)


def test_schedule_and_precision_entries_in_a_data_file_change_how_a_column_is_read(tmp_path: Path) -> None:
    """A schedule or precision variant validate does not know is said as not understood; an entry for it, with its
    source, makes it read (and said as the approximation the entry states) with no change to the code."""
    row = {**ROW, "gpu": "H100-SXM5-80GB", "layers": "24", "tp": "1", "pp": "4", "pp_schedule": "Hanayo wave",
           "precision": "FP6"}
    shipped = row_plan(row)
    assert any("names no schedule" in said for said in shipped.approximations)
    assert any("names no variant" in said for said in shipped.approximations)
    assert not NumberFormat.of(shipped.job.train).low
    schedules = _with_entry(tmp_path, SCHEDULES_FILE, "schedules", "  - {name: Hanayo, words: 'hanayo', runs: "
                            "interleaved, approximation: 'wave schedule priced as interleaved', source: a test}\n")
    precisions = _with_entry(tmp_path, PRECISIONS_FILE, "precisions", "  - {name: FP6, words: 'fp6', "
                             "runs: fp8-delayed, "
                             "tag: fp6, approximation: 'FP6 priced as FP8', source: a test}\n")
    read = row_plan({**row, "vp": "2"}, data=load_data(schedules=schedules, precisions=precisions))
    assert read.job.parallel.vpp == 2 and NumberFormat.of(read.job.train).name == "fp8-delayed"
    assert " fp6" in read.layout
    assert read.approximations == ("wave schedule priced as interleaved", "FP6 priced as FP8")


def test_the_backward_collectives_overlap_where_the_framework_runs_them_beside_the_gemms() -> None:
    assert not row_plan({**ROW, "framework": "Megatron-LM (2021)"}).options.async_tp_backward
    assert row_plan({**ROW, "framework": "Megatron-LM (2022)"}).options.async_tp_backward
    assert row_plan({**ROW, "framework": "Megatron-Core r0.8.0"}).options.async_tp_backward
    assert not row_plan({**ROW, "framework": "torchtitan"}).options.async_tp_backward


def test_megatron_lm_before_megatron_core_blocks_in_its_interleaved_exchanges() -> None:
    """frameworks.yaml: Megatron-LM's p2p_communication of 2021 waits for every exchange and synchronises;
    Megatron-Core's interleaved exchanges are asynchronous (overlap_p2p_comm)."""
    assert row_plan({**ROW, "framework": "Megatron-LM (2021)"}).options.blocking_interleaved
    assert not row_plan({**ROW, "framework": "Megatron-Core r0.8.0"}).options.blocking_interleaved
    assert not row_plan({**ROW, "framework": "NeMo 24.07 (Megatron-Core)"}).options.blocking_interleaved


SC21 = "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM' (SC21)"


def test_a_blank_micro_batch_reads_as_the_sources_scripts_set_it() -> None:
    blank = {**ROW, "source": SC21, "source_detail": "Table 1 weak scaling", "micro_batch": "", "tp": "1"}
    data = load_data()
    assert source_setting(blank, data).blank == {"micro_batch": "16"}  # run_table_1.sh: MBS=16 for 1.7B
    assert row_plan(blank).job.train.micro_batch_size == 16
    # a stated micro-batch wins; another source's, table's or model's blank stays 1
    assert row_plan({**blank, "micro_batch": "2"}).job.train.micro_batch_size == 2
    assert row_plan({**blank, "source": "another paper"}).job.train.micro_batch_size == 1
    assert row_plan({**blank, "source_detail": "Table 2"}).job.train.micro_batch_size == 1
    assert source_setting({**blank, "model": "GPT 174.6B"}, data) is None
    assert all(setting.source and setting.blank for setting in load_source_settings())


def test_a_source_setting_fills_only_blank_cells_of_a_copy(tmp_path: Path) -> None:
    settings = tmp_path / "source_settings.yaml"
    settings.write_text("version: 1\nsettings:\n  - name: a paper's scripts\n"
                        "    match: {source: 'a paper', model: '^GPT 1\\.7B$'}\n"
                        "    blank: {micro_batch: 4, recompute: selective}\n    source: its run script, at a commit\n")
    data = load_data(settings=settings)
    row = {**ROW, "source": "A Paper (2021)", "micro_batch": "", "recompute": "full"}
    filled = stated_row(row, source_setting(row, data))
    assert filled == {**row, "micro_batch": "4"} and row["micro_batch"] == ""  # the row itself is left as read
    plan = row_plan(row, data=data)
    assert plan.job.train.micro_batch_size == 4 and plan.job.parallel.recompute.value == "full"
    assert source_setting({**row, "model": "GPT 1.7B-ish"}, data) is None and stated_row(row, None) is row
    assert row_plan(row).job.train.micro_batch_size == 1  # the shipped file names no such paper


def test_sc21_table_1_runs_as_its_scripts_ran_it() -> None:
    rows = {row["id"]: row for row in read_rows(PUBLISHED_RUNS[0])}
    plans = {rid: row_plan(rows[str(rid)]) for rid in (1, 4, 5, 6, 7, 8, 9, 10)}
    # run_table_1.sh: --num-layers-per-virtual-pipeline-stage 5, 5, 3, 1 on 76B, 145B, 310B, 530B; none on 1T
    assert {rid: plan.job.parallel.vpp for rid, plan in plans.items()} == {1: None, 4: None, 5: None, 6: 3, 7: 2,
                                                                        8: 2, 9: 3, 10: None}
    assert all(f" vp{plans[rid].job.parallel.vpp} " in plans[rid].layout for rid in (6, 7, 8, 9))
    # --DDP-impl torch (1.7B-18B): its bucketed all-reduce inside the last backward; local (39B-1T): after it
    assert all(plans[rid].job.parallel.overlap_grad_reduce for rid in (1, 4))
    assert not any(plans[rid].job.parallel.overlap_grad_reduce for rid in (5, 6, 10))
    # --fp16 without --accumulate-allreduce-grads-in-fp32: the fp16 .grad reduced as it is
    assert not any(plan.job.parallel.grad_reduce_in_fp32 for plan in plans.values())
    # megatron/p2p_communication.py of 2021: every exchange of the interleaved schedule blocks (modelled, so unsaid)
    assert all(plans[rid].options.blocking_interleaved for rid in (6, 7, 8, 9))
    assert not any(plans[rid].approximations for rid in (1, 5, 6, 7, 8, 9, 10))
    # the same rows of another source run as their framework reads them
    other = row_plan({**rows["6"], "source": "another paper"})
    assert other.job.parallel.vpp is None and other.job.parallel.grad_reduce_in_fp32
    assert framework_of(rows["6"], load_data()).grad_reduce_in_fp32  # the framework's own reading is untouched
    filled = stated_row(rows["6"], source_setting(rows["6"], load_data()))
    assert type(filled) is type(rows["6"]) and filled.line == rows["6"].line and rows["6"]["vp"] == ""


def test_a_source_settings_runs_replace_its_frameworks_reading(tmp_path: Path) -> None:
    settings = tmp_path / "source_settings.yaml"
    settings.write_text("version: 1\nsettings:\n  - name: a paper's scripts\n    match: {source: 'a paper'}\n"
                        "    runs: {overlap_grad_reduce: false, grad_reduce_in_fp32: false}\n"
                        "    approximation: something it ran that is not modelled\n"
                        "    source: its run script, at a commit\n")
    data = load_data(settings=settings)
    row = {**ROW, "source": "A Paper (2021)", "framework": "Megatron-Core r0.8.0"}
    setting = source_setting(row, data)
    assert row_framework(row, data, setting).name == framework_of(row, data).name == "Megatron-Core"
    assert not row_framework(row, data, setting).grad_reduce_in_fp32 and framework_of(row, data).grad_reduce_in_fp32
    assert row_framework(row, data, None) == framework_of(row, data)
    plan, plain = row_plan(row, data=data), row_plan(row)
    assert plain.job.parallel.overlap_grad_reduce and plain.job.parallel.grad_reduce_in_fp32
    assert not plan.job.parallel.overlap_grad_reduce and not plan.job.parallel.grad_reduce_in_fp32
    assert plan.approximations == ("something it ran that is not modelled",) and not plain.approximations
    assert simulate(plan.job, options=plan.options).step_time_s > simulate(plain.job, options=plain.options).step_time_s


@pytest.mark.parametrize(("entry", "problem"), [
    ("    match: {source: x}\n", "neither"),
    ("    match: {source: x}\n    runs: {overlap_grad_reduce: 1}\n", "runs="),
    ("    match: {source: x}\n    runs: {attention: flash}\n", "runs="),
    ("    match: {source: x}\n    blank: {micro_batch: 0}\n", "micro_batch=0"),
    ("    match: {source: x}\n    blank: {micro_batch: 2.5}\n", "micro_batch=2.5"),
    ("    match: {source: x}\n    blank: {micro_batches: 2}\n", "micro_batches"),
    ("    match: {sauce: x}\n    blank: {micro_batch: 2}\n", "sauce"),
    ("    match: {}\n    blank: {micro_batch: 2}\n", "match="),
    ("    match: {model: '(unclosed'}\n    blank: {micro_batch: 2}\n", "not a regular expression"),
    ("    match: {source: x}\n    blank: {micro_batch: 2}\n    runs_with: y\n", "unknown key"),
])
def test_a_malformed_source_setting_is_refused_naming_it(tmp_path: Path, entry: str, problem: str) -> None:
    bad = tmp_path / "source_settings.yaml"
    bad.write_text(f"version: 1\nsettings:\n  - name: broken\n{entry}    source: a script somewhere, at some commit\n")
    with pytest.raises(ValidationDataError, match=f"broken.*{re.escape(problem)}"):
        load_source_settings(bad)
