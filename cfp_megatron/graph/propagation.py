"""Partition propagation over a device mesh with PyTorch's own DTensor sharding rules.

Each recorded operator of an :class:`~cfp_megatron.graph.opgraph.OpGraph` is replayed on DTensors whose local
tensors live on the meta device, under the single-process ``fake`` process group (any world size, no memory, no
communication) and :class:`~torch.distributed.tensor.debug.CommDebugMode`. DTensor decides the output placements
and, where its strategy for the operator needs other input placements than the ones given, redistributes the inputs;
every collective it issues for that (all-gather, all-reduce, reduce-scatter, all-to-all) is counted. An operator is
*communication-free* under a partition when no collective was counted. Local redistributions (Replicate -> Shard is
a slice, Replicate -> Partial a local scaling) move no data between ranks and count as free.

Placements are tuples with one :class:`~torch.distributed.tensor.Shard`, :class:`~torch.distributed.tensor.Replicate`
or :class:`~torch.distributed.tensor.Partial` per mesh axis, as DTensor spells them.

Parameters get their placements by inference (:func:`propagate`): operators that read only parameters (``t``,
``view``, casts of a weight) wait for the first operator that mixes them with an activation; there the candidate
placements of the parameters involved are tried one at a time in preference order (sharded first, Replicate last; larger
parameters decided first) and the first placement that makes the operators communication-free without
redistributing the activation is kept (greedy); failing that, the one with the fewest collectives, then the fewest
activation redistributions. (A norm weight ``Shard(0)`` would be free only by slicing a replicated activation.)
``x Replicate @ W`` so gives a column-parallel ``W`` (``Shard(0)``), and the following row-parallel linear a ``W``
``Shard(1)`` with a ``Partial`` output.

Hand-written rules, only where DTensor has none (:func:`_fallback`): an operator whose inputs are all replicated has
replicated outputs and is communication-free (every rank computes the same thing); a collective recorded in the graph
(``c10d.allreduce_`` and the like) counts as communication. Any other operator DTensor cannot run is reported as
unsupported and not communication-free.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._pytree import tree_flatten, tree_map

from cfp_megatron.base.errors import CfpError
from cfp_megatron.graph import strided_rules
from cfp_megatron.graph.opgraph import Operator, OpGraph, TensorRef

strided_rules.install()

Placements = tuple[Placement, ...]
"""One placement per mesh axis."""


class PropagationError(CfpError, RuntimeError):
    """Partition propagation cannot run as asked (a process group already exists, a bad mesh or placement)."""


# --------------------------------------------------------------------------------------------------------- mesh


@contextmanager
def fake_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Iterator[DeviceMesh]:
    """A CPU :class:`DeviceMesh` of ``shape`` over the single-process ``fake`` process group; torn down on exit.

    Raises :class:`PropagationError` when a default process group already exists (it would be replaced or mixed
    with the fake one) or when ``shape`` and ``names`` do not fit together.
    """
    if not shape or any(int(s) < 1 for s in shape):
        raise PropagationError(f"mesh shape {shape!r} must be a non-empty tuple of positive sizes")
    if len(names) != len(shape) or len(set(names)) != len(names):
        raise PropagationError(f"mesh names {names!r} must be distinct, one per axis of shape {shape!r}")
    if dist.is_initialized():
        raise PropagationError("a default process group already exists; fake_mesh needs to create its own. "
                               "Call it outside torch.distributed work (or destroy the group first).")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    try:
        yield init_device_mesh("cpu", tuple(int(s) for s in shape), mesh_dim_names=tuple(names))
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------- placements


def placement_str(placements: Placements) -> str:
    """Short form, one token per mesh axis: ``S(0)``, ``R``, ``P`` (``P(max)`` for non-sum partials).

    DTensor's strided shard (a dimension sharded after a view merged it with an outer one) reads ``S(0;4)``: dim 0,
    split factor 4.
    """
    tokens = []
    for p in placements:
        if isinstance(p, _StridedShard):
            tokens.append(f"S({p.dim};{p.split_factor})")
        elif isinstance(p, Shard):
            tokens.append(f"S({p.dim})")
        elif isinstance(p, Partial):
            tokens.append("P" if p.reduce_op == "sum" else f"P({p.reduce_op})")
        else:
            tokens.append("R")
    return ",".join(tokens)


def parse_placements(text: str) -> Placements:
    """Inverse of :func:`placement_str`."""
    out: list[Placement] = []
    for token in text.split(","):
        token = token.strip()
        if token == "R":
            out.append(Replicate())
        elif token == "P":
            out.append(Partial())
        elif token.startswith("P(") and token.endswith(")"):
            out.append(Partial(token[2:-1]))
        elif token.startswith("S(") and token.endswith(")") and ";" in token:
            dim, factor = token[2:-1].split(";")
            out.append(_StridedShard(int(dim), split_factor=int(factor)))
        elif token.startswith("S(") and token.endswith(")"):
            out.append(Shard(int(token[2:-1])))
        else:
            raise PropagationError(f"placement token {token!r} in {text!r} is not S(d), R or P")
    return tuple(out)


def replicate(mesh: DeviceMesh) -> Placements:
    """Replicated on every mesh axis."""
    return (Replicate(),) * mesh.ndim


def candidate_placements(shape: Sequence[int], mesh: DeviceMesh) -> list[Placements]:
    """Every assignment of mesh axes to tensor dimensions (``Shard(d)`` or ``Replicate`` per axis) that divides evenly.

    In preference order: more sharded axes first; among those, lower dimensions on lower axes first; all-Replicate
    last. A dimension sharded on several axes must be divisible by the product of their sizes.
    """
    options: list[Placement] = [Shard(d) for d in range(len(shape))] + [Replicate()]
    found = []
    for combo in itertools.product(options, repeat=mesh.ndim):
        ways = [1] * len(shape)
        for axis, p in enumerate(combo):
            if isinstance(p, Shard):
                ways[p.dim] *= mesh.size(axis)
        if all(s % w == 0 and (w == 1 or s >= w) for s, w in zip(shape, ways, strict=True)):
            found.append(tuple(combo))
    return sorted(found, key=lambda c: -sum(isinstance(p, Shard) for p in c))  # stable: keeps product order


def strided_candidates(shape: Sequence[int], mesh: DeviceMesh, split_factors: Sequence[int] = (2,)) -> list[Placements]:
    """Interleaved variants of :func:`candidate_placements`: a dimension sharded by exactly one mesh axis becomes
    ``_StridedShard(d, split_factor=k)`` (split into ``k`` chunks, each chunk sharded), the layout of Megatron's
    fused SwiGLU ``linear_fc1`` (``k = 2``: gate and up).
    """
    found = []
    for combo in candidate_placements(shape, mesh):
        for axis, p in enumerate(combo):
            if type(p) is not Shard or sum(isinstance(q, Shard) and q.dim == p.dim for q in combo) != 1:
                continue
            for k in split_factors:
                if shape[p.dim] % (k * mesh.size(axis)) == 0:
                    found.append(combo[:axis] + (_StridedShard(p.dim, split_factor=k),) + combo[axis + 1:])
    return found


# ----------------------------------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True)
class OpResult:
    """One operator replayed under one partition of its inputs."""

    index: int
    """:attr:`Operator.index` of the operator."""
    name: str
    """Its printable name, e.g. ``aten.mm.default``."""
    inputs: dict[int, Placements]
    """Placement each input tensor id was given."""
    outputs: dict[int, Placements]
    """Placement DTensor gave each output tensor id."""
    collectives: dict[str, int] = field(default_factory=dict)
    """Collectives counted while it ran (e.g. ``{"all_gather_into_tensor": 1}``), including the ones DTensor issued
    to redistribute inputs to a strategy it has a rule for."""
    redistributed: dict[int, Placements] = field(default_factory=dict)
    """Inputs DTensor redistributed before running the operator, with the placement it moved them to. Those that
    moved without a collective (Replicate -> Shard slices, Replicate -> Partial) keep the operator comm-free."""
    supported: bool = True
    """``False`` when DTensor has no rule for the operator under these placements and no hand-written rule applied."""
    error: str | None = None
    """Why it was unsupported."""

    @property
    def comm_free(self) -> bool:
        """Ran with zero collectives and a known rule."""
        return self.supported and not self.collectives



@dataclass(frozen=True, kw_only=True)
class Propagation:
    """A partition propagated through a sequence of operators."""

    placements: dict[int, Placements]
    """Placement of every tensor given or produced, by id (parameters included)."""
    params: dict[str, Placements]
    """Placement chosen (or given) for each parameter read, by name."""
    results: tuple[OpResult, ...]
    """Per operator, in execution order (operators never reached are absent)."""

    @property
    def comm_free(self) -> bool:
        """Every operator ran communication-free."""
        return all(r.comm_free for r in self.results)

    @property
    def first_collective(self) -> OpResult | None:
        """The first operator that needed communication (or had no rule)."""
        return next((r for r in self.results if not r.comm_free), None)

    @property
    def collectives(self) -> dict[str, int]:
        """Collectives over all operators."""
        total: dict[str, int] = {}
        for r in self.results:
            for k, v in r.collectives.items():
                total[k] = total.get(k, 0) + v
        return total


# -------------------------------------------------------------------------------------------------- one operator


def _meta_dtensor(shape: tuple[int, ...], dtype: str, placements: Placements, mesh: DeviceMesh) -> DTensor:
    torch_dtype = getattr(torch, dtype)
    stride = torch.empty(shape, device="meta", dtype=torch_dtype).stride()
    if not any(isinstance(p, _StridedShard) for p in placements):
        local, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
        return DTensor.from_local(torch.empty(local, device="meta", dtype=torch_dtype), mesh, placements,
                                  run_check=False, shape=torch.Size(shape), stride=stride)
    # A strided shard here comes from a view (rows interleaved across ranks), as DTensor's view rules make it, not
    # an encoding of the shard order across mesh axes (what from_local would read it as).
    plain = tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in placements)
    local, _ = compute_local_shape_and_global_offset(shape, mesh, plain)
    spec = DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), stride, torch_dtype),
                       use_strided_shard_as_shard_order=False)
    return DTensor(torch.empty(local, device="meta", dtype=torch_dtype), spec, requires_grad=False)


_NOISY = ("torch.distributed.tensor._redistribute", "torch.testing._internal.distributed.fake_pg",
          "torch.distributed.distributed_c10d")


class _DropWarnings(logging.Filter):
    """Drops DTensor's advice on sequential collectives while replaying: trial placements trigger it by design."""

    active = False

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.active and record.levelno <= logging.WARNING)


