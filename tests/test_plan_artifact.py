"""The Plan artifact: canonical string round trip, hash stability and sensitivity, plan.json round trip and its
errors, the never-overwrite rule of save_plan, and the exports (Megatron-LM arguments, DeepSpeed config, and a torchrun
command whose Hydra overrides, composed with the real conf/, give back the plan's layout).

Jobs are composed from the repository's own Hydra configs, as tests/test_config.py does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from cfp_megatron.base.compose import register_configs
from cfp_megatron.base.config import JobSpec, ParallelSpec, Recompute, job_from_config
from cfp_megatron.plan import (
    PLAN_FILE_SETTING,
    SCHEMA_VERSION,
    Plan,
    PlanError,
    PlanPrediction,
    deepspeed_config,
    load_plan,
    megatron_lm_args,
    save_plan,
    torchrun_command,
)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"

PREDICTION = PlanPrediction(step_time_s=12.5, tokens_per_s_per_gpu=245.75, mfu=0.4375, peak_memory_gib=61.25,
                            bubble_fraction=0.0625, exposed_comm_s=0.75)

# name -> (Hydra overrides, world size). Each layout is one the runtime accepts for that model and cluster.
LAYOUTS: dict[str, tuple[tuple[str, ...], int]] = {
    "gpt3_vpp_sp": (("model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=128", "parallel.tp=8", "parallel.sp=true",
                     "parallel.pp=16", "parallel.vpp=2", "parallel.distributed_optimizer=true",
                     "train.global_batch_size=1536", "train.micro_batch_size=1", "train.seq_length=2048",
                     "train.precision=bf16"), 1024),
    "mixtral_ep_etp_full_recompute": (("model=mixtral_8x7b", "cluster=dgx_h100", "cluster.nodes=4", "parallel.tp=2",
                                       "parallel.pp=2", "parallel.ep=8", "parallel.etp=2", "parallel.recompute=full",
                                       "parallel.recompute_num_layers=2", "train.global_batch_size=64",
                                       "train.micro_batch_size=1", "train.seq_length=4096",
                                       "train.precision=bf16"), 32),
    "llama70b_cp_selective_pp_dp_order": (("model=llama3_70b", "cluster=dgx_h100", "cluster.nodes=8", "parallel.tp=8",
                                           "parallel.sp=true", "parallel.pp=4", "parallel.cp=2",
                                           "parallel.recompute=selective", "parallel.overlap_grad_reduce=true",
                                           "parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true",
                                           "parallel.order=tp-cp-ep-pp-dp", "train.global_batch_size=32",
                                           "train.micro_batch_size=1", "train.seq_length=8192",
                                           "train.precision=fp16"), 64),
    "mixtral_selective_modules": (("model=mixtral_8x7b", "cluster=dgx_h100", "cluster.nodes=4", "parallel.ep=8",
                                   "parallel.recompute=selective", "parallel.recompute_modules=moe+layernorm",
                                   "train.global_batch_size=32", "train.micro_batch_size=1", "train.seq_length=4096",
                                   "train.precision=bf16"), 32),
    "llama405b_uneven_stages": (("model=llama3_405b", "cluster=dgx_h100", "cluster.nodes=64", "parallel.tp=8",
                                 "parallel.sp=true", "parallel.pp=16", "parallel.first_stage_layers=7",
                                 "parallel.last_stage_layers=7", "parallel.distributed_optimizer=true",
                                 "train.global_batch_size=64", "train.micro_batch_size=1", "train.seq_length=8192",
                                 "train.precision=bf16"), 512),
    "tiny_local_auto": (("model=gpt_tiny", "parallel.tp=2", "parallel.pp=2", "train.global_batch_size=8",
                         "train.micro_batch_size=2"), 4),
}


@pytest.fixture(scope="module", autouse=True)
def _schema() -> None:
    register_configs()


def make_job(*overrides: str) -> JobSpec:
    """Compose conf/config.yaml with command-line style overrides and build the frozen specs."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return job_from_config(compose(config_name="config", overrides=list(overrides)))


def make_plan(name: str, *, prediction: PlanPrediction | None = PREDICTION, fingerprint: str = "f00d") -> Plan:
    overrides, world = LAYOUTS[name]
    return Plan.from_job(make_job(*overrides), world_size=world, prediction=prediction, inputs_fingerprint=fingerprint)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: make_plan(name) for name in LAYOUTS}


