"""One profiling run under torchrun: decide what to measure, run the rounds within the budget, store the DB.

Every rank calls :func:`profile_job`. Rank 0 reads the ProfileDB of this cluster's fingerprint, decides which rounds
are missing (all with ``force``), runs the model analysis for the segment classes (before any process group: the
analysis uses its own ``fake`` group), then broadcasts the plan; all ranks run the rounds in step
(:mod:`cfp_megatron.profile.control`), and rank 0 merges the results into the DB and writes it.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cfp_megatron.base.cfp_spec import DEFAULT_PROFILE_BUDGET_S
from cfp_megatron.base.config import JobSpec, Recompute, resolve_precision
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import transformer_engine_available
from cfp_megatron.compat import moe
from cfp_megatron.compat.cpu import install_if_needed
from cfp_megatron.engine.distributed import destroy_distributed, prepare_device_and_env, resolve_backend
from cfp_megatron.profile.collectives import collective_steps, fit_results
from cfp_megatron.profile.control import StepResult, run_round
from cfp_megatron.profile.db import ProfileDB, db_path, load_db, store_db
from cfp_megatron.profile.errors import ProfileDBError
from cfp_megatron.profile.fingerprint import Fingerprint, current_fingerprint, model_key
from cfp_megatron.profile.gemm import gemm_records, gemm_steps
from cfp_megatron.profile.overheads import overhead_cases, overhead_records, overhead_steps
from cfp_megatron.profile.records import RoundRecord, RoundStatus
from cfp_megatron.profile.segments import (
    analysis_classes,
    micro_batches,
    model_kinds,
    segment_cases,
    segment_records,
    segment_steps,
)

ROUNDS = ("collectives", "gemm", "segments", "overheads", "recompute")
"""Rounds in the order they run. ``recompute``: the decoder layers of the segments round again under selective
recomputation (their memory then differs) and checkpointed whole as full recomputation runs them (their time then
differs; :func:`cfp_megatron.profile.segments.segment_cases`), last, so a short budget drops it before anything a
plan without recomputation reads."""
SHARES = {"collectives": 0.3, "gemm": 0.1, "segments": 0.35, "overheads": 0.25}
"""Share of the remaining budget each round gets when it starts (what an earlier round leaves rolls over). A round
without a share (``recompute``) runs on what the others leave."""

ProgressFn = Callable[[str, int, int, str], None]


@dataclass(frozen=True, kw_only=True)
class ProfileOutcome:
    """What one run did (complete on rank 0; other ranks get ``db=None``)."""

    db: ProfileDB | None
    """The DB after the run (rank 0)."""
    path: Path | None
    """Where it is stored (rank 0)."""
    reused: bool
    """Nothing was measured: the stored DB already had everything this job needs."""
    rounds: tuple[RoundRecord, ...]
    """Rounds of this run (analysis included)."""
    notes: tuple[str, ...]
    """Things a person should know (a stale DB replaced, TP sizes left out)."""
    wall_s: float
    """Wall time of the whole run on rank 0."""


def init_profile_group(backend: str, env: LaunchEnv, timeout: datetime.timedelta) -> None:
    """The default process group from torchrun's environment, with a short timeout so a lost peer ends a round
    instead of hanging it (the same store handling as :func:`cfp_megatron.engine.distributed.init_distributed`)."""
    if dist.is_initialized():
        return
    prepare_device_and_env(env, port=29512)
    kwargs: dict[str, Any] = {}
    if torch.cuda.is_available():
        kwargs["device_id"] = torch.device("cuda", env.local_rank)
    # The rendezvous also waits for rank 0's analysis, which runs before any group exists: allow it longer.
    store, rank, world = next(dist.rendezvous("env://", env.rank, env.world_size,
                                              timeout=max(timeout, datetime.timedelta(minutes=10))))
    store = dist.PrefixStore(f"/cfp-profile/attempt_{env.restart_count}", store)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs)


def rounds_needed(db: ProfileDB | None, model: str, micro_batch_sizes: list[int], tps: list[int], *,
                  force: bool) -> list[str]:
    """Rounds to run: all with ``force``; otherwise those whose results the DB lacks for this job."""
    if force or db is None:
        return list(ROUNDS)
    need = []
    if not db.collectives:
        need.append("collectives")
    if not db.gemms:
        need.append("gemm")
    if not any(db.has_segments(model, tp, mbs) for tp in tps for mbs in micro_batch_sizes):
        need.append("segments")
    if not any(db.has_overheads(model, tp) for tp in tps):
        need.append("overheads")
    if not all(any(db.has_segments(model, tp, mbs, recompute=rc) for tp in tps for mbs in micro_batch_sizes)
               for rc in (Recompute.selective, Recompute.full)):
        need.append("recompute")
    return need


def _plan_on_rank0(job: JobSpec, fp: Fingerprint, world: int, *, force: bool, on_gpu: bool,
                   started: float) -> dict[str, Any]:
    notes: list[str] = []
    try:
        db = load_db(fp)
    except ProfileDBError as err:
        notes.append(f"the stored ProfileDB was not used and will be replaced: {err}")
        db = None
    key = model_key(job, on_gpu=on_gpu)
    cases, skipped = segment_cases(job, world)
    notes += [f"segments: left out {s}" for s in skipped]
    tps = sorted({c.tp for c in cases})  # PrimePar's MLP is a second case of its TP size
    rounds = rounds_needed(db, key, micro_batches(job), tps, force=force)
    classes: dict[int, dict[str, dict[str, Any]]] = {}
    records: list[dict[str, Any]] = []
    if {"segments", "recompute"} & set(rounds):  # only these rounds name their records by the analysis' classes
        began = time.perf_counter()
        try:
            for tp in tps:
                classes[tp] = analysis_classes(job, tp)
            status, reason = RoundStatus.ok, ""
        except Exception as err:  # noqa: BLE001 - without class ids the kinds name the segments
            status, reason = RoundStatus.failed, f"{type(err).__name__}: {err}"
        records.append(RoundRecord(name="analysis", status=status, reason=reason, steps_done=len(classes),
                                   steps_planned=len(tps), seconds=round(time.perf_counter() - began, 3)).to_json())
    return {"rounds": rounds, "classes": classes, "notes": notes, "model_key": key, "records": records,
            "db": db.to_json() if db is not None else None, "elapsed": time.perf_counter() - started}


def profile_job(job: JobSpec, env: LaunchEnv, *, budget_s: float = DEFAULT_PROFILE_BUDGET_S, force: bool = False,
                progress: ProgressFn | None = None, keep_group: bool = False) -> ProfileOutcome:
    """Profile the cluster ``job`` runs on (every rank calls this under torchrun); see the module docstring.

    ``keep_group`` leaves the default process group up for the caller (planning at launch broadcasts its plan over
    it), which then destroys it; otherwise it is destroyed here."""
    started = time.perf_counter()
    install_if_needed()
    if job.model.is_moe and not transformer_engine_available():
        moe.install()
    on_gpu = torch.cuda.is_available()
    backend = resolve_backend(job.cluster.backend)
    world = env.world_size
    fp = current_fingerprint(world_size=world, nodes=job.cluster.nodes, backend=backend)
    plan = _plan_on_rank0(job, fp, world, force=force, on_gpu=on_gpu, started=started) if env.rank == 0 else None
    timeout = datetime.timedelta(seconds=max(60.0, 2.0 * budget_s))
    init_profile_group(backend, env, timeout)
    try:
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
        rounds_done = [RoundRecord.from_json(r) for r in plan["records"]]
        results = _run_rounds(job, plan, world=world, on_gpu=on_gpu, budget_s=budget_s, started=started,
                              rank=env.rank, progress=progress)
        rounds_done += [record for record, _ in results.values()]
        db = path = None
        if env.rank == 0:
            db = ProfileDB.from_json(plan["db"]) if plan["db"] is not None else ProfileDB(fingerprint=fp)
            if plan["rounds"]:
                db = _merge(db, job, plan, results, rounds_done)
                path = store_db(db)
            else:
                path = db_path(fp)
        dist.barrier()
    except BaseException:
        _teardown()
        raise
    if not keep_group:
        _teardown()
    return ProfileOutcome(db=db, path=path, reused=not plan["rounds"], rounds=tuple(rounds_done),
                          notes=tuple(plan["notes"]), wall_s=round(time.perf_counter() - started, 3))


def _run_rounds(job: JobSpec, plan: dict[str, Any], *, world: int, on_gpu: bool, budget_s: float, started: float,
                rank: int, progress: ProgressFn | None) -> dict[str, tuple[RoundRecord, Any]]:
    precision = resolve_precision(job.train.precision, on_gpu).value
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    out: dict[str, tuple[RoundRecord, Any]] = {}
    todo = list(plan["rounds"])
    cases, _ = segment_cases(job, world)
    for name in todo:
        release = None
        if name == "collectives":
            dtype = torch.float32 if not on_gpu else {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
                precision, torch.float32)
            steps, meaning, release = collective_steps(world, job.cluster.nodes, on_gpu=on_gpu, dtype=dtype,
                                                       device=device)
        elif name == "gemm":
            dtypes = ["fp32"] if not on_gpu else list(dict.fromkeys([precision, "fp32"]))
            steps, meaning = gemm_steps(dtypes, on_gpu=on_gpu, device=device)
        elif name in ("segments", "recompute"):
            run = cases if name == "segments" else [case for rc in (Recompute.selective, Recompute.full)
                                                    for case in segment_cases(job, world, rc)[0]]
            steps, meaning = segment_steps(run, micro_batches(job), model_kinds(job), repeats=5 if on_gpu else 7)
        else:
            steps, meaning = overhead_steps(overhead_cases(cases, world, job.model.num_layers), micro_batches(job),
                                            repeats=4)
        remaining = [n for n in todo if n not in out]
        left = budget_s - (time.perf_counter() - started)
        share = max(left, 0.0)
        if name in SHARES:
            share *= SHARES[name] / sum(SHARES[n] for n in remaining if n in SHARES)
        callback = (lambda i, n, label, name=name: progress(name, i, n, label)) if progress and rank == 0 else None
        results, record = run_round(name, steps, seconds=share, on_step=callback)
        if release is not None:
            release()
        if progress is not None and rank == 0:
            progress(name, record.steps_done, len(steps), record.status.value)
        out[name] = (record, (results, meaning))
    return out


def _merge(db: ProfileDB, job: JobSpec, plan: dict[str, Any], results: dict[str, tuple[RoundRecord, Any]],
           rounds_done: list[RoundRecord]) -> ProfileDB:
    collectives, gemms, segments, overheads = [], [], [], []
    extra: list[RoundRecord] = []
    for name, (_, (steps, meaning)) in results.items():
        steps_done: list[StepResult] = steps
        if name == "collectives":
            collectives, missing = fit_results(steps_done, meaning)
            if missing:
                extra.append(RoundRecord(name="collective-fits", status=RoundStatus.failed,
                                         reason=f"{len(missing)} fit(s) missing: " + "; ".join(missing[:4])))
        elif name == "gemm":
            gemms = gemm_records(steps_done, meaning)
        elif name == "overheads":
            overheads = overhead_records(steps_done, meaning, key=plan["model_key"])
        else:  # segments, recompute
            classes = {int(k): v for k, v in plan["classes"].items()}
            segments += segment_records(steps_done, meaning, job=job, key=plan["model_key"], classes=classes)
    rounds_done.extend(extra)
    return db.merged(collectives=collectives, gemms=gemms, segments=segments, rounds=rounds_done,
                     overheads=overheads)


def _teardown() -> None:
    destroy_distributed()
