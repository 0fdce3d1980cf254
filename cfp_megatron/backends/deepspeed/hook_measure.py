"""What the ``deepspeed.initialize`` hook measures of a user's model on the live ranks
(:mod:`cfp_megatron.backends.deepspeed.hook_plan`): its passes and the activation bytes they save at a few
micro-batches, an optimizer step's cost per parameter, and the world group's collectives (from the ProfileDB, else
a quick fit now). The model's weights, gradients, buffers, modes and the RNG states are left as they were.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes, probe_stages
from cfp_megatron.backends.deepspeed.hook_config import HookRequest, probe_config
from cfp_megatron.base.config import Backend, ClusterSpec
from cfp_megatron.base.errors import CfpError
from cfp_megatron.cluster.measured import (
    Collective,
    CollectiveFit,
    Measurements,
    NothingMeasured,
    Span,
    least_squares_line,
)
from cfp_megatron.engine.distributed import resolve_backend
from cfp_megatron.profile.cluster import measured_cluster
from cfp_megatron.profile.collectives import CPU_SIZES, GPU_SIZES, CollectiveBench, GroupPattern, repeats_for
from cfp_megatron.profile.control import barrier, slowest, timed
from cfp_megatron.profile.db import db_path, load_db
from cfp_megatron.profile.fingerprint import current_fingerprint
from cfp_megatron.profile.fit import fit_collective
from cfp_megatron.sim.prediction import GIB

if TYPE_CHECKING:
    from cfp_megatron.backends.deepspeed.engine_probe import EngineBuilder, EngineProbes, StepCall

DEFAULT_PROBE_BUDGET_S = 30.0
"""Seconds the engine probes may take by default (0 turns them off)."""

PROBE_ROUNDS = 5
"""Timed rounds of each engine probe (after one untimed), as the ``backend=deepspeed`` path takes them."""

MEASURED_MICRO_BATCHES = (1, 2, 4)
"""Micro-batch sizes the passes are timed at."""


ADAM_PROXY_ELEMENTS = 1 << 22
"""Elements of the flat tensor the optimizer step is timed on."""


@dataclass(frozen=True, kw_only=True)
class MeasuredPasses:
    """The user's model measured on the live ranks (the slowest rank's figures)."""

    forward: tuple[float, float]
    """Forward seconds per micro-batch as (fixed, per sample): the least-squares line."""
    backward: tuple[float, float]
    """Backward seconds per micro-batch as (fixed, per sample)."""
    activations: tuple[float, float]
    """Bytes saved for the backward pass per micro-batch as (fixed, per sample)."""
    optimizer_s_per_param: float
    """Seconds of one AdamW step per parameter."""
    params: int
    """Parameters of the model."""
    points: tuple[tuple[int, float, float, float], ...]
    """What the lines were fitted to: (micro-batch, forward s, backward s, saved bytes)."""
    wall_s: float
    """Seconds the measurement took on this rank."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rebatch(example_input: Any, size: int, device: torch.device) -> tuple[Any, ...]:
    """``example_input`` (a tensor or a tuple) with every tensor of the example's batch size sliced or repeated along
    dim 0 to ``size`` and moved to ``device``."""
    from torch.utils._pytree import tree_flatten

    inputs = example_input if isinstance(example_input, tuple) else (example_input,)
    tensors = [x for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor) and x.dim() >= 1]
    batch = int(tensors[0].shape[0]) if tensors else None

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if batch is not None and x.dim() >= 1 and x.shape[0] == batch:
            reps = -(-size // batch)
            x = (x.repeat(reps, *([1] * (x.dim() - 1))) if reps > 1 else x)[:size]
        return x.to(device)

    return tuple(tree_map(one, inputs))


def _loss(out: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    """``loss_fn(out)``, or the capture's default: the sum of the first output."""
    if loss_fn is not None:
        return loss_fn(out)
    first = out[0] if isinstance(out, tuple | list) else out
    return first.float().sum()


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Put back the CPU and CUDA RNG states after the block."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextlib.contextmanager
def _model_kept(model: torch.nn.Module) -> Iterator[None]:
    """Put back the model's gradients, buffers, train/eval mode and the RNG states after the block."""
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    modes = [(m, m.training) for m in model.modules()]
    try:
        with rng_kept():
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g
        for m, training in modes:
            m.training = training


def _saved_bytes(model: torch.nn.Module, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Run the forward ``run`` counting the bytes autograd saves for the backward pass (each storage once, the
    model's parameters left out); its loss and the count."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a subclass): not counted
            return t
        ptr = storage.data_ptr()
        if ptr not in params and ptr != 0:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    return loss, float(sum(seen.values()))


def _adam_seconds_per_param(params: int, device: torch.device, repeats: int) -> float:
    """Seconds per parameter of one AdamW step, timed on a flat fp32 tensor of the model's size (at most
    :data:`ADAM_PROXY_ELEMENTS`; median after a warm-up)."""
    n = max(min(params, ADAM_PROXY_ELEMENTS), 1)
    weight = torch.zeros(n, device=device, requires_grad=True)
    weight.grad = torch.full((n,), 1e-3, device=device)
    opt = torch.optim.AdamW([weight], lr=1e-3)
    opt.step()
    samples = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        opt.step()
        _sync(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) / n


def measure_passes(model: torch.nn.Module, example_input: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                   sizes: tuple[int, ...] = MEASURED_MICRO_BATCHES, repeats: int = 5,
                   warmup: int = 2) -> MeasuredPasses:
    """Time ``model``'s forward and backward at micro-batch ``sizes`` (``warmup`` untimed passes, then the median of
    ``repeats``) and count the bytes it saves for the backward pass (module docstring, steps 1-3). Every rank calls
    this when a process group is up; the figures are the slowest rank's. The model's weights, gradients, buffers and
    the RNG states are as before."""

    began = time.perf_counter()
    first = next(iter(model.parameters()), None)
    device = first.device if first is not None else torch.device("cpu")
    rows: list[float] = []
    saved: list[float] = []
    with _model_kept(model):
        model.train()
        for size in sizes:
            inputs = rebatch(example_input, size, device)
            model.zero_grad(set_to_none=True)
            loss, nbytes = _saved_bytes(model, lambda inputs=inputs: _loss(model(*inputs), loss_fn))
            loss.backward()  # the first warm-up pass
            saved.append(nbytes)
            for _ in range(warmup - 1):
                model.zero_grad(set_to_none=True)
                _loss(model(*inputs), loss_fn).backward()
            forward, backward = [], []
            for _ in range(repeats):
                model.zero_grad(set_to_none=True)
                barrier()
                _sync(device)
                start = time.perf_counter()
                loss = _loss(model(*inputs), loss_fn)
                _sync(device)
                middle = time.perf_counter()
                loss.backward()
                _sync(device)
                forward.append(middle - start)
                backward.append(time.perf_counter() - middle)
            rows += [statistics.median(forward), statistics.median(backward)]
        model.zero_grad(set_to_none=True)
    barrier()
    params = sum(p.numel() for p in model.parameters())
    optimizer = _adam_seconds_per_param(params, device, repeats)
    slowest_figures = slowest([*rows, *saved, optimizer])
    n = len(sizes)
    fwd, bwd = slowest_figures[0:2 * n:2], slowest_figures[1:2 * n:2]
    nbytes = slowest_figures[2 * n:3 * n]
    points = tuple((s, f, b, m) for s, f, b, m in zip(sizes, fwd, bwd, nbytes, strict=True))
    return MeasuredPasses(forward=least_squares_line([(s, f) for s, f, _, _ in points]),
                          backward=least_squares_line([(s, b) for s, _, b, _ in points]),
                          activations=least_squares_line([(s, m) for s, _, _, m in points]),
                          optimizer_s_per_param=slowest_figures[3 * n], params=params,
                          points=points, wall_s=time.perf_counter() - began)


class EngineProbeError(CfpError, RuntimeError):
    """An engine probe of the user's model failed: its copy, or DeepSpeed's engine around the copy."""


def model_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` for an engine probe, in training mode and without gradients; the hook's own
    attributes on it (``cfp_*``) are shared, not copied. ``model`` is only read."""
    memo: dict[int, Any] = {id(v): v for k, v in vars(model).items() if k.startswith("cfp_")}
    try:
        twin = copy.deepcopy(model, memo)
    except (TypeError, RuntimeError, copy.Error) as err:
        raise EngineProbeError(f"{type(model).__name__} cannot be deep-copied for the engine probes ({err}); pass "
                               "probe_budget_s=0 to plan without them.") from err
    twin.train()
    twin.zero_grad(set_to_none=True)
    return twin


def probe_inputs(example_input: Any, device: torch.device, precision: str) -> tuple[Any, ...]:
    """``example_input`` re-batched to one sample on ``device``, its floating-point tensors in the engine's
    ``precision`` (DeepSpeed casts the module, not its inputs)."""
    inputs = rebatch(example_input, 1, device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return inputs
    return tuple(tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                          inputs))


def _engine_builder(model: torch.nn.Module, example_input: Any, request: HookRequest,
                    loss_fn: Callable[[Any], torch.Tensor] | None) -> EngineBuilder:
    """Builds, for a ZeRO stage, DeepSpeed's engine around a copy of ``model`` (:func:`probe_config`) and the call
    that runs a step of ``n`` micro-batches of one sample."""
    def build(stage: int) -> tuple[Any, StepCall]:
        import deepspeed

        twin = model_copy(model)
        try:
            engine, _, _, _ = deepspeed.initialize(model=twin, config=probe_config(request, stage),
                                                   model_parameters=[p for p in twin.parameters() if p.requires_grad])
        except Exception as err:
            raise EngineProbeError(f"DeepSpeed's engine for the ZeRO-{stage} probe could not be built ({err}); "
                                   "pass probe_budget_s=0 to plan without the probes.") from err
        inputs = probe_inputs(example_input, engine.device, request.precision)

        def step(accumulation: int) -> Callable[[], object]:
            def run() -> None:
                for _ in range(accumulation):
                    engine.backward(_loss(engine(*inputs), loss_fn))
                    engine.step()
            return run

        return engine, step

    return build


def probe_engines(model: torch.nn.Module, example_input: Any, request: HookRequest, stages: Iterable[int], *,
                  name: str, loss_fn: Callable[[Any], torch.Tensor] | None = None,
                  budget_s: float = DEFAULT_PROBE_BUDGET_S, rounds: int = PROBE_ROUNDS) -> EngineProbes:
    """The engine probes of ``model`` for ZeRO ``stages`` (every rank calls this), as the ``backend=deepspeed``
    path takes them (:func:`~cfp_megatron.backends.deepspeed.engine_probe.probe_stages`): per stage, DeepSpeed's
    engine around a copy of the model at micro-batch 1, timed at 1, 2 and 4 micro-batches per step in turn, then
    destroyed; stages not reached within ``budget_s`` are left out. The model and the RNG states are as before."""

    with rng_kept():
        found = probe_stages(stages, _engine_builder(model, example_input, request, loss_fn), world=request.world,
                             rounds=rounds, budget_s=budget_s)
    return EngineProbes(model=name, world=request.world, stages=found)


class _CollectiveFits(NothingMeasured):
    """:class:`Measurements` holding only collective fits measured now."""

    def __init__(self, fits: dict[tuple[Collective, int, Span], CollectiveFit]) -> None:
        self.fits = fits

    def collective(self, op: Collective, group_size: int, span: Span) -> CollectiveFit | None:
        return self.fits.get((op, group_size, span))


def quick_collective_fits(world: int, span: Span) -> dict[tuple[Collective, int, Span], CollectiveFit]:
    """All-reduce, reduce-scatter and all-gather on the world group at three message sizes, fitted (every rank
    calls this)."""

    import torch.distributed as dist

    on_gpu = torch.cuda.is_available()
    sizes = (GPU_SIZES[0], GPU_SIZES[3], GPU_SIZES[6]) if on_gpu else (CPU_SIZES[0], CPU_SIZES[3], CPU_SIZES[5])
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    pattern = GroupPattern(size=world, span=span, layout="contiguous", groups=(tuple(range(world)),))
    bench = CollectiveBench(pattern, torch.float32, device)
    fits = {}
    for op in (Collective.all_reduce, Collective.reduce_scatter, Collective.all_gather):
        points = []
        for size in sizes:
            actual, fn = bench.call(op, size)
            points.append((actual, timed(fn, repeats=repeats_for(size, on_gpu=on_gpu), warmup=2,
                                         group=dist.group.WORLD)))
        fits[(op, world, span)] = fit_collective(op, world, span, points)
    return fits


def live_cluster(world: int, local_world: int) -> tuple[ClusterSpec, Measurements | None, str]:
    """This machine as a :class:`ClusterSpec` (its GPU's memory, or none on CPU), the collective measurements for
    the world group and where they came from (module docstring, step 4). Every rank calls this; rank 0's answer is
    the one used."""

    import torch.distributed as dist

    per_node = max(min(local_world, world), 1)
    nodes = max(world // per_node, 1)
    on_gpu = torch.cuda.is_available()
    spec = ClusterSpec(name="local", nodes=nodes, gpus_per_node=per_node,
                       device_name=torch.cuda.get_device_name() if on_gpu else "cpu",
                       hbm_gib=torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
                       if on_gpu else None)
    if world == 1:
        return spec, None, "none needed (one rank)"
    span = Span.intra_node if nodes == 1 else Span.inter_node
    db = None
    try:
        db = load_db(current_fingerprint(world_size=world, nodes=nodes, backend=resolve_backend(Backend.auto)))
    except Exception:  # noqa: BLE001 - an unreadable or outdated ProfileDB is measured around, not fatal
        db = None
    usable = db is not None and all(db.collective(op, world, span) is not None for op in
                                    (Collective.all_reduce, Collective.reduce_scatter, Collective.all_gather))
    box = [usable]
    dist.broadcast_object_list(box, src=0)  # rank 0's answer decides whether every rank measures
    if box[0] and db is not None:
        return measured_cluster(spec, db, gpus_per_node=per_node), db, f"ProfileDB {db_path(db.fingerprint)}"
    began = time.perf_counter()
    fits = quick_collective_fits(world, span)
    return spec, _CollectiveFits(fits), (f"measured now: all-reduce, reduce-scatter, all-gather on {world} ranks at "
                                         f"3 sizes in {time.perf_counter() - began:.2f} s")


# -- the search ----------------------------------------------------------------------------------------------------
