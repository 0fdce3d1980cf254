"""PrimePar's P_{2x2} MLP against Megatron's TP=4 MLP on 4 gloo ranks: measured and simulated.

Run: ``python bench/primepar_mlp.py [--repeats 10] [--warmup 2] [--no-swiglu] [--profile] [--json out.json]``.

1. Spawns 4 gloo ranks (``torch.multiprocessing``, one thread each, CUDA hidden) with Megatron's parallel state at
   TP=4 and the CPU compat layer. For each shape it builds Megatron-Core's real ``MLP`` twice on the same TP group,
   from the layer spec the runtime uses (``get_gpt_decoder_block_spec``): once with Megatron's
   ``ColumnParallelLinear`` / ``RowParallelLinear``, once with PrimePar's (``with_primepar_mlp``, a 2x2 square), from
   the same seed (so the same full weights), in fp32.
2. Times forward + backward on a replicated input ``[s, b, h]`` that needs a gradient (as a layer's normed hidden
   state does) and a fixed output gradient: ``--warmup`` untimed runs, then ``--repeats`` timed ones, each rank's
   time reduced with MAX (a TP group's step is as slow as its slowest rank), the median of those.
3. Measures the peak tensor memory of one forward + backward per rank with PyTorch's ``MemTracker``, as the training
   step's memory is measured (:mod:`cfp_megatron.engine.memory`): the MLP's parameters, their gradients, what the
   forward pass keeps for backward ("stash": the tensors it leaves alive beyond its output, as
   ``SegmentBench.memory_once`` counts activations) and the transients; the input is made inside the measured region
   as a copy of a leaf, so it lives only as long as the MLP keeps it (as a norm's output would). Three measurements
   per rank (a collective's buffer now and then outlives its pass): the peak is each rank's median, MAX over ranks;
   the stash the median over all ranks and measurements (as ``SegmentBench.memory``).
4. Predicts both with the simulator's cost models on this machine's ProfileDB (measured collectives and GEMM table;
   ``--profile`` runs ``torchrun --nproc_per_node=4 -m cfp_megatron.profile`` first when there is none):
   :func:`~cfp_megatron.sim.primepar_cost.megatron_mlp_cost` (as ``layer_cost`` costs the dense MLP) and
   :func:`~cfp_megatron.sim.primepar_cost.primepar_mlp_cost` plus the same activation traffic; memory as
   :mod:`cfp_megatron.sim.memory` counts the MLP: parameters, fp32 gradients, the stash (fc1's input replicated
   under Megatron, one block under PrimePar, plus PrimePar's rotated weight copies), in fp32 bytes. The simulator
   counts no per-layer transients, so the peak's error is mostly the transients; the stash column compares like
   with like.

Prints one row per (shape, partition): measured and predicted ms with the error, measured and predicted peak MiB
with the error, and the stash measured / predicted; then per shape the PrimePar / Megatron ratios, measured and
predicted, and how far the two MLPs' outputs and input gradients differ. Where CUDA is available, also the local
GEMMs of one step of each partition (one block GEMM per PrimePar step) timed on the GPU with CUDA events, in fp32 and
bf16. Asserts nothing; figures on a loaded machine are noisy, so run it alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
"""Ranks: one 2x2 PrimePar square, one Megatron TP group of 4."""
MIB = 2.0**20
PARTITIONS = ("megatron", "primepar")
"""``parallel.mlp`` values compared."""
LABELS = {"megatron": "megatron TP=4", "primepar": "primepar 2x2"}


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One MLP to compare."""

    model: str
    """Config group of the model (``gpt_tiny``: GELU with biases; ``llama_tiny``: SwiGLU without)."""
    hidden: int
    """Hidden size h."""
    ffn: int
    """MLP hidden size."""
    seq: int
    """Sequence length s."""
    micro_batch: int
    """Micro-batch b (tokens = s x b)."""

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.seq * self.micro_batch

    @property
    def gated(self) -> bool:
        """Whether fc1 is a gated linear unit (SwiGLU)."""
        return self.model == "llama_tiny"

    def overrides(self, mlp: str) -> list[str]:
        """Hydra overrides of a one-layer job with this MLP under ``parallel.mlp=mlp`` on TP=4."""
        return [f"model={self.model}", "model.num_layers=1", f"model.hidden_size={self.hidden}",
                f"model.ffn_hidden_size={self.ffn}", f"model.max_position_embeddings={max(self.seq, 256)}",
                f"train.seq_length={self.seq}", f"train.micro_batch_size={self.micro_batch}",
                f"train.global_batch_size={self.micro_batch}", f"parallel.tp={WORLD}", f"parallel.mlp={mlp}",
                *(["model.num_query_groups=4"] if self.gated else [])]  # llama_tiny's 2 KV heads do not split 4 ways

    def __str__(self) -> str:
        act = "swiglu" if self.gated else "gelu+bias"
        return f"h{self.hidden} ffn{self.ffn} {act} {self.tokens} tok"


