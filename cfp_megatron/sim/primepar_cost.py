"""Seconds and stashed bytes of a dense MLP under PrimePar's P_{2^k x 2^k} (:mod:`cfp_megatron.layers`), per
micro-batch on one rank of the 4^k-rank tensor-parallel grid (side ``n = 2^k``).

Each linear ``O[T, K] = I[T, N] @ W[N, K]`` runs three phases of ``n`` steps (NOTES.md 1.4-1.5). At every step but
the last a rank multiplies one block pair while the ring brings the next one, so a step costs
``max(GEMM, ring transfer)`` (Eq. 7 of the paper, its ``intraC`` without the all-reduce term, which is zero here):

- Forward: ``(T/n x N/n) @ (N/n x K/n)``; the ring moves one I block and one W block.
- Backward (dI): ``(T/n x K/n) @ (K/n x N/n)``; the ring moves one dO block and one W block; then dI goes one hop to
  the input's layout (overlapped with the first weight-gradient GEMM).
- Gradient (dW): ``(N/n x T/n) @ (T/n x K/n)``; the ring moves one I block and one dO block; at the last step the
  partial dW block (fp32 gradient) arrives from the right neighbour, not overlapped.

The MLP is ``fc1`` (``h -> ffn``, twice ``ffn`` wide for SwiGLU), the activation, one permutation of the activation
block to ``fc2``'s start layout, and ``fc2`` (``ffn -> h``). Its input is sliced from the replicated hidden states
and its output all-gathered over the grid (forward), the input gradient all-gathered (backward): one all-gather of
the activation per pass where Megatron's column/row split all-reduces it.

Under sequence parallelism the hidden state at the MLP's boundary is split along the sequence over the TP group, and
the grid needs it replicated: the input is all-gathered (forward; backward each rank keeps its sequence chunk of the
gradient) and the replicated output cut back to this rank's chunk (forward; backward the output gradient
all-gathered). That resharding adds one all-gather of the activation per pass, where Megatron's SP split has an
all-gather and a reduce-scatter per pass.

:func:`megatron_mlp_cost` is the same MLP under Megatron's column/row split, as
:mod:`cfp_megatron.sim.layer_cost` costs it (for comparisons such as ``bench/primepar_mlp.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cfp_megatron.base.config import JobSpec, MlpPartition, primepar_grid_side
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.kernels import KernelModel

GRAD_BYTES = 4.0
"""Bytes per element of the partial weight gradient passed at the last gradient step (fp32 main gradients)."""


@dataclass(frozen=True, kw_only=True)
class MlpCost:
    """One micro-batch of the MLP on one rank (of PrimePar's grid or of Megatron's TP group)."""

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
    """(forward compute, forward exposed, backward compute, backward exposed) seconds of one P_{n x n} linear;
    without ``overlap`` every transfer is exposed."""
    e = kernels.elem
    tb, nb, kb = tokens / n, n_in / n, k_out / n

    def ring(nbytes: float) -> float:
        return costs.seconds(Collective.send_recv, nbytes, 2, span)

    def phase(gemm: float, transfer: float) -> tuple[float, float]:
        """(compute, exposed) of ``n`` steps whose first ``n - 1`` overlap ``transfer`` with ``gemm``."""
        return n * gemm, (n - 1) * (max(transfer - gemm, 0.0) if overlap else transfer)

    f_c, f_x = phase(kernels.gemm(tb, kb, nb), ring((tb * nb + nb * kb) * e))
    d_c, d_x = phase(kernels.gemm(tb, nb, kb), ring((tb * kb + nb * kb) * e))
    g_gemm = kernels.gemm(nb, kb, tb)
    g_c, g_x = phase(g_gemm, ring((tb * nb + tb * kb) * e))
    realign_di = max(ring(tb * nb * e) - g_gemm, 0.0) if overlap else ring(tb * nb * e)
    hand_over = ring(nb * kb * GRAD_BYTES)
    return f_c, f_x, d_c + g_c, d_x + g_x + realign_di + hand_over


def primepar_mlp_cost(kernels: KernelModel, costs: CollectiveCosts, *, tp: int, tp_per_node: int, tokens: float,
                      hidden: int, ffn: int, gated: bool, overlap: bool = True, sp: bool = False) -> MlpCost:
    """The MLP of ``tokens`` tokens (micro-batch x sequence / CP) on one rank of a ``tp``-rank grid: its GEMMs and
    communication; the activation's element-wise work is not in it (:func:`mlp_activation_s`). ``sp``: the boundary
    is split along the sequence, and the resharding to and from the grid's replicated input and output adds one
    all-gather per pass (see the module docstring).

    ``overlap``: the ring's transfers run beside the GEMMs (accelerators: the copy engines and NCCL's stream). CPU
    ranks run both on their own cores (gloo's transfers are CPU work), so there each step costs GEMM plus transfer."""
    n = primepar_grid_side(tp)
    if n is None:
        raise ValueError(f"a PrimePar grid needs 4^k ranks, got tp={tp}")
    span = 2 if tp_per_node >= tp else 1  # ring neighbours inside one node, or across nodes
    fc1 = _linear(kernels, costs, n, tokens, hidden, ffn * (2 if gated else 1), span, overlap)
    fc2 = _linear(kernels, costs, n, tokens, ffn, hidden, span, overlap)
    e = kernels.elem
    permute = costs.seconds(Collective.send_recv, tokens / n * ffn / n * e, 2, span)
    gather = costs.seconds(Collective.all_gather, tokens * hidden * e, tp, tp_per_node)
    reshard = gather if sp else 0.0
    return MlpCost(forward_compute_s=fc1[0] + fc2[0], forward_comm_s=fc1[1] + fc2[1] + permute + gather + reshard,
                   backward_compute_s=fc1[2] + fc2[2],
                   backward_comm_s=fc1[3] + fc2[3] + permute + gather + reshard)


def ffn_gemms(kernels: KernelModel, tokens: float, hidden: int, ffn: float, gated: bool) -> float:
    """Forward GEMM seconds of one MLP's two linears on one rank under Megatron's split: fc1
    ``[tokens, hidden] @ [hidden, ffn]`` (twice ``ffn`` wide for a gated unit) and fc2 ``[tokens, ffn] @ [ffn,
    hidden]``, with ``ffn`` this rank's share (``ffn / tp``, or ``/ etp`` for experts)."""
    return kernels.gemm(tokens, ffn * (2 if gated else 1), hidden) + kernels.gemm(tokens, hidden, ffn)


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
    """The MLP of ``tokens`` tokens under Megatron's column/row split over ``tp`` ranks, as
    :func:`~cfp_megatron.sim.layer_cost.layer_cost` costs a dense MLP without sequence parallelism or TP
    communication overlap: the split GEMMs (:func:`ffn_gemms` with ``ffn / tp``) and the activation's element-wise
    traffic (:func:`mlp_activation_s`), twice that backward; one all-reduce of the ``[tokens, hidden]`` activation
    per pass (fc2's output forward, fc1's input gradient backward). Unlike :func:`primepar_mlp_cost`, the
    activation's element-wise work is included: add :func:`mlp_activation_s` (and twice it backward) to that one
    to compare the two."""
    forward = ffn_gemms(kernels, tokens, hidden, ffn / tp, gated) + mlp_activation_s(kernels, tp=tp, tokens=tokens,
                                                                                     ffn=ffn, gated=gated)
    reduce = costs.seconds(Collective.all_reduce, tokens * hidden * kernels.elem, tp, tp_per_node)
    return MlpCost(forward_compute_s=forward, forward_comm_s=reduce, backward_compute_s=2.0 * forward,
                   backward_comm_s=reduce)


def primepar_stash_saving(*, tp: int, tokens: float, hidden: int, elem: float, sp: bool = False) -> float:
    """Activation bytes per layer the PrimePar MLP does not keep that Megatron's column/row split keeps: ``fc1``'s
    input is stashed as one block of the grid (1/tp of it) instead of the whole replicated hidden state. Under
    sequence parallelism Megatron keeps its 1/tp sequence chunk instead: no saving."""
    return 0.0 if sp else tokens * hidden * elem * (1.0 - 1.0 / tp)


def primepar_weight_copies(*, tp: int, hidden: int, ffn: int, gated: bool, elem: float) -> float:
    """Bytes of the rotated weight blocks each rank keeps between forward and backward (one block per linear,
    :class:`~cfp_megatron.layers.primepar_linear.PrimeParLinear`'s ``keep_rotated_weight``)."""
    return (hidden * ffn * (2 if gated else 1) + ffn * hidden) / tp * elem


def megatron_twin(job: JobSpec) -> JobSpec:
    """``job`` with Megatron's MLP partition on every layer: what the dense layers beyond ``parallel.primepar_layers``
    of a plan with PrimePar on some layers only run (their costs and memory do not depend on their neighbours': under
    SP the resharding is part of PrimePar's segment)."""
    return dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, mlp=MlpPartition.megatron,
                                                                 primepar_layers=None))
