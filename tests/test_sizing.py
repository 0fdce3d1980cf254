"""``cfp size``: the candidate lists and ranges, the table's rows (time, GPU-hours, energy, price, band), the smallest
cluster of each kind within a deadline, the Pareto front, the smallest size beyond a range that fits nowhere (and
the preflight's no-fit error naming it), each size named planned again and checked; searches of one cluster kind
sharing their pass costs find what separate searches find."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from cfp_megatron import cli
from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.planner.memory_fit import check_no_plan
from cfp_megatron.planner.size_cli import deadline_lines, prices, table
from cfp_megatron.planner.sizing import (
    Planner,
    Sized,
    beyond_range,
    count,
    duration_s,
    pareto_front,
    resized,
    size_all,
    sizing_request,
    smallest_meeting,
)
from cfp_megatron.search.search import SearchResult, no_plan_fix, search
from cfp_megatron.search.space import Rejection
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache

# A small Llama-3 8B (4 layers) on H100 nodes whose GPUs have 3 GiB: no plan on one node, plans on two and more.
TIGHT = ["+cfp=auto", "model=llama3_8b", "model.num_layers=4", "cluster=dgx_h100", "cluster.hbm_gib=3",
         "train.global_batch_size=16", "train.seq_length=1024", "cfp.top_k=1"]


def _planner(overrides: list[str], nodes: int = 1) -> Planner:
    cfg = compose_config([*overrides, f"cluster.nodes={nodes}"])
    return Planner(job=job_from_config(cfg), cfp=cfp_from_config(cfg))


@pytest.fixture(scope="module")
def tight() -> Planner:
    """One planner of :data:`TIGHT` for the module (its searches are kept per node count)."""
    return _planner(TIGHT)


def test_lists_choices_and_ranges_of_clusters_and_nodes() -> None:
    r = sizing_request(["model=llama3_70b", "train.tokens=15T", "cluster=[dgx_h100,gb200_nvl72]",
                        "cluster.nodes=range(4,20,4)", "cfp.constraints.pp=[1,2]"])
    assert r.clusters == ("dgx_h100", "gb200_nvl72")
    assert r.nodes == (4, 8, 12, 16)  # Python's range: the stop left out
    assert r.tokens == 15e12
    assert r.overrides == ("model=llama3_70b", "cfp.constraints.pp=[1,2]")  # a list value is a value, kept
    assert sizing_request(["train.tokens=1e9", "cluster=b200", "cluster.nodes=16,4,8,4"]).nodes == (4, 8, 16)
    assert sizing_request(["train.tokens=2_000B", "cluster=b200,h200"]).clusters == ("b200", "h200")
    assert sizing_request(["train.tokens=1M", "cluster=b200"]).nodes == (1,)
    assert count("k", "1.5e3") == 1500
    assert duration_s("d", "30d") == 30 * 86400 and duration_s("h", "720h") == 720 * 3600


@pytest.mark.parametrize("overrides, key", [
    (["cluster=b200"], "train.tokens"),
    (["train.tokens=15T"], "cluster"),
    (["train.tokens=lots", "cluster=b200"], "train.tokens"),
    (["train.tokens=15T", "cluster=b200", "cluster.nodes=[4,0]"], "cluster.nodes"),
    (["train.tokens=15T", "cluster=b200", "cluster.nodes=range(0.5,3)"], "cluster.nodes"),
    (["train.tokens=15T", "cluster=b200", "model=llama3_8b,llama3_70b"], "model"),
    (["train.tokens=1T,2T", "cluster=b200"], "train.tokens"),
    (["train.tokens=1T", "cluster=b200", "cluster.nodes=range(1,1000000000)"], "cluster.nodes"),  # never listed
    (["train.tokens=1T", "cluster=b200", "cluster.nodes=range(1,9,0)"], "cluster.nodes"),
    (["train.tokens=1T", "cluster=b200", "cluster.nodes=[1,2"], "cluster.nodes"),
])
def test_a_bad_request_names_its_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        sizing_request(overrides)
    assert caught.value.issues[0].key == key


def test_prices_for_every_cluster_or_one() -> None:
    assert prices(["2.5"], ["a", "b"]) == {"a": 2.5, "b": 2.5}
    assert prices(["2.5", "b=4"], ["a", "b"]) == {"a": 2.5, "b": 4.0}
    with pytest.raises(ConfigError, match="--price"):
        prices(["c=1"], ["a", "b"])


def test_rows_plan_each_size_with_time_hours_energy_price_and_band(tight: Planner) -> None:
    rows = size_all([tight], [1, 2, 4], tokens=1e9, price_of=lambda _: 2.0)
    assert [r.gpus for r in rows] == [8, 16, 32]
    assert rows[0].plan is None and "GiB per GPU" in rows[0].why_not  # one node: over memory
    for row in rows[1:]:
        found = search(resized(tight.job, row.nodes), row.gpus, tight.cfp)  # planned again, without the shared cache
        assert row.plan == found.best.candidate.describe(row.gpus)
        assert row.step_time_s == pytest.approx(found.best.prediction.step_time_s, rel=1e-12)
        assert row.steps == math.ceil(1e9 / (16 * 1024))
        assert row.time_s == pytest.approx(row.steps * row.step_time_s)
        assert row.gpu_hours == pytest.approx(row.time_s * row.gpus / 3600)
        assert row.energy_mwh == pytest.approx(row.gpu_hours * 700.0 / 1e6)  # the H100 SXM's 700 W board power
        assert row.cost == pytest.approx(row.gpu_hours * 2.0)
        low, high = row.banded(row.time_s)
        assert row.band_pct > 0 and low < row.time_s < high


def test_forked_planners_give_the_same_rows(tight: Planner) -> None:
    alone = size_all([tight], [1, 2], tokens=1e9)
    forked = size_all([_planner(TIGHT), _planner(TIGHT)], [1, 2], tokens=1e9, jobs=3)  # a fresh pair: searched there
    assert forked == alone + alone  # in order, whichever worker planned each


def test_workers_stay_on_a_kind_and_share_the_last() -> None:
    """The sizes handed to two workers of three kinds x four sizes: each worker keeps to its kind while it has
    sizes left, then moves to the kind with the fewest workers and the most left; every size is handed out once,
    and at most one kind is warmed in both workers."""
    import multiprocessing

    from cfp_megatron.planner.sizing import _Shares

    shares = _Shares(multiprocessing.get_context("fork"), 3, 4)
    kinds: list[int | None] = [None, None]
    warmed: list[set[int]] = [set(), set()]
    handed = []
    worker = 0
    while (task := shares.take(kinds[worker])) is not None:
        kinds[worker] = task[0]
        warmed[worker].add(task[0])
        handed.append(task)
        worker = 1 - worker if len(handed) % 3 else worker  # uneven speeds: worker 0 takes one more now and then
    assert sorted(handed) == [(k, i) for k in range(3) for i in range(4)]
    assert handed[0][0] != handed[1][0]  # the second worker starts on another kind
    assert len(warmed[0]) + len(warmed[1]) <= 3 + 1  # each kind warmed once, but one at most twice
    assert [t[1] for t in handed if t[0] == 2] == [0, 1, 2, 3]  # a kind's sizes in order


class _Refusing(Planner):
    def search(self, nodes: int) -> SearchResult:
        raise ConfigError(ConfigIssue(key="cluster.nodes", value=nodes, problem="is refused.", fix="another."))


def test_a_worker_s_error_is_raised_here_and_meanwhile_runs(tight: Planner) -> None:
    ran = []
    with pytest.raises(ConfigError) as info:
        size_all([_Refusing(job=tight.job, cfp=tight.cfp)], [1, 2], tokens=1e9, jobs=2,
                 meanwhile=lambda: ran.append(True))
    assert ran == [True] and info.value.keys == ["cluster.nodes"]  # whole, as the worker raised it
    text = str(info.value)
    assert text.startswith("1 invalid setting(s):\n  - cluster.nodes=") and "Fix: another." in text
    rows = size_all([tight], [1], tokens=1e9, jobs=1, meanwhile=lambda: ran.append(False))
    assert ran == [True, False] and len(rows) == 1


def _row(cluster: str, gpus: int, step: float | None) -> Sized:
    return Sized(cluster=cluster, device="GPU", nodes=gpus // 8, gpus=gpus, tokens=1e6, tokens_per_step=1000,
                 plan=None if step is None else "dp1", step_time_s=step)


def test_smallest_within_the_deadline_per_kind() -> None:
    rows = [_row("a", 64, 10.0), _row("a", 8, 100.0), _row("a", 16, 40.0), _row("a", 32, 20.0),
            _row("b", 8, None), _row("b", 16, 90.0)]
    # 1,000 steps: a at 8 GPUs 100,000 s, at 16 40,000 s, at 32 20,000 s; b at 16 90,000 s
    meeting = smallest_meeting(rows, 50_000.0)
    assert meeting["a"].gpus == 16 and meeting["b"] is None
    assert smallest_meeting(rows, 100_000.0)["a"].gpus == 8  # the deadline met exactly counts
    assert smallest_meeting(rows, 100_000.0)["b"].gpus == 16
    lines = deadline_lines(meeting, 50_000.0, rows)
    assert "a: 2 nodes, 16 GPUs" in lines[1] and "b: none of those sized (the fastest, 16 GPUs, takes 1.0 d" in lines[2]


def test_pareto_front_keeps_what_nothing_beats_on_both() -> None:
    fast_dear, slow_cheap, beaten, equal = _row("a", 64, 10.0), _row("a", 8, 60.0), _row("b", 64, 12.0), \
        _row("c", 8, 60.0)
    front = pareto_front([beaten, slow_cheap, fast_dear, equal, _row("b", 8, None)])
    # GPU-hours: 64 x 10 s beats 64 x 12 s on both; 8 x 60 s is cheapest; two equal points both stay
    assert front == [fast_dear, slow_cheap, equal]


def test_a_kind_that_fits_nowhere_in_the_range_names_the_smallest_that_does(tight: Planner) -> None:
    rows = size_all([tight], [1], tokens=1e9)
    beyond = beyond_range(tight, rows, tokens=1e9, price=None)
    assert beyond is not None and beyond.nodes == 2
    fresh = _planner(TIGHT, nodes=2)  # planned again: it fits there, and not on one node
    assert fresh.fits(2) and not fresh.fits(1)
    weights, gradients, optimizer = beyond.states_gib
    assert weights > 0 and gradients > 0
    assert "the smallest that fits is 2 nodes (16 GPUs)" in beyond.line()
    assert f"{beyond.fitting.plan}" in beyond.line()
    assert beyond_range(tight, size_all([tight], [1, 2], tokens=1e9), tokens=1e9, price=None) is None


def test_preflight_no_fit_names_the_fewest_nodes_and_a_shorter_sequence_that_fit() -> None:
    long = _planner([*TIGHT, "train.seq_length=8192"], nodes=2)  # 16 GPUs: the logits of 8,192 tokens do not fit
    job = long.job
    with pytest.raises(ConfigError) as caught:
        check_no_plan(job, 16, long.cfp, given=job.cluster, measurements=None, te_available=True, options=None)
    issue = caught.value.issues[0]
    assert "cluster.nodes=3 (24 ranks)" in issue.problem and "train.seq_length=4096 (of 8192) fits" in issue.problem
    assert issue.fix.startswith("size the cluster to cluster.nodes=3 or more, or train shorter sequences "
                                "(train.seq_length=4096)")
    # each, planned again, fits; and neither the smaller size nor the longer sequences do
    assert search(resized(job, 3), 24, long.cfp).ranked and not search(job, 16, long.cfp).ranked
    shorter = dataclasses.replace(job, train=dataclasses.replace(job.train, seq_length=4096))
    assert search(shorter, 16, long.cfp).ranked


def test_no_fit_anywhere_says_how_far_it_looked() -> None:
    hopeless = _planner([*TIGHT, "cluster.hbm_gib=0.01"])
    job = hopeless.job
    with pytest.raises(ConfigError) as caught:
        check_no_plan(job, 8, hopeless.cfp, given=job.cluster, measurements=None, te_available=True, options=None)
    issue = caught.value.issues[0]
    assert "None fits on up to 64 nodes of cluster=dgx_h100 either" in issue.problem
    assert issue.fix.startswith("start fewer ranks per node")  # no size to name
    assert not search(resized(job, 64), 512, hopeless.cfp).ranked  # the largest tried, planned again


def test_no_plan_fix_names_pins_only_where_there_are_some() -> None:
    assert "relax the cfp pins" in no_plan_fix(("cfp.tp",)) and "cfp.tp" in no_plan_fix(("cfp.tp",))
    assert "relax" not in no_plan_fix(()) and "no cfp pin" in no_plan_fix(())
    empty = SearchResult(ranked=(), rejected=(Rejection(what="cp=2", reason="no.", count=0),), space_size=0,
                         simulated=0, memory_checked=0, over_memory=0, invalid=0, pruned=0, memory_limit_gib=None,
                         least_over_gib=None, seconds=0.0, world=8)
    with pytest.raises(ConfigError) as caught:
        empty.best  # noqa: B018
    assert "relax" not in caught.value.issues[0].fix


def test_searches_sharing_pass_costs_find_what_separate_searches_find() -> None:
    planner = _planner(["+cfp=auto", "model=llama3_8b", "model.num_layers=4", "cluster=gb200_nvl72",
                        "train.global_batch_size=32", "train.seq_length=1024", "cfp.top_k=3"])
    cache = CostCache.for_job(planner.job, None, SimOptions())
    for nodes in (4, 2):
        job = resized(planner.job, nodes)
        shared, alone = search(job, nodes * 4, planner.cfp, cache=cache), search(job, nodes * 4, planner.cfp)
        assert [(r.candidate, r.prediction.step_time_s) for r in shared.ranked] == \
            [(r.candidate, r.prediction.step_time_s) for r in alone.ranked]
    assert cache.costs  # filled by the first, read by the second
    other = dataclasses.replace(planner.job, cluster=dataclasses.replace(planner.job.cluster, hbm_gib=100.0))
    assert cache.resized(other, None, SimOptions()).costs is not cache.costs  # another kind: its own costs


def test_cfp_size_prints_writes_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["size", *TIGHT[1:], "train.tokens=1B", "cluster.nodes=[1,2]", "--deadline", "30d",
                     "--price", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "smallest cluster of each kind that trains within 30.0 d" in out and "dgx_h100: 2 nodes, 16 GPUs" in out
    (data,) = tmp_path.glob("size-llama3_8b-*.json")
    rows = json.loads(data.read_text())["candidates"]
    assert [(r["gpus"], r["plan"] is None, r["smallest_within_deadline"]) for r in rows] == \
        [(8, True, False), (16, False, True)]
    (png,) = tmp_path.glob("size-llama3_8b-*.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cli.main(["size", "train.tokens=1B", "cluster=local"]) == 2  # not a GPU preset: one message
    out = capsys.readouterr().out
    assert "is not a GPU cluster preset" in out and "cluster=[dgx_h100,b200]" in out  # text, not rich markup


def test_table_rows_show_labels_with_brackets_as_text() -> None:
    row = dataclasses.replace(_row("a", 8, 1.0), plan="dp8 tp1 pp1 mb1 rc=selective[moe_act+layernorm]")
    console = Console(record=True, width=250)
    console.print(table([row, _row("b", 8, None)], pareto_front([row]), {"a": row}))
    shown = console.export_text()
    assert "rc=selective[moe_act+layernorm]" in shown and "*<" in shown