def default_shapes(swiglu: bool) -> list[Shape]:
    """hidden 256 / ffn 1024 and 512 / 2048 at 512 and 2048 tokens (sequence 512, micro-batch 1 and 4) and 1024 /
    4096 at 2048 tokens (GEMMs long enough to hide the ring), GELU with biases; with ``swiglu`` also a SwiGLU MLP
    (no biases) of hidden 256 / ffn 1024 at 2048 tokens."""
    shapes = [Shape(model="gpt_tiny", hidden=h, ffn=4 * h, seq=512, micro_batch=b) for h in (256, 512) for b in (1, 4)]
    shapes.append(Shape(model="gpt_tiny", hidden=1024, ffn=4096, seq=512, micro_batch=4))
    if swiglu:
        shapes.append(Shape(model="llama_tiny", hidden=256, ffn=1024, seq=512, micro_batch=4))
    return shapes


# Measurement on 4 gloo ranks ----------------------------------------------------------------------------------------

def _build_mlp(job: Any, tp_group: Any) -> torch.nn.Module:
    """Megatron-Core's MLP of ``job``'s layer spec (PrimePar's under ``parallel.mlp=primepar``), as the runtime
    builds it (:mod:`cfp_megatron.engine.model`), on ``tp_group``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.spec_utils import build_module

    from cfp_megatron.base.config import MlpPartition
    from cfp_megatron.base.parallel_dims import ParallelDims
    from cfp_megatron.layers.primepar_mlp import with_primepar_mlp
    from cfp_megatron.model.megatron_config import transformer_config

    config = transformer_config(job, ParallelDims.build(job, WORLD), on_gpu=False)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization=job.model.normalization.value)
    if job.parallel.mlp is MlpPartition.primepar:
        block = with_primepar_mlp(block)
    torch.manual_seed(job.train.seed)  # the same full weights under both partitions (CPU initialisation)
    model_parallel_cuda_manual_seed(job.train.seed)
    return build_module(block.layer_specs[0].submodules.mlp, config=config, tp_group=tp_group)


def _step(mlp: torch.nn.Module, leaf: torch.Tensor) -> torch.Tensor:
    """The MLP's forward pass on a fresh copy of ``leaf`` (kept alive only by what the MLP saves), bias added."""
    out, bias = mlp(leaf.clone())
    return out + bias if bias is not None else out


def _clear(mlp: torch.nn.Module, leaf: torch.Tensor) -> None:
    mlp.zero_grad(set_to_none=True)
    leaf.grad = None


def _time(mlp: torch.nn.Module, leaf: torch.Tensor, grad: torch.Tensor, *, warmup: int,
          repeats: int) -> tuple[list[float], list[float]]:
    """(forward, forward + backward) seconds of each repeat on this rank, started together after a barrier."""
    import torch.distributed as dist

    for _ in range(warmup):
        _clear(mlp, leaf)
        _step(mlp, leaf).backward(grad)
    forward, total = [], []
    for _ in range(repeats):
        _clear(mlp, leaf)
        dist.barrier()
        t0 = time.perf_counter()
        y = _step(mlp, leaf)
        t1 = time.perf_counter()
        y.backward(grad)
        t2 = time.perf_counter()
        del y
        forward.append(t1 - t0)
        total.append(t2 - t0)
    return forward, total


