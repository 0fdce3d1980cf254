"""Kernel launches per layer kind and pass, counted from the Megatron-Core modules the runtime builds.

``python bench/kernel_launches.py [--out FILE.json] [--repeats 20]``
``python bench/kernel_launches.py --host-timing [--out FILE.json] [--repeats 10] [--cases dense,moe_dropless,moe_padded]
[--seqs 1024,4096]``

Builds a short GPTModel of each model below with Megatron-Core's own layer specs (Transformer Engine's where it is
installed and a GPU is present, else the local spec; as :mod:`cfp_megatron.engine.model` builds them), on one rank,
and counts what one forward and one backward of each part dispatches: the embedding, a dense decoder layer
(attention + MLP), a MoE layer (its router, token dispatch and permutation, experts, shared expert, split by
module) at two numbers of local experts (the experts' launches per local expert are the difference), the head
(final norm, logits, cross-entropy), and the optimizer step (per parameter tensor).

- On a GPU: the host's launch calls under ``torch.profiler`` (``cudaLaunchKernel``, ``cuLaunchKernel``,
  ``cudaMemcpyAsync``, ``cudaMemsetAsync``, ...) and its synchronisations (``cudaStreamSynchronize``,
  ``cudaEventSynchronize``, blocking copies), at the models' own shapes (a 2-layer slice).
- On CPU: the aten operators that reach the dispatcher below autograd (``TorchDispatchMode``) less those that launch
  no kernel on a GPU (views, ``empty``), the closest proxy; shapes shrunk (the counts do not depend on them on CPU).
  It also times the host's seconds per counted kernel (a dense layer's forward and backward at tiny shapes).

The JSON it writes is the format of ``cfp_megatron/sim/kernel_launches.json`` (the counts the simulator's host
term reads; docs/simulator.md, "Host time"). Asserts nothing.

``--host-timing`` instead times, without the profiler, one forward and one backward of a dense layer
(``llama3_8b``-shaped), a dropless all-to-all MoE layer and a drop-and-pad one (capacity 1.0, padded: no host sync),
Mixtral-shaped, at a short and a long sequence: the host's seconds (wall time until the call returns) and the GPU's
(CUDA events around it), eager and with the GPU's queue prefilled by a sleep (the host's enqueue time alone, the
GPU's busy time alone), with each pass's launch calls and syncs counted under the profiler afterwards. It writes
``host_timing`` (under a minute on one GPU; on CPU the host's seconds only, at CPU shapes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NO_KERNEL = {"aten.empty.memory_format", "aten.empty_strided.default", "aten.detach.default",
             "aten._unsafe_view.default", "aten.lift_fresh.default", "aten.set_.source_Storage",
             "aten.set_.source_Storage_storage_offset", "aten.is_same_size.default", "aten.sym_size.int",
             "aten.sym_stride.int", "aten.sym_numel.default", "aten.sym_storage_offset.default"}
"""Dispatched operators that launch no kernel on a GPU besides views (allocation, metadata)."""
SYNC_OPS = {"aten._local_scalar_dense.default"}
"""Dispatched operators that make the host wait for the device (``.item()``, ``.tolist()``)."""
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaLaunchCooperativeKernel", "cudaMemcpyAsync", "cudaMemsetAsync", "cudaGraphLaunch",
                "cuLaunchKernelEx_ptsz", "cudaLaunchKernel_ptsz")
"""CUDA runtime/driver calls the profiler records on the host for each piece of device work it enqueues."""
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
"""Host calls that wait for the device."""

CPU_NOTE = ("counted on CPU, the proxy for the GPU's launches (Megatron-Core's local spec: unfused norms, RoPE, "
            "attention and activation; Transformer Engine fuses them into fewer kernels); the device's syncs are not "
            "observable on CPU (the one counted is the RNG tracker's check of host tensors); replaced by the counts of "
            "a GPU run of bench/kernel_launches.py when measured")
GPU_NOTE = ("counted on CUDA: the host's launch calls and syncs under torch.profiler (syncs less the profiler's "
            "own); host_s_per_launch is the wall time per launch outside the profiler, inflated where the host waits "
            "for the GPU: not a launch cost")
CPU_SHAPES = {"hidden_size": 256, "ffn_hidden_size": 896, "num_attention_heads": 8, "num_query_groups": 2,
              "vocab_size": 1024, "max_position_embeddings": 256}
"""Shapes on CPU (the counts do not depend on them there; the models' head and group ratios are kept)."""
TINY = {"hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 8, "num_query_groups": 2,
        "vocab_size": 256, "max_position_embeddings": 64}
"""Shapes at which the host's seconds per kernel are timed on CPU (its kernels take next to nothing there)."""


class OpCounter(TorchDispatchMode):
    """Counts the operators dispatched below autograd, under the part :attr:`part` names."""

    def __init__(self) -> None:
        super().__init__()
        self.part = "other"
        self.kernels: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, D105
        name = str(func)
        self.ops[name] += 1
        if name in SYNC_OPS:
            self.syncs[self.part] += 1
        elif not (getattr(func, "is_view", False) or name in NO_KERNEL):
            self.kernels[self.part] += 1
        return func(*args, **(kwargs or {}))


def layer_parts(layer: torch.nn.Module, counter: OpCounter) -> list[Any]:
    """Forward hooks that name the decoder layer's parts while they run: ``attention`` (from the input norm to the
    attention's residual add), then ``mlp`` for a dense layer; for a MoE layer ``router``, ``experts``,
    ``shared_expert``, and ``dispatch`` for the rest of the MoE block (its norm, token dispatch, permutation,
    unpermutation and combine, residual add)."""
    handles = []

    def naming(name: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            counter.part = name
        return hook

    mlp = getattr(layer, "mlp", None)
    moe = hasattr(mlp, "router")
    rest = "dispatch" if moe else "mlp"
    for child, name, back in ((getattr(layer, "input_layernorm", None), "attention", None),
                              (getattr(layer, "pre_mlp_layernorm", None), rest, None),
                              (getattr(mlp, "router", None), "router", rest),
                              (getattr(mlp, "experts", None), "experts", rest),
                              (getattr(mlp, "shared_experts", None), "shared_expert", rest)):
        if isinstance(child, torch.nn.Module):
            handles.append(child.register_forward_pre_hook(naming(name)))
            if back is not None:
                handles.append(child.register_forward_hook(naming(back)))
    return handles


def counted_cpu(forward: Callable[[], torch.Tensor], grad: torch.Tensor, layer: torch.nn.Module | None
                ) -> dict[str, Any]:
    """Dispatched kernels and syncs of one forward (by part) and one backward."""
    forward().backward(grad)  # warm-up: lazy state (RoPE cache, workspace buffers) built outside the count
    fwd = OpCounter()
    handles = layer_parts(layer, fwd) if layer is not None else []
    fwd.part = "attention" if layer is not None else "all"
    try:
        with fwd:
            out = forward()
    finally:
        for handle in handles:
            handle.remove()
    bwd = OpCounter()
    with bwd:
        out.backward(grad)
    return {"forward": sum(fwd.kernels.values()), "backward": sum(bwd.kernels.values()),
            "forward_parts": dict(sorted(fwd.kernels.items())), "forward_syncs": sum(fwd.syncs.values()),
            "backward_syncs": sum(bwd.syncs.values())}


def profiled_calls(fn: Callable[[], Any]) -> tuple[int, int, Any]:
    """Launch calls and syncs the host makes in ``fn`` under ``torch.profiler``, and its result."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        result = fn()
        torch.cuda.synchronize()
    names = Counter(event.name for event in prof.events())
    launches = sum(n for name, n in names.items() if name.startswith(LAUNCH_CALLS))
    syncs = sum(n for name, n in names.items() if name in SYNC_CALLS) - 1  # less the synchronize of this count
    return launches, syncs, result


def counted_gpu(forward: Callable[[], torch.Tensor], grad: torch.Tensor, layer: torch.nn.Module | None
                ) -> dict[str, Any]:
    """Launch calls and syncs the host makes in one forward and one backward (``torch.profiler``), and the
    dispatched operators (:func:`counted_cpu`) beside them."""
    forward().backward(grad)
    fwd_launches, fwd_syncs, out = profiled_calls(forward)
    bwd_launches, bwd_syncs, _ = profiled_calls(lambda: out.backward(grad))
    found = counted_cpu(forward, grad, layer)
    # The host's seconds per launch: the calls return once their kernels are queued (the queue holds ~1,000 launches,
    # more than a layer's), so their wall time is the host's, synchronised before each.
    launches = {"forward": max(fwd_launches, 1), "backward": max(bwd_launches, 1)}
    per_launch = host_seconds(forward, grad, launches, 5, before=torch.cuda.synchronize)
    torch.cuda.synchronize()
    return {"forward": fwd_launches, "backward": bwd_launches, "forward_syncs": fwd_syncs,
            "backward_syncs": bwd_syncs, "forward_parts": found["forward_parts"],
            "dispatched": {"forward": found["forward"], "backward": found["backward"]},
            "host_s_per_launch": per_launch}


def host_seconds(forward: Callable[[], torch.Tensor], grad: torch.Tensor, kernels: dict[str, Any],
                 repeats: int, before: Callable[[], None] = lambda: None) -> dict[str, float]:
    """Host seconds per counted kernel of one forward and one backward (median wall time over ``repeats``, each pass
    / its kernels, ``before`` called ahead of each: a synchronisation on a GPU): Python, module calls, autograd, the
    dispatcher and the launches."""
    fwd, bwd = [], []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        out = forward()
        middle = time.perf_counter()
        out.backward(grad)
        fwd.append(middle - start)
        bwd.append(time.perf_counter() - middle)
    return {"forward": statistics.median(fwd) / kernels["forward"],
            "backward": statistics.median(bwd) / kernels["backward"]}


def setup() -> None:
    """One rank: the CPU layer (without CUDA), the MoE fixes, a one-process group."""
    from cfp_megatron.compat import cpu, moe

    cpu.install_if_needed()
    moe.install()
    if not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        torch.distributed.init_process_group(backend, rank=0, world_size=1, store=torch.distributed.HashStore())


def bench(model: str, overrides: list[str], *, on_gpu: bool, seq: int, experts: int | None = None):
    """The probe model (one layer per kind) of ``model`` and its :class:`SegmentBench`."""
    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.base.parallel_dims import ParallelDims
    from cfp_megatron.profile.segments import SegmentBench, SegmentCase, probe_job

    shape = [] if on_gpu else [f"model.{key}={value}" for key, value in CPU_SHAPES.items()]
    if experts is not None:
        shape.append(f"model.num_experts={experts}")
    cfg = compose_config([f"model={model}", "cluster=local", f"train.seq_length={seq}", "train.micro_batch_size=1",
                          "train.global_batch_size=1", *shape, *overrides])
    job = probe_job(job_from_config(cfg), 1, 1, 1)
    return job, SegmentBench(SegmentCase(tp=1, job=job, dims=ParallelDims.build(job, 1)), repeats=1)


def optimizer_launches(segment: Any, on_gpu: bool) -> dict[str, float]:
    """Kernels of one Adam step per parameter tensor (torch's Adam, as Megatron-Core falls back to without Apex or
    Transformer Engine; ``foreach`` on a GPU)."""
    params = [p for p in segment.model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=on_gpu)
    opt.step()
    counter = OpCounter()
    with counter:
        opt.step()
    return {"per_tensor": sum(counter.kernels.values()) / len(params), "tensors": len(params)}


HOST_TIMING_CASES = {
    "dense": ("llama3_8b", "dense", []),
    "moe_dropless": ("mixtral_8x7b", "moe", ["model.moe_router_topk=2"]),
    "moe_padded": ("mixtral_8x7b", "moe", ["model.moe_router_topk=2", "model.moe_expert_capacity_factor=1.0",
                                           "model.moe_pad_expert_input_to_capacity=true"]),
}
"""The layers ``--host-timing`` times: (model, layer kind, overrides). The dropless all-to-all MoE layer copies its
token counts to the host in its forward; the drop-and-pad one (capacity 1.0, padded) does not."""
HOST_TIMING_SEQS = {"gpu": (1024, 4096), "cpu": (32, 128)}
"""Tokens per pass (one sequence): on a GPU the short one leaves a layer's pass near the host's launch time, the
long one makes the GPU the bottleneck (the host's time is then its enqueue time alone)."""


def layer_pass(segment: Any, kind: str, seq: int) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
    """(forward, gradient of its output) of the decoder layer ``kind`` of ``segment`` on ``seq`` tokens."""
    model, config = segment.model, segment.config
    layer = segment.layers[kind]
    shape = (seq, 1, config.hidden_size)
    x = torch.randn(shape, dtype=config.params_dtype, device=segment.device, requires_grad=True)
    rope = model.rotary_pos_emb(seq) if getattr(model, "position_embedding_type", "") == "rope" else None

    def forward() -> torch.Tensor:
        out = layer(hidden_states=x, attention_mask=None, rotary_pos_emb=rope)
        return out[0] if isinstance(out, tuple) else out

    return forward, torch.randn(shape, dtype=config.params_dtype, device=segment.device)


def seconds_per_sleep_cycle() -> float:
    """The GPU's seconds per cycle of ``torch.cuda._sleep`` (CUDA events around a long sleep)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / cycles


def timed_passes(forward: Callable[[], torch.Tensor], grad: torch.Tensor, *, on_gpu: bool, repeats: int,
                 prefill_cycles: int = 0) -> dict[str, dict[str, float | None]]:
    """Median host and GPU seconds of one forward and one backward, the queue empty before each (synchronised):
    host seconds the wall time until the Python call returns (no sync added inside), GPU seconds CUDA events
    recorded before and after the call (``None`` on CPU). With ``prefill_cycles`` the GPU first sleeps that long, so
    the host enqueues the whole pass before the GPU starts it: host seconds are the enqueue time, GPU seconds the
    GPU's busy time (unless the pass synchronises inside: the dropless dispatcher waits for the sleep too)."""
    host: dict[str, list[float]] = {"forward": [], "backward": []}
    gpu: dict[str, list[float]] = {"forward": [], "backward": []}

    def one(side: str, fn: Callable[[], Any]) -> Any:
        if on_gpu:
            torch.cuda.synchronize()
            if prefill_cycles:
                torch.cuda._sleep(prefill_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        result = fn()
        host[side].append(time.perf_counter() - began)
        if on_gpu:
            end.record()
            end.synchronize()
            gpu[side].append(start.elapsed_time(end) / 1e3)
        return result

    for _ in range(repeats):
        out = one("forward", forward)
        one("backward", lambda out=out: out.backward(grad))
    return {side: {"host_s": statistics.median(host[side]),
                   "gpu_s": statistics.median(gpu[side]) if gpu[side] else None} for side in ("forward", "backward")}


def host_timing(repeats: int, warmups: int = 3, *, cases: list[str], seqs: tuple[int, ...] | None = None,
                on_case: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """``--host-timing``: each layer of :data:`HOST_TIMING_CASES` at each length of :data:`HOST_TIMING_SEQS`, timed
    eager (``eager``) and, on a GPU, with the queue prefilled (``queued``: the host's enqueue time, the GPU's busy
    time), with its launch calls and syncs (``torch.profiler``, one pass after the timings) and its dispatched
    operators. Without the profiler in the timings. A case that fails is recorded with its error; ``on_case`` gets
    the results so far after each case (written out, in case a later one hangs)."""
    on_gpu = torch.cuda.is_available()
    seqs = seqs or HOST_TIMING_SEQS["gpu" if on_gpu else "cpu"]
    per_cycle = seconds_per_sleep_cycle() if on_gpu else None
    timed: dict[str, Any] = {}
    result = {"how": "wall time until the pass's Python call returns (host_s) and CUDA events around it (gpu_s), "
                     f"median of {repeats} after {warmups} warm-ups, synchronised before each pass; no profiler",
              "sleep_s_per_cycle": per_cycle, "cases": timed}
    for name in cases:
        model, kind, overrides = HOST_TIMING_CASES[name]
        began = time.perf_counter()
        try:
            timed[name] = {"model": model, "kind": kind, "overrides": overrides,
                           "seq": timed_case(model, kind, overrides, seqs, on_gpu=on_gpu, repeats=repeats,
                                             warmups=warmups, per_cycle=per_cycle)}
        except Exception as err:  # noqa: BLE001 - the other cases still count
            timed[name] = {"model": model, "kind": kind, "overrides": overrides, "error": repr(err)}
        print(f"host timing: {name} in {time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
        if on_gpu:
            torch.cuda.empty_cache()
        if on_case is not None:
            on_case(result)
    return result


def timed_case(model: str, kind: str, overrides: list[str], seqs: tuple[int, ...], *, on_gpu: bool, repeats: int,
               warmups: int, per_cycle: float | None) -> dict[str, Any]:
    """One case of :func:`host_timing`: its runs per sequence length."""
    _, segment = bench(model, overrides, on_gpu=on_gpu, seq=max(seqs))
    runs: dict[str, Any] = {}
    for seq in seqs:
        forward, grad = layer_pass(segment, kind, seq)
        for _ in range(warmups):
            forward().backward(grad)
        run: dict[str, Any] = {"eager": timed_passes(forward, grad, on_gpu=on_gpu, repeats=repeats)}
        if on_gpu:
            # sleep twice the eager pair's longest wall time, plus 2 ms: the host enqueues both passes meanwhile
            longest = max(max(v["host_s"], v["gpu_s"] or 0.0) for v in run["eager"].values())
            run["prefill_s"] = 2 * longest + 2e-3
            run["queued"] = timed_passes(forward, grad, on_gpu=True, repeats=repeats,
                                         prefill_cycles=int(run["prefill_s"] / per_cycle))
            # a pass that synchronises inside waited for the sleep: its queued host time is no enqueue time
            run["queued_waited"] = {side: v["host_s"] > run["prefill_s"] / 2 for side, v in run["queued"].items()}
        found = counted_cpu(forward, grad, segment.layers[kind])
        run["dispatched"] = {"forward": found["forward"], "backward": found["backward"]}
        if on_gpu:
            fwd_launches, fwd_syncs, out = profiled_calls(forward)
            bwd_launches, bwd_syncs, _ = profiled_calls(lambda out=out, grad=grad: out.backward(grad))
            run["launches"] = {"forward": fwd_launches, "backward": bwd_launches}
            run["syncs"] = {"forward": fwd_syncs, "backward": bwd_syncs}
        runs[str(seq)] = run
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the counts as JSON here")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed passes: 20 for the host's cost per operator, 10 under --host-timing")
    parser.add_argument("--host-timing", action="store_true",
                        help="instead of the counts, time the host and the GPU per pass of a dense, a dropless MoE and "
                             "a drop-and-pad MoE layer without the profiler (the JSON's host_timing)")
    parser.add_argument("--cases", default=",".join(HOST_TIMING_CASES),
                        help="--host-timing: the layers to time, comma-separated")
    parser.add_argument("--seqs", default=None, help="--host-timing: tokens per pass, comma-separated "
                        "(default 1024,4096 on a GPU, 32,128 on CPU)")
    args = parser.parse_args()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    setup()
    on_gpu = torch.cuda.is_available()
    count = counted_gpu if on_gpu else counted_cpu
    seq = 4096 if on_gpu else 128
    from megatron.core import __version__ as mcore_version

    from cfp_megatron.base.parallel_dims import transformer_engine_available

    started = time.perf_counter()
    if args.host_timing:
        def timed(timing: dict[str, Any], *, final: bool = False) -> None:
            out = {"about": "Host and GPU seconds per pass of Megatron-Core's layers, timed by "
                            "bench/kernel_launches.py --host-timing (docs/simulator.md, \"Host time\").",
                   "spec": "transformer_engine" if (on_gpu and transformer_engine_available()) else "local",
                   "date": datetime.date.today().isoformat(), "megatron_core": mcore_version,
                   "torch": torch.__version__,
                   "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or platform.machine(),
                   "host_timing": timing, "seconds": round(time.perf_counter() - started, 1)}
            if final:
                write(out, args.out)
            elif args.out is not None:
                args.out.write_text(json.dumps(out, indent=1) + "\n")

        seqs = tuple(int(n) for n in args.seqs.split(",")) if args.seqs else None
        timed(host_timing(args.repeats or 10, cases=args.cases.split(","), seqs=seqs, on_case=timed), final=True)
        return
    kinds: dict[str, Any] = {}
    host_s = None
    if not on_gpu:  # first, at tiny shapes on one thread, where the host's work is most of the wall time
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        _, tiny = bench("llama3_8b", [f"model.{key}={value}" for key, value in TINY.items()], on_gpu=False, seq=16)
        forward, grad = tiny._part("dense", 1)
        host_s = host_seconds(forward, grad, counted_cpu(forward, grad, tiny.layers["dense"]), args.repeats or 20)
        torch.set_num_threads(threads)
    # The dense layer, the embedding and the head of a Llama-3-8B-shaped model.
    _, dense = bench("llama3_8b", [], on_gpu=on_gpu, seq=seq)
    for kind in ("embedding", "dense", "head"):
        forward, grad = dense._part(kind, 1)
        layer = dense.layers.get(kind)
        kinds[kind] = count(forward, grad, layer)
    kinds["optimizer"] = optimizer_launches(dense, on_gpu)
    # A Mixtral-shaped MoE layer (dropless, all-to-all dispatcher) at two numbers of local experts: the experts'
    # launches grow with them (one GEMM pair a local expert without a grouped GEMM).
    moe_counts = {}
    for experts in (4, 8):
        _, moe = bench("mixtral_8x7b", ["model.moe_router_topk=2"], on_gpu=on_gpu, seq=seq, experts=experts)
        forward, grad = moe._part("moe", 1)
        moe_counts[experts] = count(forward, grad, moe.layers["moe"])
    kinds["moe"] = moe_counts[8]
    kinds["moe"]["local_experts"] = 8
    kinds["moe_4_experts"] = moe_counts[4]
    out = {
        "about": "Kernel launches per layer kind and pass of Megatron-Core's layers, counted by "
                 "bench/kernel_launches.py (docs/simulator.md, \"Host time\").",
        "counted": "gpu" if on_gpu else "cpu",
        "how": ("host launch calls under torch.profiler" if on_gpu else
                "aten operators dispatched below autograd, less views and allocations (TorchDispatchMode)"),
        "spec": "transformer_engine" if (on_gpu and transformer_engine_available()) else "local",
        "note": (GPU_NOTE if on_gpu else CPU_NOTE),
        "command": "python3 bench/kernel_launches.py --out $OUT/launches.json",
        "date": datetime.date.today().isoformat(),
        "megatron_core": mcore_version, "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if on_gpu else platform.processor() or platform.machine(),
        "seq_length": seq, "kinds": kinds, "host_s_per_kernel": host_s,
        "seconds": round(time.perf_counter() - started, 1),
    }
    write(out, args.out)


def write(out: dict[str, Any], path: Path | None) -> None:
    """Print ``out`` as JSON, and write it to ``path`` if given."""
    text = json.dumps(out, indent=1)
    print(text)
    if path is not None:
        path.write_text(text + "\n")


if __name__ == "__main__":
    main()
