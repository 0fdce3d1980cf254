"""One profiling run under torchrun: decide what to measure, run the rounds within the budget, store the DB.

Every rank calls :func:`profile_job`. Rank 0 reads the ProfileDB of this cluster's fingerprint, decides which entries
of which rounds are missing (:func:`rounds_needed`; all with ``force``), runs the model analysis for the segment
classes (before any process group: the analysis uses its own ``fake`` group), then broadcasts the plan; all ranks run
the missing entries' steps in step (:mod:`cfp_megatron.profile.control`), and rank 0 merges the results into the DB,
with each round's measured and missing entries, and writes it.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cfp_megatron.base.cfp_spec import DEFAULT_PROFILE_BUDGET_S
from cfp_megatron.base.config import JobSpec, Recompute, resolve_precision
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import transformer_engine_available
from cfp_megatron.compat import moe
from cfp_megatron.compat.cpu import install_if_needed
from cfp_megatron.engine import rank_watch
from cfp_megatron.engine.distributed import (
    destroy_distributed,
    init_default_group,
    prepare_device_and_env,
    resolve_backend,
)
from cfp_megatron.profile.collectives import collective_steps, fit_results
from cfp_megatron.profile.control import Step, StepResult, grouped_steps, run_round, select_steps
from cfp_megatron.profile.db import ProfileDB, db_path, load_db, store_db
from cfp_megatron.profile.errors import ProfileDBError, ProfileError
from cfp_megatron.profile.fingerprint import Fingerprint, current_fingerprint, model_key
from cfp_megatron.profile.gemm import gemm_records, gemm_steps
from cfp_megatron.profile.load import LoadWatch, quiet_reference
from cfp_megatron.profile.overheads import overhead_cases, overhead_records, overhead_steps
from cfp_megatron.profile.progress import PREPARE
from cfp_megatron.profile.records import RoundRecord, RoundStatus, collective_entry_key
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

CLASSED_ROUNDS = ("segments", "recompute")
"""Rounds that time segment probes (:func:`~cfp_megatron.profile.segments.segment_steps`), whose records are named
by the model analysis' segment classes of the probes' TP sizes."""
ORDERED_ROUNDS = ("segments", "overheads", "recompute")
"""Rounds whose entries are measured in the order the search needs them (:func:`prioritized`): their steps build one
probe per partition, so any order of partitions costs the same. The collectives keep their own order (the smallest
and largest size of every pattern first, so a short budget still fits each) and the GEMMs are cheap."""

ProgressFn = Callable[..., None]
"""``progress(round, done, total, text, final=False)``: ``done`` of the round's ``total`` entries (the reused ones
counted as done), what runs now or how it ended (``final``); the round :data:`PREPARE` is the work before the first."""


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
    coverage: tuple[RoundRecord, ...] = ()
    """Per round of :data:`ROUNDS` (rank 0): the entries this run measured, how many it reused, which the profile
    still lacks for this job (a round that did not run: everything reused)."""
    measured_under: str = ""
    """When and under what load the profile this job reads was measured (rank 0; :meth:`ProfileDB.measured_under`)."""
    busy: tuple[str, ...] = ()
    """The rounds of that profile measured on a busy machine, each with why (rank 0)."""
    retry: str = ""
    """What became of the entries an earlier run measured on a busy machine: measured again (the machine was quiet
    when this run started) or used as they are; ``""`` when there were none."""

    @property
    def incomplete(self) -> tuple[RoundRecord, ...]:
        """The rounds whose profile for this job is partial (their ``missing`` entries are not measured)."""
        return tuple(r for r in self.coverage if r.missing)


def init_profile_group(backend: str, env: LaunchEnv, timeout: datetime.timedelta) -> None:
    """The default process group from torchrun's environment, with ``timeout`` (``train.collective_timeout_s``) so a
    stalled peer ends the run naming it instead of hanging it (the same store handling and progress record as
    :func:`cfp_megatron.engine.distributed.init_distributed`)."""
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
    init_default_group(backend, store, rank, world, timeout, **kwargs)


SEGMENT_REPEATS = {"gpu": 5, "cpu": 7}
"""Timed steps of each segment probe (the median is kept), unless ``cfp.profile_repeats`` sets them."""
OVERHEAD_REPEATS = 4
"""Timed steps of each overheads probe (its pipelined twin repeats them
:data:`~cfp_megatron.profile.overheads.PIPELINE_REPEATS` times), unless ``cfp.profile_repeats`` sets them."""


def round_steps(name: str, job: JobSpec, world: int, *, on_gpu: bool, device: torch.device,
                repeats: int | None = None) -> tuple[list[Step], Any, Callable[[], None] | None]:
    """One round's steps for ``job`` on ``world`` ranks (nothing runs: closures), what each measures by label, and
    what to release after the round (the collectives' groups). ``repeats`` (``cfp.profile_repeats``): the timed
    repeats of every probe instead of each round's own count (:data:`SEGMENT_REPEATS`, :data:`OVERHEAD_REPEATS`,
    the collectives' and GEMMs' ``repeats_for``); what a round measures stays the same."""
    precision = resolve_precision(job.train.precision, on_gpu).value
    if name == "collectives":
        dtype = torch.float32 if not on_gpu else {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            precision, torch.float32)
        return collective_steps(world, job.cluster.nodes, on_gpu=on_gpu, dtype=dtype, device=device, repeats=repeats)
    if name == "gemm":
        dtypes = ["fp32"] if not on_gpu else list(dict.fromkeys([precision, "fp32"]))
        return (*gemm_steps(dtypes, on_gpu=on_gpu, device=device, repeats=repeats), None)
    cases, _ = segment_cases(job, world)
    if name in CLASSED_ROUNDS:
        run = cases if name == "segments" else [case for rc in (Recompute.selective, Recompute.full)
                                                for case in segment_cases(job, world, rc)[0]]
        count = repeats or SEGMENT_REPEATS["gpu" if on_gpu else "cpu"]
        return (*segment_steps(run, micro_batches(job), model_kinds(job), repeats=count), None)
    if name == "overheads":
        return (*overhead_steps(overhead_cases(cases, world, job.model.num_layers), micro_batches(job),
                                repeats=repeats or OVERHEAD_REPEATS), None)
    raise ProfileError(f"unknown profiling round {name!r}; one of {', '.join(ROUNDS)}.")


def round_entries(job: JobSpec, world: int, *, on_gpu: bool) -> dict[str, list[str]]:
    """Every round's entries for ``job`` on ``world`` ranks, in the order the round measures them."""
    out = {}
    for name in ROUNDS:
        steps, _, _ = round_steps(name, job, world, on_gpu=on_gpu, device=torch.device("cpu"))
        out[name] = list(dict.fromkeys(s.entry for s in steps if s.entry is not None))
    return out