def _memory(mlp: torch.nn.Module, leaf: torch.Tensor, grad: torch.Tensor) -> tuple[int, int, int]:
    """(peak, stash, parameter) bytes of one forward + backward on this rank under ``MemTracker``: the peak counts
    the parameters (tracked as external), their gradients and everything the passes allocate; the stash is what the
    forward pass leaves alive besides its output."""
    from cfp_megatron.engine.memory import tensor_tracker

    _clear(mlp, leaf)
    tracker = tensor_tracker()
    tracker.track_external(mlp)
    device = torch.device("cpu")

    def total(which: str) -> int:
        return int(tracker.get_tracker_snapshot(which).get(device, {}).get("Total", 0))

    def settled() -> int:  # once reference cycles (collectives', autograd's) are gone
        gc.collect()
        return total("current")

    gc.freeze()
    try:
        with tracker:
            base = settled()
            y = _step(mlp, leaf)
            stash = settled() - base - y.untyped_storage().nbytes()
            y.backward(grad)
            del y
            peak = total("peak")
    finally:
        gc.unfreeze()
        _clear(mlp, leaf)
    params = sum(p.numel() * p.element_size() for p in mlp.parameters())
    return peak, stash, params


def _rank(rank: int, port: int, out_dir: str, shapes: list[Shape], jobs: dict[str, dict[str, Any]], warmup: int,
          repeats: int) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the comparison runs on CPU gloo ranks even on a GPU machine
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state

    from cfp_megatron.compat.cpu import install_if_needed

    install_if_needed()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        results: list[dict[str, Any]] = []
        for shape in shapes:
            gen = torch.Generator().manual_seed(shape.tokens + shape.hidden)  # the same input on every rank
            leaf = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=gen).requires_grad_()
            grad = torch.randn(shape.seq, shape.micro_batch, shape.hidden, generator=gen)
            outputs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for mlp_name in PARTITIONS:
                mlp = _build_mlp(jobs[str(shape)][mlp_name], tp_group)
                forward, total = _time(mlp, leaf, grad, warmup=warmup, repeats=repeats)
                samples = torch.tensor([_memory(mlp, leaf, grad) for _ in range(3)], dtype=torch.float64)
                every = [torch.zeros_like(samples) for _ in range(WORLD)]
                dist.all_gather(every, samples)
                every_rank = torch.stack(every)  # [rank, repeat, (peak, stash, params)]
                peak = float(every_rank[:, :, 0].median(dim=1).values.max())  # each rank's median, the largest
                stash = float(every_rank[:, :, 1].flatten().median())  # as SegmentBench.memory: over all
                params = float(every_rank[:, :, 2].max())
                y = _step(mlp, leaf)
                y.backward(grad)
                outputs[mlp_name] = (y.detach(), leaf.grad.detach().clone())
                _clear(mlp, leaf)
                times = torch.tensor([forward, total], dtype=torch.float64)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per repeat, the slowest rank
                results.append({"shape": str(shape), "mlp": mlp_name,
                                "forward_s": statistics.median(times[0].tolist()),
                                "step_s": statistics.median(times[1].tolist()),
                                "peak_bytes": peak, "stash_bytes": stash, "param_bytes": params})
                del mlp
                gc.collect()
            (y_m, dx_m), (y_p, dx_p) = outputs["megatron"], outputs["primepar"]
            diff = torch.tensor([float((y_m - y_p).abs().max()), float((dx_m - dx_p).abs().max())])
            dist.all_reduce(diff, op=dist.ReduceOp.MAX)
            results[-1].update(output_diff=float(diff[0]), grad_input_diff=float(diff[1]))
            if rank == 0:
                print(f"  measured {shape}", flush=True)
        if rank == 0:
            Path(out_dir, "results.json").write_text(json.dumps(results))
        dist.barrier()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    os._exit(0)  # skip the interpreter teardown, where gloo's threads now and then abort


def _free_port() -> int:
    """An unused TCP port on the loopback interface for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(shapes: list[Shape], jobs: dict[str, dict[str, Any]], *, warmup: int, repeats: int) -> list[dict]:
    """Run the measurement on :data:`WORLD` spawned gloo ranks; rank 0's results, one dict per (shape, MLP)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCH_COMPILE_DISABLE"] = "1"  # Megatron's TorchScript/compiled fusions run as plain PyTorch
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(_free_port(), tmp, shapes, jobs, warmup, repeats), nprocs=WORLD)
        return json.loads(Path(tmp, "results.json").read_text())


