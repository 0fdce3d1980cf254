"""Sizing a cluster before buying it: one model and token budget planned on each candidate cluster (kinds x node
counts) by the preflight's search, with the time to train, GPU-hours, energy and price of each, the smallest of each
kind that meets a deadline, the Pareto front of time against GPU-hours, and, for a model that fits nowhere in the
range, the smallest size that would (docs/sizing.md)."""

from __future__ import annotations

import dataclasses
import gc
import math
import multiprocessing
import multiprocessing.context
import multiprocessing.queues
import queue
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import MAX_WORLD_SIZE, JobSpec
from cfp_megatron.base.errors import CfpError, ConfigError, ConfigIssue
from cfp_megatron.model.derive import partition_options
from cfp_megatron.model.options import PartitionOption
from cfp_megatron.planner.job_checks import world_issues
from cfp_megatron.search.search import SearchResult, search
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache
from cfp_megatron.sim.prediction import GIB
from cfp_megatron.sim.uncertainty import error_band

SWEPT = ("cluster", "cluster.nodes")
"""The keys a sizing sweeps: a list (``[a,b]``), a choice (``a,b``) or a range (``range(4,64,4)``, Python's: the stop
is left out) of each."""

MAX_CANDIDATES = 400
"""Most candidate clusters (kinds x node counts) one sizing plans: each is a search of about a second."""

TOKENS_KEY = "train.tokens"
"""The token budget's key (``train.tokens=15T``, ``=1.5e13``): read by the sizing, not a training setting."""

_SUFFIX = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}
"""Multipliers of a count's suffix (``15T`` tokens)."""

DAY_S = 86400.0
"""Seconds in a day."""

_DURATION = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY_S, "w": 7 * DAY_S}
"""Seconds of a duration's unit (``30d``, ``720h``)."""


@dataclass(frozen=True, kw_only=True)
class SizingRequest:
    """What to size: the model's job, the candidate clusters, the budget and the deadline."""

    overrides: tuple[str, ...]
    """The Hydra overrides every candidate shares (the swept keys and the token budget taken out)."""
    clusters: tuple[str, ...]
    """Cluster presets (``conf/cluster/``) to try."""
    nodes: tuple[int, ...]
    """Node counts to try on each, increasing."""
    tokens: float
    """Training tokens to plan the time for."""


