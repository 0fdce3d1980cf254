"""PrimePar's spatial-temporal partitioned linear layer, O[B*M, K] = I[B*M, N] @ W[N, K], on a 2^k x 2^k square.

Each rank (r, c) of the square (:class:`~cfp_megatron.layers.primepar_grid.PrimeParGrid`) holds one block of each
tensor, 1/4^k of it, and never a copy of another rank's block between steps (n = 2^k, T = n - 1, indices mod n, the
flattened tokens B*M are the notes' M dimension; layouts from the DSIs of NOTES.md 1.4)::

    tensor   rank (r, c) holds at the start of Forward     as a full tensor is cut
    I        tokens block r, N block r+c                    [B*M, N] into n x n blocks
    W        N block r+c, K block c      (the parameter)    [N, K]   into n x n blocks
    O        tokens block r, K block c   (the output)       [B*M, K] into n x n blocks

Forward runs n steps. At step t the rank multiplies its current I block (r, r+c+t) by its current W block (r+c+t, c)
and adds the product into its output block (r, c): over the n steps it sums all of N locally, so there is no
all-reduce. While it computes step t it already exchanges the blocks of step t+1 (Table 1: I from the right
neighbour (r, c+1), W from the one below (r+1, c)); the transfers are posted with ``batch_isend_irecv`` before the
step's GEMM and waited after it (double buffering), so they overlap the GEMM; on CUDA they run on NCCL's stream
while the GEMM runs on the current one, as Megatron's pipeline transfers do.

Backward (dI = dO @ W^T, summed over K) keeps dI (r, r+c-1) on the rank while dO comes from (r, c+1) and W from
(r-1, c+1). It starts from the W block Forward ended with (kept between the phases, or fetched from the rank above
with ``keep_rotated_weight=False``) and from dO in the output's layout. Gradient (dW = I^T @ dO, summed over the
tokens) keeps dW (r+c-1, c-1) while I comes from (r+1, c-1) and dO from (r+1, c) (from (r+1, c) and (r+1, c+1)
before the last step); at the last step the rank receives the partial dW of its right neighbour, which is block
(r+c, c), and adds its own last product to it. So dW ends in W's layout and is the parameter's ``.grad`` as it is,
and Gradient starts from exactly what the other phases left: the I block Forward ended with (the only stashed
activation, one block of the input, no gathered copy) and the dO block Backward ended with.

Two transfers are added to Table 1, each one ring hop and checked against the DSIs in the tests: Backward leaves dI
in the layout (r, r+c-1), one column away from the input's (r, r+c), and an autograd function must return the
gradient of its input, so dI goes one hop left, overlapped with the first Gradient GEMM; and when the input needs no
gradient, Backward is skipped and dO moves one hop right to Gradient's start. Table 1's last Backward transfer (W
back to the Forward layout) is not needed: the parameter is never moved, only copies of it travel.

A bias (``bias=True``) is block c of [K] on every rank of column c (2^k copies of a vector of K/2^k). Its gradient
rides on Gradient: each rank records the column sums of the dO blocks it sees, indexed by token block, sends them
with its partial dW and sums the received stack in token-block order, so the 2^k copies get bit-identical gradients
without any collective.

Squares are independent: ranks at the same position of several squares are data-parallel replicas, and their
gradients are averaged with the usual all-reduce across squares (groups from
:func:`~cfp_megatron.layers.primepar_grid.new_replica_groups`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from cfp_megatron.layers.errors import PrimeParShapeError
from cfp_megatron.layers.primepar_grid import (
    GRAD_INPUT_REALIGN,
    GRAD_OUTPUT_SHIFT,
    WEIGHT_FETCH,
    Operand,
    Phase,
    PrimeParGrid,
    RingTransfer,
    TransferKind,
    dsi,
    extra_transfer,
    ring_transfers,
)

__all__ = [
    "PrimeParLinear",
    "bias_block",
    "block_size",
    "gather_input",
    "gather_output",
    "gather_weight",
    "input_block",
    "output_block",
    "primepar_linear",
    "weight_block",
]

_BIAS_TAG = 64
"""Point-to-point tag of the bias-gradient stack (the operands use 1 to 6)."""


def block_size(extent: int, grid: PrimeParGrid, *, dim: str) -> int:
    """``extent / 2^k``, the size of one block of a dimension; raises :class:`PrimeParShapeError` naming ``dim``
    when the dimension does not split evenly over the square."""
    n = grid.size
    if extent % n:
        lower, upper = extent // n * n, -(-extent // n) * n
        raise PrimeParShapeError(dim=dim, value=extent,
                                 problem=f"is not divisible by the side 2^k = {n} of the PrimePar square (k={grid.k}).",
                                 fix=f"make {dim} a multiple of {n} (e.g. {lower or n} or {upper}), or use a smaller "
                                     f"k.")
    return extent // n


# Point-to-point exchange --------------------------------------------------------------------------------------------

_Item = tuple[object, RingTransfer, torch.Tensor, int]
"""(key, transfer, tensor to send, tag): one ring transfer of one tensor."""


def _post(grid: PrimeParGrid, items: Sequence[_Item]) -> tuple[list[dist.Work], dict[object, torch.Tensor]]:
    """Post every rank's send and receive of each item at once; return the requests and the receive buffers by key.
    The sent tensors must not change until the requests are waited."""
    ops: list[dist.P2POp] = []
    received: dict[object, torch.Tensor] = {}
    for key, transfer, tensor, tag in items:
        source, destination = grid.peers(transfer)
        buffer = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        ops.append(dist.P2POp(dist.isend, tensor, destination, grid.group, tag))
        ops.append(dist.P2POp(dist.irecv, buffer, source, grid.group, tag))
        received[key] = buffer
    return (dist.batch_isend_irecv(ops) if ops else []), received


def _wait(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()


def _ring(grid: PrimeParGrid, transfers: Sequence[RingTransfer], blocks: dict[Operand, torch.Tensor],
          ) -> tuple[list[dist.Work], dict[object, torch.Tensor]]:
    """Post the transfers of the operands in ``blocks`` (transfers of other operands are left out)."""
    return _post(grid, [(t.operand, t, blocks[t.operand], t.operand.tag) for t in transfers if t.operand in blocks])


def _accumulate(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b) if acc is None else acc.addmm_(a, b)


# The autograd function ----------------------------------------------------------------------------------------------

class _PrimeParLinearFunction(torch.autograd.Function):
    """Forward, Backward and Gradient phases of P_{2^k x 2^k} on one rank (see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: PrimeParGrid,
                keep_rotated_weight: bool) -> torch.Tensor:
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        i_cur, w_cur = x.contiguous(), weight.contiguous()
        out: torch.Tensor | None = None
        for step in range(grid.size):
            works, received = _ring(grid, ring_transfers(Phase.FORWARD, k=grid.k, step=step),
                                    {Operand.INPUT: i_cur, Operand.WEIGHT: w_cur})
            out = _accumulate(out, i_cur, w_cur)
            _wait(works)
            i_cur = received.get(Operand.INPUT, i_cur)
            w_cur = received.get(Operand.WEIGHT, w_cur)
        if bias is not None:
            out.add_(bias)
        # i_cur is the I block (r, r+c-1) Gradient starts with; w_cur the W block (r+c-1, c) Backward starts with.
        ctx.grid = grid
        ctx.save_for_backward(i_cur if need_w else None, w_cur if need_x and keep_rotated_weight else None,
                              weight if need_x and not keep_rotated_weight else None)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grid: PrimeParGrid = ctx.grid
        n, k, last = grid.size, grid.k, grid.size - 1
        i_last, w_kept, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        d_cur = grad_out.contiguous()
        grad_x = grad_w = grad_b = None
        realign: tuple[list[dist.Work], dict[object, torch.Tensor]] | None = None
        realign_waited = False

        if need_x:  # Backward phase: dI (r, r+c-1) stays, dO and W rotate.
            w_cur = w_kept
            if w_cur is None:
                works, received = _ring(grid, [extra_transfer(WEIGHT_FETCH, k=k)], {Operand.WEIGHT: weight})
                _wait(works)
                w_cur = received[Operand.WEIGHT]
            d_in: torch.Tensor | None = None
            for step in range(n):
                # Table 1's last Backward transfer moves W back to the Forward layout; here the parameter stayed.
                transfers = [t for t in ring_transfers(Phase.BACKWARD, k=k, step=step)
                             if t.kind is TransferKind.NEXT_STEP]
                works, received = _ring(grid, transfers, {Operand.GRAD_OUTPUT: d_cur, Operand.WEIGHT: w_cur})
                d_in = _accumulate(d_in, d_cur, w_cur.t())
                _wait(works)
                d_cur = received.get(Operand.GRAD_OUTPUT, d_cur)
                w_cur = received.get(Operand.WEIGHT, w_cur)
            realign = _ring(grid, [extra_transfer(GRAD_INPUT_REALIGN, k=k)], {Operand.GRAD_INPUT: d_in})
        elif need_w or need_b:  # no Backward phase: move dO straight to Gradient's start
            works, received = _ring(grid, [extra_transfer(GRAD_OUTPUT_SHIFT, k=k)], {Operand.GRAD_OUTPUT: d_cur})
            _wait(works)
            d_cur = received[Operand.GRAD_OUTPUT]

        if need_w or need_b:  # Gradient phase: dW (r+c-1, c-1) stays, I and dO rotate; realigned at the last step.
            i_cur = i_last
            acc: torch.Tensor | None = None
            stack = d_cur.new_empty(n, d_cur.shape[1]) if need_b else None  # dO column sums by token block
            for step in range(n):
                if step < last:
                    blocks = {Operand.GRAD_OUTPUT: d_cur}
                    if need_w:
                        blocks[Operand.INPUT] = i_cur
                    works, received = _ring(grid, ring_transfers(Phase.GRADIENT, k=k, step=step), blocks)
                    if need_w:
                        acc = _accumulate(acc, i_cur.t(), d_cur)
                    if stack is not None:
                        stack[(grid.row + step) % n] = d_cur.sum(0)
                    if realign is not None and step == 0:  # dI's hop overlapped with the first Gradient GEMM
                        _wait(realign[0])
                        realign_waited = True
                    _wait(works)
                    d_cur = received.get(Operand.GRAD_OUTPUT, d_cur)
                    i_cur = received.get(Operand.INPUT, i_cur)
                    continue
                (partial,) = ring_transfers(Phase.GRADIENT, k=k, step=step)
                items: list[_Item] = []
                if need_w:
                    items.append((Operand.GRAD_WEIGHT, partial, acc, Operand.GRAD_WEIGHT.tag))
                if stack is not None:
                    items.append(("bias", partial, stack, _BIAS_TAG))
                works, received = _post(grid, items)
                local = torch.mm(i_cur.t(), d_cur) if need_w else None
                own = d_cur.sum(0) if stack is not None else None
                _wait(works)
                if need_w:
                    grad_w = received[Operand.GRAD_WEIGHT].add_(local)
                if stack is not None:
                    sums = received["bias"]
                    sums[(grid.row + step) % n] = own
                    grad_b = sums.sum(0)
        if realign is not None:
            if not realign_waited:  # no Gradient phase to overlap with (a gloo request must be waited only once)
                _wait(realign[0])
            grad_x = realign[1][Operand.GRAD_INPUT]
        return grad_x, grad_w, grad_b, None, None


