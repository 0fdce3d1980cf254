"""PrimePar's P_{2^k x 2^k} MLP inside Megatron-Core's ``TransformerLayer`` (``parallel.mlp=primepar``).

Megatron-Core's ``MLP`` builds ``linear_fc1`` (a ``ColumnParallelLinear``) and ``linear_fc2`` (a
``RowParallelLinear``) from ``MLPSubmodules``. :class:`PrimeParColumnLinear` and :class:`PrimeParRowLinear` take the
same constructor arguments and return the same ``(output, bias)`` pair, and run both GEMMs with
:func:`~cfp_megatron.layers.primepar_linear.primepar_linear` on a 2^k x 2^k square made of Megatron's
tensor-parallel group (4^k ranks; TP rank -> (row, col) by :func:`~cfp_megatron.layers.primepar_grid.grid_position`,
the paper's Algorithm 1). With n = 2^k, tokens = s*b (the flattened [s, b] of the hidden states), rank (r, c)::

    fc1   input     replicated [s, b, h]    -> its block (tokens r, h block r+c): a slice, no communication
          GEMM      primepar_linear          -> output block (tokens r, ffn block c)   (Cannon steps, ring P2P)
          backward  dI blocks all-gathered over the TP group -> the full, identical input gradient on every rank
                    (the only collective; Megatron's column-parallel linear all-reduces there)
    act   Megatron's MLP applies the activation to the block as it is (GELU; SwiGLU chunks the block in two)
    fc2   input     (tokens r, ffn block c)  -> (tokens r, ffn block r+c): one point-to-point permutation along the
                    row (Cannon's initial skew; row 0 keeps its block), backward the inverse permutation
          GEMM      primepar_linear          -> output block (tokens r, h block c)
          output    all-gathered over the TP group to the replicated [tokens, h]; backward: each rank takes its
                    block of the (replicated) gradient, no communication. The bias is a replicated [h] vector added
                    after the gather, as RowParallelLinear adds its own.

Under Megatron's sequence parallelism (``parallel.sp=true``, t = n^2 = the TP size) the hidden state around the MLP
is cut along the sequence, [s/t, b, h] per TP rank, and the two ends change (everything between stays as above)::

    fc1   input     sequence shards [s/t, b, h] all-gathered to the replicated [s, b, h] (Megatron's
                    gather_from_sequence_parallel_region, as ColumnParallelLinear under SP), then sliced as above;
                    backward: the dI all-gather above already leaves the full, identical input gradient on every
                    rank, so each rank keeps its own sequence chunk of it (a split, no communication; NOT Megatron's
                    reduce-scatter, which would sum t identical copies)
    fc2   output    after the all-gather, each rank keeps its sequence chunk [s/t * b, h] of the replicated
                    [tokens, h] (scatter_to_sequence_parallel_region: a split, no communication); backward: the
                    chunks' gradients are all-gathered to the replicated [tokens, h] first, then each rank takes its
                    block as above. The bias is added to the chunk (by the caller with ``skip_bias_add``), so each
                    rank's bias gradient sums its own tokens; ``bias.sequence_parallel`` makes Megatron's
                    finalize_model_grads all-reduce it over the TP group, as for RowParallelLinear's bias under SP.

So per pass the MLP all-gathers a [tokens, h] activation twice under SP (forward: fc1's input and fc2's output;
backward: fc2's output gradient and fc1's input gradient), once without (forward: fc2's output; backward: fc1's
input gradient), each rank contributing [tokens/t, h]; plus, under SP with a bias, one all-reduce of fc2's [h] bias
gradient per step. Megatron's MLP under SP instead all-gathers fc1's input and reduce-scatters fc2's output
forward, and backward all-gathers fc2's output gradient and fc1's input again (for its weight gradient) and
reduce-scatters fc1's input gradient.

fc1 flattens its input to [tokens, h] and fc2 returns [tokens, h] ([tokens/t, h], its sequence chunk, under SP);
:class:`PrimeParMLP` (Megatron's ``MLP`` with two differences, see there) gives it the leading shape of the MLP's
input back, [s, b] or [s/t, b]. Between the replicated hidden state and the output every tensor of the MLP is split
n x n: nothing is replicated but fc1's bias (block c on the n ranks of column c; with ``skip_bias_add`` its
gradient still comes from primepar_linear's Gradient phase, see :class:`_ZeroCarryingGrad`) and fc2's bias (on
every rank).

Parameters are stored in Megatron's orientation, [out_features, in_features] (the transpose of the notes' W[N, K]):
rank (r, c) holds rows (out) block c and columns (in) block r+c (mod n). A gated (SwiGLU) fc1 has out_features =
2 * ffn and its block c holds the gate rows block c over the up rows block c, as Megatron's column-parallel fc1
holds [gate block t; up block t] on TP rank t, so ``MLP``'s ``torch.chunk(x, 2, dim=-1)`` splits each rank's output
block into the matching gate and up halves. ``sharded_state_dict`` describes each block with Megatron's keys,
GLOBAL shapes and 2-D offsets (the gated fc1 as the gate and up parts of Megatron's [2 * ffn, h] tensor), so
layout-independent initialisation and ``dist_checkpointing`` see the same tensors as under Megatron's layers, and a
checkpoint saved under PrimePar loads under any other layout and back.

Gradients are complete on every rank when backward ends (the fc1 bias copies of a column are bit-identical, fc2's
replicated bias gets the same gradient on every TP rank as RowParallelLinear's; under SP its per-rank partial sums
are all-reduced over TP by finalize_model_grads, as RowParallelLinear's), so Megatron's DDP only has to average
over data-parallel replicas, as it does. Gradient-norm clipping counts each element once over the TP group:
weight blocks are tensor-parallel (``tensor_model_parallel=True``), the fc1 bias only on row 0 of each column, the
fc2 bias only on TP rank 0 (Megatron's ``param_is_not_tensor_parallel_duplicate``).

Not supported (refused with :class:`~cfp_megatron.layers.errors.PrimeParError`): MoE experts,
``gradient_accumulation_fusion``, Transformer Engine's fused MLP (``TEFusedMLP``). The weights carry
``partition_dim=-1`` (cut on both axes), so tools that reshard along one TP dimension (Muon's TP mode, inference
weight refit) do not apply. Storing Megatron's orientation costs one transposed copy of the weight block per forward
(primepar_linear takes W[N, K]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ReplicaId, ShardedStateDict, ShardedTensor, ShardedTensorFactory
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_tensor_model_parallel_group_if_none
from torch import nn

from cfp_megatron.base.config import primepar_grid_side
from cfp_megatron.layers.errors import PrimeParError, PrimeParShapeError
from cfp_megatron.layers.primepar_grid import PrimeParGrid, grid_position, square_ranks
from cfp_megatron.layers.primepar_linear import (
    bias_block,
    block_size,
    gather_input,
    gather_output,
    input_block,
    output_block,
    primepar_linear,
    weight_block,
)

__all__ = [
    "PrimeParColumnLinear",
    "PrimeParMLP",
    "PrimeParRowLinear",
    "tensor_parallel_grid",
    "with_primepar_mlp",
]

_SKEW_TAG = 96
"""Point-to-point tag of fc2's input permutation (primepar_linear uses 1 to 6 and 64)."""


