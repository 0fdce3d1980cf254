"""Profiling under torchrun with gloo ranks: a real run fills the DB, a second run reuses it, and a round that fails
or outlasts its deadline is recorded while the job still finishes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cfp_megatron.cluster.measured import Collective
from cfp_megatron.profile.control import FAULT_ENV
from cfp_megatron.profile.load import LOAD_ENV
from tests.launcher import REPO, free_port


def run_profile(nproc: int, args: list[str], cache: Path, *, fault: str | None = None,
                load: str = "quiet") -> subprocess.CompletedProcess:
    """``torchrun -m cfp_megatron.profile`` with its cache under ``cache``, on a machine whose load readings say
    ``load`` (:data:`~cfp_megatron.profile.load.LOAD_ENV`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CFP_CACHE_DIR": str(cache),
           LOAD_ENV: load}
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
           "--max-restarts=0", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           "-m", "cfp_megatron.profile", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def only_db(cache: Path) -> dict:
    files = sorted((cache / "profile").glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text())


SMALL_JOB = ["model=gpt_tiny", "model.num_layers=2", "train.global_batch_size=2"]
"""The job the fill-and-reuse test profiles: two layers and a global batch of 2 (micro-batch sizes 1 and 2, the
job's and its double: fewer entries than the preset's, each probe the same)."""


def missing(rounds: list[dict]) -> dict[str, list[str]]:
    """Per round, the entries its newest record says the profile still lacks (rounds lacking none left out)."""
    latest = {r["name"]: r for r in rounds if r["name"] != "analysis" and "missing" in r}
    return {name: r["missing"] for name, r in latest.items() if r["missing"]}


def test_profile_fills_the_db_and_a_second_run_reuses_it(tmp_path) -> None:
    cache = tmp_path / "cache"
    first = run_profile(2, [*SMALL_JOB, "cluster=local", "--budget", "12"], cache)
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-4000:]
    assert "ProfileDB:" in out and "Collectives" in out
    db = only_db(cache)  # the first run has ended: its rounds are all recorded
    assert db["fingerprint"]["device_count"] == 2 and db["fingerprint"]["backend"] == "gloo"
    # Each timing step is followed by its memory step: a round the budget cut may leave only the last timing
    # without its memory (a loaded machine gets that far in 12 s or not); a round that ended leaves none.
    segments_round = [r for r in db["rounds"] if r["name"] == "segments"]
    unmeasured = [s for s in db["segments"] if s["activation_bytes"] is None and not s["partition"].endswith(
        ("-selective", "-full"))]
    assert len(unmeasured) <= (0 if segments_round and segments_round[-1]["status"] == "ok" else 1), (
        segments_round, unmeasured)
    # The first run's 12 s leave rounds unfinished (at least the recompute round, which runs on what the others
    # leave): each round's record names the entries still missing, and each next run measures only those (and the
    # analysis its records are named by), reusing the rest, until none is; a run after that measures nothing.
    left = missing(db["rounds"])
    assert left, db["rounds"]
    assert any(r.get("measured") for r in db["rounds"]), db["rounds"]  # and measured some
    reused = 0
    for _ in range(6):  # a loaded machine may need several runs of 90 s
        if not left:
            break
        # one timed repeat per probe (cfp.profile_repeats): the same entries, measured in fewer runs
        again = run_profile(2, [*SMALL_JOB, "--budget", "90", "--repeats", "1"], cache)
        assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
        new = only_db(cache)["rounds"][len(db["rounds"]):]
        assert new and {r["name"] for r in new} <= {"analysis", "collective-fits"} | set(left), (left, new)
        for r in new:
            if r["name"] in left:  # only what was missing was measured, what was there reused
                assert set(r["measured"]) <= set(left[r["name"]]), r
                assert len(r["measured"]) + len(r["missing"]) <= len(left[r["name"]]), r
                reused += r["reused"]
        db = only_db(cache)
        now = missing(db["rounds"])
        assert sum(map(len, now.values())) < sum(map(len, left.values())), (left, now)  # it moved on
        left = now
    assert not left, left
    assert reused > 0  # the first run's entries were not measured again
    second = run_profile(2, [*SMALL_JOB, "--budget", "12"], cache)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    assert "reused (nothing measured)" in second.stdout
    # Every round of every run has ended: the complete profile, as the last run left it (nothing measured, nothing
    # written).
    assert only_db(cache) == db
    fits = {(c["op"], c["group_size"], c["span"]): c for c in db["collectives"]}
    for op in Collective:
        fit = fits[(op.value, 2, "intra_node")]
        assert fit["latency_s"] > 0 and fit["bandwidth_bytes_per_s"] > 0 and fit["points"] >= 2, fit
    assert db["gemms"] and all(g["tflops"] > 0 and g["dtype"] == "fp32" for g in db["gemms"])
    kinds = {s["kind"] for s in db["segments"]}
    assert {"embedding", "dense", "head"} <= kinds, kinds
    assert all(s["forward_s"] > 0 and s["backward_s"] > 0 for s in db["segments"])
    dense_memory = [s["activation_bytes"] for s in db["segments"] if s["kind"] == "dense"]
    assert any(b is not None and b > 0 for b in dense_memory), dense_memory  # measured with times
    assert {s["partition"] for s in db["segments"]} <= {
        f"tp{tp}{sp}{rc}" for tp, sp in ((1, ""), (2, ""), (2, "-sp")) for rc in ("", "-selective", "-full")}


