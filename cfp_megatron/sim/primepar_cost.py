"""Seconds and stashed bytes of a dense MLP under PrimePar's P_{2^k x 2^k} (:mod:`cfp_megatron.layers`), per
micro-batch on one rank of the 4^k-rank tensor-parallel grid (side ``n = 2^k``), and the same MLP under Megatron's
column/row split for comparison. The three phases, their overlap and the resharding under sequence parallelism:
docs/simulator.md, "primepar_cost.py".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cfp_megatron.base.config import JobSpec, MlpPartition, primepar_grid_side
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.format_costs import FP32_BYTES
from cfp_megatron.sim.kernels import KernelModel


@dataclass(frozen=True, kw_only=True)
class MlpCost:
    """Seconds of one micro-batch of the MLP on one rank (of PrimePar's grid or of Megatron's TP group)."""

    forward_compute_s: float
    """GEMMs of the forward pass (both linears, every step)."""
    forward_comm_s: float
    """Forward communication left exposed: ring transfers beyond their step's GEMM, the permutation between the
    linears, the output all-gather."""
    backward_compute_s: float
    """GEMMs of the backward pass (input and weight gradients of both linears)."""
    backward_comm_s: float
    """Backward communication left exposed (as forward, plus the un-overlapped weight-gradient hand-over and the
    input-gradient all-gather)."""

    @property
    def total_s(self) -> float:
        """Forward plus backward seconds."""
        return self.forward_compute_s + self.forward_comm_s + self.backward_compute_s + self.backward_comm_s


def _linear(kernels: KernelModel, costs: CollectiveCosts, n: int, tokens: float, n_in: float, k_out: float,
            span: int, overlap: bool) -> tuple[float, float, float, float]:
    """(forward compute, forward exposed, backward compute, backward exposed) seconds of one P_{n x n} linear
    ``[tokens, n_in] @ [n_in, k_out]`` (grid side ``n``; ``span`` 2 where ring neighbours share a node, else 1);
    without ``overlap`` every transfer is exposed."""
    elem_bytes = kernels.elem
    # One rank's block of the tokens, of the input features and of the output features.
    token_block, in_block, out_block = tokens / n, n_in / n, k_out / n

    def ring(nbytes: float) -> float:
        """Seconds of one ring hop of ``nbytes`` bytes."""
        return costs.seconds(Collective.send_recv, nbytes, 2, span)

    def phase(gemm: float, transfer: float) -> tuple[float, float]:
        """(compute, exposed) of ``n`` steps whose first ``n - 1`` overlap ``transfer`` with ``gemm``."""
        return n * gemm, (n - 1) * (max(transfer - gemm, 0.0) if overlap else transfer)

    fwd_compute, fwd_exposed = phase(kernels.gemm(token_block, out_block, in_block, low_precision=False),
                                     ring((token_block * in_block + in_block * out_block) * elem_bytes))
    dgrad_compute, dgrad_exposed = phase(kernels.gemm(token_block, in_block, out_block, low_precision=False),
                                         ring((token_block * out_block + in_block * out_block) * elem_bytes))
    wgrad_gemm = kernels.gemm(in_block, out_block, token_block, low_precision=False)  # not a TE layer: bf16
    wgrad_compute, wgrad_exposed = phase(wgrad_gemm,
                                         ring((token_block * in_block + token_block * out_block) * elem_bytes))
    realign_di = (max(ring(token_block * in_block * elem_bytes) - wgrad_gemm, 0.0) if overlap
                  else ring(token_block * in_block * elem_bytes))
    hand_over = ring(in_block * out_block * FP32_BYTES)
    return (fwd_compute, fwd_exposed, dgrad_compute + wgrad_compute,
            dgrad_exposed + wgrad_exposed + realign_di + hand_over)


def primepar_mlp_cost(kernels: KernelModel, costs: CollectiveCosts, *, tp: int, tp_per_node: int, tokens: float,
                      hidden: int, ffn: int, gated: bool, overlap: bool = True, sp: bool = False) -> MlpCost:
    """Seconds of the MLP of ``tokens`` tokens (micro-batch x sequence / CP) on one rank of a ``tp``-rank grid
    (``tp_per_node`` of them on one node; ``hidden`` and ``ffn`` widths, ``gated`` for SwiGLU): its GEMMs and
    communication; the activation's element-wise work is not in it (:func:`mlp_activation_s`). ``sp``: the boundary
    is split along the sequence, and the resharding adds one all-gather per pass. ``overlap``: the ring's transfers
    run beside the GEMMs (false on CPU ranks; docs/simulator.md, "primepar_cost.py"). Raises :class:`ValueError`
    unless ``tp`` is a power of 4."""
    side = primepar_grid_side(tp)
    if side is None:
        raise ValueError(f"a PrimePar grid needs 4^k ranks, got tp={tp}")
    span = 2 if tp_per_node >= tp else 1  # ring neighbours inside one node, or across nodes
    fc1 = _linear(kernels, costs, side, tokens, hidden, ffn * (2 if gated else 1), span, overlap)
    fc2 = _linear(kernels, costs, side, tokens, ffn, hidden, span, overlap)
    elem_bytes = kernels.elem
    permute_s = costs.seconds(Collective.send_recv, tokens / side * ffn / side * elem_bytes, 2, span)
    gather_s = costs.seconds(Collective.all_gather, tokens * hidden * elem_bytes, tp, tp_per_node)
    reshard_s = gather_s if sp else 0.0
    return MlpCost(forward_compute_s=fc1[0] + fc2[0],
                   forward_comm_s=fc1[1] + fc2[1] + permute_s + gather_s + reshard_s,
                   backward_compute_s=fc1[2] + fc2[2],
                   backward_comm_s=fc1[3] + fc2[3] + permute_s + gather_s + reshard_s)


def ffn_gemms(kernels: KernelModel, tokens: float, hidden: int, ffn: float, gated: bool, *,
              split_gate: bool = False) -> float:
    """Forward GEMM seconds of one MLP's two linears on one rank under Megatron's split: fc1
    ``[tokens, hidden] @ [hidden, ffn]`` (twice ``ffn`` wide for a gated unit) and fc2 ``[tokens, ffn] @ [ffn,
    hidden]``, with ``ffn`` this rank's share (``ffn / tp``, or ``/ etp`` for experts); ``split_gate``: a gated
    unit's halves as two GEMMs ``ffn`` wide (torchtitan's ``FeedForward``, w1 and w3 each reading the input)."""
    up = (2 * kernels.gemm(tokens, ffn, hidden) if gated and split_gate
          else kernels.gemm(tokens, ffn * (2 if gated else 1), hidden))
    return up + kernels.gemm(tokens, hidden, ffn)


def mlp_activation_elements(*, tp: int, ffn: int, gated: bool) -> float:
    """Element-wise traffic of the MLP's activation per token and pass on one rank, in elements (read fc1's output
    block, write the activation's; a gated unit reads two): the same under Megatron's split and PrimePar's grid,
    both of which hold ``ffn / tp`` of each token's intermediate values."""
    return (3 if gated else 2) * ffn / tp


