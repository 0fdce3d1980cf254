"""torchtitan's routed experts priced as its ``GroupedExperts`` runs them (issue N; docs/validation.md, "torchtitan's
experts and torchao's saved inputs"): their forward's lines (pytorch/torchtitan b5bcd76c, models/common/moe.py, copied)
run on CPU, every aten op counted by a ``TorchDispatchMode`` and every tensor autograd saves by
``saved_tensors_hooks``, against the bytes, tensors and launches the simulator prices; and torchao's FP8 linears'
bf16 saved inputs. The step times of the made-up rows are placeholders."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim import host_costs as hc
from cfp_megatron.sim.backward_memory import saved_input_bytes
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.format_costs import low_format_cost
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import layer_passes
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import TORCH_SWIGLU_SAVED_FFN, layer_activation_bytes
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.simulate import prepare_costs
from cfp_megatron.sim.terms.expert_dispatch import torch_swiglu_bytes
from cfp_megatron.validate import row_plan
from tests.test_sim_expert_ops_counted import MOVES_NOTHING, ByteCount
from tests.test_torchtitan_moe_ops import DSV3_16B, block

ROWS, HIDDEN, FFN, EXPERTS = 64, 48, 40, 4


def grouped_experts() -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """``GroupedExperts.forward`` on ``[ROWS, HIDDEN]`` bf16 rows split evenly over ``EXPERTS``, its lines copied
    (the ``DTensor`` and ``spmd_types`` branches left out), with its input and weights."""
    x_RD = torch.randn(ROWS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    w1_EFD, w3_EFD = (torch.randn(EXPERTS, FFN, HIDDEN, dtype=torch.bfloat16, requires_grad=True) for _ in "13")
    w2_EDF = torch.randn(EXPERTS, HIDDEN, FFN, dtype=torch.bfloat16, requires_grad=True)
    num_tokens_per_expert_E = torch.full((EXPERTS,), ROWS // EXPERTS)

    def forward(x_RD: torch.Tensor) -> torch.Tensor:
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        h_RF = F.silu(torch._grouped_mm(x_RD.bfloat16(), w1_EFD.bfloat16().transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * torch._grouped_mm(x_RD.bfloat16(), w3_EFD.bfloat16().transpose(-2, -1), offs=offsets_E)
        return torch._grouped_mm(h_RF, w2_EDF.bfloat16().transpose(-2, -1), offs=offsets_E).type_as(x_RD)

    return forward, x_RD, [w1_EFD, w2_EDF, w3_EFD]


GEMMS = {"mm", "addmm", "bmm", "_grouped_mm"}
"""Aten GEMMs (priced by ``KernelModel.gemm`` and ``grouped_gemm``, not as element-wise bytes)."""


class ElementwiseBytes(ByteCount):
    """:class:`ByteCount` without the GEMMs (:data:`GEMMS`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in GEMMS:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class OpCount(TorchDispatchMode):
    """Aten ops that move data (one launch each), and of them the grouped GEMMs."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.grouped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in MOVES_NOTHING:
            self.ops += 1
            self.grouped += name == "_grouped_mm"
        return func(*args, **(kwargs or {}))


Module = Callable[[], tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor, list[torch.Tensor]]]
"""A builder of a forward, its input and its weights (:func:`grouped_experts`)."""


def passes(mode: type[TorchDispatchMode], build: Module = grouped_experts
           ) -> tuple[TorchDispatchMode, TorchDispatchMode]:
    """``mode`` over ``build``'s forward and over its backward (input and weight gradients)."""
    forward_fn, x, weights = build()
    forward, backward = mode(), mode()
    with forward:
        out = forward_fn(x)
    grad = torch.ones_like(out)
    with backward:
        torch.autograd.grad(out, [x, *weights], grad)
    return forward, backward


def test_torchtitans_unfused_swiglu_moves_the_counted_bytes() -> None:
    forward, backward = passes(ElementwiseBytes)
    counted = torch_swiglu_bytes(2.0)
    assert forward.bytes == ROWS * (FFN * counted.ffn[0] + HIDDEN * counted.hidden[0])
    assert backward.bytes == ROWS * (FFN * counted.ffn[1] + HIDDEN * counted.hidden[1])
    assert (counted.ffn, counted.hidden) == ((10.0, 18.0), (0.0, 6.0))  # Megatron-Core's fused: (6, 12), none


def test_torchtitans_experts_launch_the_counted_kernels() -> None:
    forward, backward = passes(OpCount)
    assert (forward.ops, backward.ops) == (hc.TORCH_EXPERT_OPS.forward, hc.TORCH_EXPERT_OPS.backward)
    assert (forward.grouped, backward.grouped) == hc.TORCH_GROUPED_MMS


def saved_bytes(forward_fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                weights: list[torch.Tensor]) -> int:
    """Bytes of the distinct floating-point tensors (storages) autograd saves running ``forward_fn(x)``, the
    weights left out."""
    params = {w.untyped_storage().data_ptr() for w in weights}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.is_floating_point():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_fn(x)
    return sum(saved.values())


def test_torchtitans_experts_keep_the_counted_tensors() -> None:
    """One copy of the input (w1's and w3's grouped GEMMs save the same tensor) and four of the FFN width."""
    assert saved_bytes(*grouped_experts()) == ROWS * (HIDDEN + TORCH_SWIGLU_SAVED_FFN * FFN) * 2


def test_torchtitans_experts_run_w1_and_w3_as_two_grouped_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3 16B on 8 H100 at EP 8: fc1 priced as two grouped GEMMs of the FFN width, forward and backward
    (the same FLOPs as one of twice the width, two launches and two reads of the input), and the SwiGLU's counted
    bytes in place of the fused activation's elements."""
    shapes: dict[bool, list[tuple[float, float, float]]] = {}
    original = KernelModel.grouped_gemm
    for titan in (True, False):
        calls: list[tuple[float, float, float]] = []

        def record(self, groups, m, n, k, *, _calls=calls, **kwargs):
            _calls.append((m, n, k))
            return original(self, groups, m, n, k, **kwargs)

        monkeypatch.setattr(KernelModel, "grouped_gemm", record)
        job, _, _, moe = block(DSV3_16B, torch_swiglu=titan)
        shapes[titan] = calls
        if titan:
            titan_moe = moe
        else:
            fused_moe = moe
    monkeypatch.setattr(KernelModel, "grouped_gemm", original)
    ffn, hidden, topk = job.model.moe_ffn_hidden_size, job.model.hidden_size, job.model.moe_router_topk
    rows = shapes[True][0][0]
    fc1 = {(rows, ffn, hidden), (rows, hidden, ffn), (ffn, hidden, rows)}  # forward, data and weight gradients
    assert fc1 <= set(shapes[True]) and not fc1 & {(rows, 2 * ffn, hidden), (2 * ffn, hidden, rows)}
    assert {(rows, 2 * ffn, hidden), (rows, hidden, 2 * ffn), (2 * ffn, hidden, rows)} <= set(shapes[False])
    assert titan_moe.gemm_s > fused_moe.gemm_s and titan_moe.gemm_bwd_s > fused_moe.gemm_bwd_s
    swiglu = torch_swiglu_bytes(2.0)
    assert fused_moe.elements_per_token - titan_moe.elements_per_token == pytest.approx(topk * 3 * ffn)
    for i in (0, 1):
        assert titan_moe.unfused_bytes_per_token[i] - fused_moe.unfused_bytes_per_token[i] == pytest.approx(
            topk * (ffn * swiglu.ffn[i] + hidden * swiglu.hidden[i]))


def test_torchtitans_experts_pay_their_own_launches_on_the_host() -> None:
    job = row_plan(DSV3_16B).job
    constants, counts = hc.host_constants(), hc.launch_counts()
    titan = hc.host_costs(job, 8, te_experts=False, torch_experts=True)
    fused = hc.host_costs(job, 8, te_experts=False)
    assert titan.moe[0] - fused.moe[0] == pytest.approx(
        (hc.TORCH_EXPERT_OPS.forward - counts.moe["experts"].forward) * constants.forward_launch_s
        + hc.TORCH_GROUPED_MMS[0] * constants.backward_launch_s)
    assert titan.moe[1] - fused.moe[1] == pytest.approx(
        (hc.TORCH_EXPERT_OPS.backward - counts.moe["experts"].backward) * constants.backward_launch_s
        + hc.TORCH_GROUPED_MMS[1] * constants.backward_launch_s)


def kept(row: dict, **change: object) -> float:
    """Bytes one MoE layer of ``row``'s plan keeps for one micro-batch (``change``: options to set)."""
    plan = row_plan(row)
    options = dataclasses.replace(plan.options, **change)
    return layer_activation_bytes(plan.job, build_layout(plan.job), options, moe=True)[0]


def test_torchtitans_experts_keep_silus_output_beside_the_fused_reading() -> None:
    row = {**DSV3_16B, "recompute": "none"}
    plan = row_plan(row)
    layout = build_layout(plan.job)
    tokens = layout.micro_batch * layout.seq_length
    model = plan.job.model
    extra = (TORCH_SWIGLU_SAVED_FFN - 3) * 2 * model.moe_ffn_hidden_size * model.moe_router_topk * tokens
    assert kept(row) - kept(row, torch_moe_combine=False) == pytest.approx(extra)


def test_a_torchtitan_fp8_row_saves_its_linears_inputs_in_bf16() -> None:
    """torchao's ``Float8Linear`` and scaled grouped MMs save the bf16 input (``save_for_backward(input_hp, ...)``):
    a torchtitan FP8 row keeps 2 bytes an input element, what its BF16 twin keeps; Transformer Engine's 1."""
    fp8 = {**DSV3_16B, "recompute": "none", "precision": "FP8"}
    plan = row_plan(fp8)
    assert plan.options.torchao_low_precision
    assert low_format_cost(plan.job) is not None
    assert saved_input_bytes(plan.job, plan.options) == 2.0
    assert saved_input_bytes(plan.job, dataclasses.replace(plan.options, torchao_low_precision=False)) == 1.0
    assert kept(fp8) == pytest.approx(kept({**fp8, "precision": "BF16"}))
    assert kept(fp8, torchao_low_precision=False) < kept(fp8)



def test_a_torchtitan_rows_plan_prices_its_experts_so_in_the_layer_and_on_the_host() -> None:
    """The row's options reach the layer cost and the host term (``SimOptions.torch_swiglu_experts``)."""
    plan = row_plan(DSV3_16B)
    job, options = plan.job, plan.options
    fused = dataclasses.replace(options, torch_moe_combine=False)
    assert options.torch_swiglu_experts(job.model) and not fused.torch_swiglu_experts(job.model)
    layout = build_layout(job)
    eff = efficiency_for(job.cluster)
    kernels = KernelModel(job.cluster, eff, NumberFormat.of(job.train))
    costs = collective_costs(job.cluster, None, eff)
    _, _, _, titan_block = block(DSV3_16B)
    passes = layer_passes(job, layout, kernels, costs, options, moe=True)
    assert passes.moe_block.unfused_bytes_per_token == titan_block.unfused_bytes_per_token
    host = prepare_costs(job, options=options).host
    assert host.moe == hc.host_costs(job, 64 // layout.dims.ep, te_experts=False, torch_experts=True,
                                     moe_layer_syncs=options.moe_layer_syncs).moe