def rounds_needed(db: ProfileDB | None, model: str, planned: Mapping[str, Sequence[str]], *,
                  force: bool) -> dict[str, list[str]]:
    """Per round to run (in :data:`ROUNDS` order), the entries it measures: with ``force`` or without a DB every
    planned entry; otherwise only those the DB lacks (:meth:`ProfileDB.missing_entries`), so a round cut off by
    the budget is completed by the next run. A round with nothing missing is left out."""
    need: dict[str, list[str]] = {}
    for name in ROUNDS:
        entries = list(planned.get(name, ()))
        missing = entries if force or db is None else db.missing_entries(name, model, entries)
        if missing:
            need[name] = missing
    return need


def prioritized(entries: Sequence[str], priority: Sequence[str]) -> list[str]:
    """``entries`` in the order ``priority`` asks for: ``priority`` lists partitions at micro-batch sizes, most
    needed first (``tp2-sp mbs=4``, from the layouts a search ranks best). The entries naming both words of an item
    come first, in the items' order; then those naming only an item's partition (another micro-batch size), in the
    order of their partition's first item; the rest keep their order after all of them."""
    items = [tuple(item.split()) for item in priority]

    def rank(entry: str) -> float:
        words = set(entry.split())
        exact = (i for i, item in enumerate(items) if item and set(item) <= words)
        partition = (len(items) + i for i, item in enumerate(items) if item and item[0] in words)
        return min(exact, default=min(partition, default=float("inf")))

    return sorted(entries, key=rank)  # stable