_DROP = _DropWarnings()
for _name in _NOISY:
    logging.getLogger(_name).addFilter(_DROP)


@contextmanager
def _quiet() -> Iterator[None]:
    _DROP.active = True
    try:
        yield
    finally:
        _DROP.active = False


def comm_counts(comm: Any) -> dict[str, int]:
    """The collectives a :class:`CommDebugMode` counted, by short name (``all_reduce``), zero counts left out."""
    return {str(getattr(k, "__name__", k)).rsplit(".", 1)[-1]: int(v) for k, v in comm.get_comm_counts().items() if v}


def _check_placements(tid: int, placements: Placements, mesh: DeviceMesh) -> None:
    if len(placements) != mesh.ndim or not all(isinstance(p, Placement) for p in placements):
        raise PropagationError(f"tensor {tid}: placements {placements!r} need one Shard/Replicate/Partial per "
                               f"axis of the {mesh.ndim}-D mesh")


def propagate_op(op: Operator, graph: OpGraph, placements: Mapping[int, Placements], mesh: DeviceMesh) -> OpResult:
    """Replay ``op`` on meta DTensors placed as ``placements`` says (Replicate for tensors it does not name).

    Counts the collectives under :class:`CommDebugMode`, including the redistributions DTensor performs to reach a
    strategy; returns the output placements per output tensor id.
    """
    given: dict[int, Placements] = {}
    for tid in op.inputs:
        p = placements.get(tid, replicate(mesh))
        _check_placements(tid, p, mesh)
        given[tid] = p
    values: dict[int, DTensor] = {}

    def value(x: Any) -> Any:
        if not isinstance(x, TensorRef):
            return x
        if x.id not in values:
            meta = graph.tensors[x.id]
            values[x.id] = _meta_dtensor(meta.shape, meta.dtype, given[x.id], mesh)
        return values[x.id]

    args = tree_map(value, op.args)
    kwargs = tree_map(value, op.kwargs)
    comm = CommDebugMode()
    try:
        with warnings.catch_warnings(), _quiet(), _watch() as watch, _meta_shapes(), strided_rules.strided_costs(), \
                comm:
            warnings.simplefilter("ignore")
            out = op.op(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - DTensor raises several types for "no rule"
        return _fallback(op, graph, given, mesh, args, kwargs, exc)
    collectives = comm_counts(comm)
    flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    outputs = {tid: (tuple(t.placements) if isinstance(t, DTensor) else replicate(mesh))
               for tid, t in zip(op.outputs, flat, strict=False)}
    return OpResult(index=op.index, name=op.name, inputs=given, outputs=outputs, collectives=collectives,
                    redistributed=_redistributed(op, watch))


class _Watch:
    """Records the input placements DTensor's dispatcher redistributes to (wraps its ``redistribute_local_args``)."""

    def __init__(self) -> None:
        self.moves: list[tuple[list[DTensorSpec], list[DTensorSpec]]] = []

    def __call__(self, op_info: Any, schema: Any, use_val: bool) -> None:
        have = [s for s in op_info.flat_args_schema if isinstance(s, DTensorSpec)]
        want = [s for s in tree_flatten(schema.args_schema)[0] if isinstance(s, DTensorSpec)]
        self.moves.append((have, want))
        type(DTensor._op_dispatcher).redistribute_local_args(op_info, schema, use_val)


@contextmanager
def _watch() -> Iterator[_Watch]:
    dispatcher = DTensor._op_dispatcher
    watch = _Watch()
    dispatcher.redistribute_local_args = watch  # instance attribute shadows the static method
    try:
        yield watch
    finally:
        del dispatcher.redistribute_local_args


def _meta_tensor_meta(propagator: Any, op_schema: Any) -> Any:
    """What DTensor's ``_propagate_tensor_meta_non_cached`` gives (the global output's shape, stride and dtype),
    from the operator run on meta tensors of the global shapes instead of fake ones; DTensor's own way where the
    operator has no meta kernel. A ``FakeTensorMode`` made per operator (with a stack trace) cost about a third
    of a replay."""
    def rebuild(spec: DTensorSpec) -> torch.Tensor:
        meta = spec.tensor_meta
        return torch.empty_strided(meta.shape, meta.stride, dtype=meta.dtype, device="meta")

    def is_spec(x: Any) -> bool:
        return isinstance(x, DTensorSpec)

    if op_schema.op is torch.ops.aten.equal.default:  # data dependent: DTensor's own answer (none)
        return type(propagator)._propagate_tensor_meta_non_cached(propagator, op_schema)
    try:
        args = tree_map(lambda x: rebuild(x) if is_spec(x) else x, op_schema.args_schema, is_leaf=is_spec)
        kwargs = tree_map(lambda x: rebuild(x) if is_spec(x) else x, op_schema.kwargs_schema, is_leaf=is_spec)
        out = op_schema.op(*args, **kwargs)
    except Exception:  # noqa: BLE001 - no meta kernel (or data-dependent): DTensor's fake-tensor way
        return type(propagator)._propagate_tensor_meta_non_cached(propagator, op_schema)

    def tensor_meta(t: Any) -> TensorMeta | None:
        return TensorMeta(shape=t.shape, stride=t.stride(), dtype=t.dtype) if isinstance(t, torch.Tensor) else None

    if isinstance(out, torch.Tensor):
        return tensor_meta(out)
    if isinstance(out, tuple | list):
        found = [tensor_meta(t) for t in out]
        return tuple(found) if isinstance(out, tuple) else found
    return None


@contextmanager
def _meta_shapes() -> Iterator[None]:
    """DTensor's output metadata from meta tensors while inside (:func:`_meta_tensor_meta`)."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator._propagate_tensor_meta_non_cached = lambda schema: _meta_tensor_meta(propagator, schema)
    try:
        yield
    finally:
        del propagator._propagate_tensor_meta_non_cached


def _redistributed(op: Operator, watch: _Watch) -> dict[int, Placements]:
    """Which positional tensor inputs DTensor's chosen strategy moved."""
    if not watch.moves:
        return {}
    have, want = watch.moves[0]
    ids = [x.id for x in tree_flatten(op.args)[0] if isinstance(x, TensorRef)]
    return {tid: tuple(w.placements) for tid, h, w in zip(ids, have, want, strict=False)
            if tuple(h.placements) != tuple(w.placements)}


_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


def _fallback(op: Operator, graph: OpGraph, given: dict[int, Placements], mesh: DeviceMesh, args: Any, kwargs: Any,
              exc: Exception) -> OpResult:
    """Hand-written rules for operators DTensor cannot run under the given placements.

    - A recorded collective (``c10d.allreduce_``, ``_c10d_functional.*``: the model communicates by itself, e.g.
      Megatron's vocab-parallel cross entropy) is communication whatever the placements: counted under its name.
    - All inputs replicated: every rank computes the same thing, so the outputs are replicated and nothing moves
      (covers ``aten._local_scalar_dense``, i.e. ``Tensor.item()``, which cannot run on meta tensors at all).
    - Otherwise: unsupported, not communication-free.
    """
    error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    outputs = {tid: replicate(mesh) for tid in op.outputs}
    namespace = getattr(op.op, "namespace", "")
    if namespace in _COLLECTIVE_NAMESPACES:
        name = str(getattr(op.op, "__name__", op.name)).split(".")[0]
        return OpResult(index=op.index, name=op.name, inputs=given, outputs=outputs, collectives={name: 1})
    if all(all(isinstance(p, Replicate) for p in pl) for pl in given.values()):
        return OpResult(index=op.index, name=op.name, inputs=given, outputs=outputs)
    return OpResult(index=op.index, name=op.name, inputs=given, outputs=outputs, supported=False, error=error)


# ------------------------------------------------------------------------------------------ many operators


class _Replayer:
    """Runs :func:`propagate_op` with a cache keyed by operator and input placements.

    Operators that repeat with the same structure (the experts of a MoE layer, the heads of a loop) share one
    replay: the second key is the operator's name and arguments with each tensor replaced by its shape, dtype,
    placement and position of first use, and a hit is re-labelled with the operator's own tensor ids.
    """

    def __init__(self, graph: OpGraph, mesh: DeviceMesh, cache: dict[Any, OpResult] | None) -> None:
        self.graph = graph
        self.mesh = mesh
        self.cache: dict[Any, Any] = cache if cache is not None else {}

    def _signature(self, op: Operator, placements: Mapping[int, Placements]) -> str:
        first: dict[int, int] = {}

        def sig(x: Any) -> Any:
            if isinstance(x, TensorRef):
                t = self.graph.tensors[x.id]
                return ("T", first.setdefault(x.id, len(first)), t.shape, t.dtype,
                        placements.get(x.id, replicate(self.mesh)))
            return x

        outputs = tuple(first.setdefault(t, len(first) + 1000) for t in op.outputs)
        return repr((op.name, tree_map(sig, (op.args, op.kwargs)), outputs))

    def run(self, op: Operator, placements: Mapping[int, Placements]) -> OpResult:
        key = (id(self.graph), op.index, tuple(placements.get(t, replicate(self.mesh)) for t in op.inputs))
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        signature = ("signature", self._signature(op, placements))
        shared = self.cache.get(signature)
        if shared is not None:
            base, base_ids = shared
            relabel = dict(zip(base_ids, op.inputs + op.outputs, strict=True))
            hit = dataclasses.replace(
                base, index=op.index, inputs={relabel[t]: p for t, p in base.inputs.items()},
                outputs={relabel[t]: p for t, p in base.outputs.items()},
                redistributed={relabel[t]: p for t, p in base.redistributed.items()})
        else:
            hit = propagate_op(op, self.graph, placements, self.mesh)
            self.cache[signature] = (hit, op.inputs + op.outputs)
        self.cache[key] = hit
        return hit


def _ancestors(pending: list[Operator], wanted: set[int]) -> list[Operator]:
    """The pending operators ``wanted`` tensors derive from, in execution order."""
    need = set(wanted)
    chain = []
    for p in reversed(pending):
        if need.intersection(p.outputs):
            chain.append(p)
            need.update(p.inputs)
    return chain[::-1]


def propagate(graph: OpGraph, ops: Sequence[Operator], entry: Mapping[int, Placements], mesh: DeviceMesh,
              param_choice: Mapping[str, Placements] | None = None, *, stop_on_collective: bool = False,
              cache: dict[Any, OpResult] | None = None) -> Propagation:
    """Propagate ``entry`` placements (tensor id -> placements) through ``ops`` in order.

    ``param_choice`` fixes some parameters' placements by name; the others are inferred greedily (module docstring).
    Tensors neither given, produced nor parameters (e.g. a mask fed in) are replicated. With ``stop_on_collective``
    the walk ends at the first operator that needs communication. ``cache`` (a dict, shared between calls on the
    same mesh, for one graph or several alive together) saves replaying an operator under input placements already
    seen, and one of the same structure in another graph (two layer kinds with the same attention).

    Past an operator that needed a collective the walk goes on as DTensor executes: the redistributed copy served that
    operator only, later readers of the same tensor see its original placement again.
    """
    replayer = _Replayer(graph, mesh, cache)
    placements: dict[int, Placements] = {}
    for tid, p in entry.items():
        _check_placements(tid, p, mesh)
        placements[tid] = tuple(p)
    by_name = dict(graph.params)
    for name, p in (param_choice or {}).items():
        if name not in by_name:
            raise PropagationError(f"param_choice names {name!r}, which is not a parameter of graph {graph.kind!r}")
        _check_placements(by_name[name], p, mesh)
        placements[by_name[name]] = tuple(p)
    roots: dict[int, frozenset[int]] = {pid: frozenset({pid}) for pid in graph.params.values()
                                        if pid not in placements}
    pending: list[Operator] = []
    results: dict[int, OpResult] = {}

    def commit(result: OpResult) -> None:
        results[result.index] = result
        placements.update(result.outputs)

    for position, op in enumerate(ops):
        deferred = [t for t in op.inputs if t in roots]
        if not deferred:
            commit(replayer.run(op, placements))
        elif all(t in roots for t in op.inputs):
            pending.append(op)
            derived = frozenset().union(*(roots[t] for t in deferred))
            for t in op.outputs:
                roots[t] = derived
            continue
        else:
            chain = _ancestors(pending, set(deferred))
            ahead = ops[position + 1:position + 1 + _LOOKAHEAD]
            for r in _choose(graph, replayer, chain, op, deferred, roots, placements, ahead):
                commit(r)
            done = {o.index for o in chain}
            pending = [p for p in pending if p.index not in done]
            for tid in [t for t in roots if t in placements]:
                del roots[tid]
        if stop_on_collective and not results[op.index].comm_free:
            break
    else:
        for op in list(pending):  # parameters only ever read by parameter-only operators: replicate them
            for tid in op.inputs:
                placements.setdefault(tid, replicate(mesh))
            commit(replayer.run(op, placements))
    params = {name: placements[pid] for name, pid in graph.params.items() if pid in placements}
    ordered = tuple(results[i] for i in sorted(results))
    return Propagation(placements=placements, params=params, results=ordered)


_LOOKAHEAD = 8
"""Operators past a parameter decision that :func:`_choose` also replays to break ties between placements."""


def _choose(graph: OpGraph, replayer: _Replayer, chain: list[Operator], op: Operator, deferred: list[int],
            roots: Mapping[int, frozenset[int]], placements: dict[int, Placements],
            ahead: Sequence[Operator] = ()) -> list[OpResult]:
    """Pick placements for the unfixed parameters ``op`` reads (through ``chain``); return the results to commit.

    One parameter at a time, largest first, the ones not yet decided held Replicate: the first candidate of
    :func:`candidate_placements` that makes ``chain`` + ``op`` communication-free without redistributing an
    activation wins, else the one with the fewest collectives, then redistributions (earliest on ties).

    Lookahead: when the winner makes the operators ``ahead`` (up to the first that reads another undecided
    parameter) need a collective, the interleaved layouts (:func:`strided_candidates`) are tried too and one that
    keeps them free replaces it. A column-parallel fused SwiGLU weight is free at its matmul in the plain and the
    interleaved layout alike; only the chunk into gate and up after it tells them apart.
    """
    params = sorted((pid for pid in frozenset().union(*(roots[t] for t in deferred)) if pid not in placements),
                    key=lambda pid: (-graph.tensors[pid].numel, pid))
    chosen = {pid: replicate(replayer.mesh) for pid in params}
    activations = [t for t in op.inputs if t not in roots and t not in graph.params.values()]
    undecided = set(roots)

    def trial(choice: dict[int, Placements]) -> tuple[tuple[int, int], int, list[OpResult]]:
        state = dict(placements)
        state.update(choice)
        out = []
        for o in [*chain, op]:
            r = replayer.run(o, state)
            state.update(r.outputs)
            out.append(r)
        later = 0
        if out[-1].comm_free:
            for o in ahead:
                if undecided.intersection(o.inputs):
                    break
                r = replayer.run(o, state)
                state.update(r.outputs)
                later += _cost(r)
        return (sum(_cost(r) for r in out), sum(t in out[-1].redistributed for t in activations)), later, out

    best = trial(chosen)
    for pid in params:
        shape = graph.tensors[pid].shape
        for cand in candidate_placements(shape, replayer.mesh):
            result = trial({**chosen, pid: cand})
            if result[0] == (0, 0) or result[0] < best[0]:
                best, chosen[pid] = result, cand
            if result[0] == (0, 0):
                break
        if best[0] == (0, 0) and best[1]:
            for cand in strided_candidates(shape, replayer.mesh):
                result = trial({**chosen, pid: cand})
                if result[0] == (0, 0) and not result[1]:
                    best, chosen[pid] = result, cand
                    break
    placements.update(chosen)
    return best[2]


def _cost(result: OpResult) -> int:
    return sum(result.collectives.values()) + (0 if result.supported else 1000)
