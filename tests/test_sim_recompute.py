"""Block recomputation in the simulator: the first N layers of each pipeline chunk recomputed, the others kept.

N = 0 is no recomputation and N = the chunk's layers is the uniform method; in between, each extra recomputed layer
costs time and saves activation memory, so block plans lie between the two on both axes.
"""

from __future__ import annotations

import pytest

from cfp_megatron.sim import SimOptions, simulate
from cfp_megatron.sim.memory import recomputed_layers
from cfp_megatron.sim.prediction import Prediction
from tests.test_sim import job

LAYOUT = {"tp": 2, "pp": 2, "vpp": 2, "gbs": 32}
"""16 layers over 2 x 2 pipeline chunks: 4 layers per chunk."""
PER_CHUNK = 4


def _block(n: int, options: SimOptions | None = None, **layout) -> Prediction:
    """Block recomputation of the first ``n`` layers per chunk (``n = 0``: none)."""
    layout = {**LAYOUT, **layout}
    if n == 0:
        return simulate(job(**layout), options=options)
    return simulate(job(**layout, recompute="full", recompute_method="block", recompute_num_layers=n),
                    options=options)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "no-flash"])
def test_block_lies_between_none_and_uniform_full(flash: bool) -> None:
    options = SimOptions(flash_attention=flash)
    preds = [_block(n, options) for n in range(PER_CHUNK + 1)]
    uniform = simulate(job(**LAYOUT, recompute="full"), options=options)
    times = [p.step_time_s for p in preds]
    recompute = [p.time.recompute_s for p in preds]
    memory = [p.memory.activations for p in preds]
    assert recompute[0] == 0.0
    # More recomputed layers: more time, less activation memory.
    assert all(a < b for a, b in zip(times, times[1:], strict=False)), times
    assert all(a < b for a, b in zip(recompute, recompute[1:], strict=False)), recompute
    assert all(a > b for a, b in zip(memory, memory[1:], strict=False)), memory
    # Each recomputed layer per chunk costs the same (dense model): the recompute time grows linearly.
    assert recompute[2] - recompute[1] == pytest.approx(recompute[1])
    # Every layer of the chunk: the uniform method.
    assert preds[-1].step_time_s == pytest.approx(uniform.step_time_s)
    assert preds[-1].time.recompute_s == pytest.approx(uniform.time.recompute_s)
    assert preds[-1].memory.activations == pytest.approx(uniform.memory.activations)
    # Block with one layer per chunk keeps the other layers' activations as without recomputation (with the
    # attention scores when the attention core is not fused): more than half of what no recomputation keeps.
    assert memory[1] > 0.5 * memory[0]


def test_block_recomputes_the_leading_dense_layers_first() -> None:
    moe = {"num_experts": 8, "moe_router_topk": 2, "activation": "swiglu", "moe_ffn_hidden_size": 2048,
           "num_layers": 4, "moe_first_dense_layers": 1}
    preds = [simulate(job(model=moe, tp=8, sp=True, gbs=8, **({"recompute": "full", "recompute_method": "block",
                                                      "recompute_num_layers": n} if n else {})))
             for n in range(5)]
    rec = [p.time.recompute_s for p in preds]
    dense, moe_layer = rec[1] - rec[0], rec[2] - rec[1]
    assert rec[3] - rec[2] == pytest.approx(moe_layer) and rec[4] - rec[3] == pytest.approx(moe_layer)
    assert dense != pytest.approx(moe_layer)  # the first recomputed layer is the dense one
    uniform = simulate(job(model=moe, tp=8, sp=True, gbs=8, recompute="full"))
    assert rec[4] == pytest.approx(uniform.time.recompute_s)


def test_recomputed_layers_per_rank() -> None:
    moe = {"num_experts": 8, "moe_router_topk": 2, "moe_ffn_hidden_size": 2048, "num_layers": 8,
           "moe_first_dense_layers": 3}
    plan = job(model=moe, tp=2, pp=2, vpp=2, gbs=32, recompute="full", recompute_method="block",
               recompute_num_layers=1)
    # Chunks of 2 layers: rank 0 holds layers 0-1 and 4-5, rank 1 holds 2-3 and 6-7; layers 0-2 are dense.
    assert recomputed_layers(plan, rank=0) == (1, 1)  # layers 0 (dense) and 4 (MoE)
    assert recomputed_layers(plan, rank=1) == (1, 1)  # layers 2 (dense) and 6 (MoE)
    uniform = job(model=moe, tp=2, pp=2, vpp=2, gbs=32, recompute="full")
    assert recomputed_layers(uniform, rank=0) == (2, 2)
    assert recomputed_layers(uniform, rank=1) == (1, 3)
    assert recomputed_layers(job(model=moe, tp=2, pp=2, vpp=2, gbs=32), rank=0) == (0, 0)
