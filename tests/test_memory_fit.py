"""Memory on every machine (issue R, deliverable 2): the local cluster's memory is the host's shared by its ranks on
CPU; a job no layout of which fits, a layout by hand that does not fit, an impossible pin and a GPU preset on a
machine without a GPU are each refused before profiling and before any process group, naming the cause."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import ClusterSpec, Precision, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.profile import cluster as cluster_module
from cfp_megatron.profile.cluster import host_memory_gib, host_share_gib, local_measurements

HOST_GIB = 23.5
"""The host memory these tests pretend to have (the machine of the issue's repro)."""

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the host's memory is the limit only without a GPU")


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A host of :data:`HOST_GIB` and an empty profile cache (analytical figures)."""
    monkeypatch.setattr(cluster_module, "host_memory_gib", lambda: HOST_GIB)
    monkeypatch.setattr("cfp_megatron.planner.memory_fit.host_memory_gib", lambda: HOST_GIB)
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "cache"))


def _compose(*overrides: str):
    cfg = compose_config(list(overrides))
    return job_from_config(cfg), cfp_from_config(cfg)


def test_host_memory_is_memtotal_else_the_page_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:        2097152 kB\nMemFree:          1000 kB\nMemAvailable:  5 kB\n")
    monkeypatch.setattr(cluster_module, "MEMINFO", meminfo)
    assert host_memory_gib() == 2.0  # the total, never what happens to be free
    monkeypatch.setattr(cluster_module, "MEMINFO", tmp_path / "absent")
    assert host_memory_gib() > 0


def test_the_host_is_shared_by_the_ranks_of_a_node_less_the_reserves() -> None:
    spec = ClusterSpec(host_reserve_gib=1.0, rank_reserve_gib=0.5)
    assert host_share_gib(spec, 2, total_gib=24.0) == pytest.approx(11.0)
    assert host_share_gib(spec, 4, total_gib=24.0) == pytest.approx(5.25)
    with pytest.raises(ConfigError, match="64 ranks share this host's 24.0 GiB") as info:
        host_share_gib(spec, 64, total_gib=24.0)
    assert info.value.keys == ["cluster.gpus_per_node"] and "--nproc_per_node" in str(info.value)
    with pytest.raises(ConfigError, match="it leaves nothing for one rank") as info:  # not the rank count's fault
        host_share_gib(ClusterSpec(host_reserve_gib=1.0, rank_reserve_gib=30.0), 1, total_gib=24.0)
    assert info.value.keys == ["cluster.rank_reserve_gib"] and "set it below 23.00" in str(info.value)


@cpu_only
def test_the_local_cluster_on_cpu_plans_with_the_hosts_memory(host: None) -> None:
    job, _ = _compose("model=gpt_tiny")
    assert (job.cluster.host_reserve_gib, job.cluster.rank_reserve_gib) == (1.0, 0.5)  # conf/cluster/local.yaml
    two, _ = local_measurements(job, world_size=2)
    four, _ = local_measurements(job, world_size=4)
    assert two.hbm_gib == pytest.approx((HOST_GIB - 1.0) / 2 - 0.5)
    assert four.hbm_gib == pytest.approx((HOST_GIB - 1.0) / 4 - 0.5)
    given, _ = _compose("model=gpt_tiny", "cluster.hbm_gib=3")
    assert local_measurements(given, world_size=2)[0].hbm_gib == 3.0  # a figure the user gives wins
    preset, _ = _compose("cluster=dgx_h100")
    assert local_measurements(preset, world_size=8)[0].hbm_gib == 80.0  # a GPU preset plans with its own


@cpu_only
def test_auto_refuses_a_job_that_cannot_fit_before_profiling(host: None, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    """The repro: llama3_8b on 2 CPU ranks of a 23.5 GiB host profiled for a minute, then died in the allocator."""
    from cfp_megatron.planner import launch_plan

    def no_profiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled a job that cannot fit")

    monkeypatch.setattr(launch_plan, "_profile_and_search", no_profiling)
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, restart_count=0, under_torchrun=True)
    job, cfp = _compose("+cfp=auto", "model=llama3_8b")
    with pytest.raises(ConfigError) as info:
        launch_plan.resolve_launch_plan(job, cfp, env, tmp_path)
    text = str(info.value)
    assert info.value.keys == ["cluster"] and "no layout of llama3_8b on 2 ranks fits in memory" in text
    assert "needs at least" in text and "each rank has 10.75 GiB (this host's 23.5 GiB" in text
    assert "fewer ranks per node" in text and "smaller model" in text and "recompute" in text
    job, cfp = _compose("+cfp=auto", "cluster.hbm_gib=0.001")  # the issue's second repro: named, not cp=2
    with pytest.raises(ConfigError, match="cluster.hbm_gib=0.001: no layout of gpt_tiny") as info:
        launch_plan.resolve_launch_plan(job, cfp, env, tmp_path)
    assert "cp=2" not in str(info.value)


@cpu_only
def test_a_layout_by_hand_that_cannot_fit_is_refused_before_any_group(host: None) -> None:
    import torch.distributed as dist

    from cfp_megatron.planner.entry import train_from_config
    from cfp_megatron.planner.memory_fit import check_layout_fits

    job, _ = _compose("model=gpt_tiny")
    check_layout_fits(job, 2)  # the tests' small models fit
    with pytest.raises(ConfigError, match=r"the layout tp=1 pp=1 cp=1 micro_batch=2 recompute=none of llama3_8b on "
                                          r"1 rank needs .* GiB per rank .* each rank has 22.00 GiB"):
        train_from_config(compose_config(["model=llama3_8b", "train.steps=1"]))
    assert not dist.is_initialized()


@cpu_only
def test_preflight_exits_nonzero_when_nothing_fits(host: None, tmp_path: Path, capsys) -> None:
    from cfp_megatron.planner.plan_cli import main

    out = str(tmp_path / "plans")
    assert main(["model=deepseek_v3", "cluster=local", "cluster.gpus_per_node=2", "--out", out]) == 2
    text = capsys.readouterr().out
    assert "no layout of deepseek_v3 on 2 ranks fits in memory" in text and "GiB per rank" in text
    assert main(["model=llama3_8b", "cluster=dgx_h100", "cluster.hbm_gib=1", "--out", out]) == 2
    assert "cluster.hbm_gib=1.0: no layout of llama3_8b on 8 ranks fits" in capsys.readouterr().out
    assert main(["cfp.micro_batch=3", "--world", "2", "--out", out]) == 2
    assert "cfp.micro_batch=3: no layout of gpt_tiny on 2 ranks takes it" in capsys.readouterr().out
    assert not Path(out).exists() or not any(Path(out).iterdir())  # nothing written


@pytest.mark.parametrize(("overrides", "world", "key", "words"), [
    (["cfp.micro_batch=3"], 2, "cfp.micro_batch", "3 does not divide the sequences of a step per data-parallel rank "
                                                  "(train.global_batch_size=8: 4 at DP 2, 8 at DP 1)"),
    (["cfp.constraints.micro_batch=[3,5]"], 4, "cfp.constraints.micro_batch", "5 does not divide"),
    (["cfp.micro_batch=128"], 1, "cfp.micro_batch", "above cfp.constraints.max_micro_batch=64"),
    (["cfp.sp=true"], 1, "cfp.sp", "every layout left has TP 1"),
    (["cfp.mlp=primepar"], 2, "cfp.mlp", "TP group of 4^k ranks"),
    (["cfp.vpp=2", "train.global_batch_size=3"], 3, "cfp.vpp", "interleaving (vpp 2) needs pipeline parallelism"),
    (["cfp.tp=3"], 4, "cfp.tp", "tp=3: does not divide the world size 4"),
    (["cfp.ep=2"], 2, "cfp.ep", "gpt_tiny is a dense model: it has no experts to split"),
    (["cfp.distributed_optimizer=true"], 1, "cfp.distributed_optimizer", "leaves DP 1"),
    (["cfp.tp=2", "cfp.distributed_optimizer=true"], 2, "cfp", "leaves DP 1"),
    (["cfp.tp=2", "cfp.pp=2"], 2, "cfp", "must divide the 2 ranks"),
])
def test_an_impossible_pin_is_named_before_profiling(overrides: list[str], world: int, key: str, words: str) -> None:
    from cfp_megatron.planner.launch_plan import check_constraints

    job, cfp = _compose("+cfp=auto", *overrides)
    with pytest.raises(ConfigError) as info:
        check_constraints(job, world, cfp)
    assert info.value.keys == [key] and words in str(info.value), str(info.value)
    assert "cp=2" not in str(info.value)  # not blamed on a knob no pin asked for


def test_pins_that_fail_together_are_said_as_the_command_line_writes_them() -> None:
    """Each pin as ``key=value`` (not the group with a dict), every problem a sentence before ``Fix:``."""
    from cfp_megatron.planner.launch_plan import check_constraints

    job, cfp = _compose("+cfp=auto", "cfp.tp=2", "cfp.pp=2")
    with pytest.raises(ConfigError) as info:
        check_constraints(job, 2, cfp)
    assert "  - cfp.tp=2 cfp.pp=2: each of cfp.tp, cfp.pp leaves layouts" in str(info.value), str(info.value)
    assert "{" not in str(info.value)


def test_a_search_that_leaves_nothing_is_one_issue_of_the_search_not_one_per_value_it_tried() -> None:
    from cfp_megatron.search.search import nothing_left

    err = nothing_left([("cp=2", "context parallelism needs Transformer Engine's attention"),
                        ("tp=8", "does not divide the world size 4")], "relax the cfp pins.")
    assert len(err.issues) == 1 and err.keys == ["cfp"]
    assert str(err.issues[0]) == ("cfp='auto': the search left no layout (what ruled them out: cp=2: context "
                                  "parallelism needs Transformer Engine's attention; tp=8: does not divide the world "
                                  "size 4). Fix: relax the cfp pins.")


def test_a_problem_without_a_full_stop_still_ends_before_fix() -> None:
    from cfp_megatron.base.errors import ConfigIssue

    issue = ConfigIssue(key="cfp.cp", value=2, problem="needs Transformer Engine", fix="leave it out.")
    assert str(issue) == "cfp.cp=2: needs Transformer Engine. Fix: leave it out."


def test_possible_pins_pass(host: None) -> None:
    from cfp_megatron.planner.launch_plan import check_constraints

    for overrides, world in ((["cfp.micro_batch=2"], 2), (["cfp.tp=2", "cfp.sp=true"], 2), ([], 4),
                             (["model=moe_tiny", "cfp.ep=2"], 2)):
        job, cfp = _compose("+cfp=auto", *overrides)
        check_constraints(job, world, cfp)


@cpu_only
def test_a_gpu_preset_is_refused_for_training_on_a_machine_without_a_gpu() -> None:
    import torch.distributed as dist

    from cfp_megatron.planner.entry import train_from_config

    with pytest.raises(ConfigError, match="cluster='dgx_h100': names NVIDIA H100-SXM5-80GB GPUs, and this machine has "
                                          "none") as info:
        train_from_config(compose_config(["cluster=dgx_h100", "cluster.gpus_per_node=1", "train.steps=1"]))
    assert "cluster=local" in str(info.value) and "python -m cfp_megatron.plan cluster=dgx_h100" in str(info.value)
    assert not dist.is_initialized()


@cpu_only
@pytest.mark.parametrize(("override", "key", "said"), [
    ("cluster.device_name=H100", "cluster.device_name", "drop cluster.device_name=H100: cluster=local trains on"),
    ("cluster.generation=hopper", "cluster.generation", "drop cluster.generation=hopper")])  # was ignored, silently
def test_gpu_settings_on_the_cpu_cluster_are_refused_naming_the_key(override: str, key: str, said: str) -> None:
    from cfp_megatron.planner.memory_fit import check_training_machine

    job, _ = _compose(override)
    with pytest.raises(ConfigError) as info:
        check_training_machine(job)
    assert info.value.keys == [key] and said in str(info.value)


@cpu_only
def test_nccl_where_it_cannot_run_is_refused_before_the_rendezvous() -> None:
    """Training and profiling both resolve the backend before any rendezvous (torch's RuntimeError traceback on
    every rank before)."""
    from cfp_megatron.base.config import Backend
    from cfp_megatron.engine.distributed import resolve_backend

    with pytest.raises(ConfigError) as info:
        resolve_backend(Backend.nccl)
    assert info.value.keys == ["cluster.backend"] and "set cluster.backend=gloo" in str(info.value)
    assert resolve_backend(Backend.auto) == "gloo"


@cpu_only
def test_mfu_on_cpu_is_against_the_cpus_measured_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    from cfp_megatron.engine import peak

    monkeypatch.setattr(peak, "measure_matmul_tflops", lambda *args, **kwargs: 0.25)
    job, _ = _compose("cluster=dgx_h100")
    value, source = peak.peak_tflops(job.cluster, Precision.bf16)
    assert value == 0.25 and source.startswith("measured (fp32 matmul: no NVIDIA H100-SXM5-80GB here)")
    assert "cfp profile" in source  # measured at each start: the source says how to make it comparable


def _zero_no_fit(*overrides: str) -> str:
    from cfp_megatron.base.backend_spec import backend_from_config
    from cfp_megatron.planner.deepspeed_memory import check_zero_search_fits

    cfg = compose_config(["backend=deepspeed", "+cfp=auto", *overrides])
    job = job_from_config(cfg)
    with pytest.raises(ConfigError) as info:
        check_zero_search_fits(job, job.cluster.nodes * job.cluster.gpus_per_node, cfp_from_config(cfg),
                               backend_from_config(cfg), on_gpu=True, figures=(job.cluster, None))
    return str(info.value)


def test_deepspeed_no_fit_without_pins_names_the_fewest_nodes_that_fit() -> None:
    """Issue Q, deliverable 3: no ZeRO plan of Llama-3 405B on one DGX H100 node, nothing pinned: the error plans
    more nodes and names the fewest that fit (its plan planned there), and names no pin to relax."""
    text = _zero_no_fit("model=llama3_405b", "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=1024",
                        "train.seq_length=4096")
    assert "The fewest nodes of cluster=dgx_h100 on which one fits: cluster.nodes=4 (32 ranks): zero3" in text
    assert "size the cluster to cluster.nodes=4 or more" in text
    assert "remove backend" not in text and "pin" not in text.split("Fix:")[1]
    few = _zero_no_fit("model=llama3_405b", "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=8")
    assert "train.global_batch_size=8 has none for more ranks" in few and "cluster.nodes=2" not in few


def test_deepspeed_no_fit_with_pins_names_those_pins_only() -> None:
    text = _zero_no_fit("model=llama3_70b", "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=64",
                        "train.seq_length=8192", "backend.zero_stage=1", "cfp.micro_batch=1")
    assert "remove backend.zero_stage, cfp.micro_batch)" in text
    assert "backend.activation_checkpointing" not in text and "The fewest nodes" not in text


def test_deepspeed_search_leaving_nothing_names_its_pins_only_where_there_are_pins() -> None:
    from cfp_megatron.backends.deepspeed.search import search_zero
    from cfp_megatron.base.backend_spec import backend_from_config

    def refused(*overrides: str) -> str:
        cfg = compose_config(["backend=deepspeed", "+cfp=auto", *overrides])
        with pytest.raises(ConfigError) as info:
            search_zero(job_from_config(cfg), 2, cfp_from_config(cfg), backend_from_config(cfg))
        return str(info.value)

    text = refused("cfp.constraints.micro_batch=[3]")
    assert "relax the cfp pins and constraints (cfp.constraints.micro_batch)" in text
    assert "none of them divides the 4 sequences per rank" in text
    bare = refused("cluster.hbm_gib=0.0001")  # nothing pinned, every plan over the memory
    assert "no cfp pin or constraint is set" in bare and "relax" not in bare and "start more ranks" in bare


@cpu_only
def test_deepspeed_auto_refuses_a_job_that_cannot_fit_before_profiling(host: None, monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    """``backend=deepspeed +cfp=auto model=llama3_8b`` on 2 CPU ranks: refused before the profiling and the engine
    probes, naming the memory; ``gpt_tiny`` passes."""
    import torch.distributed as dist

    from cfp_megatron.base.backend_spec import backend_from_config
    from cfp_megatron.planner import launch_plan
    from cfp_megatron.planner.deepspeed_memory import check_zero_search_fits
    from cfp_megatron.planner.entry import train_from_config

    def no_profiling(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled a job that cannot fit")

    monkeypatch.setattr(launch_plan, "_profile_and_search", no_profiling)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        train_from_config(_ds_config("+cfp=auto", "model=llama3_8b", "train.steps=1"))
    text = str(info.value)
    assert info.value.keys == ["cluster"] and "no DeepSpeed ZeRO plan of llama3_8b on 2 ranks fits in memory" in text
    assert "needs at least" in text and "each rank has 10.75 GiB (this host's 23.5 GiB" in text
    assert "fewer ranks per node" in text and "backend=megatron" in text
    assert "backend.zero_stage" not in text and "pinned" not in text  # nothing pinned: no pin to relax
    assert not dist.is_initialized()
    cfg = compose_config(["backend=deepspeed", "+cfp=auto", "model=gpt_tiny"])
    check_zero_search_fits(job_from_config(cfg), 2, cfp_from_config(cfg), backend_from_config(cfg), on_gpu=False)
    with pytest.raises(ConfigError, match="cluster.hbm_gib=0.001: no DeepSpeed ZeRO plan of gpt_tiny"):
        train_from_config(_ds_config("+cfp=auto", "cluster.hbm_gib=0.001", "train.steps=1"))
    with pytest.raises(ConfigError, match="train.global_batch_size"):  # the search's own refusals stay its own
        train_from_config(_ds_config("+cfp=auto", "train.global_batch_size=7", "train.steps=1"))


@cpu_only
def test_a_deepspeed_plan_by_hand_that_cannot_fit_is_refused(host: None, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path) -> None:
    import torch.distributed as dist

    from cfp_megatron.base.backend_spec import backend_from_config
    from cfp_megatron.planner.deepspeed_entry import manual_plan
    from cfp_megatron.planner.deepspeed_memory import check_zero_plan_fits
    from cfp_megatron.planner.entry import train_from_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"cluster='local': the DeepSpeed plan zero0 mb2 ga4 of llama3_8b on 1 rank "
                                          r"needs .* GiB per rank .* each rank has 22.00 GiB") as info:
        train_from_config(compose_config(["backend=deepspeed", "model=llama3_8b", "train.steps=1"]))
    assert "backend.zero_stage=3" in str(info.value) and not dist.is_initialized()
    with pytest.raises(ConfigError, match="the DeepSpeed plan zero3 mb2 ga4 ckpt of llama3_8b"):
        train_from_config(compose_config(["backend=deepspeed", "model=llama3_8b", "backend.zero_stage=3",
                                          "backend.activation_checkpointing=true", "train.steps=1"]))
    cfg = compose_config(["backend=deepspeed", "model=gpt_tiny"])
    job, backend = job_from_config(cfg), backend_from_config(cfg)
    check_zero_plan_fits(job, manual_plan(job, backend, 2, on_gpu=False), 2)  # the tests' small models fit


def _ds_config(*overrides: str) -> object:
    """The composed config of ``backend=deepspeed`` and ``overrides``."""
    return compose_config(["backend=deepspeed", *overrides])


# ------------------------------------------------------------------------ the machine's shape and what it holds

def _torchrun(world: int, here: int) -> LaunchEnv:
    return LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=here, restart_count=0,
                     under_torchrun=True)


@pytest.mark.parametrize(("overrides", "world", "here", "key"), [
    (["cluster.nodes=2"], 2, 2, "cluster.nodes"),  # both ranks on this host, each planned with all of it
    (["cluster.gpus_per_node=4"], 4, 2, "cluster.gpus_per_node cluster.nodes"),  # 2 nodes of 2, planned as 1 of 4
    (["cluster=dgx_h100", "cluster.nodes=2"], 16, 8, None),  # torchrun --nnodes=2 --nproc_per_node=8
    (["cluster.nodes=2"], 4, 2, None),  # two agents of 2 ranks (tests/test_launch_plan.py's c10d job)
])
def test_the_clusters_shape_is_the_one_torchrun_started(overrides: list[str], world: int, here: int,
                                                        key: str | None) -> None:
    from cfp_megatron.planner.job_checks import check_node_shape

    job, _ = _compose(*overrides)
    if key is None:
        check_node_shape(job, _torchrun(world, here))
        return
    with pytest.raises(ConfigError, match=f"torchrun started .*{here} on this node|{here} rank\\(s\\) on this node") \
            as info:
        check_node_shape(job, _torchrun(world, here))
    assert info.value.keys == key.split()
    check_node_shape(job, dataclasses.replace(_torchrun(world, here), under_torchrun=False))  # a plain process


@cpu_only
def test_the_local_clusters_memory_is_at_most_this_machines_for_training(host: None) -> None:
    from cfp_megatron.planner.memory_fit import check_training_machine

    job, _ = _compose("model=llama3_8b", "cluster.hbm_gib=100000")
    with pytest.raises(ConfigError, match="is more memory than each rank has on this machine, 10.75 GiB") as info:
        check_training_machine(job, 2)
    assert info.value.keys == ["cluster.hbm_gib"] and "at most 10.75" in str(info.value)
    check_training_machine(_compose("model=llama3_8b", "cluster.hbm_gib=3")[0], 2)  # a lower limit holds


@cpu_only
def test_a_cluster_of_another_size_than_the_world_is_one_error_before_the_search(host: None, capsys) -> None:
    from cfp_megatron.planner.megatron_launch import MegatronLaunch
    from cfp_megatron.planner.plan_cli import main

    job, cfp = _compose("+cfp=auto", "cluster.gpus_per_node=4")
    with pytest.raises(ConfigError, match="1 x 4 = 4 but 2 ranks were started") as info:
        MegatronLaunch().check_job(job, cfp, 2, planned=True)  # before profiling (it used to profile, then fail)
    assert info.value.keys == ["cluster.nodes"]
    assert main(["cluster=dgx_h100", "cluster.gpus_per_node=2", "--world", "4", "--out", "unused"]) == 2
    text = capsys.readouterr().out
    assert text.count("but 4 ranks were started") == 1 and "1 invalid setting" in text  # once, not per layout


def test_pins_that_leave_no_layout_in_memory_are_named(capsys, tmp_path: Path) -> None:
    from cfp_megatron.planner.plan_cli import main

    out = str(tmp_path / "plans")
    assert main(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "cfp.tp=1", "cfp.recompute=none",
                 "cfp.micro_batch=8", "train.global_batch_size=64", "--out", out]) == 2
    text = capsys.readouterr().out
    assert "cfp.tp=1: no layout of llama3_8b on 8 ranks with cfp.tp=1, cfp.micro_batch=8, cfp.recompute=none fits" \
        in text.replace("\n", " ")
    flat = " ".join(text.split())  # the message wraps where the console's width puts it
    assert "without them, dp" in flat and "Fix: drop or widen cfp.tp, cfp.micro_batch, cfp.recompute" in flat


def test_preflight_refuses_what_it_would_ignore(capsys, tmp_path: Path) -> None:
    from cfp_megatron.planner.plan_cli import main

    out = str(tmp_path / "plans")
    for args, says in ((["+cfp=manual", "--world", "1"], "cfp='manual': python -m cfp_megatron.plan searches"),
                       (["cfp.plan=gpt_tiny@localx1x1:tp=1", "--world", "1"], "cfp.plan='gpt_tiny@localx1x1:tp=1'"),
                       (["backend=deepspeed", "cfp.tp=2", "--world", "2"], "cfp.tp=[2]: the DeepSpeed backend"),
                       (["backend=deepspeed", "cfp.recompute=full", "--world", "1"],
                        "backend.activation_checkpointing=true|false"),
                       (["backend=deepspeed", "cluster.hbm_gib=0.0001", "--world", "1"],
                        "cluster.hbm_gib=0.0001: no DeepSpeed ZeRO plan of gpt_tiny on 1 rank fits in memory")):
        assert main([*args, "--out", out]) == 2, args
        assert says in capsys.readouterr().out.replace("\n", " "), args
    assert not list(Path(out).rglob("*.json"))  # nothing planned, nothing written
