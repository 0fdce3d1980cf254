"""Keeping every rank on the same profiling step: rank 0 decides from the budget, every rank learns the decision.

After each step all ranks join one small all-reduce (MAX) of ``[stop, failed, values...]``: rank 0 alone writes
``stop`` (its budget decision for the next step; the others write 0, so the reduction is a broadcast of rank 0's
decision), every rank writes whether its step raised, and the step's measured values come back as the slowest
rank's. So no rank ever waits on a collective the others skipped: they all run the same deterministic step list and
all stop at the same step. A step that raises on one rank is seen by all at the next sync (and a collective that a
failed peer never joins ends with the process group's timeout instead of hanging).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cfp_megatron.engine import rank_watch
from cfp_megatron.profile.errors import ProfileError
from cfp_megatron.profile.records import RoundRecord, RoundStatus

FAULT_ENV = "CFP_PROFILE_FAULT"
"""Test hook, comma-separated entries: ``<round>:fail[:<rank>]`` makes that round's first step raise on one rank
(default: the last), ``<round>:oom[:<rank>]`` run out of device memory there; ``<round>:slow`` makes its first step
outlast the round's deadline on every rank."""
SLOTS = 6
"""Length of the sync tensor: stop, failed, and up to four measured values."""


@dataclass(frozen=True, kw_only=True)
class Step:
    """One unit of profiling work that every rank runs."""

    label: str
    """What it measures, for progress lines and failure reasons."""
    run: Callable[[], Sequence[float]]
    """Does the work; returns up to four figures (e.g. seconds) to reduce by maximum over ranks."""
    entry: str | None = None
    """The round's entry this step measures (:class:`~cfp_megatron.profile.records.RoundRecord`'s ``measured`` and
    ``missing``; several steps may share one); ``None`` for a set-up step."""
    needs: str | None = None
    """Label of the set-up step this step needs (run before it whenever it runs); ``None`` for none."""


def select_steps(steps: Sequence[Step], entries: Iterable[str]) -> list[Step]:
    """The steps of ``entries`` in their order, with the set-up steps they need (a completed profile's round
    gets none; a partial one only what is missing)."""
    wanted = set(entries)
    kept = [s for s in steps if s.entry is not None and s.entry in wanted]
    needed = {s.needs for s in kept if s.needs is not None}
    return [s for s in steps if (s.entry is not None and s.entry in wanted) or (s.entry is None and s.label in needed)]


def grouped_steps(steps: Sequence[Step], entries: Sequence[str]) -> list[Step]:
    """The steps of ``entries`` with the set-up steps they need, in ``entries``' order as far as set-up allows: the
    steps that share a set-up step run together after it (a set-up frees the previous one's model), the groups in the
    order of the earliest entry each holds, and within a group in ``entries``' order. For rounds whose set-up holds
    one probe at a time (segments, overheads, recompute), so the entries a search needs first are measured first."""
    rank = {entry: i for i, entry in enumerate(dict.fromkeys(entries))}
    setups = {s.label: s for s in steps if s.entry is None}
    groups: dict[str | None, list[Step]] = {}
    for step in steps:
        if step.entry is not None and step.entry in rank:
            groups.setdefault(step.needs, []).append(step)
    out: list[Step] = []
    for needs, group in sorted(groups.items(), key=lambda kv: min(rank[s.entry or ""] for s in kv[1])):
        if needs is not None and needs in setups:
            out.append(setups[needs])
        out += sorted(group, key=lambda s: rank[s.entry or ""])  # stable: an entry's timing step before its memory
    return out


@dataclass(frozen=True, kw_only=True)
class StepResult:
    """A finished step and its figures, the slowest rank's."""

    label: str
    """The step's label."""
    values: tuple[float, ...]
    """The step's figures, reduced by maximum over ranks."""