def primepar_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, grid: PrimeParGrid, *,
                    keep_rotated_weight: bool = True) -> torch.Tensor:
    """The functional form of :class:`PrimeParLinear`: ``x`` is this rank's input block [tokens/2^k, N/2^k],
    ``weight`` its W block [N/2^k, K/2^k], ``bias`` its bias block [K/2^k] or ``None``; returns the output block
    [tokens/2^k, K/2^k]. Every rank of the square must call it with blocks of the same shapes."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise PrimeParShapeError(dim="x.shape[-1] (N/2^k)", value=int(x.shape[-1]),
                                 problem=f"the input block {tuple(x.shape)} does not fit the weight block "
                                         f"{tuple(weight.shape)} (need [tokens/2^k, N/2^k] @ [N/2^k, K/2^k]).",
                                 fix="feed the block input_block() gives for this rank.")
    if bias is not None and tuple(bias.shape) != (weight.shape[1],):
        raise PrimeParShapeError(dim="bias.shape[0] (K/2^k)", value=int(bias.shape[0]) if bias.dim() else 0,
                                 problem=f"the bias block {tuple(bias.shape)} does not fit the weight block "
                                         f"{tuple(weight.shape)}.", fix="pass bias_block() of the full bias.")
    return _PrimeParLinearFunction.apply(x, weight, bias, grid, keep_rotated_weight)


# The module ---------------------------------------------------------------------------------------------------------

class PrimeParLinear(nn.Module):
    """A linear layer O = I @ W partitioned by P_{2^k x 2^k} over a square of ranks (see the module docstring).

    ``weight`` is this rank's block of the full W[N, K] (in_features x out_features, the notes' layout, i.e. the
    transpose of ``torch.nn.Linear.weight``): N block (r+c) mod 2^k, K block c, shape [N/2^k, K/2^k]. Its gradient
    lands in the same layout. The input is this rank's block of the flattened tokens x N (:func:`input_block`),
    any leading shape with last dimension N/2^k; the output is its block (r, c) of tokens x K, same leading shape,
    last dimension K/2^k (:func:`gather_output` reassembles it).

    The default initialization draws each rank's block uniformly in +-1/sqrt(in_features) (``torch.nn.Linear``'s
    bound) from the rank's own generator, and sets the bias to zero (its 2^k copies must agree); use
    :meth:`from_dense` for a given dense weight.
    """

    def __init__(self, in_features: int, out_features: int, grid: PrimeParGrid, *, bias: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None,
                 keep_rotated_weight: bool = True) -> None:
        super().__init__()
        self.in_features: int = in_features
        """N, the full input width."""
        self.out_features: int = out_features
        """K, the full output width."""
        self.grid: PrimeParGrid = grid
        """This rank's square."""
        self.keep_rotated_weight: bool = keep_rotated_weight
        """True: keep the W block Forward ends with until Backward (one more W block per rank between the phases);
        False: Backward fetches it from the rank above first (one ring hop not overlapped with compute)."""
        n_block = block_size(in_features, grid, dim="in_features (N)")
        k_block = block_size(out_features, grid, dim="out_features (K)")
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(n_block, k_block, **factory))
        self.bias = nn.Parameter(torch.zeros(k_block, **factory)) if bias else None
        bound = 1.0 / math.sqrt(in_features)
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n_block = self.weight.shape[0]
        if x.dim() < 1 or x.shape[-1] != n_block:
            raise PrimeParShapeError(dim="x.shape[-1]", value=int(x.shape[-1]) if x.dim() else 0,
                                     problem=f"a PrimeParLinear({self.in_features}, {self.out_features}) on a "
                                             f"{self.grid.size}x{self.grid.size} square takes input blocks of width "
                                             f"in_features/2^k = {n_block}.",
                                     fix="feed this rank's block of the activation (input_block()).")
        out = primepar_linear(x.reshape(-1, n_block), self.weight, self.bias, self.grid,
                              keep_rotated_weight=self.keep_rotated_weight)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        g = self.grid
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"square={g.size}x{g.size}, position=({g.row}, {g.col})")

    @classmethod
    def from_dense(cls, weight: torch.Tensor, grid: PrimeParGrid, *, bias: torch.Tensor | None = None,
                   keep_rotated_weight: bool = True) -> PrimeParLinear:
        """A layer holding this rank's blocks of a full ``weight`` [N, K] (in_features x out_features, NOT
        ``nn.Linear``'s [K, N]: use :meth:`from_linear` for that) and of an optional full ``bias`` [K]. Every rank
        passes the same full tensors."""
        if weight.dim() != 2:
            raise PrimeParShapeError(dim="weight.dim()", value=weight.dim(), problem="the dense weight must be 2-D.",
                                     fix="pass the full [in_features, out_features] weight.")
        layer = cls(int(weight.shape[0]), int(weight.shape[1]), grid, bias=bias is not None, dtype=weight.dtype,
                    device=weight.device, keep_rotated_weight=keep_rotated_weight)
        with torch.no_grad():
            layer.weight.copy_(weight_block(weight, grid))
            if bias is not None:
                layer.bias.copy_(bias_block(bias, grid))
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, grid: PrimeParGrid, *, keep_rotated_weight: bool = True
                    ) -> PrimeParLinear:
        """A layer holding this rank's blocks of a ``torch.nn.Linear`` (whose weight is [K, N])."""
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls.from_dense(linear.weight.detach().t(), grid, bias=bias, keep_rotated_weight=keep_rotated_weight)