def tensor_parallel_grid(tp_group: dist.ProcessGroup | None) -> PrimeParGrid:
    """This rank's 2^k x 2^k square made of a tensor-parallel group of 4^k ranks: TP rank i sits at
    ``grid_position(i, k)`` (Algorithm 1 bit interleaving), the point-to-point transfers run in ``tp_group``."""
    if tp_group is None:
        raise PrimeParError("the PrimePar MLP runs on Megatron's tensor-parallel group, and there is none.",
                            fix="initialise torch.distributed and Megatron's parallel_state (or pass tp_group).",
                            setting="tp_group")
    size, index = tp_group.size(), tp_group.rank()
    side = primepar_grid_side(size)
    if side is None:
        raise PrimeParError(f"the PrimePar MLP needs a tensor-parallel group of 4^k ranks (k >= 1), got {size}.",
                            fix="set parallel.tp to 4 or 16, or parallel.mlp=megatron.", setting="parallel.tp")
    k = side.bit_length() - 1
    ranks = tuple(tuple(dist.get_global_rank(tp_group, i) for i in row) for row in square_ranks(k))
    row, col = grid_position(index, k=k)
    return PrimeParGrid(k=k, row=row, col=col, ranks=ranks, group=tp_group)


# Autograd pieces around primepar_linear -------------------------------------------------------------------------------