def _values(override: str) -> tuple[str, list[str]]:
    """The key of ``override`` and its values as text: one, or those of a list, choice or range."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import RangeSweep
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_override(override)
    except HydraException as err:
        raise ConfigError(ConfigIssue(key=override.split("=", 1)[0], value=override.split("=", 1)[-1],
                                      problem=f"is not an override Hydra reads: {str(err).splitlines()[0]}.",
                                      fix="write key=value, key=[a,b], key=a,b or key=range(start,stop,step)."),
                          ) from None
    key = parsed.key_or_group
    if parsed.is_sweep_override():
        value = parsed.value()
        if isinstance(value, RangeSweep):  # counted before it is listed: range(1,10**9) or a step of 0 never ends
            step = value.step or 0
            size = max(math.ceil((value.stop - value.start) / step), 0) if step else 0
            if not 1 <= size <= MAX_CANDIDATES:
                raise ConfigError(ConfigIssue(key=key, value=override.split("=", 1)[-1], problem=f"gives {size:,} "
                                              f"values; a sizing plans 1 to {MAX_CANDIDATES} candidates.",
                                              fix="give a range with a positive step and fewer values, e.g. "
                                                  f"{key}=range(4,68,4) (4 to 64)."))
        return key, list(parsed.sweep_string_iterator())
    value = parsed.value()
    return key, [str(v) for v in value] if isinstance(value, list) else [str(value)]


def count(key: str, text: str) -> float:
    """A positive count such as ``15T``, ``1.5e13`` or ``2_000_000`` (suffixes k, M, B or G, T, P)."""
    found = re.fullmatch(r"\s*([0-9][0-9_]*(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)\s*([kmbgtp]?)\s*", text, re.IGNORECASE)
    value = float(found.group(1).replace("_", "")) * _SUFFIX.get(found.group(2).lower(), 1.0) if found else math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(ConfigIssue(key=key, value=text, problem="is not a positive count.",
                                      fix=f"write it as a number with an optional suffix, e.g. {key}=15T "
                                          "(15 trillion) or 1.5e13."))
    return value


def duration_s(key: str, text: str) -> float:
    """A positive duration such as ``30d``, ``720h``, ``6w`` or ``3600`` (seconds) in seconds."""
    found = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([smhdw]?)\s*", text, re.IGNORECASE)
    value = float(found.group(1)) * _DURATION[found.group(2).lower() or "s"] if found else math.nan
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(ConfigIssue(key=key, value=text, problem="is not a positive duration.",
                                      fix=f"write a number and a unit (s, m, h, d, w), e.g. {key} 30d."))
    return value


def sizing_request(overrides: Sequence[str]) -> SizingRequest:
    """The request of a command line's overrides: :data:`SWEPT` keys as lists, choices or ranges, the token budget
    (:data:`TOKENS_KEY`), the rest shared by every candidate. A sweep of any other key is refused (one model and
    job, several clusters)."""
    shared: list[str] = []
    swept: dict[str, list[str]] = {}
    tokens: float | None = None
    for override in overrides:
        key, values = _values(override)
        bare = key.lstrip("+~")
        if bare == TOKENS_KEY:
            if len(values) != 1:
                raise ConfigError(ConfigIssue(key=TOKENS_KEY, value=override.split("=", 1)[-1], problem="is one "
                                              "budget, not a sweep.", fix=f"give one, e.g. {TOKENS_KEY}=15T."))
            tokens = count(TOKENS_KEY, values[0])
        elif bare in SWEPT:
            swept[bare] = values
        elif len(values) > 1 and "=[" not in override:  # a list value (cfp.constraints.pp=[1,2]) is a value
            raise ConfigError(ConfigIssue(key=key, value=override.split("=", 1)[-1], problem="is a sweep: a sizing "
                                          "plans one job on several clusters, and sweeps cluster and cluster.nodes "
                                          "only.", fix=f"give one value of {key}, and run cfp size once per value."))
        else:
            shared.append(override)
    if tokens is None:
        raise ConfigError(ConfigIssue(key=TOKENS_KEY, value=None, problem="is not given: the sizing needs the "
                                      "tokens to train to say how long each cluster takes.",
                                      fix=f"add {TOKENS_KEY}=N, e.g. {TOKENS_KEY}=15T."))
    clusters = tuple(dict.fromkeys(swept.get("cluster", [])))
    if not clusters:
        raise ConfigError(ConfigIssue(key="cluster", value=None, problem="is not given: the sizing needs the kinds "
                                      "of cluster to compare.", fix="add cluster=<preset> or cluster=[a,b] "
                                      "(cfp --help lists the presets)."))
    nodes = []
    for text in swept.get("cluster.nodes", ["1"]):
        value = float(text) if re.fullmatch(r"-?[0-9]+(\.[0-9]*)?", text) else math.nan
        if not value.is_integer() or value < 1:
            raise ConfigError(ConfigIssue(key="cluster.nodes", value=text, problem="is not a whole number of nodes "
                                          "of at least 1.", fix="give node counts such as cluster.nodes=[4,8,16] or "
                                          "cluster.nodes=range(4,68,4)."))
        nodes.append(int(value))
    nodes = sorted(set(nodes))
    if len(clusters) * len(nodes) > MAX_CANDIDATES:
        raise ConfigError(ConfigIssue(key="cluster.nodes", value=len(nodes), problem=f"node counts on {len(clusters)} "
                                      f"kind(s) make {len(clusters) * len(nodes):,} candidates; a sizing plans at "
                                      f"most {MAX_CANDIDATES}.", fix="give fewer node counts (a coarser range) or "
                                      "kinds, and size again around the best."))
    return SizingRequest(overrides=tuple(shared), clusters=clusters, nodes=tuple(nodes), tokens=tokens)


@dataclass(frozen=True, kw_only=True)
class Sized:
    """One candidate cluster planned for the budget."""

    cluster: str
    """Its preset."""
    device: str
    """Its GPU."""
    nodes: int
    """Nodes."""
    gpus: int
    """GPUs (ranks)."""
    tokens: float
    """Tokens to train."""
    tokens_per_step: int
    """Tokens per optimizer step (global batch x sequence)."""
    plan: str | None = None
    """The chosen layout (``dp8 tp8 sp pp2 ...``); ``None`` where none fits."""
    step_time_s: float | None = None
    """Its predicted step time."""
    peak_gib: float | None = None
    """Its predicted peak memory per GPU."""
    band_pct: float | None = None
    """The prediction's error band (percent, ``sim/error_bands.json``); ``None`` where none is stored."""
    board_w: float | None = None
    """Board power per GPU (``cluster.power_limit_w``, else ``cluster.tdp_w``, the datasheet's)."""
    price_per_gpu_hour: float | None = None
    """Price of one GPU-hour, where given."""
    why_not: str | None = None
    """Why no plan fits (the first cause)."""

    @property
    def steps(self) -> int:
        """Optimizer steps to train :attr:`tokens`."""
        return math.ceil(self.tokens / self.tokens_per_step)

    @property
    def time_s(self) -> float | None:
        """Predicted time to train."""
        return None if self.step_time_s is None else self.steps * self.step_time_s

    @property
    def gpu_hours(self) -> float | None:
        """GPUs x hours of training."""
        return None if self.time_s is None else self.time_s * self.gpus / 3600.0

    @property
    def energy_mwh(self) -> float | None:
        """The GPUs' board energy (MWh): GPU-hours at board power (no host, network or cooling)."""
        return None if self.gpu_hours is None or self.board_w is None else self.gpu_hours * self.board_w / 1e6

    @property
    def cost(self) -> float | None:
        """GPU-hours at :attr:`price_per_gpu_hour`."""
        hours = self.gpu_hours
        return None if hours is None or self.price_per_gpu_hour is None else hours * self.price_per_gpu_hour

    def banded(self, value: float | None) -> tuple[float, float] | None:
        """``value`` (one that scales with the step time) at the low and high end of the band."""
        if value is None or self.band_pct is None:
            return None
        return value * (1 - self.band_pct / 100), value * (1 + self.band_pct / 100)


