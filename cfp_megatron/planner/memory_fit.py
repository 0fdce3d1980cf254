"""Whether a job fits the memory of the machine it is about to run on, checked before profiling and before any
process group: ``+cfp=auto`` refuses a job no layout of which fits (the search on the simulator's memory model), a
layout given by hand (``parallel.*``, or a plan file made elsewhere) is refused when its predicted peak exceeds each
rank's memory, and a GPU cluster preset is refused for training on a machine without a GPU.

Each rank's memory is ``cluster.hbm_gib``, else the GPU's, else (CPU) the host's shared by the ranks of a node
(:func:`cfp_megatron.profile.cluster.host_share_gib`).
"""

from __future__ import annotations

import dataclasses

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.compose import group_presets
from cfp_megatron.base.config import ClusterSpec, JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.parallel_dims import transformer_engine_available
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.model.derive import partition_options
from cfp_megatron.planner.sizing import GROWTH, Planner, growth_limit, resized, smallest_fitting
from cfp_megatron.profile.cluster import host_memory_gib, local_measurements, this_device
from cfp_megatron.search.search import SearchResult, search
from cfp_megatron.search.space import KNOBS, knob_setting, no_layout_issues, only_knob
from cfp_megatron.sim.options import SimOptions, options_here
from cfp_megatron.sim.prediction import GIB
from cfp_megatron.sim.simulate import predict_memory

MEMORY_FIX = ("start fewer ranks per node (torchrun --nproc_per_node), train a smaller model (model=..., "
              "model.num_layers), allow recomputation and more model parallelism (cfp.recompute, the cfp pins and "
              "cfp.constraints), or use a cluster with more memory (cluster=<preset>, cluster.hbm_gib).")
"""What to change when a job does not fit."""

LAYOUT_FIX = ("split the model over more ranks (parallel.tp, parallel.pp), recompute activations "
              "(parallel.recompute=full), lower train.micro_batch_size, or let +cfp=auto find a layout that fits; "
              "else ")
"""What to change first when a layout given by hand does not fit."""


def ranks(n: int) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} rank{'s' if n != 1 else ''}"