class _InputBlock(torch.autograd.Function):
    """This rank's block (tokens r, in block r+c) of a replicated [tokens, in] input; backward: the full input
    gradient, all-gathered from every rank's block (each block of dI is complete on exactly one rank)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
        ctx.grid = grid
        return input_block(x, grid)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gather_input(grad, ctx.grid), None


class _GatherOutput(torch.autograd.Function):
    """The replicated [tokens, out] from every rank's output block (tokens r, out block c); backward: this rank's
    block of the output gradient, which is the same on every TP rank (no communication)."""

    @staticmethod
    def forward(ctx, block: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
        ctx.grid = grid
        return gather_output(block, grid)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return output_block(grad, ctx.grid), None


def _row_shift(block: torch.Tensor, grid: PrimeParGrid, shift: int) -> torch.Tensor:
    """Every rank (r, c) of the row receives the block of (r, c + shift) and sends its own to (r, c - shift)."""
    send = block.contiguous()
    received = torch.empty_like(send)
    ops = [dist.P2POp(dist.isend, send, grid.global_rank(grid.row, grid.col - shift), grid.group, _SKEW_TAG),
           dist.P2POp(dist.irecv, received, grid.global_rank(grid.row, grid.col + shift), grid.group, _SKEW_TAG)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class _Skew(torch.autograd.Function):
    """Cannon's initial skew of row r by r places: the block (tokens r, ffn block c) that fc1 left on rank (r, c)
    goes to rank (r, c - r), so rank (r, c) holds (tokens r, ffn block r+c), fc2's Forward start. Backward sends
    the gradient blocks back (the inverse permutation). Row 0 does not move (callers skip it)."""

    @staticmethod
    def forward(ctx, block: torch.Tensor, grid: PrimeParGrid) -> torch.Tensor:
        ctx.grid = grid
        return _row_shift(block, grid, grid.row)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _row_shift(grad, ctx.grid, -ctx.grid.row), None


class _ZeroCarryingGrad(torch.autograd.Function):
    """Zeros shaped like ``bias`` whose gradient goes to ``bias``.

    fc1 with ``skip_bias_add`` returns its bias for the caller to add to the output block (tokens r, ffn block c),
    so the caller's autograd would give each copy of the bias only the sum over token block r. Passing this to
    primepar_linear as its bias (adding zeros changes no value) makes its Gradient phase deliver the sum over all
    tokens, bit-identical on the column's ranks, while the caller adds the bias value itself (detached)."""

    @staticmethod
    def forward(ctx, bias: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


# The two linear layers ------------------------------------------------------------------------------------------------

def _refuse(options: dict[str, bool]) -> None:
    """Raise for the first Megatron option in ``options`` (described, e.g. ``"gather_output=True"``) that is asked
    for (value True): these layers do not implement it."""
    for what, asked in options.items():
        if asked:
            raise PrimeParError(f"the PrimePar MLP does not support {what}.",
                                fix="use parallel.mlp=megatron for this configuration.", setting="parallel.mlp")


def _block_tensor(key: str, data: torch.Tensor, sharded_offsets: tuple, *axes: tuple[int, int],
                  replica_id: ReplicaId) -> ShardedTensor:
    """A ShardedTensor for a block cut on the tensor's own axes: ``axes[i] = (block index, block count)`` of axis i
    (after the ``sharded_offsets`` axes prepended by pipeline/layer stacking)."""
    pre = len(sharded_offsets)
    offsets = [(pre + axis, index, count) for axis, (index, count) in enumerate(axes)]
    return ShardedTensor.from_rank_offsets(key, data, *sharded_offsets, *offsets, replica_id=replica_id,
                                           prepend_axis_num=pre)


class _PrimeParLinearBase(nn.Module):
    """What fc1 and fc2 share: the grid, the parameters in Megatron's orientation, their attributes and init."""

    replicated_bias: bool = False
    """Whether the bias is the full [out] vector on every rank (fc2) rather than block c of it (fc1)."""

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_group: dist.ProcessGroup | None, stride: int,
                 gated: bool) -> None:
        super().__init__()
        _refuse({"is_expert=True (MoE experts)": is_expert,
                 "gradient_accumulation_fusion=True": config.gradient_accumulation_fusion})
        self.input_size: int = input_size
        """in_features (N), full width."""
        self.output_size: int = output_size
        """out_features (K), full width (2 x ffn for a gated fc1)."""
        self.gated: bool = gated
        """Whether out_features are a gated linear unit's [gate; up] halves (fc1 of a SwiGLU MLP)."""
        self.config: ModelParallelConfig = config
        """Megatron's config (dtype, initialisation)."""
        self.skip_bias_add: bool = skip_bias_add
        """Return the bias for the caller to add instead of adding it."""
        self.grid: PrimeParGrid = tensor_parallel_grid(get_tensor_model_parallel_group_if_none(tp_group))
        """This rank's position in the square."""
        self.tp_group: dist.ProcessGroup = self.grid.group
        """The tensor-parallel group the square is made of."""
        self.sequence_parallel: bool = bool(config.sequence_parallel)
        """Megatron's sequence parallelism: the MLP's input and output are sequence shards over the TP group (fc1
        gathers them, fc2 keeps its chunk; see the module docstring)."""
        halves = 2 if gated else 1
        out_local = halves * block_size(output_size // halves, self.grid,
                                        dim="ffn_hidden_size" if gated else "out_features (K)")
        in_local = block_size(input_size, self.grid, dim="in_features (N)")
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        factory = {"dtype": config.params_dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(out_local, in_local, **factory))
        set_tensor_model_parallel_attributes(self.weight, True, -1, stride)  # cut on both axes: no single dim
        self.weight.allreduce = True
        if config.perform_initialization:
            self._init_weight(init_method)
        if bias:  # zero, as Megatron's (the copies of a replicated bias must agree)
            self.bias = nn.Parameter(torch.zeros(output_size if self.replicated_bias else out_local, **factory))
            self.bias.allreduce = True
        else:
            self.register_parameter("bias", None)
        # As Megatron's linear layers: an empty _extra_state, so state dicts match theirs.
        self._register_load_state_dict_pre_hook(
            lambda state_dict, prefix, *args, **kwargs: state_dict.setdefault(f"{prefix}_extra_state"))

    @torch.no_grad()
    def _init_weight(self, init_method: Callable) -> None:
        """As Megatron: with ``use_cpu_initialization`` draw the full [out, in] weight and keep this rank's block
        (same values as one rank would hold); otherwise draw the block from the model-parallel RNG stream."""
        if self.config.use_cpu_initialization:
            full = torch.empty(self.output_size, self.input_size, dtype=torch.float32)
            init_method(full)
            self.weight.copy_(self.local_block(full))
        else:
            with get_cuda_rng_tracker().fork():
                init_method(self.weight)

    def local_block(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of a full [out, in] weight (or [out] bias) in Megatron's layout (a gated fc1's
        [gate; up] rows: gate block c over up block c)."""
        def cut(part: torch.Tensor) -> torch.Tensor:
            return weight_block(part.t(), self.grid).t() if part.dim() == 2 else bias_block(part, self.grid)

        return torch.cat([cut(half) for half in torch.chunk(full, 2)]) if self.gated else cut(full)

    def _gemm(self, block: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """primepar_linear on this rank's [tokens/n, in/n] block; the weight is passed as its W[N, K] block."""
        return primepar_linear(block, self.weight.t(), bias, self.grid)

    def _sharded_weight(self, key: str, sharded_offsets: tuple, replica_id: ReplicaId, other_axes: tuple,
                        data: torch.Tensor, singleton_local_shards: bool) -> ShardedTensor | ShardedTensorFactory:
        """This rank's block of a weight or bias: out block c of n (a gated fc1: gate block c and up block c of
        Megatron's [gate; up], 2n blocks), then ``other_axes``."""
        n, c = self.grid.size, self.grid.col
        if not self.gated:
            return _block_tensor(key, data, sharded_offsets, (c, n), *other_axes, replica_id=replica_id)

        def build(key: str, t: torch.Tensor, replica_id: ReplicaId, flattened_range: slice | None) -> list:
            gate, up = torch.chunk(t, 2, dim=0)
            if singleton_local_shards:  # Megatron's alternative: separate _w and _v tensors
                parts = ((f"{key}_w", gate, c, n), (f"{key}_v", up, c, n))
            else:
                parts = ((key, gate, c, 2 * n), (key, up, n + c, 2 * n))
            return [_block_tensor(k, part, sharded_offsets, (index, count), *other_axes, replica_id=replica_id)
                    for k, part, index, count in parts]

        def merge(parts: list[torch.Tensor]) -> torch.Tensor:
            with torch.no_grad():
                return torch.cat(parts)

        return ShardedTensorFactory(key, data, build, merge, replica_id)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> ShardedStateDict:
        """Megatron's keys with GLOBAL shapes and 2-D block offsets (see the module docstring)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        dp_cp_group = metadata["dp_cp_group"]
        state = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {},
                                                    sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp_group)
        singleton = bool(metadata.get("singleton_local_shards", False))
        dp_rank = get_pg_rank(dp_cp_group)
        n, r, c = self.grid.size, self.grid.row, self.grid.col
        in_axis = ((r + c) % n, n)
        state[f"{prefix}weight"] = self._sharded_weight(f"{prefix}weight", sharded_offsets, (0, 0, dp_rank),
                                                        (in_axis,), self.weight, singleton)
        self._sharded_bias(state, prefix, sharded_offsets, dp_rank, singleton)
        return state

    def _sharded_bias(self, state: ShardedStateDict, prefix: str, sharded_offsets: tuple, dp_rank: int,
                      singleton: bool) -> None:
        """Replace the bias entry of ``state`` if it is not Megatron's replicated default."""

    def set_extra_state(self, state: Any) -> None:
        """Extra state is ignored (as Megatron's linear layers)."""

    def get_extra_state(self) -> None:
        """None, as Megatron's linear layers (keeps state dicts compatible with theirs)."""
        return None

    def backward_dw(self) -> None:
        """Delayed weight-gradient computation is not split out: the weight gradient comes with backward."""

    def extra_repr(self) -> str:
        g = self.grid
        return (f"in_features={self.input_size}, out_features={self.output_size}, bias={self.bias is not None}, "
                f"gated={self.gated}, square={g.size}x{g.size}, position=({g.row}, {g.col})")


