"""Progress of the profiling rounds, shown with rich on rank 0 only."""

from __future__ import annotations

from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class RoundProgress:
    """One bar per round; :meth:`update` is the runner's progress callback."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._progress = Progress(TextColumn("{task.fields[round]:<12}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("{task.description}"),
                                  console=Console(stderr=True), transient=False) if enabled else None
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> RoundProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.stop()

    def update(self, round_name: str, done: int, total: int, label: str) -> None:
        """Step ``done`` of ``total`` of ``round_name`` is ``label`` (or the round ended with status ``label``)."""
        if self._progress is None:
            return
        if round_name not in self._tasks:
            self._tasks[round_name] = self._progress.add_task(label, total=total, round=round_name)
        self._progress.update(self._tasks[round_name], completed=done, description=label)