def board_power_w(job: JobSpec) -> float | None:
    """A GPU's board power: the cap ``cluster.power_limit_w`` where set, else the datasheet's ``cluster.tdp_w``."""
    c = job.cluster
    return c.power_limit_w if c.power_limit_w is not None else c.tdp_w


def resized(job: JobSpec, nodes: int) -> JobSpec:
    """``job`` on ``nodes`` nodes of its cluster."""
    return dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, nodes=nodes))


def world_of(job: JobSpec) -> int:
    """Ranks of ``job``'s cluster (nodes x GPUs per node)."""
    return job.cluster.nodes * (job.cluster.gpus_per_node or 1)


@dataclass(kw_only=True)
class Planner:
    """Searches of one model on one kind of cluster at several node counts, sharing their pass costs."""

    job: JobSpec
    """The job on one node count of the cluster (any: each search resizes it)."""
    cfp: CfpSpec
    """The planner's settings."""
    cache: CostCache | None = None
    """The pass costs the searches share (made by the first)."""
    results: dict[int, SearchResult] = dataclasses.field(default_factory=dict)
    """Each node count's search, kept (a size asked again is not searched again)."""
    partitions: tuple[PartitionOption, ...] | None = None
    """The model's partition options as the preflight reads them (:meth:`options`), once."""

    def options(self) -> tuple[PartitionOption, ...]:
        """The model's derived partition options (:func:`~cfp_megatron.model.derive.partition_options`, cached by
        model key), read once per planner."""
        if self.partitions is None:
            self.partitions = partition_options(self.job)
        return self.partitions

    def issues(self, nodes: int) -> list[ConfigIssue]:
        """What refuses ``nodes`` nodes whatever the layout."""
        job = resized(self.job, nodes)
        return world_issues(job, world_of(job))

    def search(self, nodes: int) -> SearchResult:
        """The search on ``nodes`` nodes (once per count)."""
        if nodes not in self.results:
            job = resized(self.job, nodes)
            if self.cache is None:
                self.cache = CostCache.for_job(job, None, SimOptions())
            self.results[nodes] = search(job, world_of(job), self.cfp, cache=self.cache, partitions=self.options())
        return self.results[nodes]

    def fits(self, nodes: int) -> bool:
        """Whether a plan exists on ``nodes`` nodes."""
        return not self.issues(nodes) and bool(self.search(nodes).ranked)


