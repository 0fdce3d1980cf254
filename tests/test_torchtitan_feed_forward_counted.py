"""torchtitan's dense MLP and shared experts priced as its ``FeedForward`` runs them, and its DTensor TP's gathered
inputs (issue N; docs/validation.md, "torchtitan's FeedForward and DTensor's gathered inputs"): the forward's lines
(pytorch/torchtitan b5bcd76c, models/common/feed_forward.py, copied) run on CPU, every aten op counted by a
``TorchDispatchMode`` and every tensor autograd saves by ``saved_tensors_hooks``, against the bytes, tensors and
launches the simulator prices. The step times of the made-up rows are placeholders."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from cfp_megatron.base.config import JobSpec, job_from_config
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim import host_costs as hc
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import layer_cost, layer_passes
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import (
    TORCH_SWIGLU_SAVED_FFN,
    layer_activation_bytes,
    sp_gather_working_bytes,
    torch_swiglu_kept_bytes,
)
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.simulate import prepare_costs
from cfp_megatron.sim.terms.expert_dispatch import moe_block_cost, torch_swiglu_bytes
from cfp_megatron.validate import row_plan
from tests.test_host_time import H100
from tests.test_torchtitan_experts_counted import ElementwiseBytes, OpCount, passes, saved_bytes

BATCH, SEQ, HIDDEN, FFN = 2, 32, 48, 40

LLAMA3_8B = {"id": "l8", "model": "Llama 3 8B", "arch_type": "dense", "layers": "32", "hidden": "4096",
             "ffn_hidden": "14336", "heads": "32", "kv_heads": "8", "vocab": "128256", "seq_len": "8192",
             "gpu": "H100-SXM5-80GB", "num_gpus": "8", "framework": "torchtitan", "tp": "1", "pp": "1",
             "zero_or_fsdp": "FSDP", "micro_batch": "1", "global_batch_seqs": "8", "recompute": "none",
             "precision": "BF16", "step_time_s": "1.0"}
"""A made-up torchtitan row: Llama 3 8B on 8 H100 under FSDP2."""
LLAMA3_70B = {**LLAMA3_8B, "id": "l70", "model": "Llama 3 70B", "layers": "80", "hidden": "8192",
              "ffn_hidden": "28672", "heads": "64", "num_gpus": "64", "tp": "8", "global_batch_seqs": "8",
              "step_time_s": "2.0"}
"""The same for Llama 3 70B on 64 H100 under FSDP2 x TP 8 (torchtitan runs its norms sequence-parallel)."""


def feed_forward(*, fused: bool = False) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor,
                                                  list[torch.Tensor]]:
    """``FeedForward.forward`` on ``[BATCH, SEQ, HIDDEN]`` bf16 input, its line copied, with its input and weights;
    ``fused``: the same SwiGLU with w1 and w3 one linear of twice the width, chunked (Megatron-Core's one fc1)."""
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    w1, w3 = (torch.randn(FFN, HIDDEN, dtype=torch.bfloat16, requires_grad=True) for _ in "13")
    w2 = torch.randn(HIDDEN, FFN, dtype=torch.bfloat16, requires_grad=True)
    w13 = torch.randn(2 * FFN, HIDDEN, dtype=torch.bfloat16, requires_grad=True)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

    def one_fc1(x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.chunk(F.linear(x, w13), 2, dim=-1)
        return F.linear(F.silu(gate) * up, w2)

    return (one_fc1, x, [w13, w2]) if fused else (forward, x, [w1, w2, w3])


def kernels_costs(job: JobSpec) -> tuple[KernelModel, CollectiveCosts]:
    """The kernel model and collective costs of ``job``'s cluster."""
    eff = efficiency_for(job.cluster)
    return KernelModel(job.cluster, eff, NumberFormat.of(job.train)), collective_costs(job.cluster, None, eff)


def test_feed_forwards_unfused_swiglu_moves_the_counted_bytes() -> None:
    """The experts' count (``torch_swiglu_bytes``) holds for the dense linears: 10 and 18 bytes a token and FFN
    element, 6 backward a token and hidden element (the add of the input's two gradients)."""
    forward, backward = passes(ElementwiseBytes, feed_forward)
    fwd, bwd = torch_swiglu_bytes(2.0).per_row(FFN, HIDDEN)
    assert (forward.bytes, backward.bytes) == (BATCH * SEQ * fwd, BATCH * SEQ * bwd)


def test_feed_forward_launches_the_counted_kernels_beyond_one_fc1() -> None:
    titan_fwd, titan_bwd = passes(OpCount, feed_forward)
    fused_fwd, fused_bwd = passes(OpCount, lambda: feed_forward(fused=True))
    assert (titan_fwd.ops, titan_bwd.ops) == (5, 10)
    assert (titan_fwd.ops - fused_fwd.ops, titan_bwd.ops - fused_bwd.ops) == (
        hc.TORCH_FEED_FORWARD_EXTRA.forward, hc.TORCH_FEED_FORWARD_EXTRA.backward)


def test_feed_forward_keeps_the_counted_tensors() -> None:
    """One copy of the input (w1 and w3 save the same tensor) and four of the FFN width, the experts' count."""
    assert saved_bytes(*feed_forward()) == BATCH * SEQ * (HIDDEN * 2 + FFN * torch_swiglu_kept_bytes(2.0, 2.0))
    assert torch_swiglu_kept_bytes(2.0, 2.0) == TORCH_SWIGLU_SAVED_FFN * 2


def test_a_torchtitan_dense_layer_runs_w1_and_w3_as_two_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 3 70B at TP 8: the MLP's up projection priced as two GEMMs ``ffn / tp`` wide (the same FLOPs as one of
    twice the width, two launches and two reads of the input), and the counted SwiGLU bytes in place of the fused
    activation's elements."""
    plan = row_plan(LLAMA3_70B)
    job, layout = plan.job, build_layout(plan.job)
    kernels, costs = kernels_costs(job)
    tokens, hidden, ffn = layout.micro_batch * layout.seq_length, job.model.hidden_size, job.model.ffn_size / 8
    moved: dict[bool, list[float]] = {}
    gemm_s: dict[bool, float] = {}
    memory = KernelModel.memory
    for titan in (True, False):
        moved[titan] = []

        def record(self, nbytes, _moved=moved[titan]):
            _moved.append(nbytes)
            return memory(self, nbytes)

        monkeypatch.setattr(KernelModel, "memory", record)
        options = dataclasses.replace(plan.options, torch_swiglu=titan)
        gemm_s[titan] = layer_passes(job, layout, kernels, costs, options, moe=False).mlp_gemm_s
    monkeypatch.setattr(KernelModel, "memory", memory)
    down = kernels.gemm(tokens, hidden, ffn)
    assert gemm_s[True] == pytest.approx(2 * kernels.gemm(tokens, ffn, hidden) + down)
    assert gemm_s[False] == pytest.approx(kernels.gemm(tokens, 2 * ffn, hidden) + down)
    fwd, bwd = torch_swiglu_bytes(2.0).per_row(ffn, hidden)
    assert {tokens * fwd, tokens * bwd} <= set(moved[True])
    assert not {tokens * fwd, tokens * bwd} & set(moved[False])


def test_a_torchtitan_dense_layer_pays_feed_forwards_launches_on_the_host() -> None:
    job = row_plan(LLAMA3_8B).job
    constants = hc.host_constants()
    titan, fused = hc.host_costs(job, 1, torch_mlp=True), hc.host_costs(job, 1)
    extra = hc.TORCH_FEED_FORWARD_EXTRA
    assert titan.dense[0] - fused.dense[0] == pytest.approx(extra.forward * constants.forward_launch_s)
    assert titan.dense[1] - fused.dense[1] == pytest.approx(extra.backward * constants.backward_launch_s)


SHARED_MOE = {"name": "moe_shared", "num_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
              "vocab_size": 1024, "max_position_embeddings": 512, "activation": "swiglu", "num_experts": 8,
              "moe_router_topk": 2, "moe_ffn_hidden_size": 256, "moe_shared_expert_intermediate_size": 512,
              "add_bias_linear": False}
"""A small MoE model with a shared expert (DeepSeek's)."""


def shared_job() -> JobSpec:
    """A one-node job of :data:`SHARED_MOE`."""
    return job_from_config({"model": SHARED_MOE, "cluster": {**H100, "nodes": 1}, "parallel": {},
                            "train": {"global_batch_size": 16, "micro_batch_size": 1, "seq_length": 512,
                                      "precision": "bf16"}})


def test_torchtitans_shared_experts_are_its_feed_forward() -> None:
    """The shared expert: two GEMMs of its width, its SwiGLU's counted bytes, its launches and kept tensors."""
    job = shared_job()
    layout = build_layout(job)
    kernels, costs = kernels_costs(job)
    titan, fused = (moe_block_cost(job, layout, kernels, costs, torch_combine=True, torch_shared_expert=shared)
                    for shared in (True, False))
    tokens, hidden, shared_ffn = layout.seq_length, 256, 512
    assert titan.shared_gemm_s == pytest.approx(2 * kernels.gemm(tokens, shared_ffn, hidden)
                                                + kernels.gemm(tokens, hidden, shared_ffn))
    assert fused.shared_elements_per_token - titan.shared_elements_per_token == 3 * shared_ffn
    per_row = torch_swiglu_bytes(kernels.elem).per_row(shared_ffn, hidden)
    for i in (0, 1):
        assert titan.unfused_bytes_per_token[i] - fused.unfused_bytes_per_token[i] == pytest.approx(per_row[i])
    extra, constants = hc.TORCH_FEED_FORWARD_EXTRA, hc.host_constants()
    host = hc.host_costs(job, 8, torch_mlp=True).moe[0] - hc.host_costs(job, 8).moe[0]
    assert host == pytest.approx(extra.forward * constants.forward_launch_s)
    options = SimOptions(torch_moe_combine=True, torch_swiglu=True)
    layer_block = layer_passes(job, layout, kernels, costs, options, moe=True).moe_block
    assert layer_block.shared_gemm_s == titan.shared_gemm_s and layer_block.shared_elements_per_token == 0.0
    kept = (layer_activation_bytes(job, layout, options, moe=True)[0]
            - layer_activation_bytes(job, layout, dataclasses.replace(options, torch_swiglu=False), moe=True)[0])
    routed = 2 * (TORCH_SWIGLU_SAVED_FFN - 3) * 2 * 256  # the routed experts' copies (the experts' change)
    assert kept == pytest.approx(tokens * (routed + (TORCH_SWIGLU_SAVED_FFN - 3) * 2 * shared_ffn))


def kept(row: dict, **change: object) -> float:
    """Bytes one dense layer of ``row``'s plan keeps for one micro-batch (``change``: options to set)."""
    plan = row_plan(row)
    options = dataclasses.replace(plan.options, **change)
    return layer_activation_bytes(plan.job, build_layout(plan.job), options, moe=False)[0]


def test_a_torchtitan_dense_layer_keeps_silus_output_beside_the_fused_reading() -> None:
    plan = row_plan(LLAMA3_8B)
    tokens, ffn = 8192, plan.job.model.ffn_size
    assert kept(LLAMA3_8B) - kept(LLAMA3_8B, torch_swiglu=False) == pytest.approx(
        (TORCH_SWIGLU_SAVED_FFN - 3) * 2 * ffn * tokens)


def test_dtensor_tp_keeps_the_gathered_inputs_and_gathers_none_again() -> None:
    """Llama 3 70B at TP 8 with SP: QKV's and the MLP's inputs kept whole as gathered (7/8 more of two ``[tokens,
    hidden]`` tensors), and no backward gathers a saved shard again (Transformer Engine's transient)."""
    plan = row_plan(LLAMA3_70B)
    assert plan.options.dtensor_tp and plan.options.torch_swiglu
    layout = build_layout(plan.job)
    assert layout.dims.sp and layout.dims.tp == 8
    tokens, hidden = 8192, plan.job.model.hidden_size
    assert kept(LLAMA3_70B) - kept(LLAMA3_70B, dtensor_tp=False) == pytest.approx(
        2 * tokens * hidden * 2 * (1 - 1 / 8))
    assert sp_gather_working_bytes(plan.job, layout, plan.options) == 0.0
    te = dataclasses.replace(plan.options, dtensor_tp=False)
    assert sp_gather_working_bytes(plan.job, layout, te) == tokens * hidden * 2


def test_torchtitans_op_sac_gathers_each_blocks_input_again() -> None:
    """Under its per-op SAC the all-gathers are not saved: the recomputation runs the two of a dense layer again."""
    row = {**LLAMA3_70B, "recompute": "selective"}
    plan = row_plan(row)
    job, layout = plan.job, build_layout(plan.job)
    kernels, costs = kernels_costs(job)
    cost = layer_cost(job, layout, kernels, costs, plan.options, moe=False)
    gather = costs.seconds(Collective.all_gather, 8192 * 8192 * 2, 8, layout.tp_per_node)
    assert cost.recompute.tp_comm_s == pytest.approx(2 * gather)
    megatron = layer_cost(job, layout, kernels, costs, dataclasses.replace(plan.options, dtensor_tp=False),
                          moe=False)
    assert megatron.recompute.tp_comm_s == 0.0


def test_a_torchtitan_dense_rows_plan_prices_its_feed_forward_in_the_layer_and_on_the_host() -> None:
    """The row's options reach the layer cost and the host term (``SimOptions.torch_swiglu_mlp``)."""
    plan = row_plan(LLAMA3_8B)
    job, options = plan.job, plan.options
    assert options.torch_swiglu_mlp(job.model)
    assert not dataclasses.replace(options, torch_swiglu=False).torch_swiglu_mlp(job.model)
    host = prepare_costs(job, options=options).host
    assert host.dense == hc.host_costs(job, 1, te_experts=False, torch_mlp=True,
                                       moe_layer_syncs=options.moe_layer_syncs).dense
    assert host.dense != hc.host_costs(job, 1).dense


def test_a_compiled_torchtitan_model_runs_its_swiglu_fused_and_its_loss_compiled() -> None:
    """torch.compile fuses FeedForward's silu and multiply (Inductor): a row whose recipe compiles the model (Llama 3
    405B's) or whose notes say it ran compiled is priced with the fused SwiGLU and a compiled loss; an eager row is
    not; its DTensor TP reading stays."""
    eager = row_plan(LLAMA3_8B).options
    assert eager.torch_swiglu and eager.eager_torch_loss
    stated = row_plan({**LLAMA3_8B, "notes": "torch.compile on, FP8 rowwise"}).options
    recipe = row_plan({**LLAMA3_70B, "model": "Llama 3.1 405B", "layers": "126", "hidden": "16384",
                       "ffn_hidden": "53248", "heads": "128", "num_gpus": "512", "pp": "8"}).options
    for options in (stated, recipe):
        assert not options.torch_swiglu and not options.eager_torch_loss and options.dtensor_tp
    assert row_plan({**LLAMA3_8B, "notes": "compiled model, bf16"}).options.torch_swiglu is False
    assert row_plan({**LLAMA3_8B, "notes": "compile time excluded"}).options.torch_swiglu  # not a statement of it
