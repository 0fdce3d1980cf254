"""Operation-level rates on one GPU against what the simulator's kernel model predicts for the same operation.

Run on a machine with a GPU (one process, about a minute on an H200): ``python bench/gpu_ops.py [--out ops.json]
[--cluster h200] [--budget-s 80]``. It times, with warm-ups, CUDA events and the median of repeats:

- GEMMs in BF16 (``torch.mm``) and FP8 (``torch._scaled_mm``, e4m3 operands with per-tensor scales, BF16 out) at
  the linear layers' shapes of Llama 3 8B and 70B (QKV, projection, gated fc1, fc2) for m = 2k, 8k, 16k tokens;
- the attention core: ``scaled_dot_product_attention`` on the flash backend, causal, BF16, head dim 128, 32 heads,
  seq 2k/4k/8k at 16k tokens, forward and forward+backward;
- the experts' grouped GEMM (gated fc1 then fc2 of 8 local experts of Mixtral 8x7B and Qwen3-30B-A3B shapes) at
  64 .. 4096 tokens per expert, with ``torch._grouped_mm`` where this torch has it and works on this GPU, and a loop
  of per-expert ``torch.mm`` beside it (the JSON says which ran);
- the cost per kernel launch: a minimal kernel (``torch.cuda._sleep(0)``, no dispatcher) and a tiny eager op
  (``x.add_(1)``, the dispatcher's path) launched N times back to back (host seconds per launch while the GPU
  idles), the same op on a CPU tensor (dispatch alone), one launch + synchronize round trip, and a CUDA graph
  replaying the same N tiny kernels (GPU seconds per kernel, host seconds per replay).

Beside each figure it prints the simulator's prediction: :class:`cfp_megatron.sim.kernels.KernelModel` on the
``--cluster`` preset with the efficiencies of its generation (``sim/efficiencies.json``), the attention FLOPs and the
2.5x backward the layer model uses, the experts as the MoE term prices them (``KernelModel.grouped_gemm``); for the
launches the host per-launch constant of the host-time term's data file where one exists (else ``n/a``).

Without a GPU it runs the same code with small shapes on the CPU (``perf_counter``; no FP8, no launches: the
dispatch of a tiny op only), the code path's check. Asserts nothing; writes ``--out`` after every section.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cfp_megatron.base.compose import compose_config  # noqa: E402
from cfp_megatron.base.config import JobSpec, Precision, job_from_config  # noqa: E402
from cfp_megatron.base.flops import causal_score_share  # noqa: E402
from cfp_megatron.sim.calibration import efficiency_for  # noqa: E402
from cfp_megatron.sim.kernels import KernelModel  # noqa: E402

LINEARS = {  # (n, k) of x[m, k] @ W[n, k]^T: Llama 3 8B (hidden 4096, ffn 14336, 8 KV groups) and 70B (8192, 28672)
    "8b.qkv": (6144, 4096), "8b.proj": (4096, 4096), "8b.fc1": (28672, 4096), "8b.fc2": (4096, 14336),
    "70b.qkv": (10240, 8192), "70b.proj": (8192, 8192), "70b.fc1": (57344, 8192), "70b.fc2": (8192, 28672),
}
TOKENS = (2048, 8192, 16384)
ATTENTION_SEQ = (2048, 4096, 8192)
ATTENTION_TOKENS = 16384
EXPERTS = {  # (hidden, expert ffn) of Mixtral 8x7B and Qwen3-30B-A3B; 8 local experts, gated (SwiGLU)
    "mixtral": (4096, 14336), "qwen3_30b_a3b": (2048, 768),
}
LOCAL_EXPERTS = 8
TOKENS_PER_EXPERT = (64, 128, 256, 512, 1024, 2048, 4096)
LAUNCHES = 2000
"""Back-to-back launches per timing of the launch section."""
FLASH_BACKWARD = 2.5
"""Backward of the fused attention core over its forward, as the layer model prices it (sim/layer_cost.py)."""


class Clock:
    """Seconds of a callable run ``iters`` times: CUDA events on a GPU, ``perf_counter`` on the CPU; median of
    ``repeats`` after ``warmup`` untimed calls."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        """Wait for the device."""
        if self.cuda:
            torch.cuda.synchronize()

    def median(self, fn: Callable[[], Any], *, warmup: int = 2, repeats: int = 7, iters: int = 1) -> float:
        """Median seconds of one call of ``fn``."""
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3 / iters)
            else:
                began = time.perf_counter()
                for _ in range(iters):
                    fn()
                times.append((time.perf_counter() - began) / iters)
        return statistics.median(times)


def sim_kernels(cluster: str) -> tuple[JobSpec, KernelModel, KernelModel]:
    """Llama 3 8B on ``cluster`` and the simulator's BF16 and FP8 kernel models there."""
    job = job_from_config(compose_config(["model=llama3_8b", f"cluster={cluster}"]))
    eff = efficiency_for(job.cluster)
    bf16 = KernelModel(job.cluster, eff, Precision.bf16)
    fp8 = KernelModel(job.cluster, eff, Precision.fp8 if job.cluster.peak_tflops_fp8 is not None else Precision.bf16)
    return job, bf16, fp8


