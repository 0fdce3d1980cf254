"""Context parallelism: the attention kernel at the chunk length, Transformer Engine's exchange types, memory,
checks and exports."""

from __future__ import annotations

import pytest

from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims, hierarchical_cp_sizes
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import megatron_lm_args
from cfp_megatron.sim import simulate
from cfp_megatron.sim.terms.context_parallel import chunk_slowdown, kernel_share
from cfp_megatron.validate import load_preset

H100 = load_preset("dgx_h100")
LLAMA = {"name": "llama_test", "num_layers": 8, "hidden_size": 4096, "ffn_hidden_size": 14336,
         "num_attention_heads": 32, "num_query_groups": 8, "vocab_size": 128256, "activation": "swiglu",
         "position_embedding": "rope", "max_position_embeddings": 131072, "add_bias_linear": False}


def job(seq: int, nodes: int = 1, gbs: int = 8, **parallel):
    return job_from_config({"model": LLAMA, "cluster": {**H100, "nodes": nodes}, "parallel": parallel,
                            "train": {"global_batch_size": gbs, "micro_batch_size": 1, "seq_length": seq,
                                      "precision": "bf16"}})


def test_the_kernel_is_slower_per_flop_on_short_chunks() -> None:
    assert kernel_share(512) == pytest.approx(2 / 3)
    assert kernel_share(8192) > 0.96
    assert chunk_slowdown(4096, 1) == 1.0
    assert chunk_slowdown(2048, 4) > chunk_slowdown(131072, 4) > 1.0


def test_cp_at_short_context_costs_more_attention_per_token_than_at_long() -> None:
    def core_share(seq: int) -> float:
        plain = simulate(job(seq, tp=1, cp=1, gbs=8), world_size=8)
        split = simulate(job(seq, tp=1, cp=4, gbs=8), world_size=8)
        return split.step_time_s / plain.step_time_s

    assert core_share(2048) > core_share(65536)


def test_ring_hides_behind_long_attention_and_all_to_all_does_not() -> None:
    ring = simulate(job(131072, cp=8, gbs=1), world_size=8)
    a2a = simulate(job(131072, cp=8, gbs=1, cp_comm_type="a2a"), world_size=8)  # 8 KV groups over 8 ranks
    assert ring.time.cp_comm_s == pytest.approx(0.0, abs=1e-9)
    assert a2a.time.cp_comm_s > 0
    gathered = simulate(job(131072, cp=8, gbs=1, cp_comm_type="all_gather"), world_size=8)
    assert gathered.memory.comm_buffers > ring.memory.comm_buffers > 0


def test_ring_across_nodes_is_exposed_at_short_context() -> None:
    inside = simulate(job(8192, tp=1, cp=8, gbs=1), world_size=8)
    across = simulate(job(8192, nodes=2, tp=1, cp=16, gbs=1), world_size=16)
    assert across.time.cp_comm_s > inside.time.cp_comm_s
    hier = simulate(job(32768, nodes=2, cp=16, gbs=1, cp_comm_type="a2a+p2p"), world_size=16)
    assert hier.time.cp_comm_s > 0


def test_tp_splits_the_exchanged_keys_and_values() -> None:
    one = simulate(job(16384, tp=1, cp=4, gbs=2, cp_comm_type="all_gather"), world_size=8)
    two = simulate(job(16384, tp=2, cp=4, sp=True, gbs=1, cp_comm_type="all_gather"), world_size=8)
    assert 0 < two.time.cp_comm_s < one.time.cp_comm_s


def test_all_to_all_needs_heads_per_rank_divisible_by_cp() -> None:
    with pytest.raises(ConfigError, match="parallel.cp_comm_type"):  # 4 key/value groups per TP rank over 8
        simulate(job(16384, nodes=2, tp=2, cp=8, sp=True, gbs=1, cp_comm_type="a2a"), world_size=16)


def test_hierarchical_sizes_split_cp_at_the_node() -> None:
    def sizes(tp: int, cp: int, kind: str) -> list[int] | None:
        j = job(32768, nodes=4, tp=tp, cp=cp, sp=tp > 1, gbs=32 // (tp * cp), cp_comm_type=kind)
        return hierarchical_cp_sizes(j, ParallelDims.build(j, 32, te_available=True))

    assert sizes(1, 16, "a2a+p2p") == [8, 2]
    assert sizes(2, 16, "a2a+p2p") == [4, 4]
    assert sizes(1, 16, "p2p") is None


def test_the_exchange_type_is_in_the_plan_and_megatron_arguments() -> None:
    default = Plan.from_job(job(16384, cp=2, gbs=4), world_size=8, prediction=None, inputs_fingerprint="")
    assert "cpc=" not in default.canonical() and "--cp-comm-type" not in megatron_lm_args(default)
    a2a = Plan.from_job(job(16384, cp=2, gbs=4, cp_comm_type="a2a"), world_size=8, prediction=None,
                        inputs_fingerprint="")
    assert ",cpc=a2a," in a2a.canonical() and Plan.parse(a2a.canonical()) == a2a
    args = megatron_lm_args(a2a)
    assert args[args.index("--cp-comm-type") + 1] == "a2a"
