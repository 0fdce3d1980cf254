"""Rich tables of a ProfileDB for people."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from cfp_megatron.profile.db import ProfileDB
from cfp_megatron.profile.records import RoundRecord


def _bytes(value: float) -> str:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if value >= scale:
            return f"{value / scale:.0f} {unit}"
    return f"{value:.0f} B"


def render(db: ProfileDB, rounds: tuple[RoundRecord, ...], *, console: Console | None = None) -> None:
    """Print the fits, the GEMM table's peaks and best shapes, the segment times and the rounds of this run."""
    console = console or Console(highlight=False)
    if not console.is_terminal:
        console.width = 150
    fp = db.fingerprint
    console.print(f"[bold]ProfileDB[/] {fp.key}: {fp.device_count} x {fp.device_name} | {fp.nodes} node(s) x "
                  f"{fp.gpus_per_node} | {fp.backend} | torch {fp.torch} | megatron-core {fp.megatron_core}"
                  + (f" | CUDA {fp.cuda} | NCCL {fp.nccl}" if fp.cuda else ""))
    table = Table(title="Collectives: seconds = latency + bytes / bandwidth")
    for col in ("collective", "group", "span", "layout", "latency (us)", "bandwidth (GB/s)", "bus BW (GB/s)",
                "sizes", "max fit error"):
        table.add_column(col, justify="right" if col not in ("collective", "span", "layout") else "left")
    for rec in sorted(db.collectives, key=lambda r: (r.fit.op.value, r.fit.group_size, r.fit.span.value)):
        f = rec.fit
        sizes = f"{_bytes(rec.samples[0][0])}..{_bytes(rec.samples[-1][0])}" if rec.samples else ""
        table.add_row(f.op.value, str(f.group_size), f.span.value, rec.pattern, f"{f.latency_s * 1e6:.1f}",
                      f"{f.bandwidth_bytes_per_s / 1e9:.3f}", f"{f.bus_bandwidth_bytes_per_s / 1e9:.3f}",
                      f"{f.points} ({sizes})", f"{f.max_rel_error:.0%}")
    console.print(table)
    gemm = Table(title="GEMM (per rank, all ranks busy)")
    for col in ("dtype", "shapes", "practical peak (TFLOP/s)", "at m x n x k", "smallest shape (TFLOP/s)"):
        gemm.add_column(col)
    for dtype in sorted({g.dtype for g in db.gemms}):
        rows = [g for g in db.gemms if g.dtype == dtype]
        best = max(rows, key=lambda g: g.tflops)
        small = min(rows, key=lambda g: g.m * g.n * g.k)
        gemm.add_row(dtype, str(len(rows)), f"{best.tflops:.4f}", f"{best.m}x{best.n}x{best.k}",
                     f"{small.tflops:.4f} ({small.m}x{small.n}x{small.k})")
    console.print(gemm)
    seg = Table(title="Segments: forward / backward per micro-batch (slowest rank)")
    for col in ("model", "kind", "class", "partition", "mbs", "seq", "forward (ms)", "backward (ms)", "TP confirmed"):
        seg.add_column(col)
    for s in sorted(db.segments, key=lambda s: (s.model_name, s.tp, s.micro_batch, s.kind)):
        seg.add_row(s.model_name, s.kind, s.segment, s.partition, str(s.micro_batch), str(s.seq_length),
                    f"{s.forward_s * 1e3:.2f}", f"{s.backward_s * 1e3:.2f}", "yes" if s.confirmed else "no")
    console.print(seg)
    if rounds:
        rt = Table(title="Rounds of this run")
        for col in ("round", "status", "steps", "seconds", "measured", "reused", "missing", "over memory", "load",
                    "reason"):
            rt.add_column(col, overflow="fold")
        for r in rounds:
            entries = r.name not in ("analysis", "collective-fits")
            load = "" if r.load is None else ("busy: " + r.busy if r.busy else "quiet: " + r.load.describe())
            rt.add_row(r.name, r.status.value, f"{r.steps_done}/{r.steps_planned}", f"{r.seconds:.2f}",
                       str(len(r.measured)) if entries else "", str(r.reused) if entries else "",
                       str(len(r.missing)) if entries else "", str(len(r.over_memory)) if entries else "", load,
                       r.reason)
        console.print(rt)
