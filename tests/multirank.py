"""Training cases that share one torchrun job per world size (the ``multirank`` fixture of tests/conftest.py).

A test names the runs it reads with ``@pytest.mark.multirank(Case(...), ...)`` (on a ``pytest.param`` for one
parametrised case) and takes the ``multirank`` fixture: once per session, the cases of every selected test are
gathered, the same run asked for by several tests is trained once, and each world size's cases run in one
``torchrun tests/scripts/multirank_cases.py`` job (the largest world first, so a checkpoint saved on more ranks can
be resumed on fewer; a world's cases in the order the tests name them). Each test then reads its own case's
:class:`~tests.launcher.RunResult` and fails on its own. docs/testing.md, "One job per world size".
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from tests.launcher import REPO, RunResult, torchrun_command

SCRIPT = REPO / "tests" / "scripts" / "multirank_cases.py"
"""The job each world size runs."""

TMP = "{tmp}"
"""In a case's overrides, the session's folder for the multi-rank jobs (a checkpoint folder a sequence shares)."""

COLLECTIVE_TIMEOUT_S = 180
"""``train.collective_timeout_s`` of every case: a case that stalls its ranks ends in minutes, not in the default
10, and the cases after it still run."""


@dataclass(frozen=True, kw_only=True)
class Case:
    """One training run of launch/train.py's path, on ``world`` ranks."""

    world: int
    """Ranks (torchrun's ``--nproc_per_node``)."""
    overrides: tuple[str, ...]
    """Hydra overrides; :data:`TMP` stands for the session's folder."""
    prepare: Callable[[Path], None] | None = field(default=None, compare=False)
    """What the case reads that a test makes (an indexed dataset), written under the session's folder (its
    argument) once, before the first job; ``None``: nothing."""
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables set while the case runs (``CFP_CACHE_DIR``: a cache of its own); :data:`TMP` in a
    value stands for the session's folder."""

    @property
    def key(self) -> str:
        """What makes two cases the same run."""
        return json.dumps([self.world, *self.overrides] + ([dict(self.env)] if self.env else []))


def case(world: int, *overrides: str, prepare: Callable[[Path], None] | None = None,
         env: dict[str, str] | None = None) -> Case:
    """A :class:`Case` of ``overrides`` on ``world`` ranks (``prepare``: :attr:`Case.prepare`, ``env``:
    :attr:`Case.env`)."""
    return Case(world=world, overrides=tuple(overrides), prepare=prepare, env=tuple(sorted((env or {}).items())))


class MultiRankRuns:
    """The results of the session's multi-rank jobs, by case."""

    def __init__(self, folder: Path, results: dict[str, RunResult], files: dict[str, list[list[str]]],
                 run_dirs: dict[str, Path]) -> None:
        self.folder = folder
        self._results = results
        self._files = files
        self._run_dirs = run_dirs

    def __getitem__(self, c: Case) -> RunResult:
        return self._results[c.key]

    def files(self, c: Case) -> tuple[list[str], list[str]]:
        """The files under the case's ``train.checkpoint_dir`` before and after it ran (relative paths)."""
        before, after = self._files[c.key]
        return before, after

    def run_dir(self, c: Case) -> Path:
        """The case's Hydra run directory (``plan.json``, ``ds_config.json``...)."""
        return self._run_dirs[c.key]

    def path(self, name: str) -> Path:
        """The path a case's overrides name as ``{tmp}/<name>``."""
        return self.folder / name


def run_cases(cases: Iterable[Case], folder: Path, *, timeout_per_case: float = 240) -> MultiRankRuns:
    """Run ``cases`` (duplicates once), one torchrun job per world size, largest world first."""
    unique = list({c.key: c for c in cases}.values())
    results: dict[str, RunResult] = {}
    files: dict[str, list[list[str]]] = {}
    run_dirs: dict[str, Path] = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for prepare in dict.fromkeys(c.prepare for c in unique if c.prepare is not None):
        prepare(folder)
    for world in sorted({c.world for c in unique}, reverse=True):
        mine = [c for c in unique if c.world == world]
        job = folder / f"world{world}"
        job.mkdir(parents=True, exist_ok=True)
        listed = []
        for i, c in enumerate(mine):
            metrics = job / f"case{i}" / "metrics.jsonl"
            metrics.parent.mkdir()
            overrides = [o.replace(TMP, str(folder)) for o in c.overrides]
            listed.append({"id": c.key, "metrics": str(metrics), "run_dir": str(metrics.parent / "run"),
                           "overrides": [*overrides, f"train.metrics_file={metrics}",
                                         f"train.collective_timeout_s={COLLECTIVE_TIMEOUT_S}"],
                           "env": {k: v.replace(TMP, str(folder)) for k, v in c.env}})
        (job / "cases.json").write_text(json.dumps(listed, indent=1))
        command = torchrun_command(world, [str(job / "cases.json"), str(job / "results.json")], script=SCRIPT)
        try:
            proc = subprocess.run(command, cwd=job, env=env, capture_output=True, text=True,
                                  timeout=120 + timeout_per_case * len(mine))
            returncode, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            returncode, output = -1, f"the job of world {world} timed out\n{err.stdout or ''}{err.stderr or ''}"
        done = json.loads((job / "results.json").read_text()) if (job / "results.json").exists() else {}
        for entry in listed:
            metrics = Path(entry["metrics"])
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
                if metrics.exists() else []
            outcome = done.get(entry["id"])
            files[entry["id"]] = outcome["files"] if outcome is not None else [[], []]
            run_dirs[entry["id"]] = Path(entry["run_dir"])
            if outcome is None:
                results[entry["id"]] = RunResult(returncode=-1, records=records, output=(
                    f"the case did not finish: its job (world {world}) ended with {returncode}\n{output[-6000:]}"))
            else:
                results[entry["id"]] = RunResult(returncode=0 if outcome["ok"] else 1, records=records,
                                                 output=outcome["error"] or "")
    return MultiRankRuns(folder, results, files, run_dirs)