def arg_value(args: list[str], flag: str) -> str:
    """The value after ``flag`` in an argument list."""
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


# --------------------------------------------------------------------------------------------------------------------
# Canonical string


def test_canonical_format_of_the_gpt3_plan(plans: dict[str, Plan]) -> None:
    text = plans["gpt3_vpp_sp"].canonical()
    assert text.startswith("gpt3_175b@dgx_a100x128x8:tp=8,sp=1,pp=16,vpp=2,cp=1,ep=1,etp=1,dp=8,mb=1,gbs=1536,"
                           "seq=2048,ppf=null,ppl=null,rc=none,rcn=1,")
    assert text.endswith(",do=1,ogr=0,opg=0,gf32=1,order=tp-cp-ep-dp-pp,mlp=megatron,mlpn=null,prec=bf16")
    assert " " not in text and "\n" not in text


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_canonical_round_trip(plans: dict[str, Plan], name: str) -> None:
    plan = plans[name]
    parsed = Plan.parse(plan.canonical())
    assert parsed.canonical() == plan.canonical()
    assert parsed.plan_hash() == plan.plan_hash()
    # Everything but the prediction and the fingerprint comes back exactly (they are not in the string).
    assert parsed == dataclasses.replace(plan, predicted=None, inputs_fingerprint="")
    assert Plan.parse("  " + plan.canonical() + "\n") == parsed


def test_every_parallel_field_is_in_the_canonical_string(plans: dict[str, Plan]) -> None:
    keys = [item.split("=")[0] for item in plans["gpt3_vpp_sp"].canonical().split(":", 1)[1].split(",")]
    assert len(keys) == len(set(keys))
    short = {"recompute": "rc", "recompute_num_layers": "rcn", "recompute_method": "rcm",
             "distributed_optimizer": "do", "overlap_grad_reduce": "ogr", "overlap_param_gather": "opg",
             "first_stage_layers": "ppf", "last_stage_layers": "ppl", "grad_reduce_in_fp32": "gf32",
             "primepar_layers": "mlpn"}
    for f in dataclasses.fields(ParallelSpec):
        if f.metadata["layout"].optional:  # written only away from its default: old plans keep their hashes
            assert f.metadata["layout"].key not in keys, f.name
            continue
        assert short.get(f.name, f.name) in keys, f.name
    assert {"dp", "mb", "gbs", "seq", "prec"} <= set(keys)


def test_a_field_added_later_keeps_old_plans_and_round_trips() -> None:
    """The embedding/loss accounting fields came after plans were saved: a default one leaves the string (and the
    hash) as before; a set one is written, parsed back, and exported as Megatron-LM's flag."""
    job = make_job("model=llama_tiny", "parallel.pp=2")
    plain = Plan.from_job(job, world_size=2, prediction=None, inputs_fingerprint="")
    assert "ppemb" not in plain.canonical() and "pploss" not in plain.canonical()
    counted = Plan.from_job(make_job("model=llama_tiny", "parallel.pp=2",
                                     "parallel.account_for_embedding_in_pipeline_split=true",
                                     "parallel.account_for_loss_in_pipeline_split=true", "model.num_layers=6"),
                            world_size=2, prediction=None, inputs_fingerprint="")
    assert ",ppemb=1,pploss=1," in counted.canonical() and Plan.parse(counted.canonical()) == counted
    args = megatron_lm_args(counted)
    assert "--account-for-embedding-in-pipeline-split" in args and "--account-for-loss-in-pipeline-split" in args


def test_pipeline_layout_round_trips_and_exports() -> None:
    """The per-stage layout is an optional key (a plan without one keeps its string and hash): written with its
    groups and repeats, parsed back, exported as Megatron-LM's --pipeline-model-parallel-layout (without the
    interleaving flags, which Megatron-LM refuses beside it: the stage count gives the virtual size) and as a quoted
    torchrun override that Hydra reads back to the same plan."""
    plain = Plan.from_job(make_job("model=gpt_tiny", "parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=8"),
                          world_size=2, prediction=None, inputs_fingerprint="")
    assert "pplayout" not in plain.canonical()
    overrides = ("model=gpt_tiny", "model.num_layers=5", "parallel.pp=2", "parallel.vpp=2", "train.global_batch_size=8")
    plan = Plan.from_job(make_job(*overrides, "parallel.pipeline_model_parallel_layout='Ett|(t|)*2tL'"), world_size=2,
                         prediction=None, inputs_fingerprint="")
    assert ",pplayout=Ett|(t|)*2tL," in plan.canonical() and Plan.parse(plan.canonical()) == plan
    assert "layout=Ett|(t|)*2tL" in plan.describe()
    args = megatron_lm_args(plan, num_layers=5)
    assert args[args.index("--pipeline-model-parallel-layout") + 1] == "Ett|(t|)*2tL"
    assert not {"--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage"} & set(args)
    command = shlex.split(torchrun_command(plan))
    assert 'parallel.pipeline_model_parallel_layout="Ett|(t|)*2tL"' in command
    again = Plan.from_job(make_job("model=gpt_tiny", "model.num_layers=5",
                                   *(a for a in command if a.startswith(("parallel.", "train."))),
                                   "cluster.gpus_per_node=2"), world_size=2, prediction=None, inputs_fingerprint="")
    assert again.canonical() == plan.canonical()


