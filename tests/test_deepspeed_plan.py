"""The DeepSpeed backend's planning side, without processes: the backend group, Plan's canonical
string and file, ds_config.json, the ZeRO simulator and the search."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from cfp_megatron.backends.deepspeed.costs import ZERO_SIM_OPTIONS, megatron_passes, simulate_zero, zero3_fetches
from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes, StageProbe, load_probes
from cfp_megatron.backends.deepspeed.hook_config import DEEPSPEED_PERSISTENCE_THRESHOLD
from cfp_megatron.backends.deepspeed.search import search_zero
from cfp_megatron.backends.deepspeed.zero_plan import ds_config, model_job, write_json_file, zero_plan
from cfp_megatron.base.backend_spec import BackendKind, BackendSpec, backend_from_config
from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config, compose_job
from cfp_megatron.base.config import Precision, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.plan import Plan, PlanError, deepspeed_config, hydra_overrides, megatron_lm_args, torchrun_command
from cfp_megatron.plan.exports import ZERO3_PERSISTENCE_THRESHOLD
from cfp_megatron.planner.deepspeed_entry import check_layout, manual_plan
from cfp_megatron.sim.pass_costs import CostCache
from cfp_megatron.sim.prediction import GIB


def _plan(job, world: int, **knobs) -> Plan:
    values = {"zero_stage": 0, "micro_batch": 1, "activation_checkpointing": False, "offload_optimizer": False,
              "offload_param": False, "bucket_elements": 50_000_000, "precision": Precision.bf16, **knobs}
    return zero_plan(job, world=world, **values)


def test_backend_group_composes_and_validates() -> None:
    spec = backend_from_config(compose_config(["backend=deepspeed", "backend.zero_stage=2"]))
    assert spec.is_deepspeed and spec.zero_stage == 2
    assert not backend_from_config(compose_config([])).is_deepspeed
    job_from_config(compose_config(["backend=deepspeed"]))  # the group is not a JobSpec section
    with pytest.raises(ConfigError, match="backend.zero_stage=5"):
        backend_from_config(compose_config(["backend=deepspeed", "backend.zero_stage=5"]))
    with pytest.raises(ConfigError, match="backend.offload_param=True: parameter offload needs ZeRO stage 3"):
        backend_from_config(compose_config(["backend=deepspeed", "backend.zero_stage=2",
                                            "backend.offload_param=true"]))
    with pytest.raises(ConfigError, match="is a DeepSpeed setting"):
        backend_from_config(compose_config(["backend.zero_stage=1"]))


def test_config_file_values_pin_and_auto_is_planned(tmp_path: Path) -> None:
    user = tmp_path / "my_ds.json"
    text = json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": "auto"},
                       "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": True})
    user.write_text(text)
    spec = BackendSpec(name=BackendKind.deepspeed, config_file=str(user))
    assert spec.pins() == {"zero_stage": 3}
    with pytest.raises(ConfigError, match="contradicts backend.config_file"):
        dataclasses.replace(spec, zero_stage=1).pins()
    job = compose_job(["model=gpt_tiny"])
    plan = _plan(job, 4, zero_stage=3, micro_batch=2)
    config = ds_config(plan, job, base=spec.base_config())
    assert config["wall_clock_breakdown"] is True  # the user's keys are kept
    assert config["zero_optimization"]["stage"] == 3 and config["train_micro_batch_size_per_gpu"] == 2
    assert config["zero_optimization"]["offload_optimizer"] == {"device": "none"}
    assert user.read_text() == text  # read, never written


def test_ds_config_batch_identity_and_sections() -> None:
    job = compose_job(["model=gpt_tiny", "train.global_batch_size=32"])
    for stage in range(4):
        plan = _plan(job, 4, zero_stage=stage, micro_batch=2, offload_optimizer=stage > 0,
                     offload_param=stage == 3)
        config = ds_config(plan, job)
        assert config["train_batch_size"] == (config["train_micro_batch_size_per_gpu"]
                                               * config["gradient_accumulation_steps"] * 4) == 32
        zero = config["zero_optimization"]
        assert zero["stage"] == stage
        assert ("offload_param" in zero) == (stage == 3)
        assert zero["offload_optimizer"]["device"] == ("cpu" if stage else "none")
        assert config["bf16"]["enabled"] and config["optimizer"]["type"] == "AdamW"
    assert config["scheduler"]["type"] == "WarmupCosineLR"


def test_write_json_file_never_overwrites(tmp_path: Path) -> None:
    target = tmp_path / "ds_config.json"
    assert write_json_file({"a": 1}, target) == target
    assert write_json_file({"a": 1}, target) == target  # same content: reused
    other = write_json_file({"a": 2}, target)
    assert other != target and json.loads(target.read_text()) == {"a": 1} and json.loads(other.read_text()) == {"a": 2}


def test_canonical_string_round_trips_and_edits_are_caught() -> None:
    job = compose_job(["model=gpt_tiny", "train.global_batch_size=32"])
    plan = _plan(job, 4, zero_stage=3, micro_batch=4, activation_checkpointing=True, offload_param=True)
    assert Plan.parse(plan.canonical()) == plan
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.backend.value == "deepspeed" and plan.canonical().endswith(
        "prec=bf16,backend=deepspeed,zero=3,oopt=0,oparam=1,bucket=50000000")
    data = plan.to_json()
    data["micro_batch_size"] = 2
    with pytest.raises(PlanError, match="hash mismatch"):
        Plan.from_json(data)
    with pytest.raises(PlanError, match="says dp=3"):
        Plan.parse(plan.canonical().replace("dp=4", "dp=3"))
    with pytest.raises(PlanError, match="not a multiple of micro-batch 3"):
        _plan(job, 4, micro_batch=3)
    with pytest.raises(ConfigError, match="optimizer offload needs a ZeRO stage of 1 or more"):
        _plan(job, 4, offload_optimizer=True)


def test_deepspeed_plans_written_before_they_were_plans_still_load() -> None:
    legacy = "gpt_tiny@localx1x4:zero=2,dp=4,mb=2,ga=1,gbs=8,seq=64,ckpt=1,oopt=1,oparam=0,bucket=1000,prec=fp32"
    plan = Plan.parse(legacy)
    assert (plan.zero_stage, plan.micro_batch_size, plan.activation_checkpointing, plan.offload_optimizer,
            plan.bucket_elements, plan.precision) == (2, 2, True, True, 1000, "fp32")
    assert plan.parallel.distributed_optimizer and plan.dp == 4 and plan.num_microbatches == 1
    fields = {"model": "gpt_tiny", "cluster": "local", "nodes": 1, "gpus_per_node": 4, "zero_stage": 2,
              "micro_batch_size": 2, "global_batch_size": 8, "seq_length": 64, "activation_checkpointing": True,
              "offload_optimizer": True, "offload_param": False, "bucket_elements": 1000, "precision": "fp32"}
    old_json = {"schema_version": 1, "canonical": legacy, "hash": hashlib.sha256(legacy.encode()).hexdigest()[:16],
                "plan": fields,
                "predicted": {"step_time_s": 0.5, "peak_memory_gib": 1.0, "tokens_per_s_per_gpu": 10.0, "mfu": None,
                              "exposed_comm_s": 0.1}}
    loaded = Plan.from_json(old_json)
    assert loaded.canonical() == plan.canonical() and loaded.predicted.step_time_s == 0.5
    with pytest.raises(PlanError, match="dp=3 and ga=1 do not follow"):
        Plan.parse(legacy.replace("dp=4", "dp=3"))


def test_layout_with_model_parallelism_is_refused() -> None:
    cfg = compose_config(["backend=deepspeed", "parallel.tp=2", "+cfp=auto", "cfp.pp=2"])
    with pytest.raises(ConfigError) as info:
        check_layout(job_from_config(cfg), cfp_from_config(cfg))
    assert info.value.keys == ["parallel.tp", "cfp.pp"]


def test_a_precision_deepspeed_cannot_train_here_is_refused_before_any_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 on CPU: DeepSpeed's engine raised ValueError as it started (after profiling, on every rank)."""
    from deepspeed import accelerator

    from cfp_megatron.planner.deepspeed_launch import DeepSpeedLaunch

    class NoFp16:
        def is_fp16_supported(self) -> bool:
            return False

        def is_bf16_supported(self) -> bool:
            return True

        def device_name(self) -> str:
            return "cpu"

    monkeypatch.setattr(accelerator, "get_accelerator", lambda: NoFp16())
    job = compose_job(["backend=deepspeed", "train.precision=fp16"])
    cfp = cfp_from_config(compose_config(["backend=deepspeed"]))
    with pytest.raises(ConfigError) as info:
        DeepSpeedLaunch().check_job(job, cfp, 1, planned=False)
    assert info.value.keys == ["train.precision"] and "backend=megatron" in str(info.value)
    DeepSpeedLaunch().check_job(compose_job(["backend=deepspeed", "train.precision=bf16"]), cfp, 1, planned=False)