def test_recomputation_is_profiled_as_its_own_partitions(tmp_path) -> None:
    """The last round (``recompute``) measures the decoder layer again under selective recomputation (the layer
    built with Megatron's ``recompute_granularity="selective"``): its checkpointed core attention keeps neither the
    attention scores nor the softmax for the backward pass, so the layer keeps fewer bytes than without
    recomputation at every micro-batch size, and the recomputation in its backward pass raises its transient. And
    checkpointed whole, as full recomputation runs it (Megatron's ``tensor_parallel.checkpoint``): the layer keeps
    its input only, so its output is all it leaves alive, less than under selective recomputation."""
    cache = tmp_path / "cache"
    run = run_profile(1, ["model=gpt_tiny", "cluster=local", "train.seq_length=64", "--budget", "120", "--repeats",
                          "1"], cache)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    dense = {(s["partition"], s["micro_batch"]): s for s in only_db(cache)["segments"] if s["kind"] == "dense"}
    sizes = sorted(mb for partition, mb in dense if partition == "tp1")
    assert sizes == sorted(mb for partition, mb in dense if partition == "tp1-selective") and len(sizes) >= 3
    for mb in sizes:
        plain, selective = dense[("tp1", mb)], dense[("tp1-selective", mb)]
        assert selective["activation_bytes"] < plain["activation_bytes"], (mb, plain, selective)
        assert selective["transient_bytes"] > plain["transient_bytes"], (mb, plain, selective)
        full = dense[("tp1-full", mb)]
        assert full["activation_bytes"] < selective["activation_bytes"], (mb, selective, full)
        assert full["forward_s"] > 0 and full["backward_s"] > 0
    embedding_partitions = {s["partition"] for s in only_db(cache)["segments"] if s["kind"] != "dense"}
    assert embedding_partitions == {"tp1"}  # the embedding and the head are not profiled again
    rounds = {r["name"]: r for r in only_db(cache)["rounds"]}
    assert rounds["recompute"]["status"] == "ok" and rounds["recompute"]["steps_done"] > 0


def test_failed_and_slow_rounds_are_recorded_and_the_job_finishes(tmp_path) -> None:
    cache = tmp_path / "cache"
    proc = run_profile(2, ["model=gpt_tiny", "--budget", "12", "--force"], cache,
                       fault="gemm:fail:1,segments:slow", load="busy")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rounds = {r["name"]: r for r in only_db(cache)["rounds"]}
    # on a busy machine (the readings of every rank say so): every round marked, and the note says how to redo them
    assert all(rounds[name]["load"]["other_during"] == 1.0 for name in ("collectives", "gemm", "segments"))
    assert "machine busy: other work used 100% of the cores before the round" in proc.stderr  # each round's line
    said = " ".join(proc.stdout.split())  # as wrapped to the console's width
    if any(rounds[name]["measured"] for name in ("collectives", "gemm", "segments")):  # a loaded machine: maybe none
        assert "measured on a busy machine: " in said and "-m cfp_megatron.profile model=gpt_tiny" in said
        assert "--force" in said and "rounds on a busy machine" in said
    # The round without an injected fault ends as its steps or its share of the 12 s allow (the share is what the
    # set-up before it leaves, so a slow machine may stop it at the budget), never as failed.
    assert rounds["collectives"]["status"] in {"ok", "timeout"}, rounds["collectives"]
    if rounds["collectives"]["status"] == "timeout":
        assert "budget" in rounds["collectives"]["reason"], rounds["collectives"]
    assert rounds["gemm"]["status"] == "failed" and "rank 1" in rounds["gemm"]["reason"]
    assert "injected failure" in rounds["gemm"]["reason"]
    assert rounds["segments"]["status"] == "timeout" and "budget" in rounds["segments"]["reason"]
    assert rounds["segments"]["steps_done"] < rounds["segments"]["steps_planned"]