def no_plan_reason(result: SearchResult) -> str:
    """Why a search found no plan, in one line: the memory the lightest layout needs, else the first reason."""
    if result.least_over_gib is not None and result.memory_limit_gib is not None:
        return (f"the lightest of {result.over_memory:,} layouts needs at least {result.least_over_gib:,.1f} GiB per "
                f"GPU, over the {result.memory_limit_gib:,.1f} GiB allowed")
    reasons = sorted(result.rejected, key=lambda r: r.count == 0)  # families that held plans first
    return f"{reasons[0].what}: {reasons[0].reason}" if reasons else "no layout is left"


GROWTH = 64
"""How many times the nodes tried :func:`smallest_fitting` looks beyond (six doublings): a model that fits on none
of them is said to, not searched on ever larger clusters."""


def growth_limit(nodes: int, gpus_per_node: int) -> int:
    """The most nodes :func:`smallest_fitting` tries above ``nodes``: :data:`GROWTH` times as many, within
    :data:`~cfp_megatron.base.config.MAX_WORLD_SIZE` GPUs."""
    return max(min(nodes * GROWTH, MAX_WORLD_SIZE // max(gpus_per_node, 1)), nodes)


class Sizes(Protocol):
    """Searches of one job at several node counts of its cluster (:class:`Planner`, or another backend's)."""

    job: JobSpec
    """The job on one node count of the cluster."""

    def fits(self, nodes: int) -> bool:
        """Whether a plan exists on ``nodes`` nodes."""
        ...


def smallest_fitting(planner: Sizes, above: int, *, limit_nodes: int | None = None) -> int | None:
    """The fewest nodes above ``above`` at which ``planner`` finds a plan: node counts doubled from ``above`` until
    one fits, then the gap to the last that did not bisected; ``None`` where none fits up to ``limit_nodes``
    (default: :func:`growth_limit`). Fitting need not be monotone in the node count (the batch must divide over data
    parallelism): the answer is the smallest of those tried, each planned."""
    gpn = planner.job.cluster.gpus_per_node or 1
    top = limit_nodes or growth_limit(above, gpn)
    low, high = above, None
    nodes = above
    while nodes < top:
        nodes = min(nodes * 2, top)
        if planner.fits(nodes):
            high = nodes
            break
        low = nodes
    if high is None:
        return None
    while high - low > 1:
        mid = (low + high) // 2
        if planner.fits(mid):
            high = mid
        else:
            low = mid
    return high


def size_one(planner: Planner, nodes: int, *, tokens: float, price: float | None) -> Sized:
    """``nodes`` nodes of the planner's cluster planned for ``tokens``."""
    job = resized(planner.job, nodes)
    t = job.train
    row = Sized(cluster=job.cluster.name, device=job.cluster.device_name, nodes=nodes, gpus=world_of(job),
                tokens=tokens, tokens_per_step=t.global_batch_size * t.seq_length, board_w=board_power_w(job),
                price_per_gpu_hour=price)
    issues = planner.issues(nodes)
    if issues:
        return dataclasses.replace(row, why_not=issues[0].problem)
    result = planner.search(nodes)
    if not result.ranked:
        return dataclasses.replace(row, why_not=no_plan_reason(result))
    best = result.best
    band = error_band(best.job)
    return dataclasses.replace(row, plan=best.candidate.describe(row.gpus), step_time_s=best.prediction.step_time_s,
                               peak_gib=best.prediction.memory.total / GIB,
                               band_pct=None if band is None else band.pct)


def size_all(planners: Sequence[Planner], nodes: Sequence[int], *, tokens: float,
             price_of: Callable[[str], float | None] = lambda _: None, jobs: int = 1,
             meanwhile: Callable[[], object] | None = None) -> list[Sized]:
    """Every planner's cluster at every node count in ``nodes``, in order; ``jobs`` forked processes where more than
    one (:class:`_Shares`: each stays on one kind while it has sizes left, so its copy of that kind's shared costs
    serves). ``meanwhile`` runs in this process while they plan (after they start). The rows are the same whatever
    ``jobs`` (each search is deterministic)."""
    tasks = [(i, n) for i in range(len(planners)) for n in nodes]
    if jobs <= 1 or len(tasks) < 2 or "fork" not in multiprocessing.get_all_start_methods():
        rows = [_size_task(t, planners, tokens, price_of) for t in tasks]
        if meanwhile is not None:
            meanwhile()
        return rows
    for planner in planners:  # read before the fork: the workers share them
        planner.options()
    gc.freeze()  # what the workers inherit is never traversed by their collector (nor copied for it)
    ctx = multiprocessing.get_context("fork")
    shares = _Shares(ctx, len(planners), len(nodes))
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker, args=(shares, results, planners, nodes, tokens, price_of), daemon=True)
               for _ in range(min(jobs, len(tasks)))]
    for w in workers:
        w.start()
    try:
        if meanwhile is not None:
            meanwhile()
        rows: dict[int, Sized] = {}
        while len(rows) < len(tasks):
            try:
                index, row = results.get(timeout=1.0)
            except queue.Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead:
                    raise CfpError(f"a sizing worker process ended with exit status {dead[0]} before its sizes were "
                                   "planned (out of memory?); run cfp size again with --jobs 1") from None
                continue
            if isinstance(row, BaseException):
                raise row
            rows[index] = row
        return [rows[i] for i in range(len(tasks))]
    finally:
        for w in workers:
            if w.is_alive():
                w.terminate()
            w.join()
        gc.unfreeze()