# The simulator's prediction ------------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Predicted:
    """The simulator's figures for one (shape, MLP) on one rank."""

    forward_s: float
    """Forward pass: GEMMs, activation, exposed communication."""
    step_s: float
    """Forward plus backward."""
    peak_bytes: float
    """Parameters, gradients and the stash."""
    stash_bytes: float
    """What the forward pass keeps for backward."""


def local_cost_models(job: Any, *, profile: bool) -> tuple[Any, Any, str] | None:
    """(KernelModel, CollectiveCosts, description) from this machine's ProfileDB for :data:`WORLD` ranks, as
    :func:`cfp_megatron.sim.simulate.simulate` builds them; with ``profile``, profile first when there is no DB;
    ``None`` when there is none."""
    from cfp_megatron.cluster.costs import CollectiveCosts
    from cfp_megatron.profile.cluster import describe_cluster, local_measurements
    from cfp_megatron.sim.calibration import efficiency_for
    from cfp_megatron.sim.kernels import KernelModel

    cluster, db = local_measurements(job, world_size=WORLD)
    if db is None and profile:
        print(f"no ProfileDB for {WORLD} ranks on this machine: profiling (a few minutes) ...", flush=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", "-m",
               "cfp_megatron.profile"]
        subprocess.run(cmd, cwd=ROOT, check=True)
        cluster, db = local_measurements(job, world_size=WORLD)
    if db is None:
        return None
    eff = efficiency_for(cluster)
    costs = CollectiveCosts(cluster, db, intra_efficiency=eff.intra_node_comm, inter_efficiency=eff.inter_node_comm)
    kernels = KernelModel(cluster, eff, job.train.precision, measurements=db)
    return kernels, costs, describe_cluster(cluster)


def predict(job: Any, shape: Shape, kernels: Any, costs: Any) -> Predicted:
    """The simulator's time and memory of the MLP of ``job`` on one rank (see the module docstring)."""
    from cfp_megatron.base.config import MlpPartition
    from cfp_megatron.base.flops import mlp_params
    from cfp_megatron.sim.layout import build_layout
    from cfp_megatron.sim.primepar_cost import (
        megatron_mlp_cost,
        mlp_activation_s,
        primepar_mlp_cost,
        primepar_stash_saving,
        primepar_weight_copies,
    )

    m, tp, elem = job.model, WORLD, float(kernels.elem)
    layout = build_layout(job, WORLD)
    sizes = {"tp": tp, "tp_per_node": layout.tp_per_node, "tokens": float(shape.tokens), "hidden": m.hidden_size,
             "ffn": m.ffn_size, "gated": shape.gated}
    primepar = job.parallel.mlp is MlpPartition.primepar
    if primepar:
        cost = primepar_mlp_cost(kernels, costs, **sizes, overlap=not job.cluster.on_cpu)
        act = mlp_activation_s(kernels, tp=tp, tokens=shape.tokens, ffn=m.ffn_size, gated=shape.gated)
        cost = dataclasses.replace(cost, forward_compute_s=cost.forward_compute_s + act,
                                   backward_compute_s=cost.backward_compute_s + 2.0 * act)
    else:
        cost = megatron_mlp_cost(kernels, costs, **sizes)
    # Parameters as layer_cost and memory.layer_extra_params count the MLP's: weights and fc1's bias split over TP,
    # fc2's bias replicated; gradients in fp32.
    params = mlp_params(m, m.ffn_size) / tp
    if m.add_bias_linear:
        params += m.ffn_size * (2 if shape.gated else 1) / tp + m.hidden_size
    # The stash as memory.layer_activation_bytes counts the MLP: its input (replicated), fc1's output and the
    # activation's output (split over TP); PrimePar keeps one block of the input and its rotated weight blocks.
    stash = shape.tokens * (m.hidden_size + (m.ffn_size * (2 if shape.gated else 1) + m.ffn_size) / tp) * elem
    if shape.gated and job.cluster.on_cpu:  # unfused SwiGLU: SiLU's output, the half
        stash += shape.tokens * 2 * m.ffn_size / tp * elem
    if primepar:
        stash -= primepar_stash_saving(tp=tp, tokens=shape.tokens, hidden=m.hidden_size, elem=elem)
        stash += primepar_weight_copies(tp=tp, hidden=m.hidden_size, ffn=m.ffn_size, gated=shape.gated, elem=elem)
    return Predicted(forward_s=cost.forward_compute_s + cost.forward_comm_s, step_s=cost.total_s,
                     peak_bytes=params * (elem + 4.0) + stash, stash_bytes=stash)