def mlp_activation_s(kernels: KernelModel, *, tp: int, tokens: float, ffn: int, gated: bool) -> float:
    """Forward seconds of the activation's element-wise traffic (:func:`mlp_activation_elements`) for ``tokens``
    tokens; the layer cost counts the backward pass twice this."""
    return kernels.memory(mlp_activation_elements(tp=tp, ffn=ffn, gated=gated) * tokens * kernels.elem)


def megatron_mlp_cost(kernels: KernelModel, costs: CollectiveCosts, *, tp: int, tp_per_node: int, tokens: float,
                      hidden: int, ffn: int, gated: bool) -> MlpCost:
    """Seconds of the MLP of ``tokens`` tokens under Megatron's column/row split over ``tp`` ranks, as
    :func:`~cfp_megatron.sim.layer_cost.layer_cost` costs a dense MLP without sequence parallelism or TP
    communication overlap: split GEMMs and activation traffic, twice that backward, one all-reduce of the
    ``[tokens, hidden]`` activation per pass. It includes the activation's element-wise work, which
    :func:`primepar_mlp_cost` leaves out (how to compare the two: docs/simulator.md, "primepar_cost.py")."""
    forward_s = ffn_gemms(kernels, tokens, hidden, ffn / tp, gated) + mlp_activation_s(kernels, tp=tp, tokens=tokens,
                                                                                       ffn=ffn, gated=gated)
    reduce_s = costs.seconds(Collective.all_reduce, tokens * hidden * kernels.elem, tp, tp_per_node)
    return MlpCost(forward_compute_s=forward_s, forward_comm_s=reduce_s, backward_compute_s=2.0 * forward_s,
                   backward_comm_s=reduce_s)


def primepar_stash_saving(*, tp: int, tokens: float, hidden: int, elem: float, sp: bool = False) -> float:
    """Activation bytes per layer (for ``tokens`` tokens of ``elem`` bytes per element) the PrimePar MLP does not
    keep that Megatron's column/row split keeps: ``fc1``'s input is stashed as one block of the grid (1/tp of it)
    instead of the whole replicated hidden state. Under sequence parallelism Megatron keeps its 1/tp sequence chunk
    instead: no saving."""
    return 0.0 if sp else tokens * hidden * elem * (1.0 - 1.0 / tp)


def primepar_weight_copies(*, tp: int, hidden: int, ffn: int, gated: bool, elem: float) -> float:
    """Bytes of the rotated weight blocks each rank keeps between forward and backward (one block per linear,
    :class:`~cfp_megatron.layers.primepar_linear.PrimeParLinear`'s ``keep_rotated_weight``), at ``elem`` bytes per
    element."""
    return (hidden * ffn * (2 if gated else 1) + ffn * hidden) / tp * elem


def megatron_twin(job: JobSpec) -> JobSpec:
    """``job`` with Megatron's MLP partition on every layer: what the dense layers beyond ``parallel.primepar_layers``
    of a plan with PrimePar on some layers only run (their costs and memory do not depend on their neighbours': under
    SP the resharding is part of PrimePar's segment)."""
    return dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, mlp=MlpPartition.megatron,
                                                                 primepar_layers=None))