class PrimeParColumnLinear(_PrimeParLinearBase):
    """MLP's ``linear_fc1`` slot (ColumnParallelLinear's interface): replicated [..., in] in (under sequence
    parallelism this rank's sequence shard [s/t, ..., in], all-gathered first), this rank's block (tokens r, out
    block c), shape [tokens/n, out/n], out (see the module docstring).

    The bias (if any) is block c of [out], the same on the n ranks of column c: ``replica_id`` row r in checkpoints,
    ``tensor_model_parallel`` only on row 0 (counted once by gradient clipping); primepar_linear gives its copies
    bit-identical gradients over all tokens, also with ``skip_bias_add`` (see :class:`_ZeroCarryingGrad`).
    """

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool = True, gather_output: bool = False, stride: int = 1,
                 keep_master_weight_for_test: bool = False, skip_bias_add: bool = False,
                 skip_weight_param_allocation: bool = False,
                 embedding_activation_buffer: list[torch.Tensor] | None = None,
                 grad_output_buffer: list[torch.Tensor] | None = None, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, disable_grad_reduce: bool = False,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        _refuse({"gather_output=True": gather_output, "keep_master_weight_for_test=True": keep_master_weight_for_test,
                 "skip_weight_param_allocation=True": skip_weight_param_allocation,
                 "disable_grad_reduce=True": disable_grad_reduce,
                 "an embedding_activation_buffer": embedding_activation_buffer is not None,
                 "a grad_output_buffer": grad_output_buffer is not None})
        # Megatron's MLP doubles fc1's width for a gated linear unit (and passes stride 2).
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         skip_bias_add=skip_bias_add, is_expert=is_expert, tp_group=tp_group, stride=stride,
                         gated=bool(getattr(config, "gated_linear_unit", False)))
        if self.bias is not None:
            set_tensor_model_parallel_attributes(self.bias, self.grid.row == 0, 0, stride)

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[..., in] replicated (under SP: [s/t, ..., in], this rank's sequence shard) -> (output block
        [tokens/n, out/n], bias block or None), as ColumnParallelLinear without ``gather_output``."""
        _refuse({"a weight passed to forward()": weight is not None,
                 "runtime_gather_output=True": bool(runtime_gather_output)})
        if self.sequence_parallel:  # backward: a split, since PrimePar's dI is already complete on every rank
            input_ = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False,
                                                          group=self.tp_group)
        block = _InputBlock.apply(input_.reshape(-1, input_.shape[-1]), self.grid)
        if self.bias is None:
            return self._gemm(block, None), None
        if not self.skip_bias_add:
            return self._gemm(block, self.bias), None
        return self._gemm(block, _ZeroCarryingGrad.apply(self.bias)), self.bias.detach()

    def _sharded_bias(self, state: ShardedStateDict, prefix: str, sharded_offsets: tuple, dp_rank: int,
                      singleton: bool) -> None:
        if self.bias is not None:
            state[f"{prefix}bias"] = self._sharded_weight(f"{prefix}bias", sharded_offsets,
                                                          (0, self.grid.row, dp_rank), (), self.bias, singleton)


class PrimeParRowLinear(_PrimeParLinearBase):
    """MLP's ``linear_fc2`` slot (RowParallelLinear's interface): fc1's output block after the activation,
    (tokens r, in block c), in; the replicated [tokens, out] out, or under sequence parallelism this rank's sequence
    chunk of it, [tokens/t, out] (see the module docstring).

    The bias (if any) is the full [out] vector on every rank, added after the gather (and the sequence split) as
    RowParallelLinear does, with Megatron's replicated checkpoint entry and no ``tensor_model_parallel`` (counted on
    TP rank 0 by clipping). Under sequence parallelism it carries ``sequence_parallel=True`` as RowParallelLinear's:
    each rank adds it to its own tokens only, and finalize_model_grads all-reduces its gradient over the TP group.
    """

    replicated_bias = True

    def __init__(self, input_size: int, output_size: int, *, config: ModelParallelConfig, init_method: Callable,
                 bias: bool, input_is_parallel: bool, skip_bias_add: bool, stride: int = 1,
                 keep_master_weight_for_test: bool = False, is_expert: bool = False,
                 tp_comm_buffer_name: str | None = None, tp_group: dist.ProcessGroup | None = None) -> None:
        _refuse({"input_is_parallel=False": not input_is_parallel,
                 "keep_master_weight_for_test=True": keep_master_weight_for_test})
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         skip_bias_add=skip_bias_add, is_expert=is_expert, tp_group=tp_group, stride=stride,
                         gated=False)
        if self.bias is not None:
            self.bias.sequence_parallel = self.sequence_parallel

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tokens r, in block c) block -> (replicated [tokens, out], or under SP this rank's sequence chunk
        [tokens/t, out], bias or None), as RowParallelLinear."""
        block = input_.reshape(-1, input_.shape[-1])
        if self.grid.row % self.grid.size:
            block = _Skew.apply(block, self.grid)
        output = _GatherOutput.apply(self._gemm(block, None), self.grid)
        if self.sequence_parallel:
            # The tokens are the flattened [s, b]: the t equal row ranges are the t sequence chunks [s/t, b].
            ranks = self.tp_group.size()
            if output.shape[0] % ranks:
                raise PrimeParShapeError(dim="tokens", value=int(output.shape[0]),
                                         problem=f"sequence parallelism splits the tokens over the {ranks} "
                                                 "tensor-parallel ranks, which do not divide them.",
                                         fix=f"use a sequence length divisible by {ranks}, or parallel.sp=false.")
            output = scatter_to_sequence_parallel_region(output, group=self.tp_group)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias
        return output + self.bias, None