def host_launch_constant() -> tuple[float | None, str]:
    """The host-time term's seconds per kernel launch and where it stands, from its data file under
    ``cfp_megatron/sim`` (the first number whose key names a launch); ``(None, "n/a")`` where there is none."""
    for path in sorted((ROOT / "cfp_megatron" / "sim").rglob("host*")):
        if path.suffix not in (".json", ".yaml", ".yml"):
            continue
        try:
            if path.suffix == ".json":
                data = json.loads(path.read_text())
            else:
                import yaml

                data = yaml.safe_load(path.read_text())
        except Exception:  # noqa: BLE001 - an unreadable file is one without the constant
            continue
        found = _launch_number(data, path.relative_to(ROOT).as_posix())
        if found is not None:
            return found
    return None, "n/a"


def _launch_number(data: Any, where: str) -> tuple[float, str] | None:
    """The first ``(seconds, where:key)`` in ``data`` whose key names a launch (``_us``: microseconds)."""
    if isinstance(data, dict):
        for key, value in data.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and "launch" in str(key).lower():
                scale = 1e-6 if str(key).endswith("_us") else 1e-9 if str(key).endswith("_ns") else 1.0
                return float(value) * scale, f"{where}:{key}"
            found = _launch_number(value, f"{where}:{key}" if isinstance(value, dict) else where)
            if found is not None:
                return found
    return None


def bench_gemms(clock: Clock, bf16: KernelModel, fp8: KernelModel, *, small: bool) -> list[dict]:
    """BF16 and FP8 GEMM rates at the linear layers' shapes."""
    device = "cuda" if clock.cuda else "cpu"
    dtype = torch.bfloat16 if clock.cuda else torch.float32
    rows = []
    shapes = {"tiny": (256, 256)} if small else LINEARS
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, device=device, dtype=dtype)
        for m in ((128,) if small else TOKENS):
            x = torch.randn(m, k, device=device, dtype=dtype)
            flops = 2.0 * m * n * k
            seconds = clock.median(lambda: torch.mm(x, weight.t()))  # noqa: B023
            rows.append(_rate_row("gemm", f"{name} m={m}", "bf16" if clock.cuda else "fp32", flops, seconds,
                                  bf16.gemm(m, n, k), m=m, n=n, k=k))
            if clock.cuda and fp8.low:
                rows.append(_fp8_row(clock, fp8, name, x, weight, flops))
    return rows


def _fp8_row(clock: Clock, fp8: KernelModel, name: str, x: torch.Tensor, weight: torch.Tensor,
             flops: float) -> dict:
    """One FP8 GEMM (``torch._scaled_mm``, e4m3, per-tensor scales) or the reason it did not run."""
    m, k = x.shape
    n = weight.shape[0]
    try:
        a = x.to(torch.float8_e4m3fn)
        b = weight.to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants its second operand
        one = torch.ones((), device=x.device, dtype=torch.float32)
        # use_fast_accum off: the split accumulator Transformer Engine's recipes use for two of a layer's three GEMMs
        seconds = clock.median(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                        use_fast_accum=False))
    except (RuntimeError, TypeError) as err:
        return {"op": "gemm", "case": f"{name} m={m}", "dtype": "fp8", "error": str(err)[:300]}
    return _rate_row("gemm", f"{name} m={m}", "fp8", flops, seconds, fp8.gemm(m, n, k), m=m, n=n, k=k)