# Sharding helpers ---------------------------------------------------------------------------------------------------

def _forward_block(operand: Operand, grid: PrimeParGrid, row: int, col: int) -> tuple[int, int]:
    """The block of ``operand`` that rank (row, col) holds at the start of Forward (dI and dW share I's and W's)."""
    layout = {Operand.GRAD_INPUT: Operand.INPUT, Operand.GRAD_WEIGHT: Operand.WEIGHT,
              Operand.GRAD_OUTPUT: Operand.OUTPUT}.get(operand, operand)
    return dsi(Phase.FORWARD, k=grid.k, row=row, col=col, step=0).block(layout)


def _cut(full: torch.Tensor, grid: PrimeParGrid, operand: Operand, dims: tuple[str, str]) -> torch.Tensor:
    rows = block_size(int(full.shape[0]), grid, dim=dims[0])
    cols = block_size(int(full.shape[1]), grid, dim=dims[1])
    i, j = _forward_block(operand, grid, grid.row, grid.col)
    return full[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].clone()


def _flat(full: torch.Tensor, name: str) -> torch.Tensor:
    if full.dim() < 2:
        raise PrimeParShapeError(dim=f"{name}.dim()", value=full.dim(), problem=f"{name} must be at least 2-D.",
                                 fix=f"pass the full {name} as [tokens, features] (leading dims are flattened).")
    return full.reshape(-1, full.shape[-1])


