"""A :class:`~cfp_megatron.base.config.ClusterSpec` with the figures profiling measured in place of the preset's."""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cfp_megatron.base.config import ClusterSpec, JobSpec, Precision
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.cluster.measured import Collective, CollectiveFit, Measurements, Span
from cfp_megatron.cluster.presets import cluster_preset, identity, preset_for_device
from cfp_megatron.profile.db import load_db
from cfp_megatron.profile.errors import ProfileDBError
from cfp_megatron.profile.fingerprint import current_fingerprint, model_key

if TYPE_CHECKING:
    from cfp_megatron.profile.db import ProfileDB


def link_fit(measured: Measurements, span: Span) -> CollectiveFit | None:
    """The point-to-point fit that best describes one link of ``span``: send/recv between two ranks, else the
    smallest group of that span that was measured."""
    for size in (2, 4, 8, 16):
        fit = measured.collective(Collective.send_recv, size, span)
        if fit is not None:
            return fit
    return None


def measured_cluster(spec: ClusterSpec, measured: Measurements, *, gpus_per_node: int | None = None) -> ClusterSpec:
    """``spec`` with peak TFLOP/s (fp32, bf16), intra-node and inter-node bandwidth and latency replaced by what was
    measured (figures not measured keep the spec's values); ``gpus_per_node`` fills an unset one.

    A measured peak ran at the clock the GPUs really had: once one is filled in, the spec's clock or power limit is
    applied to the unmeasured fp8 peak here and then dropped, so nothing is scaled twice. A measured network link
    likewise replaces a NIC override (``nics_per_node``, ``nic_gbps``)."""
    changes: dict[str, object] = {}
    for field, dtype in (("peak_tflops_fp32", "fp32"), ("peak_tflops_bf16", "bf16")):
        peak = measured.peak_tflops(dtype)
        if peak is not None and peak > 0:
            changes[field] = peak
    if changes and spec.clock_scale < 1.0:
        changes.update(peak_tflops_fp8=spec.clocked_peak_tflops("fp8"), peak_tflops_fp4=spec.clocked_peak_tflops("fp4"),
                       sm_clock_mhz=None, power_limit_w=None)
    for prefix, span in (("intra_node", Span.intra_node), ("inter_node", Span.inter_node)):
        fit = link_fit(measured, span)
        if fit is not None:
            changes[f"{prefix}_bandwidth_gbps"] = fit.bandwidth_bytes_per_s / 1e9
            changes[f"{prefix}_latency_us"] = fit.latency_s * 1e6
            if span is Span.inter_node:
                changes.update(nics_per_node=None, nic_gbps=None)
    if spec.gpus_per_node is None and gpus_per_node is not None:
        changes["gpus_per_node"] = gpus_per_node
    return dataclasses.replace(spec, **changes)


def device_preset(device_name: str, memory_gib: float) -> dict[str, Any] | None:
    """The vendor preset (``conf/cluster``) of an accelerator as the device names itself, with ``memory_gib`` of
    memory (:func:`~cfp_megatron.cluster.presets.preset_for_device`: the presets' aliases, the memory picking between
    the variants a bare name leaves open); ``None`` for an accelerator without one."""
    name = preset_for_device(device_name, memory_gib)
    return cluster_preset(name) if name is not None else None


MEMINFO = Path("/proc/meminfo")
"""Where Linux states the host's memory (``MemTotal``)."""


