"""The pictures: the plan command's trace and timeline, the plan check's comparison, validate's scatter."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.engine.metrics import MetricsLog, StepMetrics
from cfp_megatron.plan import check as plan_check
from cfp_megatron.plan.check import PlanCheck, breakdown, log_plan_check
from cfp_megatron.plan.plots import free_path, write_check_png
from cfp_megatron.planner import plan_cli
from cfp_megatron.profile.records import PlanCheckRecord
from cfp_megatron.sim import simulate
from cfp_megatron.sim.timeline import LANES, chrome_trace, shown_ranks, slices, write_png
from cfp_megatron.validate import load_preset
from cfp_megatron.validate import main as validate_main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CSV_HEADER = ("id,model,arch_type,layers,hidden,heads,seq_len,gpu,num_gpus,tp,pp,micro_batch,global_batch_seqs,"
              "step_time_s")
CSV_ROWS = ["1,GPT 1.7B,dense,24,2304,24,2048,A100-80GB,32,1,1,1,512,3.5",
            "2,GPT 3.6B,dense,30,3072,32,2048,A100-80GB,64,2,1,1,512,3.7",
            "3,MoE test,moe,16,2048,16,4096,H100-80GB,64,2,2,1,256,2.0"]


def _job(pp: int = 4, gbs: int = 16, **parallel):
    model = {"name": "gpt_test", "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16,
             "vocab_size": 51200, "max_position_embeddings": 2048}
    cluster = {**load_preset("dgx_a100"), "nodes": 4}
    train = {"global_batch_size": gbs, "micro_batch_size": 1, "seq_length": 2048, "precision": "bf16"}
    return job_from_config({"model": model, "cluster": cluster, "parallel": {"pp": pp, "tp": 2, "sp": True,
                                                                             **parallel}, "train": train})


def _png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000  # a drawn picture, not an empty canvas


def test_plan_command_writes_the_trace_and_the_timeline(tmp_path, capsys) -> None:
    args = ["model=llama3_8b", "cluster=dgx_a100", "cluster.nodes=1", "train.global_batch_size=32",
            "train.seq_length=2048", "cfp.tp=2", "cfp.pp=2", "--out", str(tmp_path)]
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    trace_path = next(tmp_path.glob("*/plan_trace.json"))
    png_path = trace_path.parent / "plan_timeline.png"
    assert f"plan_trace.json: {trace_path}" in out.replace("\n", "") and "plan_timeline.png:" in out
    assert (trace_path.parent / "plan.json").exists()
    trace = json.loads(trace_path.read_text())
    threads = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {(rank, lane) for rank in (0, 1) for lane in ("compute", "TP comm", "idle")} <= threads
    slices_on = {(e["pid"], LANES[e["tid"]]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {(0, "compute"), (1, "compute"), (0, "TP comm"), (1, "idle")} <= slices_on
    assert any(e["ph"] == "X" and e["name"] == "bubble" for e in trace["traceEvents"])
    _png(png_path)
    # the same plan again: already drawn; a file cfp-megatron did not draw is kept; its own for another plan replaced
    before = trace_path.stat().st_mtime_ns
    png_path.write_bytes(b"the user's own picture")
    stale = json.loads(trace_path.read_text())
    stale["otherData"]["plan_hash"] = "0123456789abcdef"
    trace_path.write_text(json.dumps(stale))
    assert plan_cli.main(args) == 0
    out = capsys.readouterr().out
    assert "kept: cfp-megatron did not draw it" in out and png_path.read_bytes() == b"the user's own picture"
    assert json.loads(trace_path.read_text())["otherData"]["plan_hash"] == trace["otherData"]["plan_hash"]
    assert plan_cli.main(args) == 0
    assert "already drawn for this plan" in capsys.readouterr().out
    assert trace_path.stat().st_mtime_ns != before


def test_lanes_add_up_and_bubbles_match_the_breakdown() -> None:
    pred = simulate(_job(pp=4, vpp=2), with_events=True)
    pieces = slices(pred)
    slowest = max(range(4), key=lambda rank: max(p.end_s for p in pieces if p.rank == rank and p.lane != "idle"))
    for rank in range(4):  # every rank's lanes cover the step exactly once
        covered = sum(p.end_s - p.start_s for p in pieces if p.rank == rank)
        assert covered == pytest.approx(pred.step_time_s, rel=1e-6)
    in_pass_comm = sum(p.end_s - p.start_s for p in pieces if p.rank == slowest and p.lane == "TP comm")
    assert in_pass_comm == pytest.approx(pred.time.tp_comm_s, rel=1e-6)
    bubble = sum(p.end_s - p.start_s for p in pieces if p.rank == slowest and p.style == "bubble")
    assert bubble == pytest.approx(pred.time.pp_bubble_s, rel=1e-6)


def test_large_schedules_are_capped_and_say_so(tmp_path) -> None:
    pred = simulate(_job(pp=16, gbs=64), with_events=True)
    full = chrome_trace(pred)
    assert full["otherData"]["note"] == "" and len({e["pid"] for e in full["traceEvents"]}) == 16
    capped = chrome_trace(pred, max_events=len(full["traceEvents"]) // 4)
    kept = {e["pid"] for e in capped["traceEvents"]}
    assert 0 in kept and 15 in kept and capped["otherData"]["slowest_rank"] in kept and len(kept) < 16
    assert "of 16 pipeline ranks kept" in capped["otherData"]["note"]
    shown = shown_ranks(list(range(16)), 7, 8)
    assert len(shown) == 8 and {0, 7, 15} <= set(shown) and shown == sorted(shown)
    _png(write_png(pred, tmp_path / "big.png", title="pp=16"))


def test_plan_check_picture_from_a_record(tmp_path) -> None:
    pred = simulate(_job(pp=2))
    time_parts, memory_parts = breakdown(pred)
    assert sum(v for _, v in time_parts) == pytest.approx(pred.step_time_s)
    assert sum(v for _, v in memory_parts) == pytest.approx(pred.memory.total)
    record = PlanCheckRecord(model="m", plan="gpt_test@dgx_a100x4x8:tp=2", steps=4,
                             predicted_step_s=pred.step_time_s, calibration=1.1,
                             measured_step_s=pred.step_time_s * 1.2, predicted_peak_bytes=pred.memory.total,
                             measured_peak_bytes=None, time=0.0, repeat_spread=0.05)
    _png(write_check_png(record, tmp_path / "check.png", time_parts=time_parts, memory_parts=memory_parts))
    _png(write_check_png(record, tmp_path / "total_only.png", note="no predicted breakdown"))
    assert free_path(tmp_path / "check.png") == tmp_path / "check-2.png"


def test_the_plan_check_draws_its_picture_in_the_run_directory(tmp_path, monkeypatch) -> None:
    def no_store(*args, **kwargs):
        raise OSError("no ProfileDB here")

    monkeypatch.setattr(plan_check, "store", no_store)
    monkeypatch.setattr(plan_check, "other_load", lambda ranks: 0.0)
    (tmp_path / "plan_check.png").write_bytes(b"a picture the user keeps")
    check = PlanCheck(plan="gpt_test@localx1x2:tp=1", model_key="m", after_steps=3, predicted_step_s=0.1,
                      calibration=1.0, predicted_peak_bytes=2**30, time_parts=(("forward", 0.04), ("backward", 0.06)),
                      plot_file=str(tmp_path / "plan_check.png"))
    history = [StepMetrics(step=i, loss=1.0, lr=1e-3, grad_norm=1.0, applied=True, step_time_s=0.12,
                           tokens_per_s=1.0, tflops_per_rank=1.0, mfu=0.1,
                           peak_bytes_max=1.1 * 2**30 if i == 3 else None) for i in (1, 2, 3)]
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, restart_count=0,
                    under_torchrun=False)
    log_plan_check(check, history, log, job_from_config({"model": {"name": "m", "num_layers": 2, "hidden_size": 64,
                                                                    "num_attention_heads": 4, "vocab_size": 128}}),
                   env, backend="gloo")
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    drawn = [e for e in events if e["event"] == "plan_check_plot"]
    assert drawn and drawn[0]["path"] == str(tmp_path / "plan_check-2.png")
    assert (tmp_path / "plan_check.png").read_bytes() == b"a picture the user keeps"
    _png(tmp_path / "plan_check-2.png")


def test_validate_plot_writes_a_scatter(tmp_path, capsys) -> None:
    csv = tmp_path / "runs.csv"
    csv.write_text("\n".join([CSV_HEADER, *CSV_ROWS]) + "\n")
    out = tmp_path / "scatter.png"
    assert validate_main([str(csv), "--plot", str(out)]) == 0
    assert f"drawn to {out}" in capsys.readouterr().out
    _png(out)


@pytest.mark.parametrize("name, said", [("scatter.jpg", "ending in .png"), ("missing/scatter.png", "does not exist"),
                                        ("taken.png", "never overwritten")])
def test_validate_plot_refuses_a_bad_target_before_predicting(tmp_path, capsys, name, said) -> None:
    csv = tmp_path / "runs.csv"
    csv.write_text("\n".join([CSV_HEADER, *CSV_ROWS]) + "\n")
    (tmp_path / "taken.png").write_bytes(b"kept")
    assert validate_main([str(csv), "--plot", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert said in err and "--plot" in err
    assert (tmp_path / "taken.png").read_bytes() == b"kept"


def test_the_check_gets_the_plans_breakdown_or_says_why_not(tmp_path, monkeypatch) -> None:
    # no profile here: the presets, as the plan had (what local_measurements returns without a ProfileDB)
    monkeypatch.setattr(plan_check, "local_measurements", lambda job, world_size: (job.cluster, None))
    job = _job(pp=2)
    pred = simulate(job, world_size=32)
    check = PlanCheck(plan="p", model_key="m", after_steps=3, predicted_step_s=pred.step_time_s, calibration=1.0,
                      predicted_peak_bytes=pred.memory.total)
    found = plan_check.with_breakdown(check, job, 32, str(tmp_path / "plan_check.png"))
    assert found.plot_file == str(tmp_path / "plan_check.png") and not found.breakdown_note
    assert sum(v for _, v in found.time_parts) == pytest.approx(pred.step_time_s)
    stale = plan_check.with_breakdown(dataclasses.replace(check, predicted_step_s=pred.step_time_s * 1.5), job, 32,
                                      None)
    assert stale.time_parts == () and "profile changed" in stale.breakdown_note


def _stacks(monkeypatch) -> list[list[tuple[float, float]]]:
    """Record what the plan check's picture stacks: per x position, each bar's (bottom, height)."""
    import matplotlib.axes

    drawn: dict[float, list[tuple[float, float]]] = {}
    real = matplotlib.axes.Axes.bar

    def bar(self, x, height, *args, bottom=0.0, **kwargs):
        drawn.setdefault(id(self), []).append((x, bottom, height))
        return real(self, x, height, *args, bottom=bottom, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", bar)
    return drawn


@pytest.mark.parametrize("layout", ["parallel.tp=2 parallel.pp=2 train.micro_batch_size=8",
                                    "parallel.tp=2 parallel.sp=true parallel.pp=2 train.micro_batch_size=2",
                                    "parallel.tp=1 parallel.pp=2 train.micro_batch_size=4",
                                    "parallel.tp=1 parallel.pp=4 train.micro_batch_size=2"])
def test_the_plan_checks_stack_adds_up_to_its_label_and_names_what_it_holds(tmp_path, monkeypatch, layout) -> None:
    """On the recorded profile of gpt_tiny on 4 ranks sharing 2 cores (its pipelined probes' corrections, passes run
    at once on shared cores), the plan check's stacked prediction reaches the predicted figure it is labelled with,
    every part positive; a plan without data parallelism has no "DP sync" part, and the tied embedding's all-reduce
    between the ends of a pipeline is a part of its own."""
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.profile.cluster import local_measurements
    from cfp_megatron.sim.options import options_here
    from tests.profiles import seed_profile_db

    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    job = compose_job(layout.split())
    seed_profile_db(tmp_path, job, world=4)
    cluster, measurements = local_measurements(job, world_size=4)
    pred = simulate(dataclasses.replace(job, cluster=cluster), cluster, measurements, world_size=4,
                    options=options_here(cluster))
    assert pred.time.total_s == pytest.approx(pred.step_time_s, rel=1e-9)  # the simulator's lanes add up
    assert all(getattr(pred.time, f.name) >= 0 for f in dataclasses.fields(pred.time) if f.name != "extra")
    planned = pred.step_time_s * 1.01  # the plan's figure: a profile that moved by less than BREAKDOWN_MATCH
    check = PlanCheck(plan="p", model_key="m", after_steps=3, predicted_step_s=planned, calibration=1.0,
                      predicted_peak_bytes=pred.memory.total)
    found = plan_check.with_breakdown(check, job, 4, str(tmp_path / "plan_check.png"))
    parts = dict(found.time_parts)
    assert not found.breakdown_note and all(seconds > 0 for seconds in parts.values())
    assert sum(parts.values()) == pytest.approx(planned, rel=1e-9)
    dims = job.parallel
    assert ("DP sync" in parts) == (4 // (dims.tp * dims.pp) > 1 and pred.time.dp_comm_s > 0)
    assert ("tied-embedding sync" in parts) == (dims.pp > 1)
    assert parts.get("tied-embedding sync", 0.0) == pytest.approx(pred.time.embedding_sync_s * 1.01)
    # what the picture draws: the stack's top is the label's figure, the memory stack's the predicted peak
    drawn = _stacks(monkeypatch)
    record = PlanCheckRecord(model="m", plan="p", steps=3, predicted_step_s=planned, calibration=1.0,
                             measured_step_s=planned * 1.1, predicted_peak_bytes=pred.memory.total,
                             measured_peak_bytes=pred.memory.total, time=0.0)
    _png(write_check_png(record, tmp_path / "check.png", time_parts=found.time_parts,
                         memory_parts=found.memory_parts))
    time_bars, memory_bars = drawn.values()
    assert max(bottom + height for x, bottom, height in time_bars if x == 0) == pytest.approx(planned * 1e3)
    assert max(bottom + height for x, bottom, height in memory_bars if x == 0) == pytest.approx(
        pred.memory.total / 2**30)


@pytest.mark.parametrize("recompute, microbatches", [("none", 1), ("selective", 4)])
def test_the_timelines_legend_follows_the_plan(tmp_path, monkeypatch, recompute, microbatches) -> None:
    """The timeline says "backward (with recompute)" only for a plan that recomputes, and counts its micro-batches
    in words that fit the number."""
    import matplotlib.figure

    said: list[str] = []
    real_legend, real_title = matplotlib.figure.Figure.legend, matplotlib.axes.Axes.set_title

    def legend(self, *args, handles=(), **kwargs):
        said.extend(handle.get_label() for handle in handles)
        return real_legend(self, *args, handles=handles, **kwargs)

    def set_title(self, text, *args, **kwargs):
        said.append(text)
        return real_title(self, text, *args, **kwargs)

    import matplotlib.axes

    monkeypatch.setattr(matplotlib.figure.Figure, "legend", legend)
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title", set_title)
    pred = simulate(_job(pp=2, gbs=8 * microbatches, recompute=recompute), with_events=True)  # dp8
    assert pred.num_microbatches == microbatches and (pred.time.recompute_s > 0) == (recompute != "none")
    _png(write_png(pred, tmp_path / "timeline.png"))
    backward = [label for label in said if label.startswith("backward")]
    assert backward == ["backward (with recompute)" if recompute != "none" else "backward"]
    title = next(text for text in said if "micro-batch" in text)
    assert (f"{microbatches} micro-batch," if microbatches == 1 else f"{microbatches} micro-batches,") in title