# The MLP and the layer spec -------------------------------------------------------------------------------------------

class PrimeParMLP(MLP):
    """Megatron-Core's ``MLP`` with :class:`PrimeParColumnLinear` / :class:`PrimeParRowLinear` as fc1 / fc2, and two
    differences: the output gets the leading shape of the input back (fc2 returns flattened tokens: [s*b, h], or
    under sequence parallelism this rank's chunk [s/t*b, h] for an input [s/t, b, h]), and
    ``sharded_state_dict`` takes fc1's entries as they are (MLP's SwiGLU factory splits only axis 0 and would drop
    the 2-D offsets; fc1 splits its gate and up halves itself)."""

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None,
                **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``MLP.forward``, output shaped like ``hidden_states`` ([s, b, h], or [s/t, b, h] under SP)."""
        _refuse({"per_token_scale (MoE experts)": per_token_scale is not None})
        output, bias = super().forward(hidden_states, **kwargs)
        return output.view(*hidden_states.shape[:-1], output.shape[-1]), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> ShardedStateDict:
        """The sharded state of fc1 and fc2 under Megatron's keys."""
        state: ShardedStateDict = {}
        for name, module in self._modules.items():
            state.update(module.sharded_state_dict(f"{prefix}{name}.", sharded_offsets, metadata))
        return state


