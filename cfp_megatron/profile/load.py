"""How busy the machine is while profiling times something: the CPU time other processes take
(:mod:`cfp_megatron.profile.cpu_use`, which the plan check reads too) and a reference matmul's speed, read around
every profiling round (:class:`LoadWatch`); the verdict is :attr:`~cfp_megatron.profile.records.MachineLoad.busy`
(docs/profiling.md, "A busy machine")."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Iterable

import torch
import torch.distributed as dist

from cfp_megatron.engine.peak import measure_matmul_tflops
from cfp_megatron.profile.control import slowest, summed
from cfp_megatron.profile.cpu_use import cpu_times
from cfp_megatron.profile.records import MachineLoad, RoundRecord

REFERENCE_S = 0.2
"""Seconds every rank runs the reference matmul before a round (all at once, so the reading is the job's own)."""
REFERENCE_SIZE = {"cpu": 256, "cuda": 4096}
"""Side of the reference matmul (fp32 on CPU, bf16 on a GPU): short, and the same on every run of a machine."""
LOAD_ENV = "CFP_PROFILE_LOAD"
"""Test hook: ``quiet`` or ``busy`` makes every reading of :class:`LoadWatch` say so (other work on none or all of
the cores, no reference matmul), so a test's outcome never depends on the load of the machine it runs on."""


def reference_tflops() -> float:
    """This rank's speed on the reference matmul (:data:`REFERENCE_SIZE`, for :data:`REFERENCE_S`)."""
    if torch.cuda.is_available():
        return measure_matmul_tflops(torch.bfloat16, REFERENCE_SIZE["cuda"], seconds=REFERENCE_S)
    return measure_matmul_tflops(torch.float32, REFERENCE_SIZE["cpu"], seconds=REFERENCE_S)


def quiet_reference(records: Iterable[RoundRecord]) -> float | None:
    """The reference matmul's speed on the quiet machine: the median over ``records`` taken with other work under
    the busy share (their own reference not judged, so a slow first reading cannot set the bar); ``None``
    without one."""
    quiet = [r.load.reference_tflops for r in records if r.load is not None and r.load.reference_tflops
             and r.load.busy is None]
    return statistics.median(quiet) if quiet else None


class LoadWatch:
    """The machine's load around one profiling round, read by every rank together (collectives over the default
    group): :meth:`before` times the reference matmul on all ranks at once and the CPU time other processes took
    meanwhile; :meth:`after` the CPU time they took since. Other processes' share = the node's busy CPU seconds less
    the job's ranks' own (each rank's process time), summed over the nodes, over the cores and the wall time."""

    def __init__(self, *, ranks_here: int, nodes: int) -> None:
        self.ranks_here = max(ranks_here, 1)
        self.nodes = max(nodes, 1)
        self._mark: tuple[tuple[float, float] | None, float, float] | None = None

    def _start(self) -> None:
        self._mark = (cpu_times(), time.process_time(), time.perf_counter())

    def _other_share(self) -> float | None:
        """Other processes' share of the cores since :meth:`_start` (collective: every rank calls it)."""
        told = os.environ.get(LOAD_ENV)
        if told in ("quiet", "busy"):
            return 0.0 if told == "quiet" else 1.0
        if self._mark is None:
            return None
        node0, own0, wall0 = self._mark
        node1, own1, wall1 = cpu_times(), time.process_time(), time.perf_counter()
        known = node0 is not None and node1 is not None
        busy_s = ((node1[1] - node1[0]) - (node0[1] - node0[0])) if known else 0.0  # type: ignore[index]
        mine = busy_s / self.ranks_here - (own1 - own0)  # summed over the node's ranks: its busy less theirs
        (other,) = summed([mine])
        (wall,) = slowest([wall1 - wall0])
        (unknown,) = slowest([0.0 if known else 1.0])
        if unknown > 0 or wall <= 0:
            return None
        return min(max(other / (wall * (os.cpu_count() or 1) * self.nodes), 0.0), 1.0)

    def before(self, quiet_tflops: float | None) -> MachineLoad:
        """Time the reference matmul on every rank at once and read the other work meanwhile; start the reading of
        the round. ``quiet_tflops``: the reference's speed on the quiet machine, to compare with."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        self._start()
        told = os.environ.get(LOAD_ENV) in ("quiet", "busy")
        (negative,) = slowest([0.0 if told else -reference_tflops()])  # the slowest rank's speed
        other = self._other_share()
        self._start()
        return MachineLoad(other_before=other, reference_tflops=-negative if negative < 0 else None,
                           quiet_reference_tflops=quiet_tflops)

    def after(self, load: MachineLoad) -> MachineLoad:
        """``load`` (what :meth:`before` read) with the other work's share during the round."""
        return dataclasses.replace(load, other_during=self._other_share())