def input_block(x: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
    """This rank's block of a full activation x[..., N] (leading dims flattened to the tokens): tokens block r,
    N block (r+c) mod 2^k, shape [tokens/2^k, N/2^k]. Its gradient comes back in the same layout."""
    return _cut(_flat(x, "x"), grid, Operand.INPUT, ("tokens (B*M)", "in_features (N)"))


def output_block(out: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
    """This rank's block (r, c) of a full output (or output gradient) [..., K]: shape [tokens/2^k, K/2^k]."""
    return _cut(_flat(out, "out"), grid, Operand.OUTPUT, ("tokens (B*M)", "out_features (K)"))


def weight_block(weight: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
    """This rank's block of a full W[N, K]: N block (r+c) mod 2^k, K block c, shape [N/2^k, K/2^k]."""
    if weight.dim() != 2:
        raise PrimeParShapeError(dim="weight.dim()", value=weight.dim(), problem="the dense weight must be 2-D.",
                                 fix="pass the full [in_features, out_features] weight.")
    return _cut(weight, grid, Operand.WEIGHT, ("in_features (N)", "out_features (K)"))


def bias_block(bias: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
    """This rank's block c of a full bias [K] (the same on every rank of column c)."""
    if bias.dim() != 1:
        raise PrimeParShapeError(dim="bias.dim()", value=bias.dim(), problem="the dense bias must be 1-D.",
                                 fix="pass the full [out_features] bias.")
    size = block_size(int(bias.shape[0]), grid, dim="out_features (K)")
    return bias[grid.col * size:(grid.col + 1) * size].clone()


def _gather(block: torch.Tensor, grid: PrimeParGrid, operand: Operand) -> torch.Tensor:
    """All-gather the square's blocks of ``operand`` (in their Forward-start layout) into the full tensor."""
    block = block.detach().contiguous()
    group = grid.group if grid.group is not None else dist.group.WORLD
    parts = [torch.empty_like(block) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, block, group=group)
    rows, cols = block.shape
    full = block.new_empty(rows * grid.size, cols * grid.size)
    for part, global_rank in zip(parts, dist.get_process_group_ranks(group), strict=True):
        i, j = _forward_block(operand, grid, *grid.position_of(global_rank))
        full[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols] = part
    return full


def gather_input(block: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
    """The full [tokens, N] from every rank's input block (or input-gradient block); a collective over the square,
    not differentiable. For tests and checkpoints."""
    return _gather(block.reshape(-1, block.shape[-1]), grid, Operand.INPUT)


def gather_output(block: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
    """The full [tokens, K] from every rank's output block; a collective over the square, not differentiable."""
    return _gather(block.reshape(-1, block.shape[-1]), grid, Operand.OUTPUT)


def gather_weight(block: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
    """The full W[N, K] from every rank's weight block (or weight-gradient block); a collective over the square,
    not differentiable."""
    return _gather(block, grid, Operand.WEIGHT)