def test_moe_overlaps_round_trip_and_export() -> None:
    """The expert all-to-all and shared-expert overlaps are optional keys: written only when on, parsed back,
    exported as Megatron-LM's flags and as torchrun overrides."""
    common = ("model=moe_tiny", "cluster=dgx_h100", "cluster.nodes=1", "parallel.ep=4", "train.global_batch_size=16")
    plain = Plan.from_job(make_job(*common), world_size=8, prediction=None, inputs_fingerprint="")
    assert "a2ao" not in plain.canonical()
    overlap = Plan.from_job(make_job(*common, "parallel.moe_a2a_overlap=true"), world_size=8, prediction=None,
                            inputs_fingerprint="")
    assert ",a2ao=1," in overlap.canonical() and Plan.parse(overlap.canonical()) == overlap
    assert overlap.plan_hash() != plain.plan_hash()
    assert "--overlap-moe-expert-parallel-comm" in megatron_lm_args(overlap)
    assert "parallel.moe_a2a_overlap=true" in torchrun_command(overlap)


def test_vpp_and_etp_of_one_are_the_same_plan_as_none() -> None:
    job = make_job("model=gpt_tiny", "parallel.pp=2", "parallel.vpp=1", "parallel.etp=1")
    plan = Plan.from_job(job, world_size=2, prediction=None, inputs_fingerprint="")
    assert plan.parallel.vpp is None and plan.parallel.etp is None
    default = Plan.from_job(make_job("model=gpt_tiny", "parallel.pp=2"), world_size=2, prediction=None,
                            inputs_fingerprint="")
    assert plan == default and plan.plan_hash() == default.plan_hash()
    assert ",vpp=1," in plan.canonical() and ",etp=1," in plan.canonical()


@pytest.mark.parametrize(("text", "expected"), [
    ("gpt_tiny@localx1x4", "no ':'"),
    ("gpt_tiny-localx1x4:tp=1", "is not <model>@<cluster>x<nodes>x<gpus_per_node>"),
    ("gpt_tiny@local1x4:tp=1", "is not <model>@<cluster>x<nodes>x<gpus_per_node>"),
    ("gpt_tiny@localxAx4:tp=1", "is not <model>@<cluster>x<nodes>x<gpus_per_node>"),
])
def test_parse_rejects_a_bad_head(text: str, expected: str) -> None:
    with pytest.raises(PlanError, match=re.escape(expected)):
        Plan.parse(text)


def _with(text: str, key: str, value: str | None) -> str:
    """``text`` with ``key``'s value replaced (or the item removed when value is None)."""
    head, body = text.split(":", 1)
    items = []
    for item in body.split(","):
        k = item.split("=")[0]
        if k == key:
            if value is not None:
                items.append(f"{k}={value}")
        else:
            items.append(item)
    return f"{head}:{','.join(items)}"