def _rate_row(op: str, case: str, dtype: str, flops: float, seconds: float, predicted_s: float, **extra: Any) -> dict:
    """A measured operation beside its prediction."""
    return {"op": op, "case": case, "dtype": dtype, **extra, "flops": flops, "measured_s": seconds,
            "measured_tflops": flops / seconds / 1e12, "predicted_s": predicted_s,
            "predicted_tflops": flops / predicted_s / 1e12 if predicted_s > 0 else None,
            "error": (predicted_s - seconds) / seconds}


def bench_attention(clock: Clock, job: JobSpec, bf16: KernelModel, *, small: bool) -> list[dict]:
    """The causal attention core on the flash backend, forward and forward+backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = "cuda" if clock.cuda else "cpu"
    dtype = torch.bfloat16 if clock.cuda else torch.float32
    heads, dim = job.model.num_attention_heads, 128
    backend = SDPBackend.FLASH_ATTENTION if clock.cuda else SDPBackend.MATH
    rows = []
    for seq in ((128,) if small else ATTENTION_SEQ):
        batch = max(1, (256 if small else ATTENTION_TOKENS) // seq)
        q, k, v = (torch.randn(batch, heads, seq, dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(batch, heads, seq, dim, device=device, dtype=dtype)
        # The layer model's FLOPs of the core: 4 b s^2 (heads x dim), the causal share of the scores computed.
        flops = 4.0 * batch * seq * seq * heads * dim * causal_score_share(job.model, seq)
        fwd_pred = bf16.attention(flops)

        def forward() -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: B023

        def both() -> None:
            forward().backward(grad)  # noqa: B023

        case = f"b={batch} s={seq} h={heads} d={dim}"
        try:
            with sdpa_kernel(backend):
                with torch.no_grad():
                    fwd = clock.median(forward)
                full = clock.median(both)
        except RuntimeError as err:
            rows.append({"op": "attention", "case": case, "error": str(err)[:300]})
            continue
        label = "bf16" if clock.cuda else "fp32"
        rows.append(_rate_row("attention fwd", case, label, flops, fwd, fwd_pred, seq=seq, batch=batch))
        rows.append(_rate_row("attention fwd+bwd", case, label, flops * (1 + FLASH_BACKWARD), full,
                              fwd_pred * (1 + FLASH_BACKWARD), seq=seq, batch=batch))
    return rows


def grouped_kind() -> str:
    """``torch._grouped_mm`` where this torch has it, else ``loop``."""
    return "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"


def bench_grouped(clock: Clock, bf16: KernelModel, *, small: bool) -> list[dict]:
    """The experts' gated fc1 and fc2 over ``LOCAL_EXPERTS`` experts: grouped where possible, and as a loop."""
    device = "cuda" if clock.cuda else "cpu"
    dtype = torch.bfloat16 if clock.cuda else torch.float32
    rows = []
    experts = {"tiny": (64, 128)} if small else EXPERTS
    grouped_ok = clock.cuda and hasattr(torch, "_grouped_mm")
    for name, (hidden, ffn) in experts.items():
        w1 = torch.randn(LOCAL_EXPERTS, 2 * ffn, hidden, device=device, dtype=dtype)
        w2 = torch.randn(LOCAL_EXPERTS, hidden, ffn, device=device, dtype=dtype)
        for per_expert in ((16, 64) if small else TOKENS_PER_EXPERT):
            tokens = LOCAL_EXPERTS * per_expert
            x = torch.randn(tokens, hidden, device=device, dtype=dtype)
            h = torch.randn(tokens, ffn, device=device, dtype=dtype)
            flops = 2.0 * tokens * hidden * ffn * 3  # fc1 (2 ffn wide) and fc2
            # The simulator's grouped expert GEMM (tiles, waves, each expert's weights: sim/kernels.grouped_gemm).
            predicted = (bf16.grouped_gemm(LOCAL_EXPERTS, per_expert, 2 * ffn, hidden)
                         + bf16.grouped_gemm(LOCAL_EXPERTS, per_expert, hidden, ffn))
            xs, hs = x.split(per_expert), h.split(per_expert)

            def loop() -> None:
                for e in range(LOCAL_EXPERTS):
                    torch.mm(xs[e], w1[e].t())  # noqa: B023
                    torch.mm(hs[e], w2[e].t())  # noqa: B023

            case = f"{name} {LOCAL_EXPERTS}x{per_expert} tok"
            rows.append(_rate_row("grouped gemm", case, "bf16" if clock.cuda else "fp32", flops,
                                  clock.median(loop), predicted, impl="loop", tokens_per_expert=per_expert))
            if grouped_ok:
                offs = torch.arange(per_expert, tokens + 1, per_expert, device=device, dtype=torch.int32)
                b1, b2 = w1.transpose(-2, -1), w2.transpose(-2, -1)

                def grouped() -> None:
                    torch._grouped_mm(x, b1, offs=offs)  # noqa: B023
                    torch._grouped_mm(h, b2, offs=offs)  # noqa: B023

                try:
                    rows.append(_rate_row("grouped gemm", case, "bf16", flops, clock.median(grouped), predicted,
                                          impl="torch._grouped_mm", tokens_per_expert=per_expert))
                except RuntimeError as err:
                    grouped_ok = False
                    rows.append({"op": "grouped gemm", "case": case, "impl": "torch._grouped_mm",
                                 "error": str(err)[:300]})
    return rows