def entry_tps(job: JobSpec, world: int, *, on_gpu: bool, entries: Mapping[str, Sequence[str]]) -> list[int]:
    """The TP sizes whose probes measure ``entries`` (per round) of the :data:`CLASSED_ROUNDS`: the TP sizes this
    run's records need the analysis' classes of (:func:`~cfp_megatron.profile.segments.segment_records`)."""
    tps: set[int] = set()
    for name in CLASSED_ROUNDS:
        if entries.get(name):
            _, meaning, _ = round_steps(name, job, world, on_gpu=on_gpu, device=torch.device("cpu"))
            tps |= {meaning[entry][0] for entry in entries[name]}
    return sorted(tps)


def _plan_on_rank0(job: JobSpec, fp: Fingerprint, world: int, *, force: bool, on_gpu: bool,
                   started: float, priority: Callable[[], Sequence[str]] | None = None) -> dict[str, Any]:
    notes: list[str] = []
    try:
        db = load_db(fp)
    except ProfileDBError as err:
        notes.append(f"the stored ProfileDB was not used and will be replaced: {err}")
        db = None
    key = model_key(job, on_gpu=on_gpu)
    _, skipped = segment_cases(job, world)
    notes += [f"segments: left out {s}" for s in skipped]
    planned = round_entries(job, world, on_gpu=on_gpu)
    rounds = rounds_needed(db, key, planned, force=force)
    # what was measured on a busy machine: measured again if the machine is quiet once the ranks are up (_retry_busy)
    busy = {name: [e for e in db.busy_entries(name, key, planned[name]) if e not in rounds.get(name, ())]
            for name in ROUNDS} if db is not None and not force else {}
    busy = {name: entries for name, entries in busy.items() if entries}
    if priority is not None and (set(rounds) | set(busy)) & set(ORDERED_ROUNDS):  # only when those rounds measure
        order = priority()
        rounds, busy = ({name: prioritized(entries, order) if name in ORDERED_ROUNDS else entries
                         for name, entries in found.items()} for found in (rounds, busy))
    classes: dict[int, dict[str, dict[str, Any]]] = {}
    records: list[dict[str, Any]] = []
    tps = entry_tps(job, world, on_gpu=on_gpu, entries={name: [*rounds.get(name, ()), *busy.get(name, ())]
                                                        for name in CLASSED_ROUNDS})
    if tps:  # only what this run measures is named by the analysis' classes
        began = time.perf_counter()
        try:
            for tp in tps:
                classes[tp] = analysis_classes(job, tp)
            status, reason = RoundStatus.ok, ""
        except Exception as err:  # noqa: BLE001 - without class ids the kinds name the segments
            status, reason = RoundStatus.failed, f"{type(err).__name__}: {err}"
        records.append(RoundRecord(name="analysis", status=status, reason=reason, steps_done=len(classes),
                                   steps_planned=len(tps), seconds=round(time.perf_counter() - began, 3)).to_json())
    return {"rounds": rounds, "planned": planned, "force": force, "classes": classes, "notes": notes,
            "model_key": key, "records": records, "db": db.to_json() if db is not None else None,
            "elapsed": time.perf_counter() - started, "busy": busy,
            "quiet": quiet_reference(db.rounds) if db is not None else None}


def _retry_busy(plan: dict[str, Any], watch: LoadWatch) -> dict[str, Any]:
    """``plan`` with the entries last measured on a busy machine added to its rounds when the machine is quiet now
    (every rank reads the load together, so all decide alike); either way ``retry`` says what became of them."""
    if not plan["busy"]:
        return plan
    now = watch.before(plan["quiet"])
    count = sum(len(entries) for entries in plan["busy"].values())
    if now.busy is not None:
        return {**plan, "retry": f"{count} entries measured on a busy machine are used as they are: the machine is "
                                 f"busy now too ({now.busy})"}
    rounds = {name: list(dict.fromkeys([*plan["rounds"].get(name, ()), *plan["busy"].get(name, ())]))
              for name in ROUNDS if name in plan["rounds"] or name in plan["busy"]}
    return {**plan, "rounds": rounds, "retry": f"measuring again {count} entries measured on a busy machine: it is "
                                               f"quiet now ({now.describe()})"}