@pytest.mark.parametrize(("mutate", "expected"), [
    (lambda t: _with(t, "tp", None), "lacks ['tp']"),
    (lambda t: _with(t, "prec", None), "lacks ['prec']"),
    (lambda t: t + ",zz=1", "unknown keys ['zz']"),
    (lambda t: t + ",tp=8", "repeats the key 'tp'"),
    (lambda t: t + ",justtext", "'justtext' is not key=value"),
    (lambda t: _with(t, "tp", "eight"), "tp='eight' is not an integer"),
    (lambda t: _with(t, "sp", "yes"), "parallel.sp='yes' must be 1 or 0"),
    (lambda t: _with(t, "rc", "some"), "parallel.recompute='some' is not one of"),
    (lambda t: _with(t, "dp", "4"), "says dp=4 but world / (tp x cp x pp) = 1024 / 128 = 8"),
    (lambda t: _with(t, "tp", "3"), "not divisible by tp x cp x pp"),
    (lambda t: _with(t, "prec", "int4"), "precision='int4'"),
    (lambda t: _with(_with(t, "tp", "1"), "dp", "64"), "sequence parallelism needs parallel.tp > 1"),
])
def test_parse_names_what_is_wrong(plans: dict[str, Plan], mutate: Callable[[str], str], expected: str) -> None:
    text = mutate(plans["gpt3_vpp_sp"].canonical())
    with pytest.raises(PlanError, match=re.escape(expected)):
        Plan.parse(text)


def test_plan_error_is_a_typed_value_error() -> None:
    with pytest.raises(ValueError):
        Plan.parse("nonsense")


# --------------------------------------------------------------------------------------------------------------------
# Hash


def test_hash_is_sha256_of_the_canonical_string_and_stable(plans: dict[str, Plan]) -> None:
    plan = plans["gpt3_vpp_sp"]
    assert plan.plan_hash() == hashlib.sha256(plan.canonical().encode()).hexdigest()[:16]
    assert re.fullmatch(r"[0-9a-f]{16}", plan.plan_hash())
    again = make_plan("gpt3_vpp_sp", prediction=None, fingerprint="another-input")
    assert again.plan_hash() == plan.plan_hash()  # composed afresh; prediction and fingerprint do not count


def _variants(plan: Plan) -> dict[str, Plan]:
    """The plan with one knob changed at a time (each still a valid plan)."""
    p = plan.parallel

    def par(**kw: object) -> Plan:
        return dataclasses.replace(plan, parallel=dataclasses.replace(p, **kw))

    out = {
        "tp": par(tp=4), "sp": par(sp=False), "pp": par(pp=8), "vpp": par(vpp=4), "vpp_off": par(vpp=None),
        "cp": par(cp=2), "ep": par(ep=2), "etp": par(etp=2), "distributed_optimizer": par(distributed_optimizer=False),
        "recompute": par(recompute=Recompute.selective), "recompute_num_layers": par(recompute_num_layers=2),
        "overlap_grad_reduce": par(overlap_grad_reduce=True), "overlap_param_gather": par(overlap_param_gather=True),
        "order": par(order="tp-cp-ep-pp-dp"),
        "first_stage_layers": par(first_stage_layers=1), "last_stage_layers": par(last_stage_layers=2),
        "micro_batch_size": dataclasses.replace(plan, micro_batch_size=2),
        "global_batch_size": dataclasses.replace(plan, global_batch_size=768),
        "seq_length": dataclasses.replace(plan, seq_length=4096),
        "precision": dataclasses.replace(plan, precision="fp16"),
        "nodes": dataclasses.replace(plan, nodes=64),
        "gpus_per_node": dataclasses.replace(plan, nodes=256, gpus_per_node=4),
        "model": dataclasses.replace(plan, model="gpt3_175b_v2"),
        "cluster": dataclasses.replace(plan, cluster="dgx_h100"),
    }
    if any(f.name == "recompute_method" for f in dataclasses.fields(ParallelSpec)):
        method = type(p.recompute_method)  # type: ignore[attr-defined]
        out["recompute_method"] = par(recompute=Recompute.full, recompute_method=method("block"))
    return out


def test_changing_any_knob_changes_the_hash(plans: dict[str, Plan]) -> None:
    plan = plans["gpt3_vpp_sp"]
    variants = _variants(plan)
    hashes = {name: v.plan_hash() for name, v in variants.items()}
    assert plan.plan_hash() not in hashes.values()
    assert len(set(hashes.values())) == len(hashes)  # and no two changes collide
    for variant in variants.values():
        assert Plan.parse(variant.canonical()).canonical() == variant.canonical()


# --------------------------------------------------------------------------------------------------------------------
# plan.json


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_json_round_trip(plans: dict[str, Plan], name: str) -> None:
    plan = plans[name]
    d = json.loads(json.dumps(plan.to_json()))
    assert d["schema_version"] == SCHEMA_VERSION
    assert d["canonical"] == plan.canonical() and d["hash"] == plan.plan_hash()
    assert d["inputs_fingerprint"] == "f00d" and d["prediction"]["mfu"] == 0.4375
    assert d["dp"] == plan.dp and d["world_size"] == plan.world_size
    assert Plan.from_json(d) == plan
    no_prediction = dataclasses.replace(plan, predicted=None)
    assert Plan.from_json(json.loads(json.dumps(no_prediction.to_json()))) == no_prediction


