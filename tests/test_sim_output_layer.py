"""The output layer's cost: the logits GEMM and the memory traffic of Megatron-Core's vocabulary-parallel
cross-entropy, counted from its kernels."""

from __future__ import annotations

import pytest

from cfp_megatron.base.config import job_from_config
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import cross_entropy_bytes, output_layer_cost
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.validate import load_preset

MODEL = {"name": "loss_test", "num_layers": 2, "hidden_size": 1024, "num_attention_heads": 8, "vocab_size": 128000,
         "max_position_embeddings": 4096}


def test_cross_entropy_moves_what_megatron_cores_kernels_move() -> None:
    """Forward on bf16 logits: the fp32 copy (2 + 4), max (4), subtract (8), exp (8), sum (4), the softmax's
    division (8); backward: the scaling by the incoming gradient (8) and the cast back to bf16 (4 + 2). fp32 logits
    skip both casts."""
    assert cross_entropy_bytes(2) == (38.0, 14.0)
    assert cross_entropy_bytes(4) == (32.0, 8.0)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_loss_is_priced_per_logit_of_the_vocabulary_shard(precision: str) -> None:
    """The output layer's forward is its logits GEMM plus the loss' forward traffic over tokens x vocab / TP
    logits, its backward two GEMMs plus the loss' backward traffic."""
    job = job_from_config({"model": MODEL, "cluster": {**load_preset("dgx_h100"), "nodes": 1},
                           "parallel": {"tp": 2}, "train": {"global_batch_size": 8, "micro_batch_size": 1,
                                                            "seq_length": 4096, "precision": precision}})
    layout = build_layout(job, 8)
    eff = efficiency_for(job.cluster)
    kernels = KernelModel(job.cluster, eff, job.train.precision)
    assert kernels.elem == (4 if precision == "fp32" else 2)
    fwd, bwd = output_layer_cost(job, layout, kernels, collective_costs(job.cluster, None, eff))
    logits = 4096 * job.model.padded_vocab_size / 2
    gemm = kernels.gemm(4096, job.model.padded_vocab_size / 2, 1024)
    fwd_bytes, bwd_bytes = cross_entropy_bytes(kernels.elem)
    assert fwd.compute_s == pytest.approx(gemm + kernels.memory(logits * fwd_bytes))
    assert bwd.compute_s == pytest.approx(2 * gemm + kernels.memory(logits * bwd_bytes))