def profile_job(job: JobSpec, env: LaunchEnv, *, budget_s: float = DEFAULT_PROFILE_BUDGET_S, force: bool = False,
                progress: ProgressFn | None = None, keep_group: bool = False,
                priority: Callable[[], Sequence[str]] | None = None, repeats: int | None = None) -> ProfileOutcome:
    """Profile the cluster ``job`` runs on (every rank calls this under torchrun); see the module docstring.
    ``repeats`` (``cfp.profile_repeats``, ``--repeats``): every probe's timed repeats (:func:`round_steps`).

    ``priority`` (rank 0 calls it, only when a segments, overheads or recompute entry is missing): the partitions
    at micro-batch sizes to measure first (:func:`prioritized`), the layouts a search ranks best; planning at launch
    passes it so a budget cut leaves what the plan can do without.

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
    shown = progress if progress is not None and env.rank == 0 else None
    if shown is not None:
        shown(PREPARE, 0, 0, "reading the ProfileDB, analysing the model, planning the rounds")
    plan = (_plan_on_rank0(job, fp, world, force=force, on_gpu=on_gpu, started=started, priority=priority)
            if env.rank == 0 else None)
    timeout = datetime.timedelta(seconds=job.train.collective_timeout_s)
    rank_watch.at("the start of profiling (rank 0 plans the rounds)")
    if shown is not None:
        shown(PREPARE, 0, 0, "waiting for the other ranks")
    init_profile_group(backend, env, timeout)
    try:
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        watch = LoadWatch(ranks_here=env.local_world_size, nodes=job.cluster.nodes)
        if shown is not None:
            shown(PREPARE, 0, 0, "reading the machine's load")
        plan = _retry_busy(box[0], watch)
        if shown is not None:
            shown(PREPARE, 1, 1, f"done in {time.perf_counter() - started:.1f} s", final=True)
        rounds_done = [RoundRecord.from_json(r) for r in plan["records"]]
        results = _run_rounds(job, plan, world=world, on_gpu=on_gpu, budget_s=budget_s, started=started,
                              rank=env.rank, progress=progress, repeats=repeats, watch=watch)
        rounds_done += [record for record, _ in results.values()]
        db = path = None
        coverage: tuple[RoundRecord, ...] = ()
        under, busy = "", []
        refused: CfpError | None = None
        if env.rank == 0:
            db = ProfileDB.from_json(plan["db"]) if plan["db"] is not None else ProfileDB(fingerprint=fp)
            if plan["rounds"]:
                base = db  # as read at the start: only what this run adds is merged into the DB on disk now
                db = _merge(db, job, plan, results, rounds_done)
                try:
                    path = store_db(db, base=base)
                except CfpError as err:  # a full disk, a lock: raised after the barrier, so no rank dies on a lost peer
                    refused = err
            else:
                path = db_path(fp)
            coverage = _coverage(plan, rounds_done)
            under, busy = db.measured_under(plan["model_key"], plan["planned"])
            if shown is not None:  # the bars end on the counts the summary line gives
                for r in coverage:
                    if r.name in plan["rounds"]:
                        shown(r.name, *entry_counts(r), None, final=True)
        dist.barrier()
        if refused is not None:
            raise refused
    except BaseException:
        _teardown()
        raise
    if not keep_group:
        _teardown()
    return ProfileOutcome(db=db, path=path, reused=not plan["rounds"], rounds=tuple(rounds_done),
                          notes=tuple(plan["notes"]), wall_s=round(time.perf_counter() - started, 3),
                          coverage=coverage, measured_under=under, busy=tuple(busy), retry=plan.get("retry", ""))


def entry_counts(record: RoundRecord) -> tuple[int, int]:
    """``(done, total)`` entries of a round's coverage record, as the summary line and the progress rows count them:
    every entry the job needs (measured, missing, reused, over memory), done unless missing."""
    total = len(record.measured) + len(record.missing) + record.reused + len(record.over_memory)
    return total - len(record.missing), total


def _coverage(plan: dict[str, Any], rounds_done: list[RoundRecord]) -> tuple[RoundRecord, ...]:
    """Per round: this run's record (with its entries), or one saying everything was reused."""
    ran = {r.name: r for r in rounds_done if r.name in plan["rounds"]}
    return tuple(ran.get(name) or RoundRecord(name=name, status=RoundStatus.ok, reused=len(plan["planned"][name]))
                 for name in ROUNDS)


