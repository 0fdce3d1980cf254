"""Train many cases in one torchrun job: one start-up and one default process group per world size instead of a
torchrun each (tests/multirank.py starts it; docs/testing.md, "One job per world size").

    torchrun --nproc_per_node=W tests/scripts/multirank_cases.py CASES.json RESULTS.json

CASES.json lists ``{"id": ..., "overrides": [...], "run_dir": ..., "env": {...}}`` in the order they run (``run_dir``:
the case's Hydra run directory, where a launch writes ``plan.json`` and the like; ``env``: variables set while it
runs). Each case goes through the launch path
of ``launch/train.py`` after Hydra (:func:`cfp_megatron.planner.entry.train_from_config`: validation, the checkpoint
checks, the plan, Megatron's groups, training, checkpoints) on the overrides composed as the launcher composes them;
what differs is that the default process group is created by the first case and kept, and Megatron's model-parallel
groups are set aside at a case's end for the next case of the same layout (:class:`tests.group_pool.GroupPool`; each
case seeds its own RNGs as a fresh launch does). Rank 0 writes
RESULTS.json after every case, ``{id: {"ok": bool, "error": str | None, "seconds": float, "files": [before, after],
"groups": {"made": int, "reused": int}}}`` (``files``: the files under the case's ``train.checkpoint_dir`` before and
after it, for a case that must change nothing there; ``groups``: the job's layouts so far whose groups were made and
those that reused an earlier case's), so a case that fails leaves the others' results and a job that dies leaves
what it finished.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cfp_megatron.base.cuda_env import set_runtime_env  # noqa: E402
from cfp_megatron.compat.import_cost import import_megatron  # noqa: E402
from cfp_megatron.compat.quiet import quiet_expected_warnings  # noqa: E402

quiet_expected_warnings()
import_megatron()  # as a launch imports it (planner.entry.train_from_config): its import costs cut

import torch.distributed as dist  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from cfp_megatron.base.compose import compose_config, without_hydra  # noqa: E402
from cfp_megatron.engine import peak  # noqa: E402
from cfp_megatron.engine.rank_watch import tie_to_launcher  # noqa: E402
from cfp_megatron.planner.entry import train_from_config  # noqa: E402
from tests.group_pool import GroupPool  # noqa: E402


def run_case(overrides: list[str], run_dir: str, pool: GroupPool) -> str | None:
    """Train one case with ``run_dir`` as its Hydra run directory (as ``hydra.run.dir`` gives a launch), Megatron's
    groups from ``pool``; its error (type, message and the traceback's tail) or ``None``."""
    calls = pool.made + pool.reused
    try:
        # checked as a launch checks its command line, composed once for Hydra's run and the job
        hydra_cfg = compose_config(overrides, keep_hydra=True)
        cfg = without_hydra(hydra_cfg)
        with open_dict(hydra_cfg):
            hydra_cfg.hydra.runtime.output_dir = run_dir
        if os.environ.get("RANK", "0") == "0":
            Path(run_dir).mkdir(parents=True, exist_ok=True)
        HydraConfig.instance().set_config(hydra_cfg)  # what Hydra's app sets: the run directory, the overrides
        train_from_config(cfg)
    except Exception as err:  # noqa: BLE001 - a failing case is reported, the next one still runs
        if pool.made + pool.reused != calls:  # it had Megatron's groups, which it may have left mid-collective
            pool.clear()
        tail = "".join(traceback.format_exception(err)[-6:])
        return f"{type(err).__name__}: {err}\n{tail}"
    finally:
        HydraConfig.instance().cfg = None
    if parallel_state._global_process_group_list is not None:  # the launch's teardown did not run
        pool.release()
    return None


def files_under(overrides: list[str]) -> list[str]:
    """The files under the ``train.checkpoint_dir`` of ``overrides`` (relative paths), or none."""
    folder = next((o.split("=", 1)[1] for o in overrides if o.startswith("train.checkpoint_dir=")), None)
    if folder is None or not Path(folder).is_dir():
        return []
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())


def main(cases_file: str, results_file: str) -> None:
    """Run every case of ``cases_file`` in order; rank 0 writes ``results_file`` after each."""
    set_runtime_env()  # as launch/train.py sets it
    # The peak FLOP/s for MFU (0.3 s of matmuls per rank) is this machine's: measured by the first case, read by
    # the others.
    peak.measure_matmul_tflops = functools.cache(peak.measure_matmul_tflops)
    cases = json.loads(Path(cases_file).read_text())
    results: dict[str, dict] = {}
    # The default group outlives the cases (the launch path's teardown sets Megatron's groups aside and keeps it),
    # and a case of a layout an earlier case had takes that case's groups.
    pool = GroupPool()
    with pool.serving():
        for case in cases:
            run_one(case, results, results_file, pool)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_one(case: dict, results: dict[str, dict], results_file: str, pool: GroupPool) -> None:
    """Run ``case`` with its environment variables set, add its outcome to ``results`` and (rank 0) write them to
    ``results_file``."""
    began, before = time.perf_counter(), files_under(case["overrides"])
    kept = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))  # the case's own variables (a cache of its own), then back
    try:
        error = run_case(case["overrides"], case["run_dir"], pool)
    finally:
        for k, v in kept.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results[case["id"]] = {"ok": error is None, "error": error, "seconds": round(time.perf_counter() - began, 1),
                           "files": [before, files_under(case["overrides"])],
                           "groups": {"made": pool.made, "reused": pool.reused}}
    if os.environ.get("RANK", "0") == "0":
        Path(results_file).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    tie_to_launcher()
    main(sys.argv[1], sys.argv[2])