def _primepar_layer(spec: ModuleSpec, layer_norm: Any) -> ModuleSpec:
    """One layer spec with its dense MLP's module, fc1 and fc2 replaced; when the spec fuses the pre-MLP norm into
    fc1 (Transformer Engine's), the norm comes back as its own module under the same checkpoint keys."""
    sub = spec.submodules
    mlp = getattr(sub, "mlp", None)
    if not isinstance(sub, TransformerLayerSubmodules) or not isinstance(mlp, ModuleSpec) or mlp.module is not MLP:
        module = getattr(mlp, "module", mlp)
        raise PrimeParError(f"parallel.mlp=primepar replaces Megatron's dense MLP, but this layer's MLP is {module!r}.",
                            fix="use a dense model (no MoE) and Megatron's GPT layer specs, or parallel.mlp=megatron.",
                            setting="parallel.mlp")
    changes: dict[str, Any] = {"mlp": dataclasses.replace(mlp, module=PrimeParMLP, submodules=dataclasses.replace(
        mlp.submodules or MLPSubmodules(), linear_fc1=PrimeParColumnLinear, linear_fc2=PrimeParRowLinear))}
    if sub.pre_mlp_layernorm is IdentityOp:
        changes["pre_mlp_layernorm"] = layer_norm
        changes["sharded_state_dict_keys_map"] = {**sub.sharded_state_dict_keys_map,
                                                  "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
    return dataclasses.replace(spec, submodules=dataclasses.replace(sub, **changes))


def with_primepar_mlp(block: TransformerBlockSubmodules, first: int | None = None) -> TransformerBlockSubmodules:
    """Megatron's block spec (one pipeline chunk's layers) with the dense MLP of its first ``first`` layers (``None``:
    every layer) run by PrimePar, everything else kept (``parallel.primepar_layers``)."""
    n = len(block.layer_specs) if first is None else first
    return dataclasses.replace(block, layer_specs=[_primepar_layer(s, block.layer_norm) if i < n else s
                                                   for i, s in enumerate(block.layer_specs)])