def control_device() -> torch.device:
    """Where the sync tensor lives: the current CUDA device under NCCL, the CPU under gloo."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    """Every rank of the default group waits for the others (nothing in one process): timed work starts together."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def slowest(values: Sequence[float]) -> tuple[float, ...]:
    """``values`` reduced by maximum over the default group, element-wise (the slowest rank's figures; unchanged in
    one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tuple(float(v) for v in values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=control_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tuple(float(v) for v in tensor.tolist())


def summed(values: Sequence[float]) -> tuple[float, ...]:
    """``values`` summed over the default group, element-wise (unchanged in one process)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return tuple(float(v) for v in values)
    tensor = torch.tensor(list(values), dtype=torch.float64, device=control_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tuple(float(v) for v in tensor.tolist())


def sync(stop: bool, failed: bool, values: Sequence[float], *, out_of_memory: bool = False
         ) -> tuple[bool, bool, tuple[float, ...], bool]:
    """One all-reduce (MAX) over the default group: rank 0's ``stop``, anyone's ``failed``, the slowest values, and
    whether any rank's step ran out of device memory (``out_of_memory``; a failure of any other kind on another rank
    outranks it: ``failed``)."""
    if len(values) > SLOTS - 2:
        raise ProfileError(f"a step may report at most {SLOTS - 2} values; got {len(values)}.")
    state = 2.0 if failed else 1.0 if out_of_memory else 0.0
    data = [1.0 if stop and dist.get_rank() == 0 else 0.0, state, *values]
    data += [0.0] * (SLOTS - len(data))  # the same length on every rank (a failed step reports no values)
    out = slowest(data)
    return out[0] > 0, out[1] > 1.5, tuple(out[2:2 + len(values)]), 0.5 < out[1] < 1.5


def _free_device_memory() -> None:
    """Return the cached blocks of a step that ran out of memory to the device, so the next step starts clean."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def first_reason(reason: str | None) -> str:
    """The failure reasons of all ranks, joined (the ones that did not fail contribute nothing)."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, reason)
    found = [f"rank {r}: {text}" for r, text in enumerate(gathered) if text]
    return "; ".join(found) or "a rank failed without a message"


def _injected_fault(round_name: str) -> tuple[str, int] | None:
    for spec in os.environ.get(FAULT_ENV, "").split(","):
        parts = spec.strip().split(":")
        if len(parts) >= 2 and parts[0] == round_name:
            return parts[1], int(parts[2]) if len(parts) > 2 else dist.get_world_size() - 1
    return None


def run_round(name: str, steps: Sequence[Step], *, seconds: float,
              on_step: Callable[[int, int, str], None] | None = None) -> tuple[list[StepResult], RoundRecord]:
    """Run ``steps`` on every rank until they are done, one fails, or rank 0's share of ``seconds`` runs out.

    ``seconds`` is the round's share of the budget as rank 0 reckons it (other ranks' figure is ignored). Rank 0
    stops before a step it expects to end past the deadline (its estimate: the step just done).
    """
    start = time.perf_counter()
    rank = dist.get_rank()
    deadline = start + seconds
    # Every rank learns rank 0's share, so an injected slow step can outlast it everywhere.
    _, _, (share,), _ = sync(False, False, [seconds if rank == 0 else 0.0])
    fault = _injected_fault(name)
    results: list[StepResult] = []
    over_memory: list[str] = []
    unbuilt: set[str] = set()  # set-up steps that ran out of memory
    status, reason = RoundStatus.ok, ""
    stop = share <= 0
    for index, step in enumerate(steps):
        if stop:
            status, reason = RoundStatus.timeout, f"the round's {share:.1f} s share of the budget ran out"
            break
        rank_watch.at(f"profiling round {name}, step {index + 1} of {len(steps)} ({step.label})")
        if on_step is not None:
            on_step(index, len(steps), step.label)
        if step.needs is not None and step.needs in unbuilt:  # its set-up ran out of memory: so would it
            if step.entry is not None:
                over_memory.append(step.entry)
            continue
        if step.entry is not None and step.entry in over_memory:  # an entry's other step (its memory) after an OOM
            continue
        began = time.perf_counter()
        failed, oom, message, values = False, False, None, ()
        try:
            if fault is not None and index == 0:
                kind, fault_rank = fault
                if kind == "fail" and rank == fault_rank:
                    raise ProfileError(f"injected failure ({FAULT_ENV}) in {step.label}")
                if kind == "oom" and rank == fault_rank:
                    raise torch.OutOfMemoryError(f"injected out of memory ({FAULT_ENV}) in {step.label}")
                if kind == "slow":
                    time.sleep(share + 0.5)
            values = tuple(float(v) for v in step.run())
        except torch.OutOfMemoryError:
            oom = True  # the probe does not fit this device: recorded, and the round goes on
        except Exception as err:  # noqa: BLE001 - any failure of a step is recorded, never raised
            failed, message = True, f"{step.label}: {type(err).__name__}: {err}"
        if oom:
            _free_device_memory()  # after the except clause: its traceback no longer holds the step's tensors
        # Rank 0's estimate of the next step: this one (steps grow slowly; a one-off slow first step, e.g. lazy
        # initialisation, does not end the round).
        last = time.perf_counter() - began
        stop_next = time.perf_counter() + last > deadline
        try:
            stop, any_failed, values, any_oom = sync(stop_next, failed, values if not (failed or oom) else (),
                                                     out_of_memory=oom)
        except Exception as err:  # noqa: BLE001 - a broken group ends the round, never the job
            if rank_watch.is_collective_timeout(err):  # a stalled rank: the job ends naming it
                raise
            status, reason = RoundStatus.failed, f"sync after {step.label}: {type(err).__name__}: {err}"
            break
        if any_oom and not any_failed:
            if step.entry is None:
                unbuilt.add(step.label)
            else:
                over_memory.append(step.entry)
            continue
        if any_failed:
            status = RoundStatus.failed
            try:
                reason = first_reason(message)
            except Exception:  # noqa: BLE001
                reason = message or "another rank failed"
            break
        results.append(StepResult(label=step.label, values=values))
    record = RoundRecord(name=name, status=status, reason=reason, steps_done=len(results), steps_planned=len(steps),
                         seconds=round(time.perf_counter() - start, 3),
                         over_memory=tuple(dict.fromkeys(over_memory)))
    return results, record


def timed(fn: Callable[[], object], *, repeats: int, warmup: int = 1, batches: int = 3,
          group: dist.ProcessGroup | None = None) -> float:
    """Seconds per call of ``fn``: the median over ``batches`` batches of the batch mean (``repeats`` calls each),
    after ``warmup`` calls; the median keeps one batch hit by a noisy neighbour out. Timed as Megatron does on GPU:
    CUDA events around the calls and a synchronize; without CUDA, the wall clock (so it needs no CPU layer: the
    ``deepspeed.initialize`` hook calls it in a user's process). Ranks of
    ``group`` start each batch together (a barrier) when a group is given."""
    for _ in range(warmup):
        fn()
    on_gpu = torch.cuda.is_available()
    means = []
    for _ in range(max(batches, 1)):
        if on_gpu:
            torch.cuda.synchronize()
        if group is not None:
            dist.barrier(group=group)
        if on_gpu:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                fn()
            end.record()
            torch.cuda.synchronize()
            seconds = start.elapsed_time(end) / 1000.0
        else:
            began = time.perf_counter()
            for _ in range(repeats):
                fn()
            seconds = time.perf_counter() - began
        means.append(seconds / repeats)
    return sorted(means)[len(means) // 2]