def test_newer_schema_version_is_refused_with_the_fix(plans: dict[str, Plan]) -> None:
    d = plans["gpt3_vpp_sp"].to_json()
    d["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(PlanError, match="newer cfp-megatron") as info:
        Plan.from_json(d)
    assert "upgrade cfp-megatron" in str(info.value)
    del d["schema_version"]
    with pytest.raises(PlanError, match="no valid schema_version"):
        Plan.from_json(d)


@pytest.mark.parametrize(("edit", "value"), [(("parallel", "tp"), 4), (("hash",), "0123456789abcdef"),
                                             (("micro_batch_size",), 2), (("parallel", "recompute"), "selective")])
def test_hand_edit_is_caught_by_the_hash(plans: dict[str, Plan], edit: tuple[str, ...], value: object) -> None:
    d = json.loads(json.dumps(plans["gpt3_vpp_sp"].to_json()))
    target = d
    for key in edit[:-1]:
        target = target[key]
    target[edit[-1]] = value
    with pytest.raises(PlanError, match=re.escape("plan.json was edited: hash mismatch")):
        Plan.from_json(d)


def test_from_json_names_missing_and_unknown_keys(plans: dict[str, Plan]) -> None:
    d = plans["gpt3_vpp_sp"].to_json()
    del d["seq_length"]
    d["surprise"] = 1
    with pytest.raises(PlanError, match=r"lacks \['seq_length'\].*unknown keys \['surprise'\]"):
        Plan.from_json(d)


def test_save_and_load(plans: dict[str, Plan], tmp_path: Path) -> None:
    plan = plans["mixtral_ep_etp_full_recompute"]
    path = save_plan(plan, tmp_path / "run" / "plan.json")
    assert path == tmp_path / "run" / "plan.json"
    assert load_plan(path) == plan
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan.json"]  # no temporary file left


def test_save_plan_never_overwrites(plans: dict[str, Plan], tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("the user's file\n")
    with pytest.raises(PlanError) as info:
        save_plan(plans["gpt3_vpp_sp"], path)
    err = info.value
    assert err.setting == PLAN_FILE_SETTING == "cfp.plan_file"
    assert str(path) in str(err) and "choose another path" in str(err) and "remove" in str(err)
    assert path.read_text() == "the user's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_load_plan_errors(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="does not exist"):
        load_plan(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="is not valid JSON: .* line 1 column 2"):
        load_plan(bad)


# --------------------------------------------------------------------------------------------------------------------
# Building and applying


def test_from_job_checks_the_world_size() -> None:
    job = make_job("model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=2")
    with pytest.raises(PlanError, match="world size 8 differs from cluster.nodes x cluster.gpus_per_node = 2 x 8"):
        Plan.from_job(job, world_size=8, prediction=None, inputs_fingerprint="")
    with pytest.raises(PlanError, match="not divisible by tp x cp x pp"):
        Plan.from_job(make_job("model=gpt_tiny", "parallel.tp=4"), world_size=2, prediction=None,
                      inputs_fingerprint="")
    with pytest.raises(PlanError, match="global_batch_size=8 is not a multiple of micro_batch_size x dp"):
        Plan.from_job(make_job("model=gpt_tiny", "train.micro_batch_size=4"), world_size=4, prediction=None,
                      inputs_fingerprint="")


def test_apply_sets_layout_and_batch(plans: dict[str, Plan]) -> None:
    plan = plans["gpt3_vpp_sp"]
    job = make_job("model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=128", "train.precision=fp16")
    applied = plan.apply(job)
    assert applied.parallel == plan.parallel
    assert (applied.train.micro_batch_size, applied.train.global_batch_size, applied.train.seq_length) == (1, 1536,
                                                                                                          2048)
    # the plan's precision is applied (a typed train.precision that differs is refused at launch: launch_plan)
    assert applied.train.precision.value == "bf16" and applied.model == job.model and applied.cluster == job.cluster
    with pytest.raises(PlanError, match="the plan is for model 'gpt3_175b' but the job's model is 'gpt_tiny'"):
        plan.apply(make_job("model=gpt_tiny"))


# --------------------------------------------------------------------------------------------------------------------
# Exports


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_torchrun_command_composes_back_to_the_plan(plans: dict[str, Plan], name: str) -> None:
    plan = plans[name]
    command = torchrun_command(plan)
    tokens = shlex.split(command)
    assert tokens[:3] == ["torchrun", f"--nnodes={plan.nodes}", f"--nproc_per_node={plan.gpus_per_node}"]
    multi = plan.nodes > 1
    assert ("--rdzv_backend=c10d" in tokens) is multi
    assert ("--rdzv_endpoint=$MASTER_ADDR:29500" in tokens) is multi
    overrides = tokens[tokens.index("launch/train.py") + 1:]
    for f in dataclasses.fields(ParallelSpec):
        assert sum(o.startswith(f"parallel.{f.name}=") for o in overrides) == 1, f.name
    job = make_job(*overrides)
    assert job.parallel == plan.parallel
    assert (job.train.micro_batch_size, job.train.global_batch_size, job.train.seq_length) == (
        plan.micro_batch_size, plan.global_batch_size, plan.seq_length)
    assert job.train.precision.value == plan.precision
    rebuilt = Plan.from_job(job, world_size=plan.world_size, prediction=None, inputs_fingerprint="")
    assert rebuilt.canonical() == plan.canonical()


def test_torchrun_command_writes_null_for_vpp_of_one(plans: dict[str, Plan]) -> None:
    command = torchrun_command(plans["tiny_local_auto"], script="my dir/train.py")
    assert "parallel.vpp=null" in command and "parallel.etp=null" in command
    assert "'my dir/train.py'" in command
    assert "torchrun --nnodes=1 --nproc_per_node=4 " in command and "rdzv" not in command


def test_megatron_args_gpt3(plans: dict[str, Plan]) -> None:
    plan = plans["gpt3_vpp_sp"]
    args = megatron_lm_args(plan, num_layers=96)
    assert arg_value(args, "--tensor-model-parallel-size") == "8"
    assert arg_value(args, "--pipeline-model-parallel-size") == "16"
    assert arg_value(args, "--num-layers-per-virtual-pipeline-stage") == "3"  # 96 / (16 x 2)
    assert arg_value(args, "--context-parallel-size") == "1"
    assert arg_value(args, "--expert-model-parallel-size") == "1"
    assert arg_value(args, "--expert-tensor-parallel-size") == "1"
    assert arg_value(args, "--micro-batch-size") == "1"
    assert arg_value(args, "--global-batch-size") == "1536"
    assert arg_value(args, "--seq-length") == "2048"
    for flag in ("--sequence-parallel", "--use-distributed-optimizer", "--bf16"):
        assert args.count(flag) == 1, flag
    for flag in ("--fp16", "--recompute-granularity", "--overlap-grad-reduce", "--overlap-param-gather",
                 "--use-tp-pp-dp-mapping", "--num-virtual-stages-per-pipeline-rank"):
        assert flag not in args
    no_layers = megatron_lm_args(plan)
    assert arg_value(no_layers, "--num-virtual-stages-per-pipeline-rank") == "2"
    assert "--num-layers-per-virtual-pipeline-stage" not in no_layers
    with pytest.raises(PlanError, match=r"num_layers=100 does not split into pp x vpp = 16 x 2 = 32"):
        megatron_lm_args(plan, num_layers=100)


def test_recompute_modules_travel_with_the_plan(plans: dict[str, Plan]) -> None:
    plan = plans["mixtral_selective_modules"]
    args = megatron_lm_args(plan, num_layers=32)
    at = args.index("--recompute-modules")
    assert args[at + 1:at + 3] == ["layernorm", "moe"] and arg_value(args, "--recompute-granularity") == "selective"
    assert ",rcmod=layernorm+moe," in plan.canonical() and Plan.parse(plan.canonical()).parallel == plan.parallel
    assert "rc=selective[layernorm+moe]" in plan.describe()
    default = megatron_lm_args(plans["llama70b_cp_selective_pp_dp_order"], num_layers=80)
    assert arg_value(default, "--recompute-modules") == "core_attn" and ",rcmod=" not in plans[
        "llama70b_cp_selective_pp_dp_order"].canonical()


def test_megatron_args_moe_recompute_order_precision(plans: dict[str, Plan]) -> None:
    moe = megatron_lm_args(plans["mixtral_ep_etp_full_recompute"], num_layers=32)
    assert arg_value(moe, "--expert-model-parallel-size") == "8"
    assert arg_value(moe, "--expert-tensor-parallel-size") == "2"
    assert arg_value(moe, "--recompute-granularity") == "full"
    assert arg_value(moe, "--recompute-method") == "uniform"
    assert arg_value(moe, "--recompute-num-layers") == "2"
    assert "--sequence-parallel" not in moe and "--use-distributed-optimizer" not in moe
    llama = megatron_lm_args(plans["llama70b_cp_selective_pp_dp_order"], num_layers=80)
    assert arg_value(llama, "--context-parallel-size") == "2"
    assert arg_value(llama, "--recompute-granularity") == "selective"
    assert "--recompute-method" not in llama
    for flag in ("--overlap-grad-reduce", "--overlap-param-gather", "--use-tp-pp-dp-mapping", "--fp16"):
        assert llama.count(flag) == 1, flag
    assert "--bf16" not in llama
    uneven = megatron_lm_args(plans["llama405b_uneven_stages"], num_layers=126)
    assert arg_value(uneven, "--decoder-first-pipeline-num-layers") == "7"
    assert arg_value(uneven, "--decoder-last-pipeline-num-layers") == "7"
    assert "--decoder-first-pipeline-num-layers" not in llama
    assert "--bf16" in megatron_lm_args(plans["tiny_local_auto"])  # auto means bf16 for a Megatron-LM (GPU) run
    odd = dataclasses.replace(plans["tiny_local_auto"],
                              parallel=dataclasses.replace(plans["tiny_local_auto"].parallel, order="dp-tp-cp-ep-pp"))
    with pytest.raises(PlanError, match="cannot express the rank order 'dp-tp-cp-ep-pp'"):
        megatron_lm_args(odd)


def test_megatron_args_gradient_precision(plans: dict[str, Plan]) -> None:
    """fp16 with the default fp32 gradient reduction asks Megatron-LM for it; bf16 gets it from Megatron-LM itself,
    which cannot keep bf16 gradients, so that plan is refused with the setting named."""
    fp16 = plans["llama70b_cp_selective_pp_dp_order"]
    assert "--accumulate-allreduce-grads-in-fp32" in megatron_lm_args(fp16, num_layers=80)
    fp16_grads = dataclasses.replace(fp16, parallel=dataclasses.replace(fp16.parallel, grad_reduce_in_fp32=False))
    assert "--accumulate-allreduce-grads-in-fp32" not in megatron_lm_args(fp16_grads, num_layers=80)
    bf16 = plans["gpt3_vpp_sp"]
    assert "--accumulate-allreduce-grads-in-fp32" not in megatron_lm_args(bf16, num_layers=96)
    bf16_grads = dataclasses.replace(bf16, parallel=dataclasses.replace(bf16.parallel, grad_reduce_in_fp32=False))
    with pytest.raises(PlanError, match="grad_reduce_in_fp32=false with bf16") as err:
        megatron_lm_args(bf16_grads, num_layers=96)
    assert err.value.setting == "parallel.grad_reduce_in_fp32"
    text = bf16_grads.canonical()
    assert ",gf32=0," in text and Plan.parse(text).parallel.grad_reduce_in_fp32 is False


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_deepspeed_batch_arithmetic(plans: dict[str, Plan], name: str) -> None:
    plan = plans[name]
    cfg = deepspeed_config(plan)
    assert cfg["train_batch_size"] == plan.global_batch_size
    assert cfg["train_micro_batch_size_per_gpu"] == plan.micro_batch_size
    assert cfg["train_batch_size"] == (cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
                                       * plan.dp)
    assert cfg["zero_optimization"]["stage"] == (1 if plan.parallel.distributed_optimizer else 0)
    assert cfg["bf16"]["enabled"] == (plan.precision in ("bf16", "auto"))
    assert cfg["fp16"]["enabled"] == (plan.precision == "fp16")
    assert cfg["gradient_clipping"] == 1.0
    json.dumps(cfg)


def test_deepspeed_values(plans: dict[str, Plan]) -> None:
    cfg = deepspeed_config(plans["gpt3_vpp_sp"], gradient_clipping=0.5)
    assert cfg["gradient_accumulation_steps"] == 192  # 1536 / (1 x 8)
    assert cfg["gradient_clipping"] == 0.5
    assert "cfp" not in cfg and "tensor_parallel" not in cfg  # the layout is left to Megatron's arguments