def host_memory_gib() -> float:
    """This host's physical memory in GiB: ``MemTotal`` of :data:`MEMINFO`, else ``os.sysconf``'s page count. The
    total, not what is free now, so every rank of a node reads the same figure."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 2**30
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30


def host_share_gib(spec: ClusterSpec, ranks_per_node: int, total_gib: float | None = None) -> float:
    """The host memory (GiB) each of ``ranks_per_node`` CPU ranks may plan with: ``total_gib`` (default
    :func:`host_memory_gib`) less ``cluster.host_reserve_gib``, shared by the ranks, less ``cluster.rank_reserve_gib``
    each. A :class:`ConfigError` naming the rank count when nothing is left."""
    total = host_memory_gib() if total_gib is None else total_gib
    host, rank = spec.host_reserve_gib or 0.0, spec.rank_reserve_gib or 0.0
    share = (total - host) / max(ranks_per_node, 1) - rank
    if host >= total:
        raise ConfigError(ConfigIssue(
            key="cluster.host_reserve_gib", value=host,
            problem=f"leaves nothing of this host's {total:.1f} GiB of memory for the ranks.",
            fix=f"set it below {total:.1f} (it is what the OS and other programs keep), or null."))
    if total - host - rank <= 0:  # not even one rank: the reserve per rank is the cause, not the rank count
        raise ConfigError(ConfigIssue(
            key="cluster.rank_reserve_gib", value=rank,
            problem=f"is more than this host's {total:.1f} GiB of memory less its cluster.host_reserve_gib={host:g} "
                    f"for the OS ({total - host:.2f} GiB): it leaves nothing for one rank.",
            fix=f"set it below {total - host:.2f} (what Python, torch and Megatron-Core take per rank, about 0.5), "
                "or null."))
    if share <= 0:
        fewest = max(int((total - host) // (rank + 0.25)), 1)
        raise ConfigError(ConfigIssue(
            key="cluster.gpus_per_node", value=ranks_per_node,
            problem=f"{ranks_per_node} ranks share this host's {total:.1f} GiB of memory: less its "
                    f"cluster.host_reserve_gib={host:g} for the OS, each gets {share + rank:.2f} GiB, under its "
                    f"cluster.rank_reserve_gib={rank:g} for Python, torch and Megatron-Core alone.",
            fix=f"start fewer ranks per node (torchrun --nproc_per_node, at most about {fewest}), or run on a "
                "machine with more memory."))
    return share


def this_device(spec: ClusterSpec, *, ranks_per_node: int = 1) -> ClusterSpec:
    """``spec`` with this machine's GPU filled in where it names none (the ``local`` preset): its name and memory
    capacity (the planner's memory limit) from the device, and from its vendor preset (:func:`device_preset`) what
    it is (generation, capabilities: :func:`~cfp_megatron.cluster.presets.identity`) and the figures profiling does
    not measure: memory bandwidth (the optimizer's and element-wise work's rate) and the fp8 peak; a GPU without a
    preset gets its measured copy rate (:func:`copy_bandwidth_gbps`) and no generation (the plan warns). Without a
    GPU, a CPU cluster's memory limit is this host's, shared by ``ranks_per_node`` ranks (:func:`host_share_gib`)."""
    import torch

    if spec.hbm_gib is not None:
        return spec
    if not torch.cuda.is_available():
        if not spec.on_cpu:  # a GPU preset without its memory figure, planned on a machine without a GPU
            return spec
        return dataclasses.replace(spec, hbm_gib=host_share_gib(spec, ranks_per_node))
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    memory_gib = props.total_memory / 2**30
    changes: dict[str, Any] = {"hbm_gib": memory_gib}
    preset = device_preset(props.name, memory_gib)
    if spec.on_cpu:  # this GPU's name, and what its vendor preset says it is (generation...; None without one)
        changes.update(device_name=props.name, **identity(preset))
    if preset is not None:
        for key in ("hbm_bandwidth_gbps", "peak_tflops_fp8", "peak_tflops_fp4"):
            if getattr(spec, key) is None and preset.get(key) is not None:
                changes[key] = float(preset[key])
    elif spec.hbm_bandwidth_gbps is None:  # a GPU without a preset: its copy rate, measured here
        changes["hbm_bandwidth_gbps"] = copy_bandwidth_gbps()
    return dataclasses.replace(spec, **changes)


@functools.cache
def copy_bandwidth_gbps(nbytes: int = 512 * 2**20, repeats: int = 10) -> float:
    """Bytes read and written per second (GB/s) by a device-to-device copy of ``nbytes`` on the current GPU, the
    median of ``repeats`` copies after one warm-up (once per process). An achieved rate, which the simulator's memory
    efficiency then lowers a little more than a datasheet figure would need."""
    import statistics

    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1000.0)
    return 2 * nbytes / statistics.median(seconds) / 1e9


def local_measurements(job: JobSpec, *, world_size: int, backend: str | None = None,
                       db: ProfileDB | None = None) -> tuple[ClusterSpec, ProfileDB | None]:
    """What this machine measured for ``job`` on ``world_size`` ranks: the job's cluster filled from its ProfileDB
    and the DB itself, scoped to the job's model (segment kinds resolve against it); the cluster unchanged and
    ``None`` when this machine has not been profiled with that many ranks. ``db``: the DB in hand (a profiling run's
    outcome), read from the cache otherwise."""

    import torch

    from cfp_megatron.engine.distributed import resolve_backend

    nodes = max(job.cluster.nodes, 1)
    spec = this_device(job.cluster, ranks_per_node=job.cluster.gpus_per_node or max(world_size // nodes, 1))
    fp = current_fingerprint(world_size=world_size, nodes=spec.nodes, backend=backend or resolve_backend(spec.backend))
    db = db if db is not None else load_db(fp)
    if db is None:
        return spec, None
    db = db.for_model(model_key(job, on_gpu=torch.cuda.is_available()))
    return measured_cluster(spec, db, gpus_per_node=fp.gpus_per_node), db


def profiled_peak(job: JobSpec, *, world_size: int, precision: Precision) -> float | None:
    """The practical matmul peak per rank (TFLOP/s) this machine's ProfileDB holds for ``precision`` (the GEMM
    round's best shape, timed with all ranks busy: :meth:`~cfp_megatron.profile.db.ProfileDB.peak_tflops`), the
    peak MFU is against (:func:`cfp_megatron.engine.peak.peak_tflops`); ``None`` where this machine was not
    profiled with ``world_size`` ranks or its DB cannot be read."""
    from cfp_megatron.engine.distributed import resolve_backend
    from cfp_megatron.engine.peak import peak_dtype

    fp = current_fingerprint(world_size=world_size, nodes=max(job.cluster.nodes, 1),
                             backend=resolve_backend(job.cluster.backend))
    try:
        db = load_db(fp)
    except ProfileDBError:
        return None
    return db.peak_tflops(peak_dtype(precision)) if db is not None else None


def describe_cluster(spec: ClusterSpec) -> str:
    """One line of the figures :func:`measured_cluster` fills."""
    def fmt(value: float | None, unit: str) -> str:
        return "not measured" if value is None else f"{value:.4g} {unit}"

    return (f"peak fp32 {fmt(spec.peak_tflops_fp32, 'TFLOP/s')}, peak bf16 {fmt(spec.peak_tflops_bf16, 'TFLOP/s')}, "
            f"intra-node {fmt(spec.intra_node_bandwidth_gbps, 'GB/s')} / {fmt(spec.intra_node_latency_us, 'us')}, "
            f"inter-node {fmt(spec.network_bandwidth_gbps, 'GB/s')} / {fmt(spec.inter_node_latency_us, 'us')}")
