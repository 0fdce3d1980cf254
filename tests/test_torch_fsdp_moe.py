"""MoE under PyTorch FSDP2 with expert parallelism as torchtitan runs it (frameworks.yaml's torchtitan entry): its
fused AdamW's optimizer traffic and its one device-to-host synchronisation per MoE layer, priced from what runs
(docs/validation.md, "MoE under PyTorch FSDP2 with EP")."""

from __future__ import annotations

import pytest

from cfp_megatron.base.errors import ConfigError
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.host_costs import host_constants, host_costs
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.terms.optimizer import TORCH_FUSED_ADAMW_BYTES
from cfp_megatron.validate import row_plan

ROW = {"id": "t1", "model": "Qwen3-30B-A3B", "arch_type": "moe", "layers": "48", "hidden": "2048",
       "ffn_hidden": "6144", "heads": "32", "kv_heads": "4", "vocab": "151936", "seq_len": "4096",
       "moe_experts": "128", "moe_topk": "8", "moe_expert_ffn": "768", "gpu": "H100-SXM5-80GB", "num_gpus": "32",
       "framework": "torchtitan", "tp": "1", "pp": "1", "ep": "8", "zero_or_fsdp": "FSDP2", "micro_batch": "2",
       "global_batch_seqs": "64", "recompute": "full", "precision": "BF16", "step_time_s": "1.0"}
"""A made-up torchtitan row (the step time is a placeholder: only what the plan runs is read)."""


def test_a_torchtitan_row_runs_fused_adamw_and_one_sync_per_moe_layer() -> None:
    titan = row_plan(ROW).options
    assert titan.torch_fused_adamw and titan.moe_layer_syncs == 1 and titan.torch_fsdp
    other = row_plan({**ROW, "framework": "Megatron-Core r0.8.0", "zero_or_fsdp": "distributed optimizer"}).options
    assert not other.torch_fused_adamw and other.moe_layer_syncs is None


def test_fused_adamws_step_moves_its_counted_bytes_per_parameter() -> None:
    plan = row_plan(ROW)
    titan = simulate(plan.job, options=plan.options)
    megatron = simulate(plan.job, options=SimOptions(torch_fsdp=True))  # the fitted figure of Megatron-Core's
    fitted = megatron.time.optimizer_s
    # the same shard and grad-norm all-reduce; only the bytes per parameter differ (the all-reduce is tiny)
    per_param = efficiency_for(plan.job.cluster).optimizer_bytes_per_param
    assert per_param != TORCH_FUSED_ADAMW_BYTES
    assert titan.time.optimizer_s == pytest.approx(fitted * TORCH_FUSED_ADAMW_BYTES / per_param, rel=0.02)
    assert TORCH_FUSED_ADAMW_BYTES == 7 * 4 + 3 * 4  # AdamW's 4 reads and 3 writes, the clipping's 3 passes


def test_each_dropless_moe_layer_waits_as_often_as_its_dispatcher_syncs() -> None:
    job = row_plan(ROW).job
    stall = host_constants().moe_sync_stall_s
    assert host_costs(job, 16, moe_layer_syncs=1).moe_sync_s == pytest.approx(stall)
    assert host_costs(job, 16).moe_sync_s == pytest.approx(host_constants().moe_layer_syncs * stall)
    assert host_costs(job, 16, moe_layer_syncs=0).moe_sync_s == 0.0
    with pytest.raises(ConfigError, match="sim.moe_layer_syncs"):
        SimOptions(moe_layer_syncs=-1)


def test_a_blank_micro_batch_is_the_ranks_whole_batch_under_torchtitan() -> None:
    blank = {**ROW, "micro_batch": ""}  # 64 sequences over DP 32: torchtitan's local_batch_size 2, one micro-batch
    job = row_plan(blank).job
    assert job.train.micro_batch_size == 2 and simulate(job).num_microbatches == 1
    # gathered and scattered once a step, as torchtitan runs it, not once for each of two micro-batches of one
    one = simulate(job, options=row_plan(blank).options)
    two = simulate(row_plan({**blank, "micro_batch": "1"}).job, options=row_plan(blank).options)
    assert two.num_microbatches == 2 and one.time.fsdp_comm_s < two.time.fsdp_comm_s
    # stated accumulation, a pipeline or another framework keep Megatron's reading of a blank: 1
    assert row_plan({**blank, "grad_accum": "2", "global_batch_seqs": ""}).job.train.micro_batch_size == 1
    assert row_plan({**blank, "pp": "2", "ep": "4"}).job.train.micro_batch_size == 1
    megatron = {**blank, "framework": "Megatron-Core r0.8.0", "zero_or_fsdp": "distributed optimizer"}
    assert row_plan(megatron).job.train.micro_batch_size == 1
