"""Run launch/train.py under torchrun from tests and read back what rank 0 logged."""

from __future__ import annotations

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


def torchrun_command(nproc: int, overrides: list[str], *, max_restarts: int = 0) -> list[str]:
    """The torchrun command line for ``nproc`` CPU ranks."""
    # c10d rendezvous, as --standalone uses; the default static backend works too (checked by hand), since
    # init_distributed keeps each restart's store keys apart.
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            str(TRAIN), *overrides]


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