def bench_launches(clock: Clock, host_s: float | None, *, small: bool) -> list[dict]:
    """Host and GPU seconds per launch of tiny kernels: back to back, round trips, and in a CUDA graph."""
    n = 200 if small else LAUNCHES
    rows = []
    cpu_x = torch.zeros(1)
    rows.append(_launch_row("eager tiny op on a CPU tensor (dispatch alone)", "host", _host_per_call(
        lambda: cpu_x.add_(1.0), n, clock=None), host_s))
    if not clock.cuda:
        return rows
    x = torch.zeros(1, device="cuda")
    rows.append(_launch_row("torch.cuda._sleep(0), back to back (launch, no dispatcher)", "host",
                            _host_per_call(lambda: torch.cuda._sleep(0), n, clock=clock), host_s))
    rows.append(_launch_row("eager x.add_(1) on a 1-element CUDA tensor, back to back", "host",
                            _host_per_call(lambda: x.add_(1.0), n, clock=clock), host_s))
    rows.append(_launch_row("eager x.add_(1), the same launches on the GPU's clock (events)", "gpu",
                            clock.median(lambda: x.add_(1.0), iters=n), host_s))

    def round_trip() -> None:
        x.add_(1.0)
        torch.cuda.synchronize()

    rows.append(_launch_row("one x.add_(1) + synchronize, round trip", "host",
                            _host_per_call(round_trip, 200, clock=clock), None))
    graph_n = min(n, 1000)
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                x.add_(1.0)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(graph_n):
                x.add_(1.0)
        per_kernel = clock.median(graph.replay) / graph_n
        replay_host = _host_per_call(graph.replay, 20, clock=clock)
    except RuntimeError as err:
        rows.append({"op": "launch", "case": "CUDA graph", "error": str(err)[:300]})
        return rows
    rows.append(_launch_row(f"CUDA graph of {graph_n} x.add_(1), per kernel (events)", "gpu", per_kernel, None))
    rows.append(_launch_row(f"CUDA graph of {graph_n} x.add_(1), host seconds of one replay", "host", replay_host,
                            None))
    return rows


def _host_per_call(fn: Callable[[], Any], n: int, *, clock: Clock | None) -> float:
    """Median over 5 repeats of the host seconds per call of ``n`` back-to-back calls (the device idle before
    each repeat; not waited for inside it)."""
    for _ in range(min(n, 50)):
        fn()
    times = []
    for _ in range(5):
        if clock is not None:
            clock.sync()
        began = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - began) / n)
    if clock is not None:
        clock.sync()
    return statistics.median(times)