# GEMM steps on a GPU -------------------------------------------------------------------------------------------------

def local_gemms(shape: Shape, mlp: str, tp: int = WORLD) -> list[tuple[str, int, int, int, int]]:
    """(name, m, n, k, count) of the GEMMs ``(m x k) @ (k x n)`` one rank runs in one forward + backward: Megatron's
    split linears once each; PrimePar's block GEMM of each phase, once per step (``n = sqrt(tp)`` steps)."""
    h, f1, f = shape.hidden, shape.ffn * (2 if shape.gated else 1), shape.ffn
    t = shape.tokens
    if mlp == "megatron":
        return [("fc1 fwd", t, f1 // tp, h, 1), ("fc2 fwd", t, h, f // tp, 1),
                ("fc1 dI", t, h, f1 // tp, 1), ("fc1 dW", h, f1 // tp, t, 1),
                ("fc2 dI", t, f // tp, h, 1), ("fc2 dW", f // tp, h, t, 1)]
    n = int(tp**0.5)
    found = []
    for name, n_in, k_out in (("fc1", h, f1), ("fc2", f, h)):
        tb, nb, kb = t // n, n_in // n, k_out // n
        found += [(f"{name} fwd", tb, kb, nb, n), (f"{name} dI", tb, nb, kb, n), (f"{name} dW", nb, kb, tb, n)]
    return found


def time_gemm(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device, *, repeats: int = 50) -> float:
    """Median seconds of one ``(m x k) @ (k x n)`` matmul on ``device``, each timed with a pair of CUDA events."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    for _ in range(5):
        torch.mm(a, b)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0)
    return statistics.median(times)


def print_gpu_gemms(shapes: list[Shape], device: torch.device) -> None:
    """The local GEMMs of one forward + backward of each partition timed on ``device``: per GEMM one step's time,
    and per partition the sum over all steps."""
    print(f"\nLocal GEMMs of one rank on {torch.cuda.get_device_name(device)} (CUDA events, median of 50; PrimePar: "
          f"one step's block GEMM, run n=2 times per phase)")
    print(f"{'shape':<32} {'partition':<14} {'GEMM':<8} {'m x n x k':>18} {'steps':>5} {'fp32 us':>9} {'bf16 us':>9}")
    for shape in shapes:
        for mlp in PARTITIONS:
            sums = [0.0, 0.0]
            for name, m, n, k, count in local_gemms(shape, mlp):
                us = [time_gemm(m, n, k, dtype, device) * 1e6 for dtype in (torch.float32, torch.bfloat16)]
                sums = [s + count * u for s, u in zip(sums, us, strict=True)]
                print(f"{str(shape):<32} {LABELS[mlp]:<14} {name:<8} {f'{m} x {n} x {k}':>18} {count:>5} "
                      f"{us[0]:>9.1f} {us[1]:>9.1f}")
            print(f"{str(shape):<32} {LABELS[mlp]:<14} {'all':<8} {'':>18} {'':>5} {sums[0]:>9.1f} {sums[1]:>9.1f}")


# Report --------------------------------------------------------------------------------------------------------------

def _err(predicted: float | None, measured: float) -> str:
    return "-" if predicted is None or not measured else f"{(predicted - measured) / measured:+.0%}"


def _fmt(value: float | None, scale: float, digits: int) -> str:
    return "-" if value is None else f"{value / scale:.{digits}f}"


def report(shapes: list[Shape], measured: list[dict], predicted: dict[tuple[str, str], Predicted]) -> None:
    """The table (module docstring)."""
    rows = {(r["shape"], r["mlp"]): r for r in measured}
    print(f"\n{'shape':<32} {'partition':<14} {'meas ms':>8} {'pred ms':>8} {'err':>6} {'meas MiB':>9} "
          f"{'pred MiB':>9} {'err':>6} {'stash MiB meas/pred':>20}")
    for shape in shapes:
        for mlp in PARTITIONS:
            r, p = rows[(str(shape), mlp)], predicted.get((str(shape), mlp))
            stash = f"{r['stash_bytes'] / MIB:.2f} / {_fmt(p and p.stash_bytes, MIB, 2)}"
            print(f"{str(shape):<32} {LABELS[mlp]:<14} {r['step_s'] * 1e3:>8.1f} "
                  f"{_fmt(p and p.step_s, 1e-3, 1):>8} {_err(p and p.step_s, r['step_s']):>6} "
                  f"{r['peak_bytes'] / MIB:>9.2f} {_fmt(p and p.peak_bytes, MIB, 2):>9} "
                  f"{_err(p and p.peak_bytes, r['peak_bytes']):>6} {stash:>20}")
    print("\nPrimePar / Megatron (below 1: PrimePar better)")
    print(f"{'shape':<32} {'time meas':>9} {'time pred':>9} {'fwd meas':>9} {'fwd pred':>9} {'peak meas':>9} "
          f"{'peak pred':>9} {'max |dy|':>9} {'max |dx|':>9}")
    for shape in shapes:
        meg, pp = rows[(str(shape), "megatron")], rows[(str(shape), "primepar")]
        p_meg, p_pp = predicted.get((str(shape), "megatron")), predicted.get((str(shape), "primepar"))

        def ratio(a: float | None, b: float | None) -> str:
            return "-" if a is None or not b else f"{a / b:.2f}"

        print(f"{str(shape):<32} {ratio(pp['step_s'], meg['step_s']):>9} "
              f"{ratio(p_pp and p_pp.step_s, p_meg and p_meg.step_s):>9} "
              f"{ratio(pp['forward_s'], meg['forward_s']):>9} "
              f"{ratio(p_pp and p_pp.forward_s, p_meg and p_meg.forward_s):>9} "
              f"{ratio(pp['peak_bytes'], meg['peak_bytes']):>9} "
              f"{ratio(p_pp and p_pp.peak_bytes, p_meg and p_meg.peak_bytes):>9} "
              f"{pp['output_diff']:>9.1e} {pp['grad_input_diff']:>9.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10, help="timed forward + backward runs per MLP")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before them")
    parser.add_argument("--no-swiglu", dest="swiglu", action="store_false", help="leave out the SwiGLU MLP")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile this machine on {WORLD} ranks first when it has no ProfileDB")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the measured and predicted figures to this JSON file")
    args = parser.parse_args()
    start = time.perf_counter()

    from cfp_megatron.base.compose import compose_job

    shapes = default_shapes(args.swiglu)
    jobs = {str(s): {mlp: compose_job(s.overrides(mlp)) for mlp in PARTITIONS} for s in shapes}
    models = local_cost_models(jobs[str(shapes[0])]["megatron"], profile=args.profile)
    if models is None:
        print(f"No ProfileDB for {WORLD} ranks on this machine: predictions left out. Run "
              f"`torchrun --nproc_per_node={WORLD} -m cfp_megatron.profile` first, or pass --profile.")
        predicted: dict[tuple[str, str], Predicted] = {}
    else:
        kernels, costs, described = models
        print(f"Simulator on this machine's ProfileDB: {described}")
        predicted = {(str(s), mlp): predict(jobs[str(s)][mlp], s, kernels, costs) for s in shapes for mlp in PARTITIONS}
    print(f"Measuring {len(shapes)} shapes x {len(PARTITIONS)} partitions on {WORLD} gloo ranks "
          f"({args.warmup} warm-up + {args.repeats} timed runs each) ...", flush=True)
    measured = measure(shapes, jobs, warmup=args.warmup, repeats=args.repeats)
    report(shapes, measured, predicted)
    if args.json is not None:
        rows = [{**r, "predicted": dataclasses.asdict(predicted[(r["shape"], r["mlp"])])
                 if (r["shape"], r["mlp"]) in predicted else None} for r in measured]
        args.json.write_text(json.dumps(rows, indent=1))
    if torch.cuda.is_available():
        print_gpu_gemms(shapes, torch.device("cuda", torch.cuda.current_device()))
    print(f"\nwall time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