def test_manual_plan_defaults_and_bad_batch() -> None:
    cfg = compose_config(["backend=deepspeed", "backend.zero_stage=2", "train.micro_batch_size=2"])
    plan = manual_plan(job_from_config(cfg), backend_from_config(cfg), 2, on_gpu=False)
    assert (plan.zero_stage, plan.micro_batch_size, plan.gradient_accumulation_steps, plan.precision) == \
        (2, 2, 2, "fp32")
    cfg = compose_config(["backend=deepspeed", "train.micro_batch_size=3"])
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        manual_plan(job_from_config(cfg), backend_from_config(cfg), 2, on_gpu=False)


def test_a_deepspeed_plan_exports_like_any_plan() -> None:
    """One artifact: the torchrun command's overrides give back the same plan, the DeepSpeed config carries its
    ZeRO options, and Megatron-LM's arguments refuse it by name."""
    job = compose_job(["model=gpt_tiny", "train.global_batch_size=16"])
    plan = _plan(job, 2, zero_stage=3, micro_batch=2, activation_checkpointing=True, offload_param=True,
                 offload_optimizer=True, precision=Precision.fp32)
    command = torchrun_command(plan)
    assert "backend=deepspeed" in command and "backend.zero_stage=3" in command and "parallel." not in command
    overrides = [o for o in hydra_overrides(plan) if not o.startswith(("cluster.", "train.precision"))]
    cfg = compose_config(overrides)
    again = manual_plan(job_from_config(cfg), backend_from_config(cfg), 2, on_gpu=False)
    assert again.canonical() == plan.canonical()
    zero = deepspeed_config(plan)["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    assert ds_config(plan, job)["zero_optimization"] == zero
    with pytest.raises(PlanError, match="deepspeed plan"):
        megatron_lm_args(plan)


def _a100_job(model: str, nodes: int = 1):
    return compose_job([f"model={model}", "cluster=dgx_a100", f"cluster.nodes={nodes}",
                        "train.global_batch_size=64", "train.seq_length=2048", "train.precision=bf16"])


def test_zero_memory_falls_with_the_stage_and_offload_moves_it_to_the_host() -> None:
    job = _a100_job("llama3_8b")
    totals = []
    for stage in range(4):
        result = simulate_zero(job, _plan(job, 8, zero_stage=stage))
        m = result.memory
        totals.append(m.parameters + m.gradients + m.optimizer_states)
    assert totals[0] > totals[1] > totals[2] > totals[3]
    # ZeRO-0 in bf16: 2 (weights) + 6 (bf16 and fp32 gradients) + 12 (fp32 master, Adam) bytes per parameter
    params = simulate_zero(job, _plan(job, 8)).memory.parameters / 2
    assert totals[0] == pytest.approx(20 * params)
    plain = simulate_zero(job, _plan(job, 8, zero_stage=3))
    off = simulate_zero(job, _plan(job, 8, zero_stage=3, offload_optimizer=True, offload_param=True))
    assert off.memory.total < plain.memory.total and off.host_bytes > 0 and off.memory.optimizer_states == 0
    assert off.time.offload_s > 0
    ckpt = simulate_zero(job, _plan(job, 8, zero_stage=3, activation_checkpointing=True))
    assert ckpt.memory.activations < plain.memory.activations
    assert ckpt.time.compute_s > plain.time.compute_s and ckpt.time.param_gather_s > plain.time.param_gather_s
    # On GPUs ZeRO-3's gathers are prefetched behind the layers' compute: only a part is exposed.
    assert plain.time.param_gather_s < simulate_zero(job, _plan(job, 8, zero_stage=1)).time.param_gather_s
    # On CPU ranks nothing overlaps: ZeRO-3 moves parameters in every micro-batch, ZeRO-2 reduces in every
    # micro-batch, ZeRO-1 once per step.
    cpu = compose_job(["model=gpt_tiny", "train.global_batch_size=32"])
    s1, s2, s3 = (simulate_zero(cpu, _plan(cpu, 4, zero_stage=s, precision=Precision.fp32)).time for s in (1, 2, 3))
    assert s3.param_gather_s > s1.param_gather_s and s2.grad_reduce_s > s1.grad_reduce_s


@pytest.mark.parametrize("precision", [Precision.fp32, Precision.bf16])
def test_zero3_on_one_rank_needs_no_more_than_zero0_beyond_its_buckets(precision: Precision) -> None:
    """On one rank ZeRO-3 shards nothing away: its states are ZeRO-0's, only its buckets and gathered parameters
    come on top. In fp32 it once counted a second fp32 gradient partition and master copy (181 against 121 GiB for
    llama3_8b); DeepSpeed's stage 3 steps its fp32 partition in place."""
    job = compose_job(["model=llama3_8b", "cluster=dgx_a100", "cluster.gpus_per_node=1",
                       "train.global_batch_size=8", "train.seq_length=1024"])
    zero0, zero3 = (simulate_zero(job, _plan(job, 1, zero_stage=stage, precision=precision,
                                             activation_checkpointing=True)).memory for stage in (0, 3))
    assert zero3.total - zero0.total <= zero3.comm_buffers - zero0.comm_buffers + 1.0
    assert zero3.parameters + zero3.gradients + zero3.optimizer_states == pytest.approx(
        zero0.parameters + zero0.gradients + zero0.optimizer_states)


def test_search_fits_the_memory_and_respects_pins() -> None:
    job = _a100_job("llama3_8b")
    cfg = compose_config(["+cfp=auto", "backend=deepspeed"])
    cfp, backend = cfp_from_config(cfg), backend_from_config(cfg)
    result = search_zero(job, 8, cfp, backend, on_gpu=True)
    limit = 80 * GIB * 0.9
    assert all(r.result.memory.total <= limit for r in result.ranked)
    assert result.best.plan.zero_stage != 0  # 8B parameters x 20 bytes do not fit in 80 GB without ZeRO
    assert any(what.startswith("zero0") for what, _ in result.rejected)
    times = [r.result.step_time_s for r in result.ranked]
    assert times == sorted(times)
    assert search_zero(job, 8, cfp, backend, on_gpu=True).best.plan == result.best.plan  # deterministic
    pinned = search_zero(job, 8, cfp, dataclasses.replace(backend, zero_stage=3, offload_optimizer=True),
                         on_gpu=True)
    assert all(r.plan.zero_stage == 3 and r.plan.offload_optimizer for r in pinned.ranked)
    with pytest.raises(ConfigError, match="no DeepSpeed plan of llama3_8b on 8 ranks fits"):
        search_zero(job, 8, cfp, dataclasses.replace(backend, zero_stage=0), on_gpu=True)


def test_the_zero_report_reads_the_cost_term_registrys_lanes() -> None:
    """A ZeRO step's exposed data-parallel communication is the registry's data-parallel lane (in the passes at
    stage 3, after them below), its optimizer step the optimizer lane; the search's "exposed comm s" adds the
    registry's communication lanes."""
    from cfp_megatron.sim.terms import TERMS, LaneKind

    job = _a100_job("llama3_8b")
    cfg = compose_config(["+cfp=auto", "backend=deepspeed"])
    result = search_zero(job, 8, cfp_from_config(cfg), backend_from_config(cfg), on_gpu=True)
    assert {r.plan.zero_stage for r in result.ranked} & {3} and {r.plan.zero_stage for r in result.ranked} - {3}
    for r in result.ranked:
        t = r.result.time
        comm = t.grad_reduce_s + t.param_gather_s + t.offload_s
        assert comm > 0 and t.seconds("fsdp_comm_s" if r.plan.zero_stage == 3 else "dp_comm_s") == comm
        assert t.seconds("optimizer_s") == t.optimizer_s
        assert sum(t.seconds(lane.name) for lane in TERMS.lanes() if lane.kind is not LaneKind.comm) == t.optimizer_s
        assert r.plan.predicted is not None and r.plan.predicted.exposed_comm_s == comm


def test_search_on_cpu_leaves_offload_out_and_uses_engine_probes() -> None:
    job = compose_job(["model=gpt_tiny", "train.global_batch_size=32"])
    cfg = compose_config(["+cfp=auto", "backend=deepspeed"])
    cfp, backend = cfp_from_config(cfg), backend_from_config(cfg)
    result = search_zero(job, 4, cfp, backend)
    assert not any(r.plan.offload_optimizer or r.plan.offload_param for r in result.ranked)
    assert any(what == "offload" for what, _ in result.rejected)
    # measured engine costs replace the analytical terms: a costly ZeRO-0 step moves the choice away from it
    probes = EngineProbes(model="m", world=4, stages={
        0: StageProbe(stage=0, points=((1, 1.0), (2, 1.1), (4, 1.3))),
        1: StageProbe(stage=1, points=((1, 0.05), (2, 0.09), (4, 0.17))),
        2: StageProbe(stage=2, points=((1, 0.06), (2, 0.10), (4, 0.18))),
        3: StageProbe(stage=3, points=((1, 0.2), (2, 0.4), (4, 0.8)))})
    probed = search_zero(job, 4, cfp, backend, probes=probes)
    assert probed.best.plan.zero_stage == 1
    # one micro-batch per step (mb 8): the line through ZeRO-0's points is 0.9 s + 0.1 s per micro-batch, so the
    # per-step cost is 0.9 s and one micro-batch's extra cost 0.1 s less the passes at micro-batch 1
    zero0 = simulate_zero(job, _plan(job, 4, precision=Precision.fp32, micro_batch=8), probes=probes)
    one = _plan(job, 4, precision=Precision.fp32, micro_batch=1)
    pass_s = simulate_zero(job, one).time.compute_s / one.gradient_accumulation_steps  # passes of one micro-batch
    assert zero0.time.engine_s == pytest.approx(0.9 + max(0.1 - pass_s, 0.0), rel=0.05)
    assert zero0.time.grad_reduce_s == 0 and zero0.time.optimizer_s == 0
    assert zero0.step_time_s == pytest.approx(zero0.time.compute_s + zero0.time.engine_s)


def test_engine_probe_line_and_its_json_round_trip(tmp_path: Path) -> None:
    """The per-step and per-micro-batch costs are the least-squares line through the probe's points; the file keeps
    the points and reads back; a file of the old layout is ignored (re-probed), not misread."""
    probe = StageProbe(stage=2, points=((1, 0.30), (2, 0.52), (4, 0.88)))
    slope, intercept = np.polyfit([1, 2, 4], [0.30, 0.52, 0.88], 1)
    assert probe.per_microbatch_s(0.05) == pytest.approx(slope - 0.05)
    assert probe.per_step_s == pytest.approx(intercept)
    assert probe.per_microbatch_s(1.0) == 0.0
    probes = EngineProbes(model="m", world=4, stages={2: probe})
    path = tmp_path / "probes.json"
    path.write_text(json.dumps(probes.to_json()))
    assert load_probes(path, 4) == probes
    assert load_probes(path, 2) is None  # another world size
    path.write_text(json.dumps({"schema_version": 1, "model": "m", "world": 4,
                                "stages": [{"stage": 2, "one_s": 0.3, "two_s": 0.5}]}))
    assert load_probes(path, 4) is None


def test_engine_probes_are_measured_beyond_one_micro_batch_of_passes() -> None:
    """The passes the probes' per-micro-batch cost is taken beyond are one micro-batch's (model_job follows the
    plan's global batch; it once kept the job's, so this was the whole step's passes and the per-micro-batch cost
    came out 0)."""
    job = compose_job(["model=gpt_tiny", "train.global_batch_size=32"])
    plan = _plan(job, 4, precision=Precision.fp32, micro_batch=1)
    assert plan.gradient_accumulation_steps == 8
    one = dataclasses.replace(plan, global_batch_size=4, predicted=None)
    assert model_job(one, job).train.global_batch_size == 4
    cache = CostCache.for_job(model_job(plan, job), None, ZERO_SIM_OPTIONS)
    passes = megatron_passes(job, plan, None, cluster=job.cluster, cache=cache, single_pass=True)
    whole = passes.forward_s + passes.backward_s + passes.overhead_s
    assert passes.single_pass_s == pytest.approx(whole / 8, rel=0.05)


def test_zero3_fetches_follow_the_exported_persistence_threshold() -> None:
    """The exported ZeRO-3 config's persistence threshold is the one the cost model counts fetches with; linears at
    or under it are not fetched. The hook's default for a config that sets none is the installed DeepSpeed's."""
    job = compose_job(["model=gpt_tiny", "train.global_batch_size=16"])
    zero = deepspeed_config(_plan(job, 2, zero_stage=3, micro_batch=2))["zero_optimization"]
    threshold = zero["stage3_param_persistence_threshold"]
    assert threshold == ZERO3_PERSISTENCE_THRESHOLD
    layers = job.model.num_layers
    assert zero3_fetches(job.model, 0) == 4 * layers + 2
    # gpt_tiny's 64 x 64 attention output (4096 elements) stays whole; its QKV and MLP weights are fetched
    assert zero3_fetches(job.model) == 3 * layers + 2
    assert zero3_fetches(job.model, 10**9) == 0
    big = compose_job(["model=llama3_8b"]).model
    assert zero3_fetches(big) == zero3_fetches(big, DEEPSPEED_PERSISTENCE_THRESHOLD) == 4 * big.num_layers + 2
    zero_config = pytest.importorskip("deepspeed.runtime.zero.config")
    default = zero_config.DeepSpeedZeroConfig.model_fields["param_persistence_threshold"].default
    assert DEEPSPEED_PERSISTENCE_THRESHOLD == int(default)


def test_offload_is_priced_from_the_clusters_host_figures_and_refused_without_them() -> None:
    """ZeRO-Offload's copies run at the preset's host link and CPU Adam at the rank's share of its node's host
    memory bandwidth; a cluster that states neither leaves offload out of the search, and a pinned offload is a
    ConfigError naming the missing field."""
    job = _a100_job("llama3_8b")
    plan = _plan(job, 8, zero_stage=3, offload_optimizer=True)
    base = simulate_zero(job, plan)
    faster = dataclasses.replace(job.cluster, host_link_gbps=2 * job.cluster.host_link_gbps,
                                 host_memory_bandwidth_gbps=2 * job.cluster.host_memory_bandwidth_gbps)
    doubled = simulate_zero(job, plan, cluster=faster)
    assert doubled.time.offload_s == pytest.approx(base.time.offload_s / 2)
    assert doubled.time.optimizer_s == pytest.approx(base.time.optimizer_s / 2)
    bare = dataclasses.replace(job.cluster, host_memory_bandwidth_gbps=None)
    with pytest.raises(ConfigError, match="cluster.host_memory_bandwidth_gbps"):
        simulate_zero(job, plan, cluster=bare)
    linkless = dataclasses.replace(job.cluster, host_link_gbps=None)
    with pytest.raises(ConfigError, match="cluster.host_link_gbps"):
        simulate_zero(job, _plan(job, 8, zero_stage=3, offload_param=True), cluster=linkless)
    cfp, backend = cfp_from_config(compose_config([])), backend_from_config(compose_config(["backend=deepspeed"]))
    result = search_zero(dataclasses.replace(job, cluster=bare), 8, cfp, backend, on_gpu=True)
    assert not any(r.plan.offload_optimizer for r in result.ranked)
    assert any(what == "offload_optimizer" and "cluster.host_memory_bandwidth_gbps" in why
               for what, why in result.rejected)
    assert result.evaluated < search_zero(job, 8, cfp, backend, on_gpu=True).evaluated  # the preset tries offload
