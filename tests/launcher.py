"""Run launch/train.py under torchrun from tests and read back what rank 0 logged."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "launch" / "train.py"


def free_port() -> int:
    """An unused TCP port on the loopback interface for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, kw_only=True)
class RunResult:
    """A finished torchrun job."""

    returncode: int
    """torchrun's exit status."""
    output: str
    """stdout and stderr together."""
    records: list[dict]
    """metrics.jsonl, one dict per line."""

    @property
    def steps(self) -> list[dict]:
        """The step records."""
        return [r for r in self.records if r.get("event") == "step"]

    @property
    def losses(self) -> dict[int, float]:
        """Loss by step (the last record wins when a step was trained twice, e.g. after a restart)."""
        return {r["step"]: r["loss"] for r in self.steps}

    @property
    def grad_norms(self) -> dict[int, float]:
        """Gradient norm by step."""
        return {r["step"]: r["grad_norm"] for r in self.steps}


def torchrun_command(nproc: int, overrides: list[str], *, max_restarts: int = 0, script: Path = TRAIN) -> list[str]:
    """The torchrun command line for ``nproc`` CPU ranks running ``script`` (default launch/train.py)."""
    # c10d rendezvous, as --standalone uses; the default static backend works too (checked by hand), since
    # init_distributed keeps each restart's store keys apart.
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            str(script), *overrides]


def run_train(nproc: int, overrides: list[str], workdir: Path, *, timeout: float = 600,
              max_restarts: int = 0, run_dir: Path | None = None) -> RunResult:
    """Run the training entry point and return its metrics; the run directory is ``run_dir`` (default
    ``workdir/run``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics = workdir / "metrics.jsonl"
    args = [*overrides, f"train.metrics_file={metrics}", f"hydra.run.dir={run_dir or workdir / 'run'}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(torchrun_command(nproc, args, max_restarts=max_restarts), cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=timeout)
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    return RunResult(returncode=proc.returncode, output=proc.stdout + proc.stderr, records=records)


def _step_reached(metrics: Path, step: int) -> bool:
    if not metrics.exists():
        return False
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return any(r.get("event") == "step" and r["step"] >= step for r in records)


def run_killing_a_rank(nproc: int, overrides: list[str], workdir: Path, *, metrics: Path, kill_at_step: int,
                       env: dict[str, str], timeout: float = 600) -> tuple[int, str]:
    """Run torchrun with ``--max-restarts=1``, SIGKILL local rank 1 once ``metrics`` shows ``kill_at_step``, and
    wait for torchrun to end; returns (its exit code, its output).

    torchrun runs in a session of its own and writes to a file, not a pipe: a child the killed rank leaves behind
    (Inductor's compile workers outlive a SIGKILLed parent) would hold a pipe open and block reading it until the
    timeout; the whole session is killed at the end, so no such orphan outlives the test."""
    import signal
    import time

    import psutil

    log = workdir / "torchrun.log"
    left_behind: list = []
    with log.open("w") as out:
        proc = subprocess.Popen(torchrun_command(nproc, overrides, max_restarts=1), cwd=workdir, env=env,
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not _step_reached(metrics, kill_at_step):
            if proc.poll() is not None:
                raise AssertionError(f"torchrun ended early with {proc.returncode}: {log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"step {kill_at_step} not reached in {timeout} s")
            time.sleep(0.2)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=False)
                   if any("train.py" in part for part in p.cmdline())]
        if len(workers) != nproc:
            raise AssertionError(f"expected {nproc} workers, found {workers}")
        left_behind = workers[1].children(recursive=True)
        os.kill(workers[1].pid, signal.SIGKILL)
        returncode = proc.wait(timeout=timeout)
    finally:
        for child in [*left_behind, *_session_members(proc.pid)]:
            with contextlib.suppress(psutil.Error):
                child.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return returncode, log.read_text()


def run_with_a_rank_killed(nproc: int, overrides: list[str], workdir: Path, *, kill_at_step: int,
                           save_interval: int = 2, timeout: float = 600) -> tuple[int, str, list[dict], Path]:
    """:func:`run_killing_a_rank` of a job that checkpoints every ``save_interval`` steps into ``workdir/ckpt``:
    (torchrun's exit code, its output, rank 0's metrics records, the checkpoint folder)."""
    ckpt, metrics = workdir / "ckpt", workdir / "job" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    args = [*overrides, f"train.save_interval={save_interval}", f"train.checkpoint_dir={ckpt}",
            f"train.metrics_file={metrics}", f"hydra.run.dir={workdir / 'job' / 'run'}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    returncode, output = run_killing_a_rank(nproc, args, workdir / "job", metrics=metrics, kill_at_step=kill_at_step,
                                            env=env, timeout=timeout)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return returncode, output, records, ckpt


def _session_members(sid: int) -> list:
    """Live processes of session ``sid`` (what torchrun started, orphans included)."""
    import psutil

    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(process.pid) == sid:
                found.append(process)
    return found