def completion_hint(outcome: ProfileOutcome, overrides: Sequence[str] = (), world: int | None = None) -> list[str]:
    """Lines that say what the profile lacks and how to complete it (none when it is complete)."""
    if not outcome.incomplete:
        return []
    parts = ", ".join(f"{r.name} {len(r.missing)} of {len(r.missing) + r.reused + len(r.measured)} missing"
                      f" (e.g. {r.missing[0]})" for r in outcome.incomplete)
    return [f"the profile is partial: {parts}; plans that read these are priced by the analytical model",
            f"complete it (measures only what is missing; add the job's other overrides): "
            f"{profile_command(overrides, world, '--budget 600')}, or launch again (each launch measures what is "
            "missing within cfp.profile_budget_s)"]


def profile_command(overrides: Sequence[str], world: int | None, *options: str) -> str:
    """The command that profiles this job's cluster: ``torchrun --nproc_per_node=4 -m cfp_megatron.profile
    model=gpt_tiny --force``."""
    nproc = world if world is not None else "N"
    return " ".join(["torchrun", f"--nproc_per_node={nproc}", "-m", "cfp_megatron.profile", *overrides, *options])


def busy_hint(outcome: ProfileOutcome, overrides: Sequence[str] = (), world: int | None = None) -> list[str]:
    """What became of entries measured busy earlier (:attr:`ProfileOutcome.retry`), and one line when the profile
    this job plans with was measured (in part) on a busy machine: which rounds, why, and how to measure them again
    (none when it was quiet)."""
    if not outcome.busy:
        return [outcome.retry] if outcome.retry else []
    names = ", ".join(entry.split(" (", 1)[0] for entry in outcome.busy)
    first = outcome.busy[0].split(" (", 1)[-1].rstrip(")")
    return [*([outcome.retry] if outcome.retry else []),
            f"measured on a busy machine: {names} (first: {first}); predictions from them may be off. The next "
            f"launch that finds the machine quiet measures them again; or on a quiet machine: "
            f"{profile_command(overrides, world, '--force')}"]


def share_note(share_s: float, budget_s: float, reused: int) -> str:
    """What a round's progress line says of its time: ``its share: 71 s of the 240 s budget, 30 reused``."""
    return f"its share: {share_s:.0f} s of the {budget_s:.0f} s budget" + (f", {reused} reused" if reused else "")


def status_text(record: RoundRecord) -> str:
    """How a round ended, in words: ``done in 9.7 s``, ``stopped at its budget share after 39.0 s``, ``failed after
    2.0 s``."""
    said = {RoundStatus.ok: "done in", RoundStatus.timeout: "stopped at its budget share after",
            RoundStatus.failed: "failed after"}[record.status]
    return f"{said} {record.seconds:.1f} s" + (f", machine busy: {record.busy}" if record.busy else "")


def entries_done(steps: Sequence[Step]) -> list[int]:
    """Per step, the entries whose steps all come before it (the progress count as that step starts)."""
    last = {s.entry: i for i, s in enumerate(steps) if s.entry is not None}
    ends = sorted(last.values())
    out, done = [], 0
    for i in range(len(steps)):
        while done < len(ends) and ends[done] < i:
            done += 1
        out.append(done)
    return out


