"""The partition options of a model derived from its ParallelBlocks: the planner's analysis stage.

Each distinct layer kind is captured once on the meta device (:func:`~cfp_megatron.model.capture.capture_job`, at
:data:`PROBE_SEQ` tokens: the blocks do not depend on the sequence's length, the size checks read it from the
job) and its forward operators are replayed on DTensors over one-axis meshes of :data:`PROBE` ranks on the ``fake``
process group (:func:`~cfp_megatron.graph.propagation.propagate`):

- ``tp``: entry Replicate, parameters placed by the propagation's greedy inference. The collectives the replay
  meets are the block boundaries; each block's sharded parameters name the part it splits (the submodule that holds
  them) and the sharded dimensions its size checks (heads, FFN, vocabulary); an exit ``Partial`` is an all-reduce
  forward (under SP a reduce-scatter) and the replicated entry's gradient one backward.
- ``cp``: entry sharded on the sequence, every parameter replicated: the operators that need a collective are the
  context split's boundary (the keys and values exchanged); everything else crosses communication-free.
- the embedding's lookup table is tried ``Shard(0)`` (vocabulary rows): communication-free to a ``Partial`` exit.
- the experts: branches of one MoE layer that exchange no tensor (checked on the data flow) are the expert split
  (``ep``; tokens reach them through the dispatch and leave through the combine); one branch replayed on an
  ``etp`` axis gives each expert's tensor split.
- PrimePar's 2-D split applies to a dense column-then-row MLP block of a model without experts; its checks are the
  grid's (4^k ranks, the side dividing the block's hidden, FFN and token sizes).

The result, the derived options, is cached by model key and the derivation's code (``$CFP_CACHE_DIR/derived/``, and
in memory). The declared
catalogue (:mod:`cfp_megatron.model.options`) stays as the cross-check: ``tests/test_derive.py`` asserts derived
equals declared for every preset. Reasoning and tables: docs/analysis.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.base.config import JobSpec, ModelSpec, TrainSpec
from cfp_megatron.base.errors import CfpError, ConfigError
from cfp_megatron.base.layout_rules import moe, sequence, tensor
from cfp_megatron.base.layout_rules.problem import briefs
from cfp_megatron.compat.import_cost import collector_paused, heavy_imports
from cfp_megatron.compat.quiet import quiet_expected_warnings, say_once
from cfp_megatron.model import cache
from cfp_megatron.model.errors import CaptureError
from cfp_megatron.model.options import LayerPart, PartitionOption, SizeContext, model_options

PROBE = 2
"""Ranks per mesh axis of the probe meshes (placements do not depend on the size; a dimension they shard must divide
by it)."""
PROBE_SEQ = 64
"""Tokens per sequence of the capture the options are derived from."""
DERIVE_VERSION = "derive-v1"
"""Part of the cache key: bump when the derivation changes."""

_TP_EXIT = ("all-reduce of the output forward and of the input gradient backward (under SP: all-gather in, "
            "reduce-scatter out)")
_CONTEXT = "key/value exchange around the ring (send/recv) forward and backward: {ops}"


@dataclass(frozen=True, kw_only=True)
class DerivedOption:
    """One option as the derivation found it (JSON-ready): what :class:`PartitionOption` needs, with the sizes its
    checks read from the blocks."""

    part: str
    """A :class:`LayerPart` value."""
    name: str
    """The option's name."""
    knob: str
    """The ParallelSpec size it splits by."""
    choice: tuple[str, str] | None
    """The ParallelSpec field and value that select it, ``None`` for the part's default."""
    block: str
    """The block, as the propagation placed it: entry -> exit, sharded weights."""
    communication: str
    """The collectives at the block's boundaries per pass."""
    rule: str
    """The name of its size check (:data:`RULES`)."""
    sizes: dict[str, Any]
    """What the check reads, from the block's sharded dimensions."""
    kinds: tuple[str, ...]
    """The layer kinds it was found in."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {**dataclasses.asdict(self), "choice": list(self.choice) if self.choice else None,
                "kinds": list(self.kinds)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DerivedOption:
        """Inverse of :meth:`to_json`."""
        return cls(**{**data, "choice": tuple(data["choice"]) if data["choice"] else None,
                      "kinds": tuple(data["kinds"])})

    def option(self) -> PartitionOption:
        """The option the search reads."""
        rule, sizes = RULES[self.rule], dict(self.sizes)

        def checks(model: ModelSpec, size: int, context: SizeContext) -> list[str]:
            return rule(sizes, model, size, context)

        return PartitionOption(part=LayerPart(self.part), name=self.name, knob=self.knob, choice=self.choice,
                               block=self.block, communication=self.communication, modules=frozenset(),
                               checks=checks)


Rule = Callable[[dict[str, Any], ModelSpec, int, SizeContext], list[str]]


def _divisible(sizes: dict[str, Any], model: ModelSpec, size: int, context: SizeContext) -> list[str]:
    return [f"dimension {n} of {where} is not divisible by it" for where, n in sizes["dims"] if n % size]


def _primepar(sizes: dict[str, Any], model: ModelSpec, size: int, context: SizeContext) -> list[str]:
    return briefs(tensor.primepar_grid(size) or tensor.primepar_sizes(
        model=model.name, moe=sizes["moe"], hidden=sizes["hidden"], ffn=sizes["ffn"],
        tokens=context.micro_batch * context.seq_length, tp=size))


RULES: dict[str, Rule] = {
    "attention_heads": lambda s, m, n, c: briefs(tensor.attention_heads(s["heads"], s["groups"], n)),
    "dense_mlp": lambda s, m, n, c: briefs(tensor.dense_mlp(s["ffn"], n)),
    "vocabulary": lambda s, m, n, c: briefs(tensor.vocabulary(s["vocab"], n)),
    "context_chunks": lambda s, m, n, c: briefs(sequence.context_chunks(c.seq_length, n)),
    "experts": lambda s, m, n, c: briefs(moe.experts(s["experts"], n)),
    "expert_ffn": lambda s, m, n, c: briefs(moe.expert_ffn(s["ffn"], n)),
    "shared_expert": lambda s, m, n, c: briefs(moe.shared_expert(s["ffn"], n)),
    "primepar": _primepar,
    "divisible": _divisible,
}
"""The size checks, by name: each reads the sizes the derivation took from the block (heads, FFN, vocabulary, ...)
and says why a size of its knob does not fit, in the words of the layout rules (:mod:`cfp_megatron.base.layout_rules`)
where the block is one they name; ``divisible`` (every sharded dimension divides) for any other block."""

RUNTIME_LACKS: dict[str, tuple[str, str]] = {"cp": ("linear_kv_down_proj", "Megatron-Core's MLA has no context "
                                                                           "parallelism")}
"""A split the partitions allow but Megatron-Core's runtime does not run, by knob: the module that marks the layer
(MLA's key/value down projection) and why. Such an option is derived but not offered."""


# ------------------------------------------------------------------------------------------------ the stage


_MEMO: dict[str, tuple[DerivedOption, ...]] = {}


@functools.cache
def _code_hash() -> str:
    """SHA-256 of the code the derivation runs (this module, the propagation, the blocks, the capture): an entry
    derived by other code is never read back."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in _CODE:
        digest.update((root / name).read_bytes())
    return digest.hexdigest()


_CODE = ("model/derive.py", "graph/propagation.py", "graph/strided_rules.py", "graph/blocks.py", "graph/record.py",
         "model/capture.py", "model/megatron_layers.py", "model/moe_meta.py", "model/mla.py", "model/layer_spec.py")
"""The source files :func:`_code_hash` reads, relative to the package."""


def derive_key(model: ModelSpec, train: TrainSpec) -> str:
    """The cache key of ``model``'s derived options: the model, the capture's precision and the derivation's code."""
    inputs = {**cache.job_cache_inputs(JobSpec(model=model, train=train), seq_length=_probe_seq(model),
                                       micro_batch_size=1), "derive": DERIVE_VERSION, "code": _code_hash()}
    return cache.cache_key(inputs)


def _probe_seq(model: ModelSpec) -> int:
    return min(PROBE_SEQ, model.max_position_embeddings or PROBE_SEQ)


def derived_options(job: JobSpec, *, use_cache: bool = True) -> tuple[DerivedOption, ...]:
    """The derived options of ``job``'s model (cached by model key: in memory, then on disk, else derived)."""
    train = TrainSpec(precision=job.train.precision)
    key = derive_key(job.model, train)
    if use_cache and key in _MEMO:
        return _MEMO[key]
    found = cache.load_json(key, section="derived") if use_cache else None
    if found is not None:
        try:
            options = tuple(DerivedOption.from_json(o) for o in found["options"])
        except (KeyError, TypeError, ValueError):
            options = None
        if options is not None:
            _MEMO[key] = options
            return options
    options, seconds = derive(dataclasses.replace(job, train=train))
    cache.store_json(key, {"options": [o.to_json() for o in options], "seconds": seconds}, section="derived")
    _MEMO[key] = options
    return options


def partition_options(job: JobSpec, *, use_cache: bool = True) -> tuple[PartitionOption, ...]:
    """What the search reads: the derived options that Megatron-Core runs (:data:`RUNTIME_LACKS`; no PrimePar for a
    custom ``model.spec``, whose MLP its layers do not replace). A model the
    capture cannot record on this Megatron-Core (:class:`CaptureError`), or a derivation asked for while a process
    group exists (the probe meshes need the ``fake`` one; the launch derives before it profiles), is planned from
    the declared catalogue, with a warning that says so."""
    try:
        derived = derived_options(job, use_cache=use_cache)
    except ConfigError:
        raise  # a setting the capture cannot use (a model.spec that gives no ModuleSpec): the user's to fix
    except CfpError as err:
        warnings.warn(f"cfp: the partition options of model {job.model.name} could not be derived ({err}); the "
                      "declared ones are used (cfp_megatron/model/options.py)", stacklevel=2)
        return model_options(job.model)
    custom = job.model.spec is not None  # PrimePar's layers replace Megatron-Core's own MLP, not a custom spec's
    return tuple(o.option() for o in derived if not o.rule.startswith("lacks:")
                 and not (custom and o.choice == ("mlp", "primepar")))


def options_report(job: JobSpec, *, use_cache: bool = True) -> list[dict[str, Any]]:
    """The derived options as JSON for the ``analyze`` table: each with ``offered`` (Megatron-Core runs it) and
    ``declared`` (the declared catalogue, :func:`~cfp_megatron.model.options.model_options`, has the same option)."""
    declared = {(o.part.value, o.name, o.knob, o.choice) for o in model_options(job.model)}
    return [{**o.to_json(), "offered": not o.rule.startswith("lacks:"),
             "declared": (o.part, o.name, o.knob, o.choice) in declared}
            for o in derived_options(job, use_cache=use_cache)]


def derive(job: JobSpec) -> tuple[tuple[DerivedOption, ...], dict[str, float]]:
    """Capture ``job``'s model at :data:`PROBE_SEQ` tokens and derive its options (module docstring); the seconds
    of the imports, the capture and the propagation."""
    say_once(quiet_expected_warnings(distributed=False))  # before Megatron-Core is imported (by the capture)
    start = time.perf_counter()
    with heavy_imports():
        import torch._dynamo  # noqa: F401 - torch's `_disable_dynamo` wrappers (DTensor's dispatch) import it

        from cfp_megatron.graph.propagation import fake_mesh  # noqa: F401 - with its DTensor imports
        from cfp_megatron.graph.record import forward_only
        from cfp_megatron.model.capture import capture_job
    imported = time.perf_counter()
    with collector_paused():  # the capture and the replays make many short-lived objects, few of them cycles
        try:
            with forward_only():  # the blocks are found over the forward operators
                capture = capture_job(job, seq_length=_probe_seq(job.model), micro_batch_size=1)
        except CaptureError:
            raise
        except Exception as exc:  # noqa: BLE001 - Megatron-Core's own failures on meta (e.g. an in-place view)
            raise CaptureError(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
        captured = time.perf_counter()
        options = derive_from_graphs(capture.graphs, capture.layer_kinds)
    return options, {"imports": round(imported - start, 3), "capture": round(captured - imported, 3),
                     "derive": round(time.perf_counter() - captured, 3)}


def derive_from_graphs(graphs: dict[str, Any], layer_kinds: Sequence[str]) -> tuple[DerivedOption, ...]:
    """The options of a model whose distinct layer kinds recorded ``graphs`` (embedding, decoder kinds, head)."""
    from cfp_megatron.graph.propagation import fake_mesh

    found: list[DerivedOption] = []
    decoder = list(dict.fromkeys(layer_kinds))
    experts_somewhere = any(_expert_branches(graphs[k]) for k in decoder)
    with fake_mesh((PROBE,), ("tp",)) as mesh:
        replays: dict[Any, Any] = {}  # one per mesh: kinds that share operators (the same attention) replay them once
        if "embedding" in graphs:
            found += _embedding(graphs["embedding"], mesh)
        for kind in decoder:
            found += _tensor_split(graphs[kind], kind, mesh, experts_somewhere, replays)
        if "head" in graphs:
            found += _tensor_split(graphs["head"], "head", mesh, experts_somewhere, replays)
    with fake_mesh((PROBE,), ("cp",)) as mesh:
        replays = {}
        for kind in decoder:
            found += _context_split(graphs[kind], kind, mesh, replays)
    with fake_mesh((PROBE,), ("etp",)) as mesh:
        for kind in decoder:
            found += _expert_split(graphs[kind], kind, mesh)
    return _merge(found)


def _merge(found: Iterable[DerivedOption]) -> tuple[DerivedOption, ...]:
    """One option per (part, name, knob, choice, rule, sizes), in model order, with the kinds it was found in."""
    order = [p.value for p in LayerPart]
    merged: dict[Any, DerivedOption] = {}
    for o in found:
        key = (o.part, o.name, o.knob, o.choice, o.rule, repr(sorted(o.sizes.items())))
        if key in merged:
            kinds = tuple(dict.fromkeys(merged[key].kinds + o.kinds))
            merged[key] = dataclasses.replace(merged[key], kinds=kinds)
        else:
            merged[key] = o
    return tuple(sorted(merged.values(), key=lambda o: order.index(o.part)))


# ------------------------------------------------------------------------------------------------ helpers


def _leaf(module: str) -> str:
    return module.rsplit(".", 1)[-1]


def _layer_of(param: str) -> str:
    """``self_attention.linear_qkv.weight`` -> ``linear_qkv``."""
    return param.rsplit(".", 2)[-2] if param.count(".") >= 1 else param


def _part_of(path: str, kind: str) -> str | None:
    """The part a module (or parameter) path belongs to; ``None`` for the experts (analysed on their own)."""
    if kind == "head":
        return LayerPart.head.value
    names = path.split(".")
    if ("experts" in names and "shared_experts" not in names) or "router" in names:
        return None  # the experts are analysed on their own; the router stays replicated (each token routed once)
    if "shared_experts" in names:
        return "shared"
    if any("attention" in n for n in names):
        return LayerPart.attention.value
    if any("mlp" in n for n in names):
        return LayerPart.mlp.value
    return "layer"  # the layer's own operators (input norm, residual adds)


def _forward(graph: Any) -> tuple[Any, ...]:
    from cfp_megatron.graph.blocks import forward_operators

    return forward_operators(graph)


def _sharded(graph: Any, results: Iterable[Any], params: dict[str, Any],
             ops_by_index: dict[int, Any]) -> list[tuple[str, int, int, int]]:
    """(module or parameter, tensor id, tensor rank (-1: a parameter), dimension size / split factor) of every tensor
    dimension sharded on the axis: outputs of the replayed operators and the parameters."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def size_of(shape: tuple[int, ...], p: Any) -> int | None:
        if isinstance(p, _StridedShard):
            return shape[p.dim] // p.split_factor
        return shape[p.dim] if isinstance(p, Shard) else None

    out = []
    for r in results:
        module = ops_by_index[r.index].module
        for tid, pl in r.outputs.items():
            n = size_of(graph.tensors[tid].shape, pl[0])
            if n is not None:
                out.append((module, tid, len(graph.tensors[tid].shape), n))
    for name, pl in params.items():
        n = size_of(graph.tensors[graph.params[name]].shape, pl[0])
        if n is not None:
            out.append((name, graph.params[name], -1, n))
    return out


def _split_str(params: dict[str, Any]) -> str:
    from cfp_megatron.graph.propagation import placement_str

    shown = {}
    for name, pl in params.items():
        text = placement_str(pl)
        if text != "R":
            shown.setdefault(_layer_of(name), text)
    return ", ".join(f"{k} {v}" for k, v in shown.items())


# ------------------------------------------------------------------------------------------------ tensor split


def _tp_blocks(graph: Any, ops: Sequence[Any], mesh: Any, shared: dict[Any, Any]) -> list[tuple[Any, list[Any], Any]]:
    """The blocks of ``ops`` with a replicated entry: propagated from the entry to the first collective, then again
    from the main activation the collective's operator reads (replicated: the boundary's collective made it so).
    Each block as (its propagation, its results, the boundary's result or ``None`` at the end)."""
    from cfp_megatron.graph.blocks import main_input, param_only_ids
    from cfp_megatron.graph.propagation import propagate, replicate

    param_only = param_only_ids(graph, ops)
    found = []
    start, entry = 0, graph.inputs[0]
    while start < len(ops):
        rest = ops[start:]
        run = propagate(graph, rest, {entry: replicate(mesh)}, mesh, stop_on_collective=True, cache=shared)
        first = run.first_collective
        body = [r for r in run.results if r is not first]
        found.append((run, body, first))
        if first is None:
            break
        stop = next(i for i, op in enumerate(rest) if op.index == first.index)
        start += max(stop, 1)  # a collective at the entry itself (an explicit all-reduce): past it
        if start < len(ops):
            entry = main_input(graph, ops[start], param_only) or entry
    return found


def _tensor_split(graph: Any, kind: str, mesh: Any, experts_somewhere: bool,
                  replays: dict[Any, Any]) -> list[DerivedOption]:
    """The TP blocks of one layer kind (or the head): entry Replicate, cut at the collectives the replay meets."""
    from cfp_megatron.graph.propagation import placement_str

    ops = [o for o in _forward(graph) if _part_of(o.module, kind) is not None]
    if not ops:
        return []
    by_index = {o.index: o for o in ops}
    found = []
    for run, results, nxt in _tp_blocks(graph, ops, mesh, replays):
        if not results:
            continue
        read = {t for r in results for t in by_index[r.index].inputs}
        split = {n: p for n, p in run.params.items() if graph.params[n] in read and placement_str(p) != "R"}
        if not split:
            continue
        parts = sorted({_part_of(n, kind) or "" for n in split})
        part = parts[0] if len(parts) == 1 else parts[-1]  # a block over two parts: offered as the later one's
        last = results[-1]
        exit_pl = placement_str(next(iter(last.outputs.values()))) if last.outputs else "R"
        if part != LayerPart.head.value and not exit_pl.startswith("P"):
            continue  # a split that leaves its block sharded (MLA's down projections into their norms) needs an
            # all-gather at the boundary: Megatron's TP closes each split with a row-parallel reduction instead
        dims = _sharded(graph, results, split, by_index)
        found += _tp_option(part, kind, split, dims, exit_pl, nxt, results, by_index, graph, experts_somewhere)
    return found


def _tp_option(part: str, kind: str, split: dict[str, Any], dims: list[tuple[str, int, int, int]], exit_pl: str,
               nxt: Any, results: list[Any], by_index: dict[int, Any], graph: Any,
               experts_somewhere: bool) -> list[DerivedOption]:
    """The option a TP block with sharded parameters ``split`` gives its ``part`` (:func:`_tensor_split`)."""
    from cfp_megatron.graph.blocks import param_only_ids

    where = _split_str(split)
    boundary = (", then " + "+".join(sorted(nxt.collectives)) + f" at {_leaf(_module_of(by_index, nxt))}"
                if nxt is not None and nxt.collectives else "")
    block = f"R -> {exit_pl}, {where}"
    if part == LayerPart.attention.value:
        heads = sorted({n for _, _, rank, n in dims if rank == 4})
        if not heads:
            return [_generic(part, kind, block, dims)]
        sizes = {"heads": heads[-1], "groups": heads[0]}  # the queries' heads and the keys' and values' (groups)
        return [DerivedOption(part=part, name="head-split", knob="tp", choice=None, block=block,
                              communication=_TP_EXIT + boundary, rule="attention_heads", sizes=sizes, kinds=(kind,))]
    if part in (LayerPart.mlp.value, "shared"):
        ffn = sorted({n for _, _, rank, n in dims if rank == 3})
        if not ffn:
            return [_generic(LayerPart.mlp.value, kind, block, dims)]
        if part == "shared":
            return [DerivedOption(part=LayerPart.moe.value, name="shared-expert-split", knob="tp", choice=None,
                                  block=block, communication=_TP_EXIT + boundary, rule="shared_expert",
                                  sizes={"ffn": ffn[0]}, kinds=(kind,))]
        out = [DerivedOption(part=part, name="megatron-1d", knob="tp", choice=None, block=block,
                             communication=_TP_EXIT + boundary, rule="dense_mlp", sizes={"ffn": ffn[0]},
                             kinds=(kind,))]
        weights = param_only_ids(graph, [by_index[r.index] for r in results])
        gemms = [r for r in results if by_index[r.index].name in _GEMMS and weights & set(r.inputs)]
        hidden = graph.tensors[graph.inputs[0]].shape[-1]
        if len(gemms) == 2 and not experts_somewhere:  # a column-then-row pair: PrimePar's 2-D grid applies
            out.append(DerivedOption(
                part=part, name="primepar-2d", knob="tp", choice=("mlp", "primepar"),
                block="R -> R on a 2^k x 2^k grid: every block of " + where + " held once",
                communication="ring send/recv of weight and partial-sum blocks over 2^k steps (overlapped), an "
                              "all-gather of the output",
                rule="primepar", sizes={"hidden": hidden, "ffn": ffn[0], "moe": False}, kinds=(kind,)))
        return out
    if part == LayerPart.head.value:
        vocab = sorted({n for name, _, rank, n in dims if rank == -1})
        return [DerivedOption(part=part, name="vocab-split", knob="tp", choice=None, block=block,
                              communication="the cross-entropy's max and sum all-reduced over the vocabulary shards"
                                            f" ({'+'.join(sorted(nxt.collectives)) if nxt else 'none'} counted)",
                              rule="vocabulary", sizes={"vocab": vocab[0]}, kinds=(kind,))]
    return [_generic(part, kind, block, dims)]


_GEMMS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.matmul.default", "aten.linear.default")


def _module_of(by_index: dict[int, Any], result: Any) -> str:
    """The module of a replayed operator (also outside ``by_index``: its name then)."""
    op = by_index.get(result.index)
    return op.module if op is not None else result.name


def _generic(part: str, kind: str, block: str, dims: list[tuple[str, int, int, int]]) -> DerivedOption:
    seen = sorted({(_leaf(m), n) for m, _, _, n in dims})
    minimal = [(m, n) for m, n in seen if not any(o != n and n % o == 0 for _, o in seen)]
    part = part if part in {p.value for p in LayerPart} else LayerPart.mlp.value
    return DerivedOption(part=part, name=f"{part}-split", knob="tp", choice=None, block=block,
                         communication=_TP_EXIT, rule="divisible",
                         sizes={"dims": [list(x) for x in dict.fromkeys(minimal)]}, kinds=(kind,))


# ------------------------------------------------------------------------------------------------ embedding


def _embedding(graph: Any, mesh: Any) -> list[DerivedOption]:
    """The lookup table split by vocabulary rows: communication-free to a ``Partial`` exit."""
    from torch.distributed.tensor import Shard

    from cfp_megatron.graph.propagation import placement_str, propagate, replicate

    ops = _forward(graph)
    lookups = [o for o in ops if o.name == "aten.embedding.default"]
    if not lookups:
        return []
    table = next(n for n, pid in graph.params.items() if pid == lookups[0].inputs[0])
    rows = graph.tensors[graph.params[table]].shape[0]
    run = propagate(graph, [lookups[0]], {graph.inputs[0]: replicate(mesh)}, mesh, {table: (Shard(0),)})
    result = run.results[0]
    for p in (*result.outputs.values(), *result.redistributed.values()):
        for placement in p:  # the masked partial's mask, never reduced here: released, as DTensor's reduction does
            # (DTensor caches the placement: a later lookup would compare its mask with a meta tensor's)
            buffer = getattr(placement, "mask_buffer", None)
            while buffer is not None and buffer.refcount:
                buffer.release_mask()
    exit_pl = placement_str(next(iter(result.outputs.values())))
    if not result.comm_free or not exit_pl.startswith("P"):
        return []
    return [DerivedOption(part=LayerPart.embedding.value, name="vocab-split", knob="tp", choice=None,
                          block=f"tokens R -> hidden {exit_pl}, {_layer_of(table)} S(0)",
                          communication="all-reduce of the hidden states forward (reduce-scatter under SP)",
                          rule="vocabulary", sizes={"vocab": rows}, kinds=("embedding",))]


# ------------------------------------------------------------------------------------------------ context split


def _context_split(graph: Any, kind: str, mesh: Any, replays: dict[Any, Any]) -> list[DerivedOption]:
    """Entry sharded on the sequence, weights replicated: the attention core's collectives are the boundary."""
    from torch.distributed.tensor import Replicate, Shard

    routed = bool(_expert_branches(graph))  # a MoE layer's token exchange is the expert split's own (ep)
    ops = [o for o in _forward(graph) if _part_of(o.module, kind) is not None
           and not (routed and _part_of(o.module, kind) in (LayerPart.mlp.value, "shared"))]
    entry = graph.inputs[0]
    seq_dim = 0  # Megatron's activations are [sequence, batch, hidden]
    from cfp_megatron.graph.propagation import propagate

    run = propagate(graph, ops, {entry: (Shard(seq_dim),)}, mesh,
                    {n: (Replicate(),) for n, pid in graph.params.items()}, cache=replays)
    by_index = {o.index: o for o in ops}
    needs = [r for r in run.results if not r.comm_free]
    modules = {by_index[r.index].module for r in needs}
    if not needs or not all(_part_of(m, kind) == LayerPart.attention.value for m in modules):
        return []  # the sequence split needs communication outside attention: no context split
    lacks = RUNTIME_LACKS.get("cp")
    held = {_leaf(o.module) for o in ops}
    rule = f"lacks:{lacks[1]}" if lacks and lacks[0] in held else "context_chunks"
    counted: dict[str, int] = {}
    for r in needs:
        for k, v in r.collectives.items():
            counted[k] = counted.get(k, 0) + v
    ops_text = ", ".join(f"{v} x {k}" for k, v in sorted(counted.items())) + " in " + ", ".join(
        sorted({_leaf(m) for m in modules}))
    return [DerivedOption(part=LayerPart.attention.value, name="context-split", knob="cp", choice=None,
                          block="sequence S(0) -> S(0), weights R; the attention core needs the other chunks' "
                                "keys and values (2 x cp load-balanced chunks)",
                          communication=_CONTEXT.format(ops=ops_text), rule=rule, sizes={}, kinds=(kind,))]


# ------------------------------------------------------------------------------------------------ experts


def _expert_branches(graph: Any) -> dict[str, list[Any]]:
    """Forward operators of each expert (``...experts.local_experts.<i>``), by expert path."""
    branches: dict[str, list[Any]] = {}
    for op in _forward(graph):
        names = op.module.split(".")
        if "local_experts" in names and "shared_experts" not in names:
            i = names.index("local_experts")
            if i + 1 < len(names):
                branches.setdefault(".".join(names[:i + 2]), []).append(op)
    return branches


def _independent(branches: dict[str, list[Any]]) -> bool:
    """No branch reads a tensor another branch wrote."""
    wrote = {t: b for b, ops in branches.items() for op in ops for t in op.outputs}
    return all(wrote.get(t, b) == b for b, ops in branches.items() for op in ops for t in op.inputs)


def _expert_split(graph: Any, kind: str, mesh: Any) -> list[DerivedOption]:
    """Independent expert branches split over ``ep``; one branch's TP blocks over ``etp``."""
    from cfp_megatron.graph.propagation import placement_str, propagate, replicate

    branches = _expert_branches(graph)
    if not branches or not _independent(branches):
        return []
    out = [DerivedOption(part=LayerPart.moe.value, name="expert-split", knob="ep", choice=None,
                         block=f"{len(branches)} expert branches that exchange no tensor; tokens enter through the "
                               "dispatch and leave through the combine",
                         communication="token dispatch and combine (all-to-all, or all-gather) forward and backward",
                         rule="experts", sizes={"experts": len(branches)}, kinds=(kind,))]
    ops = next(iter(branches.values()))
    produced = {t for op in ops for t in op.outputs}
    param_ids = set(graph.params.values())
    entry = next((t for op in ops for t in op.inputs if t not in produced and t not in param_ids), None)
    if entry is None:
        return out
    run = propagate(graph, ops, {entry: replicate(mesh)}, mesh)
    by_index = {o.index: o for o in ops}
    read = {t for op in ops for t in op.inputs}
    split = {n: p for n, p in run.params.items() if graph.params[n] in read and placement_str(p) != "R"}
    if not split or not run.comm_free:
        return out
    dims = _sharded(graph, run.results, split, by_index)
    ffn = sorted({n for _, _, rank, n in dims if rank == 2})  # an expert's tokens are [tokens, ffn]
    last = run.results[-1]
    exit_pl = placement_str(next(iter(last.outputs.values())))
    out.append(DerivedOption(part=LayerPart.moe.value, name="expert-tensor-split", knob="etp", choice=None,
                             block=f"each expert R -> {exit_pl}, {_split_str(split)}",
                             communication="all-reduce (reduce-scatter) of each expert's output over the expert TP "
                                           "group",
                             rule="expert_ffn", sizes={"ffn": ffn[0] if ffn else math.gcd(*[d[3] for d in dims])},
                             kinds=(kind,)))
    return out
