"""DTensor sharding rules for interleaved ("strided") shards that PyTorch does not have yet.

Megatron-Core's SwiGLU MLP keeps a fused ``linear_fc1`` whose output is chunked into *gate* and *up*
(``torch.chunk(x, 2, dim=-1)``). Under tensor parallelism each rank holds rows ``[gate_r; up_r]`` of the fused weight:
in DTensor terms the weight is ``_StridedShard(0, split_factor=2)`` (split the dimension into 2 chunks, shard each
chunk over the mesh axis, concatenate the local pieces). The matmul keeps that layout on its output for free, but
DTensor's rules for ``split`` and ``cat`` only know plain shards, so they would all-gather before the chunk.

Two rules close the gap, added next to DTensor's own (they only add strategies; every strategy DTensor proposes is
kept):

- ``split``/``split_with_sizes`` of a tensor strided-sharded on the split dimension into exactly ``split_factor``
  equal pieces: each piece is ``Shard(dim)`` with no communication. The split size argument is rewritten to the
  local size (DTensor's scalar-shape adjuster hook), so a real run computes each rank's own chunk.
- ``cat`` of ``k`` equally shaped tensors each ``Shard(dim)`` on the same mesh axis along the cat dimension: the
  local concatenation is ``_StridedShard(dim, split_factor=k)`` (the backward of the chunk above), no communication.

:func:`install` registers them once per process; :mod:`cfp_megatron.graph.propagation` installs them on import,
so the meta-device analysis and the real gloo replay in :mod:`cfp_megatron.graph.blocks` use the same rules.

:func:`strided_costs` speeds up DTensor's choice of strategy when strided shards meet a multi-axis mesh: DTensor
prices every redistribution that involves a ``_StridedShard`` with a shortest-path search over all placement states
(~10 ms each on a 2-D mesh, thousands per layer). Inside the context a strided shard is priced as the plain shard it
interleaves (same bytes over the same axis), plus an all-gather where only the interleaving differs. Costs only rank
strategies: a zero stays zero exactly when the placements are equal, so which operators are communication-free does
not change. Both the analysis and the gloo replay run inside it, so they pick the same strategies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops import utils as _op_utils
from torch.distributed.tensor._ops.utils import generate_redistribute_costs, normalize_dim
from torch.distributed.tensor.placement_types import _StridedShard

aten = torch.ops.aten

_SPLIT_OPS = (aten.split.Tensor, aten.split_with_sizes.default)
_installed = False


def _split_sizes(length: int, size_or_sections: Any) -> list[int]:
    if isinstance(size_or_sections, int):
        return [size_or_sections] * (length // size_or_sections) + ([length % size_or_sections]
                                                                    if length % size_or_sections else [])
    return [int(s) for s in size_or_sections]


def _split_dim(op_schema: OpSchema, ndim: int) -> int:
    dim = op_schema.args_schema[2] if len(op_schema.args_schema) > 2 else op_schema.kwargs_schema.get("dim", 0)
    return normalize_dim(int(dim), ndim)


def _strided_axis(spec: DTensorSpec, dim: int) -> tuple[int, _StridedShard] | None:
    """The one mesh axis that shards ``dim``, when it is a strided shard (no other axis shards ``dim``)."""
    axes = [(a, p) for a, p in enumerate(spec.placements) if isinstance(p, Shard | _StridedShard) and p.dim == dim]
    if len(axes) == 1 and isinstance(axes[0][1], _StridedShard):
        return axes[0][0], axes[0][1]
    return None


def _with_split(original: Callable[[OpSchema], OpStrategy]) -> Callable[[OpSchema], OpStrategy]:
    def split_strategy(op_schema: OpSchema) -> OpStrategy:
        strategy = original(op_schema)
        source = op_schema.args_schema[0]
        if not isinstance(source, OpStrategy):
            return strategy
        dim = _split_dim(op_schema, source.ndim)
        sizes = _split_sizes(source.shape[dim], op_schema.args_schema[1])
        extra = []
        for option in source.strategies:
            spec = option.output_spec
            found = _strided_axis(spec, dim)
            if found is None:
                continue
            axis, placement = found
            ways = spec.mesh.size(axis)
            if len(sizes) != placement.split_factor or len(set(sizes)) != 1 or sizes[0] % ways:
                continue
            out = tuple(Shard(dim) if a == axis else p for a, p in enumerate(spec.placements))
            extra.append(OpSpec(output_specs=tuple(DTensorSpec(spec.mesh, out) for _ in sizes),
                                input_specs=(DTensorSpec(spec.mesh, spec.placements, spec.tensor_meta,
                                                         use_strided_shard_as_shard_order=False),),
                                redistribute_cost=[generate_redistribute_costs(source, spec)]))
        return OpStrategy([*extra, *strategy.strategies])

    return split_strategy


def _adjust_split_size(input_specs: list[DTensorSpec], schema: OpSchema) -> OpSchema:
    """Rewrite the global split size(s) to the local ones when the split dimension is strided-sharded."""
    spec = input_specs[0]
    if spec.tensor_meta is None:
        return schema
    dim = _split_dim(schema, len(spec.tensor_meta.shape))
    found = _strided_axis(spec, dim)
    if found is None:
        return schema
    ways = spec.mesh.size(found[0])
    args = list(schema.args_schema)
    args[1] = args[1] // ways if isinstance(args[1], int) else [int(s) // ways for s in args[1]]
    return OpSchema(schema.op, tuple(args), schema.kwargs_schema)


def _with_cat(original: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    def cat_strategy(op_schema: OpSchema) -> Any:
        strategy = original(op_schema)
        pieces = op_schema.args_schema[0]
        if not isinstance(pieces, TupleStrategy) or len(pieces.children) < 2:
            return strategy
        children = [c for c in pieces.children if isinstance(c, OpStrategy)]
        if len(children) != len(pieces.children) or len({c.shape for c in children}) != 1:
            return strategy
        dim = normalize_dim(int(op_schema.args_schema[1]) if len(op_schema.args_schema) > 1 else 0,
                            children[0].ndim)
        specs = [c.strategies[0].output_spec for c in children]
        first = specs[0].placements
        axes = [a for a, p in enumerate(first) if type(p) is Shard and p.dim == dim]
        if len(axes) != 1 or any(s.placements != first for s in specs):
            return strategy
        mesh = specs[0].mesh
        if children[0].shape[dim] % mesh.size(axes[0]):
            return strategy
        out = tuple(_StridedShard(dim, split_factor=len(children)) if a == axes[0] else p
                    for a, p in enumerate(first))
        spec = OpSpec(output_specs=DTensorSpec(mesh, out, use_strided_shard_as_shard_order=False),
                      input_specs=tuple(DTensorSpec(mesh, first, s.tensor_meta) for s in specs),
                      redistribute_cost=[generate_redistribute_costs(c, s) for c, s in zip(children, specs,
                                                                                                 strict=True)])
        return OpStrategy([spec, *strategy.strategies])

    return cat_strategy


def install() -> None:
    """Register the rules with DTensor's sharding propagator (idempotent)."""
    global _installed
    if _installed:
        return
    propagator = DTensor._op_dispatcher.sharding_propagator
    # PyTorch releases without the scalar-shape adjuster hook (2.11) could not run a strided split locally, and
    # their DTensorSpec has no shard-order flag: there DTensor's own rules stay alone (an all-gather before the
    # chunk), which prices the SwiGLU split pessimistically but runs correctly.
    adjusters = getattr(propagator, "op_to_scalar_shape_adjuster", None)
    if adjusters is not None:
        for op in _SPLIT_OPS:
            propagator.op_strategy_funcs[op] = _with_split(propagator.op_strategy_funcs[op])
            adjusters[op] = _adjust_split_size
        propagator.op_strategy_funcs[aten.cat.default] = _with_cat(propagator.op_strategy_funcs[aten.cat.default])
    propagator.propagate_op_sharding.cache_clear()
    _installed = True