def ranks_per_node(cluster: ClusterSpec, world: int) -> int:
    """Ranks on each node: ``cluster.gpus_per_node``, else the world spread over ``cluster.nodes``."""
    return cluster.gpus_per_node or max(world // max(cluster.nodes, 1), 1)


def memory_source(given: ClusterSpec, filled: ClusterSpec, world: int) -> str:
    """Where the per-rank memory ``filled.hbm_gib`` of the configured cluster ``given`` came from, in words."""
    if given.hbm_gib is not None:
        return f"cluster.hbm_gib={given.hbm_gib:g} of cluster={given.name}"
    if not filled.on_cpu:
        return f"the memory of this machine's {filled.device_name}"
    per_node = ranks_per_node(given, world)
    return (f"this host's {host_memory_gib():.1f} GiB less cluster.host_reserve_gib={given.host_reserve_gib or 0:g} "
            f"for the OS, shared by {ranks(per_node)} per node, less cluster.rank_reserve_gib="
            f"{given.rank_reserve_gib or 0:g} each")


def memory_issue(given: ClusterSpec, filled: ClusterSpec, world: int, *, what: str, need_gib: float,
                 limit_gib: float, headroom: float | None, fix: str = MEMORY_FIX) -> ConfigIssue:
    """The issue of ``what`` (the words before the memory a layout, or the smallest layout, needs) needing
    ``need_gib`` per rank where ``limit_gib`` is allowed (``filled.hbm_gib`` less ``headroom``); named by
    ``cluster.hbm_gib`` where the user set it, else by the cluster preset."""
    kept = "" if headroom is None else f", {gib(limit_gib)} within cfp.constraints.memory_headroom={headroom:g}"
    key, value = ("cluster.hbm_gib", given.hbm_gib) if given.hbm_gib is not None else ("cluster", given.name)
    return ConfigIssue(
        key=key, value=value,
        problem=f"{what} {gib(need_gib)} per rank by the simulator's memory model, and each rank has "
                f"{gib(filled.hbm_gib or 0.0)} ({memory_source(given, filled, world)}){kept}.",
        fix=fix)


def gib(value: float) -> str:
    """``value`` GiB with the digits that matter: ``5,801 GiB``, ``9.69 GiB``, ``0.0009 GiB``."""
    text = f"{value:,.0f}" if value >= 100 else f"{value:.2f}" if value >= 1 else f"{value:.2g}"
    return f"{text} GiB"


def check_search_fits(job: JobSpec, world: int, cfp: CfpSpec, *, given: ClusterSpec,
                      measurements: Measurements | None, te_available: bool,
                      options: SimOptions | None, top_k: int = 1) -> SearchResult:
    """Search ``job``'s ``top_k`` best layouts (its cluster filled with this machine's figures; ``given``: the
    cluster as configured) and return the result (a launch reuses it) where one fits. Else one
    :class:`ConfigError` of the cause: the pins and sets that leave no layout
    (:func:`~cfp_megatron.search.space.no_layout_issues`); the memory where layouts exist but none fits, naming the
    pins and sets (``cfp.tp=1``) where a layout without them would fit, else the memory the smallest layout needs
    and the memory there is; otherwise what refused every layout (:attr:`SearchResult.best`'s reasons)."""
    def run(settings: CfpSpec) -> SearchResult:
        return search(job, world, dataclasses.replace(settings, top_k=top_k), measurements=measurements,
                      options=options, te_available=te_available, partitions=partition_options(job))

    result = run(cfp)
    if result.ranked:
        return result
    issues = no_layout_issues(job, world, cfp, te_available=te_available, partitions=partition_options(job))
    if issues:
        raise ConfigError(issues)
    if result.least_over_gib is None or result.memory_limit_gib is None:
        result.best  # noqa: B018 - raises the ConfigError naming what refused every layout
    headroom = cfp.constraints.memory_headroom
    pinned = [name for name in KNOBS if cfp.allowed(name) is not None]
    if pinned and (free := run(only_knob(cfp, None))).ranked:
        settings = dict(knob_setting(cfp, name) for name in pinned)
        said = ", ".join(f"{k}={_plain(v)}" for k, v in settings.items())
        best = free.ranked[0]
        raise ConfigError(ConfigIssue(
            key=next(iter(settings)), value=next(iter(settings.values())),
            problem=f"no layout of {job.model.name} on {ranks(world)} with {said} fits in memory: the smallest of "
                    f"the {result.over_memory:,} checked needs at least {gib(result.least_over_gib)} per rank, over "
                    f"the {gib(result.memory_limit_gib)} each rank may use ({memory_source(given, job.cluster, world)}"
                    f", within cfp.constraints.memory_headroom={headroom:g}); without "
                    f"{'them' if len(settings) > 1 else 'it'}, {best.candidate.describe(world)} fits "
                    f"({gib(best.prediction.memory.total / GIB)}).",
            fix=f"drop or widen {', '.join(settings)}, or " + MEMORY_FIX))
    what = (f"no layout of {job.model.name} on {ranks(world)} fits in memory: the smallest of the "
            f"{result.over_memory:,} checked needs at least")
    issue = memory_issue(given, job.cluster, world, what=what, need_gib=result.least_over_gib,
                         limit_gib=result.memory_limit_gib, headroom=headroom)
    if measurements is None:  # a preflight on a preset: plan the sizes and sequences that would fit
        fits, fix = what_fits(job, world, cfp)
        if fits:
            issue = dataclasses.replace(issue, problem=f"{issue.problem} {fits}",
                                        fix=f"{fix}; else {issue.fix}" if fix else issue.fix)
    raise ConfigError(issue)


def what_fits(job: JobSpec, world: int, cfp: CfpSpec) -> tuple[str, str]:
    """Where no layout of ``job`` on ``world`` ranks of its preset fits in memory: the fewest nodes of it at which
    a plan exists and, at ``world`` ranks, the longest ``train.seq_length`` (halved up to three times) at which one
    does, each planned (:mod:`cfp_megatron.planner.sizing`), as a sentence and the fix; empty where neither is
    found (or the cluster does not state its GPUs per node)."""
    gpn = job.cluster.gpus_per_node
    if not gpn or world != job.cluster.nodes * gpn:
        return "", ""
    settings = dataclasses.replace(cfp, top_k=1)
    said, fixes = [], []
    planner = Planner(job=job, cfp=settings)
    nodes = smallest_fitting(planner, job.cluster.nodes)
    if nodes is not None:
        best = planner.search(nodes).best
        said.append(f"The fewest nodes of cluster={job.cluster.name} on which one fits: cluster.nodes={nodes} "
                    f"({ranks(nodes * gpn)}): {best.candidate.describe(nodes * gpn)}, "
                    f"{gib(best.prediction.memory.total / GIB)} per rank.")
        fixes.append(f"size the cluster to cluster.nodes={nodes} or more")
    else:
        said.append(f"None fits on up to {growth_limit(job.cluster.nodes, gpn):,} nodes of cluster={job.cluster.name} "
                    f"either ({GROWTH} times as many, the most tried).")
    seq = job.train.seq_length
    for _ in range(3):
        seq //= 2
        if seq < 256 or seq % max(job.parallel.cp, 1):
            break
        shorter = dataclasses.replace(job, train=dataclasses.replace(job.train, seq_length=seq))
        found = Planner(job=resized(shorter, job.cluster.nodes), cfp=settings).search(job.cluster.nodes)
        if found.ranked:
            best = found.best
            said.append(f"On these {ranks(world)}, train.seq_length={seq} (of {job.train.seq_length}) fits: "
                        f"{best.candidate.describe(world)}, {gib(best.prediction.memory.total / GIB)} per rank.")
            fixes.append(f"train shorter sequences (train.seq_length={seq})")
            break
    return " ".join(said), ", or ".join(fixes)


def _plain(value: object) -> str:
    """A pin's or set's value as typed: ``1``, ``[2,4]``, ``full``."""
    if isinstance(value, list):
        return "[" + ",".join(_plain(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def check_launch_fits(job: JobSpec, world: int, cfp: CfpSpec, *, top_k: int = 1,
                      figures: tuple[ClusterSpec, Measurements | None] | None = None) -> SearchResult:
    """Before profiling (``+cfp=auto``): :func:`check_search_fits` on this machine's ``figures`` (its cluster and
    stored profile, else the analytical model: :func:`~cfp_megatron.profile.cluster.local_measurements`), as the
    search after profiling will see them; the search's ``top_k`` best, for the launch to reuse."""
    cluster, measurements = figures or local_measurements(job, world_size=world)
    return check_search_fits(dataclasses.replace(job, cluster=cluster), world, cfp, given=job.cluster,
                             measurements=measurements, te_available=transformer_engine_available(),
                             options=options_here(cluster), top_k=top_k)


def check_no_plan(job: JobSpec, world: int, cfp: CfpSpec, *, given: ClusterSpec, measurements: Measurements | None,
                  te_available: bool, options: SimOptions | None) -> None:
    """Where a search found no plan: raise the :class:`ConfigError` of its cause (:func:`check_search_fits`: the pins
    and sets, the memory, or what refused every layout)."""
    check_search_fits(job, world, cfp, given=given, measurements=measurements, te_available=te_available,
                      options=options)


def check_layout_fits(job: JobSpec, world: int) -> None:
    """Before any process group, for a layout not chosen by this machine's search (``parallel.*`` by hand, a plan
    file or string): a :class:`ConfigError` when its predicted peak exceeds each rank's memory (no headroom: the
    user chose it)."""
    cluster, _ = local_measurements(job, world_size=world)
    if cluster.hbm_gib is None:
        return
    planned = dataclasses.replace(job, cluster=cluster)
    try:
        need = predict_memory(planned, cluster, world_size=world).total / GIB
    except ConfigError:  # a layout the memory model does not price; the layout checks have passed it
        return
    if need > cluster.hbm_gib:
        raise ConfigError(memory_issue(job.cluster, cluster, world, need_gib=need, limit_gib=cluster.hbm_gib,
                                       what=f"the layout {_layout(job)} of {job.model.name} on {ranks(world)} "
                                       "needs", headroom=None, fix=LAYOUT_FIX + MEMORY_FIX))


def _layout(job: JobSpec) -> str:
    p = job.parallel
    parts = [f"tp={p.tp}", f"pp={p.pp}", f"cp={p.cp}"] + ([f"ep={p.ep}"] if p.ep > 1 else [])
    return " ".join(parts + [f"micro_batch={job.train.micro_batch_size}", f"recompute={p.recompute.value}"])


def check_training_machine(job: JobSpec, world: int = 1) -> None:
    """A :class:`ConfigError` for training on a machine the cluster settings do not describe: a GPU cluster preset
    (``cluster=dgx_h100``), or GPU settings on the CPU one (``cluster.device_name=H100``,
    ``cluster.generation=hopper``), on a machine without a GPU (the plan, its memory limit and the MFU would be the
    GPU's, not this machine's); a ``cluster.hbm_gib`` on the ``local`` cluster (this machine, ``world`` ranks) above
    what each rank has here (the memory checks would pass a job the machine cannot hold, which would die in the
    allocator). ``cluster.backend=nccl`` where NCCL cannot run is refused as the process group starts
    (:func:`~cfp_megatron.engine.distributed.resolve_backend`). Planning for another machine offline
    (``python -m cfp_megatron.plan``) stays allowed."""
    import torch

    c = job.cluster
    if c.on_cpu and c.hbm_gib is not None:
        here = this_device(dataclasses.replace(c, hbm_gib=None), ranks_per_node=ranks_per_node(c, world))
        if here.hbm_gib is not None and c.hbm_gib > here.hbm_gib:
            raise ConfigError(ConfigIssue(
                key="cluster.hbm_gib", value=c.hbm_gib,
                problem=f"is more memory than each rank has on this machine, {gib(here.hbm_gib)} "
                        f"({memory_source(dataclasses.replace(c, hbm_gib=None), here, world)}): cluster={c.name} "
                        "trains here, and the memory checks would pass a job this machine cannot hold (it would die "
                        "in the allocator).",
                fix=f"drop cluster.hbm_gib (cluster={c.name} measures this machine) or set it at most "
                    f"{here.hbm_gib:.2f}; plan for a larger machine offline with python -m cfp_megatron.plan "
                    "cluster.hbm_gib=..."))
    on_gpu = torch.cuda.is_available()
    issues: list[ConfigIssue] = []
    preset = dict(group_presets("cluster")).get(c.name, {})
    cpu_preset = str(preset.get("device_name", "")).strip().lower() == "cpu"
    if not on_gpu and not c.on_cpu:
        key, value = ("cluster.device_name", c.device_name) if cpu_preset else ("cluster", c.name)
        fix = (f"drop cluster.device_name={c.device_name}: cluster={c.name} trains on this machine's cores (measured)"
               if cpu_preset else f"train here with cluster=local (this machine's cores and memory, measured); plan "
               f"for {c.name} offline with python -m cfp_megatron.plan cluster={c.name} ...; train with "
               f"cluster={c.name} on its GPUs")
        issues.append(ConfigIssue(key=key, value=value, problem=f"names {c.device_name} GPUs, and this machine has "
                                  "none (torch.cuda.is_available() is false): a training run here would be planned "
                                  "against that GPU's memory and report MFU against its peak.", fix=f"{fix}."))
    elif not on_gpu and cpu_preset and c.generation not in (None, preset.get("generation")):
        issues.append(ConfigIssue(key="cluster.generation", value=c.generation, problem=f"names a GPU generation, and "
                                  f"cluster={c.name} trains on this machine's CPU cores: it would not be used (the "
                                  "peak is measured here), or would plan for features the cores do not have.",
                                  fix=f"drop cluster.generation={c.generation}; plan for such GPUs offline with "
                                      "python -m cfp_megatron.plan cluster=<their preset>."))
    if issues:
        raise ConfigError(issues)
