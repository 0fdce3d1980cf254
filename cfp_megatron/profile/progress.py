"""Progress of the profiling rounds, shown with rich on rank 0 only: on a terminal a live row per round (and one
for the preparation before them, from the start), elsewhere (a log, a pipe) one line as each ends."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

PREPARE = "prepare"
"""The row of the work before the first round (reading the ProfileDB, the model's analysis, the machine's load)."""


class RoundProgress:
    """One row per round, counting its entries as the summary line does (reused ones included); :meth:`update` is
    the runner's progress callback (:data:`~cfp_megatron.profile.runner.ProgressFn`)."""

    def __init__(self, *, enabled: bool, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True, highlight=False)
        self.live = enabled and self.console.is_terminal
        self._progress = Progress(TextColumn("{task.fields[round]:<12}"), BarColumn(),
                                  TextColumn("{task.fields[count]}"), TimeElapsedColumn(),
                                  TextColumn("{task.description}"),
                                  console=self.console, transient=False) if self.live else None
        self._tasks: dict[str, int] = {}
        self._started = False

    def __enter__(self) -> RoundProgress:
        if self._progress is not None:
            self._progress.start()
            self._started = True
        self.update(PREPARE, 0, 0, "starting")
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the live rows (they stay on the terminal as they ended); a second call does nothing."""
        if self._progress is not None and self._started:
            self._progress.stop()
            self._started = False

    def update(self, round_name: str, done: int, total: int, label: str | None, *, final: bool = False) -> None:
        """``done`` of ``total`` entries of ``round_name``; ``label``: what runs now, or with ``final`` how the round
        ended (``None``: the text stays)."""
        if not self.enabled:
            return
        count = f"{done}/{total}" if total else ""
        if self._progress is None:
            if label is not None and (final or round_name == PREPARE):
                self.console.print(f"profile {round_name:<12} {count:>9}  {label}", markup=False, soft_wrap=True)
            return
        if round_name not in self._tasks:
            self._tasks[round_name] = self._progress.add_task(label or "", total=total or None, round=round_name,
                                                              count=count)
        fields = {"description": label} if label is not None else {}
        self._progress.update(self._tasks[round_name], completed=done, total=total or None, count=count, **fields)
        if final:
            self._progress.stop_task(self._tasks[round_name])