def _plain(spec: DTensorSpec, placements: tuple[Any, ...]) -> DTensorSpec:
    return DTensorSpec(spec.mesh, placements, spec.tensor_meta)


_COSTS: dict[tuple[Callable[[DTensorSpec, DTensorSpec], float], DTensorSpec, DTensorSpec], float] = {}
"""Each priced pair's cost, by the pricing function and the two specs: kept from one :func:`strided_costs` context
to the next (a cost depends only on the two specs' mesh, placements, shard order, shape and dtype, all of which
their equality compares), so the operators of a search ask DTensor's pricing for each pair once."""

_MAX_COSTS = 200_000
"""Entries :data:`_COSTS` holds before it starts again empty."""


def _priced(original: Callable[[DTensorSpec, DTensorSpec], float]) -> Callable[[DTensorSpec, DTensorSpec], float]:
    # DTensor's strategy expansion asks for the same pairs again and again (each operator's every candidate input
    # against every strategy, and the same operators under every block's candidates): each pair is priced once.
    def redistribute_cost(current: DTensorSpec, target: DTensorSpec) -> float:
        key = (original, current, target)
        cost = _COSTS.get(key)
        if cost is None:
            if len(_COSTS) >= _MAX_COSTS:
                _COSTS.clear()
            cost = _COSTS[key] = _cost(current, target)
        return cost

    def _cost(current: DTensorSpec, target: DTensorSpec) -> float:
        pairs = list(zip(current.placements, target.placements, strict=True))
        if not any(isinstance(p, _StridedShard) for pair in pairs for p in pair):
            return original(current, target)
        if current.placements == target.placements:
            return 0.0
        src, dst = [], []
        for have, want in pairs:
            plain_have = Shard(have.dim) if isinstance(have, _StridedShard) else have
            plain_want = Shard(want.dim) if isinstance(want, _StridedShard) else want
            if have != want and plain_have == plain_want:  # only the interleaving differs: gather and re-slice
                plain_want = Replicate()
            src.append(plain_have)
            dst.append(plain_want)
        return original(_plain(current, tuple(src)), _plain(target, tuple(dst)))

    return redistribute_cost


@contextmanager
def strided_costs() -> Iterator[None]:
    """Price redistributions of strided shards as their plain equivalents while the context is open (module doc)."""
    original = _op_utils.redistribute_cost
    _op_utils.redistribute_cost = _priced(original)
    try:
        yield
    finally:
        _op_utils.redistribute_cost = original


def distribute(tensor: torch.Tensor, mesh: Any, placements: Any) -> DTensor:
    """:func:`torch.distributed.tensor.distribute_tensor`, with strided shards meaning interleaved rows (module doc).

    ``distribute_tensor`` slices a ``_StridedShard`` the interleaved way but marks it as an encoding of the shard
    order across mesh axes (FSDP2 + TP); the rules here and DTensor's view rules mean the interleaved layout, so the
    spec is re-marked. Plain placements are left as ``distribute_tensor`` makes them.
    """
    from torch.distributed.tensor import distribute_tensor

    out = distribute_tensor(tensor, mesh, placements)
    if not any(isinstance(p, _StridedShard) for p in out.placements):
        return out
    spec = DTensorSpec(out.device_mesh, tuple(out.placements), tensor_meta=out._spec.tensor_meta,
                       use_strided_shard_as_shard_order=False)
    return DTensor(out.to_local(), spec, requires_grad=tensor.requires_grad)