def _run_rounds(job: JobSpec, plan: dict[str, Any], *, world: int, on_gpu: bool, budget_s: float, started: float,
                rank: int, progress: ProgressFn | None, repeats: int | None = None,
                watch: LoadWatch | None = None) -> dict[str, tuple[RoundRecord, Any]]:
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    out: dict[str, tuple[RoundRecord, Any]] = {}
    todo = list(plan["rounds"])
    for name in todo:
        steps, meaning, release = round_steps(name, job, world, on_gpu=on_gpu, device=device, repeats=repeats)
        # only what the profile lacks, the entries the search needs first where the round's set-up allows
        pick = grouped_steps if name in ORDERED_ROUNDS else select_steps
        steps = pick(steps, plan["rounds"][name])
        # the machine's load just before the round (its share is what is left after the reading)
        load = watch.before(plan["quiet"] or quiet_reference(r for r, _ in out.values())) if watch else None
        remaining = [n for n in todo if n not in out]
        left = budget_s - (time.perf_counter() - started)
        share = max(left, 0.0)
        if name in SHARES:
            share *= SHARES[name] / sum(SHARES[n] for n in remaining if n in SHARES)
        total = len(plan["planned"][name])
        reused = total - len(plan["rounds"][name])
        note = share_note(share, budget_s, reused)
        before = entries_done(steps)
        callback = ((lambda i, n, label, name=name, note=note, before=before, reused=reused, total=total:
                     progress(name, reused + before[i], total, f"{label} [{note}]"))
                    if progress and rank == 0 else None)
        results, record = run_round(name, steps, seconds=share, on_step=callback)
        record = dataclasses.replace(record, load=watch.after(load) if watch and load else None, time=time.time())
        if release is not None:
            release()
        if progress is not None and rank == 0:
            finished = {r.label for r in results}
            done = len({s.entry for s in steps if s.entry is not None}
                       - {s.entry for s in steps if s.entry is not None and s.label not in finished})
            progress(name, reused + done, total, f"{status_text(record)} [{note}]", final=True)
        out[name] = (record, (results, meaning))
    return out


def _merge(db: ProfileDB, job: JobSpec, plan: dict[str, Any], results: dict[str, tuple[RoundRecord, Any]],
           rounds_done: list[RoundRecord]) -> ProfileDB:
    collectives, gemms, segments, overheads = [], [], [], []
    extra: list[RoundRecord] = []
    for name, (_, (steps, meaning)) in results.items():
        steps_done: list[StepResult] = steps
        if name == "collectives":
            collectives, missing = fit_results(steps_done, meaning, () if plan["force"] else db.collectives)
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
    merged = db.merged(collectives=collectives, gemms=gemms, segments=segments, overheads=overheads)
    # each round's record says which of its entries this run measured and which the profile still lacks
    key = plan["model_key"]
    fitted = {(r.fit.op.value, r.fit.group_size, r.fit.span.value) for r in merged.collectives}
    ran = [i for i, r in enumerate(rounds_done) if r.name in plan["rounds"]]
    for i in ran:
        name = rounds_done[i].name
        asked = plan["rounds"][name]
        if name == "collectives":  # a size counts once its step finished and its collective's fit exists
            done = {r.label for r in results[name][1][0]}
            measured = [e for e in asked if e in done and collective_entry_key(e) in fitted]
        else:  # read off the records themselves
            lacking = set(merged.missing_entries(name, key, asked)) | set(rounds_done[i].over_memory)
            measured = [e for e in asked if e not in lacking]
        rounds_done[i] = dataclasses.replace(rounds_done[i], model="" if name in ("collectives", "gemm") else key,
                                             measured=tuple(measured),
                                             reused=len(plan["planned"][name]) - len(asked))
    recorded = merged.merged(rounds=rounds_done)
    for i in ran:
        name = rounds_done[i].name
        rounds_done[i] = dataclasses.replace(
            rounds_done[i], missing=tuple(recorded.missing_entries(name, key, plan["planned"][name])))
    rounds_done.extend(extra)
    return merged.merged(rounds=rounds_done)


def _teardown() -> None:
    destroy_distributed()
