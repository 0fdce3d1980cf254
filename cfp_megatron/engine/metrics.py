"""What a training run logs: one step's metrics, and rank 0's console lines (also in the run's ``train.log``) and
``metrics.jsonl``."""

from __future__ import annotations

import logging
import sys
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

from cfp_megatron.base.files import FileWriteError, append_record, write_error

METRICS_KIND = "cfp-metrics"
"""The ``kind`` of a metrics file's first record (``{"kind": "cfp-metrics", "event": "header", ...}``, written when
the file is created): a file that does not begin with it is not cfp-megatron's and is never appended to."""

METRICS_FORMAT = 1
"""The header's ``format``: the layout of the records that follow it."""

ONE_LINE_WIDTH = 160
"""A record whose ``key value`` pairs fit in this many characters is printed on one line."""


def record_lines(kind: str, fields: dict[str, Any]) -> list[str]:
    """A record as console lines: ``kind | key value | ...`` when it is short and flat, else ``kind`` then one aligned
    ``key  value`` line per field and, for a list of mappings (the memory record's ranks), an aligned table. Byte
    counts (keys naming ``bytes`` and a memory ``breakdown``) are shown in KiB/MiB/GiB; ``None`` values are left
    out."""
    shown = {k: v for k, v in fields.items() if v is not None}
    flat = all(not isinstance(v, (dict, list, tuple)) for v in shown.values())
    line = " | ".join([kind, *(f"{k} {_value(k, v)}" for k, v in shown.items())])
    if flat and (len(line) <= ONE_LINE_WIDTH or len(shown) <= 1):
        return [line]
    scalars = {k: v for k, v in shown.items() if not isinstance(v, (dict, list, tuple))}
    width = max((len(k) for k in shown), default=0)
    lines = [kind, *(f"  {k:<{width}}  {_value(k, v)}" for k, v in scalars.items())]
    for key, value in shown.items():
        if isinstance(value, dict):
            lines.append(f"  {key}")
            inner = max((len(k) for k in value), default=0)
            bytes_ = _is_bytes(key)
            lines += [f"    {k:<{inner}}  {_value(k, v, bytes_)}" for k, v in value.items() if v is not None]
        elif isinstance(value, (list, tuple)):
            if value and all(isinstance(v, dict) for v in value):
                lines.append(f"  {key}")
                lines += ["    " + row for row in _table(value, scalars)]
            else:
                lines.append(f"  {key:<{width}}  {', '.join(str(v) for v in value)}")
    return lines


def _is_bytes(key: str) -> bool:
    return "bytes" in key or key == "breakdown"


def _value(key: str, value: Any, in_bytes: bool = False) -> str:
    if (in_bytes or _is_bytes(key)) and isinstance(value, (int, float)) and not isinstance(value, bool):
        for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
            if abs(value) >= scale:
                return f"{value / scale:.2f} {unit}"
        return f"{value:.0f} B"
    return str(value)


def _table(rows: list[dict[str, Any]], header: dict[str, Any]) -> list[str]:
    """Aligned columns for a list of flat or one-level nested mappings; a column whose values are all ``None``, or
    all equal to the record's own field of that name, is left out."""
    flat_rows: list[dict[str, str]] = []
    for row in rows:
        cells: dict[str, str] = {}
        for k, v in row.items():
            if isinstance(v, dict):
                cells.update({kk: _value(kk, vv, _is_bytes(k)) for kk, vv in v.items() if vv is not None})
            elif v is not None and not (k in header and header[k] == v):
                cells[k] = _value(k, v)
        flat_rows.append(cells)
    columns = list(dict.fromkeys(k for cells in flat_rows for k in cells))
    widths = {c: max(len(c), *(len(cells.get(c, "")) for cells in flat_rows)) for c in columns}
    lines = ["  ".join(f"{c:<{widths[c]}}" for c in columns).rstrip()]
    lines += ["  ".join(f"{cells.get(c, ''):<{widths[c]}}" for c in columns).rstrip() for cells in flat_rows]
    return lines


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
    device_peak_bytes_max: float | None = None
    """On GPUs, the most any rank's caching allocator held on that step (``torch.cuda.max_memory_allocated``; the
    figure an out-of-memory error is about); ``None`` on CPU and on the other steps."""


RUN_LOGGER = "cfp.run"
"""The logger of the run's records in its log file (:func:`log_to_run_file`)."""


def log_to_run_file(*lines: str) -> None:
    """Write ``lines`` to the run's log file only, not the console: the file handlers Hydra's job logging gave the
    root logger (``<run dir>/train.log``, on rank 0; the other ranks have none), so that the file holds the run's
    records as the console shows them. Nothing without such a handler (no Hydra, a test)."""
    logger = logging.getLogger(RUN_LOGGER)
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    if not files:
        return
    logger.propagate = False  # the console has the lines already
    logger.handlers = files
    logger.setLevel(logging.INFO)
    for line in lines:
        logger.info(line)


class MetricsLog:
    """Rank 0's log: readable lines on the console and one JSON object per line in ``metrics.jsonl``."""

    def __init__(self, path: Path | None, enabled: bool, *, key: str = "train.metrics_file") -> None:
        self.enabled = enabled
        self.key = key
        """The setting that chose ``path`` (named in a write error)."""
        self.failed: FileWriteError | None = None
        """The write error that stopped the file's records (training goes on: see :meth:`_write`)."""
        self.console = Console(highlight=False)
        self.path = path
        # A live bar on a terminal only; logs and pipes get the step lines alone.
        self.progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True,
                                 disable=not (enabled and self.console.is_terminal))
        if enabled and path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise write_error(err, path, key) from None

    def event(self, kind: str, **fields: Any) -> None:
        """Write a non-step record (start, resume, checkpoint, end) and say it on the console."""
        self._write({"event": kind, "time": time.time(), **fields})
        if self.enabled:
            lines = record_lines(kind, fields)
            for line in lines:
                self.console.print(line, markup=False, soft_wrap=True)
            log_to_run_file(*lines)

    def step(self, m: StepMetrics, total: int) -> None:
        """Write one step's metrics and print its line."""
        self._write({"event": "step", **asdict(m)})
        if self.enabled:
            line = (f"step {m.step:>5}/{total} | loss {m.loss:.4f} | lr {m.lr:.2e} | "
                    f"{f'grad {m.grad_norm:.3f}' if m.applied else 'skipped (loss-scale overflow)'} | "
                    f"{m.step_time_s * 1000:.0f} ms | {m.tokens_per_s:,.0f} tok/s | "
                    f"{m.tflops_per_rank:.3f} TFLOP/s/rank | MFU {m.mfu * 100:.1f}%")
            self.console.print(line, soft_wrap=True)
            log_to_run_file(line)

    def _write(self, record: dict) -> None:
        """Append ``record`` as one whole line (:func:`~cfp_megatron.base.files.append_record`: a file cfp-megatron
        did not create is refused, a short write undone). When the disk refuses it (full, read-only since), the file
        keeps its whole lines, a warning says so once on stderr, no later record is written (no gaps), and training
        goes on: the console keeps every step's line and the checkpoints are saved as planned."""
        if not self.enabled or self.path is None or self.failed is not None:
            return
        try:
            append_record(self.path, record, kind=METRICS_KIND, key=self.key,
                          header={"event": "header", "format": METRICS_FORMAT, "time": time.time()})
        except FileWriteError as err:
            self.failed = err
            step = f" at step {record['step']}" if record.get("event") == "step" else ""
            print(f"cfp: warning: the metrics file stops here{step}; training goes on, and the console keeps "
                  f"every step's line. {err}", file=sys.stderr, flush=True)