class _Shares:
    """The sizes left of each kind, shared by :func:`size_all`'s workers: a worker takes the next size of the kind it
    is on while any is left, else moves to the kind with the fewest workers on it and the most sizes left (each
    kind's caches warmed in as few workers as the balance allows)."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, kinds: int, sizes: int) -> None:
        self.lock = ctx.Lock()
        self.taken = ctx.Array("i", kinds, lock=False)
        """Sizes of each kind handed out."""
        self.on = ctx.Array("i", kinds, lock=False)
        """Workers on each kind."""
        self.sizes = sizes

    def take(self, kind: int | None) -> tuple[int, int] | None:
        """The next (kind, size index) for a worker on ``kind`` (``None``: none yet); ``None`` when all are taken."""
        with self.lock:
            if kind is None or self.taken[kind] >= self.sizes:
                if kind is not None:
                    self.on[kind] -= 1
                left = [k for k in range(len(self.taken)) if self.taken[k] < self.sizes]
                if not left:
                    return None
                kind = min(left, key=lambda k: (self.on[k], self.taken[k] - self.sizes, k))
                self.on[kind] += 1
            self.taken[kind] += 1
            return kind, self.taken[kind] - 1


def _worker(shares: _Shares, results: multiprocessing.queues.Queue, planners: Sequence[Planner],
            nodes: Sequence[int], tokens: float, price_of: Callable[[str], float | None]) -> None:
    kind = None
    while (task := shares.take(kind)) is not None:
        kind, index = task
        try:
            row: Sized | BaseException = _size_task((kind, nodes[index]), planners, tokens, price_of)
        except BaseException as err:  # noqa: BLE001 - handed to the parent, which raises it
            row = err
        results.put((kind * len(nodes) + index, row))
        if isinstance(row, BaseException):
            return


def _size_task(task: tuple[int, int], planners: Sequence[Planner], tokens: float,
               price_of: Callable[[str], float | None]) -> Sized:
    planner = planners[task[0]]
    return size_one(planner, task[1], tokens=tokens, price=price_of(planner.job.cluster.name))


def smallest_meeting(rows: Sequence[Sized], deadline_s: float) -> dict[str, Sized | None]:
    """Per cluster kind (in the rows' order), the row of the fewest GPUs whose predicted time to train is within
    ``deadline_s``; ``None`` where none is."""
    out: dict[str, Sized | None] = {}
    for row in rows:
        out.setdefault(row.cluster, None)
        meets = row.time_s is not None and row.time_s <= deadline_s
        best = out[row.cluster]
        if meets and (best is None or row.gpus < best.gpus):
            out[row.cluster] = row
    return out


def pareto_front(rows: Sequence[Sized]) -> list[Sized]:
    """The rows with a plan that no other beats on both time to train and GPU-hours (lower is better; one at least
    as good on both and better on one beats it), fastest first."""
    planned = [r for r in rows if r.time_s is not None]
    front = [r for r in planned if not any(
        o.time_s <= r.time_s and o.gpu_hours <= r.gpu_hours and (o.time_s < r.time_s or o.gpu_hours < r.gpu_hours)
        for o in planned)]
    return sorted(front, key=lambda r: (r.time_s, r.gpu_hours))


@dataclass(frozen=True, kw_only=True)
class Beyond:
    """Where a cluster kind fits nowhere in the range: the smallest size that would, and why."""

    cluster: str
    """The preset."""
    largest: Sized
    """The range's largest candidate (with why no plan fits there)."""
    nodes: int | None
    """The fewest nodes at which a plan fits (:func:`smallest_fitting`); ``None``: none up to the largest clusters."""
    fitting: Sized | None
    """That size planned."""
    states_gib: tuple[float, float, float] | None
    """Its plan's weights, gradients and optimizer states per GPU (GiB) on its most loaded rank."""
    memory_bound: bool = True
    """Whether memory is what leaves the range without a plan (else more nodes were not tried)."""

    def line(self) -> str:
        """One sentence for a person."""
        head = (f"{self.cluster}: no plan on {self.largest.gpus:,} GPUs ({self.largest.nodes} nodes), the most "
                f"tried: {self.largest.why_not}")
        if not self.memory_bound:
            return head + "; not the memory, so a larger cluster would not help"
        if self.nodes is None or self.fitting is None:
            top = growth_limit(self.largest.nodes, self.largest.gpus // self.largest.nodes)
            return head + f"; none up to {top:,} nodes either ({GROWTH} times as many, the most tried)"
        w, g, o = self.states_gib or (0.0, 0.0, 0.0)
        return (f"{head}; the smallest that fits is {self.fitting.nodes} nodes ({self.fitting.gpus:,} GPUs): "
                f"{self.fitting.plan}, {self.fitting.peak_gib:.1f} GiB per GPU, of which its states alone "
                f"{w + g + o:.1f} GiB (weights {w:.1f}, gradients {g:.1f}, optimizer {o:.1f})")


def beyond_range(planner: Planner, rows: Sequence[Sized], *, tokens: float, price: float | None) -> Beyond | None:
    """For a cluster kind none of whose ``rows`` has a plan, the smallest size above the range that has one
    (``None`` where one of the rows has a plan)."""
    own = [r for r in rows if r.cluster == planner.job.cluster.name]
    if not own or any(r.plan is not None for r in own):
        return None
    largest = max(own, key=lambda r: r.nodes)
    if planner.issues(largest.nodes) or planner.search(largest.nodes).least_over_gib is None:
        return Beyond(cluster=largest.cluster, largest=largest, nodes=None, fitting=None, states_gib=None,
                      memory_bound=False)  # not the memory: more nodes would not make a plan
    nodes = smallest_fitting(planner, largest.nodes)
    if nodes is None:
        return Beyond(cluster=largest.cluster, largest=largest, nodes=None, fitting=None, states_gib=None)
    fitting = size_one(planner, nodes, tokens=tokens, price=price)
    memory = planner.search(nodes).best.prediction.memory
    states = (memory.parameters / GIB, memory.gradients / GIB, memory.optimizer_states / GIB)
    return Beyond(cluster=largest.cluster, largest=largest, nodes=nodes, fitting=fitting, states_gib=states)