def _launch_row(case: str, side: str, seconds: float, predicted_s: float | None) -> dict:
    """A per-launch figure beside the host-time term's constant (``None``: n/a)."""
    return {"op": "launch", "case": case, "side": side, "measured_s": seconds, "predicted_s": predicted_s,
            "error": (predicted_s - seconds) / seconds if predicted_s else None}


def show(rows: list[dict]) -> None:
    """The section's table."""
    for r in rows:
        if "measured_s" not in r:
            print(f"  {r['op']:<18} {r['case']:<34} failed: {r.get('error')}")
        elif r["op"] == "launch":
            pred = f"{r['predicted_s'] * 1e6:8.2f} us" if r["predicted_s"] else "     n/a"
            print(f"  {r['case']:<66} {r['side']:<4} {r['measured_s'] * 1e6:8.2f} us  sim {pred}")
        else:
            label = f"{r['case']} {r.get('impl', '')}".strip()
            pred = r["predicted_tflops"]
            print(f"  {r['op']:<18} {label:<44} {r['dtype']:<4} {r['measured_s'] * 1e3:9.3f} ms "
                  f"{r['measured_tflops']:8.1f} TFLOP/s  sim {r['predicted_s'] * 1e3:9.3f} ms "
                  f"{pred or 0:8.1f} TFLOP/s  {100 * r['error']:+6.1f}%")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="JSON file of the results (written after each part)")
    parser.add_argument("--cluster", default="h200", help="the preset whose prediction is printed beside each figure")
    parser.add_argument("--budget-s", type=float, default=80.0, help="parts not started by then are skipped")
    parser.add_argument("--parts", nargs="+", default=["gemm", "attention", "grouped", "launch"],
                        choices=["gemm", "attention", "grouped", "launch"])
    args = parser.parse_args(argv)
    began = time.perf_counter()
    cuda = torch.cuda.is_available()
    small = not cuda
    job, bf16, fp8 = sim_kernels(args.cluster)
    host_s, host_where = host_launch_constant()
    device = torch.cuda.get_device_name(0) if cuda else "CPU (small shapes: the code path's check)"
    result: dict[str, Any] = {
        "device": device, "torch": torch.__version__, "cuda": torch.version.cuda, "cluster": args.cluster,
        "efficiency": {"gemm": bf16.eff.gemm, "gemm_fp8": bf16.eff.gemm_fp8, "attention": bf16.eff.attention,
                       "memory": bf16.eff.memory},
        "grouped_impl": grouped_kind(), "host_launch_constant": {"seconds": host_s, "source": host_where},
        "parts": {}, "skipped": []}
    print(f"{device}, torch {torch.__version__}; predictions: cluster={args.cluster}, efficiencies "
          f"{result['efficiency']}; host per-launch constant: "
          f"{f'{host_s * 1e6:.2f} us ({host_where})' if host_s else 'n/a'}", flush=True)
    clock = Clock(cuda)
    parts: dict[str, Callable[[], list[dict]]] = {
        "gemm": lambda: bench_gemms(clock, bf16, fp8, small=small),
        "attention": lambda: bench_attention(clock, job, bf16, small=small),
        "grouped": lambda: bench_grouped(clock, bf16, small=small),
        "launch": lambda: bench_launches(clock, host_s, small=small),
    }
    for name in args.parts:
        if time.perf_counter() - began > args.budget_s:
            print(f"== {name}: skipped (the {args.budget_s:.0f} s budget is spent)")
            result["skipped"].append(name)
            continue
        print(f"== {name}" + (f" ({grouped_kind()} and a loop of torch.mm)" if name == "grouped" else ""),
              flush=True)
        start = time.perf_counter()
        try:
            rows = parts[name]()
        except Exception as err:  # noqa: BLE001 - one part's failure must not cost the others
            rows = [{"op": name, "case": "all", "error": f"{type(err).__name__}: {str(err)[:300]}"}]
        result["parts"][name] = {"rows": rows, "seconds": time.perf_counter() - start}
        show(rows)
        if cuda:
            torch.cuda.empty_cache()
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"done in {time.perf_counter() - began:.1f} s" + (f"; wrote {args.out}" if args.out else ""))


if __name__ == "__main__":
    main()
