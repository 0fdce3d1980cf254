"""What a training run logs: one step's metrics, and rank 0's console lines and ``metrics.jsonl``."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step did, as rank 0 logs it."""

    step: int
    """Optimizer steps completed (1-based)."""
    loss: float
    """Mean token loss over the global batch."""
    lr: float
    """Learning rate used for this step."""
    grad_norm: float
    """Gradient norm before clipping (0 when the update was skipped)."""
    applied: bool
    """False when the fp16 loss scaler found an overflow and skipped the update."""
    step_time_s: float
    """Wall-clock seconds of the step (forward, backward, optimizer)."""
    tokens_per_s: float
    """Trained tokens per second, whole job."""
    tflops_per_rank: float
    """Model TFLOP/s per rank."""
    mfu: float
    """Model FLOPs utilisation: ``tflops_per_rank`` / peak."""
    peak_bytes_max: float | None = None
    """Peak memory of the most loaded rank, on the step memory was measured (``train.memory_step``)."""


class MetricsLog:
    """Rank 0's log: readable lines on the console and one JSON object per line in ``metrics.jsonl``."""

    def __init__(self, path: Path | None, enabled: bool) -> None:
        self.enabled = enabled
        self.console = Console(highlight=False)
        self.path = path
        # A live bar on a terminal only; logs and pipes get the step lines alone.
        self.progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True,
                                 disable=not (enabled and self.console.is_terminal))
        if enabled and path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def event(self, kind: str, **fields: Any) -> None:
        """Write a non-step record (start, resume, checkpoint, end) and say it on the console."""
        self._write({"event": kind, "time": time.time(), **fields})
        if self.enabled:
            detail = " | ".join(f"{k} {v}" for k, v in fields.items() if v is not None)
            self.console.print(f"[bold]{kind}[/] | {detail}", soft_wrap=True)

    def step(self, m: StepMetrics, total: int) -> None:
        """Write one step's metrics and print its line."""
        self._write({"event": "step", **asdict(m)})
        if self.enabled:
            self.console.print(
                f"step {m.step:>5}/{total} | loss {m.loss:.4f} | lr {m.lr:.2e} | "
                f"{f'grad {m.grad_norm:.3f}' if m.applied else 'skipped (loss-scale overflow)'} | "
                f"{m.step_time_s * 1000:.0f} ms | {m.tokens_per_s:,.0f} tok/s | "
                f"{m.tflops_per_rank:.3f} TFLOP/s/rank | MFU {m.mfu * 100:.1f}%", soft_wrap=True)

    def _write(self, record: dict) -> None:
        if self.enabled and self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
