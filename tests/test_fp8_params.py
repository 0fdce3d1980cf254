"""The weight memory each number format holds as Transformer Engine and Megatron-Core keep it, and FP8 parameters
(``parallel.fp8_param_gather``) as a plan setting: priced (memory and the parameter all-gather), refused where it
cannot run, carried by the plan to Megatron-LM's arguments and Megatron-Core's fields, and read from the published
rows whose recipes set it (docs/simulator.md, "Number formats")."""

from __future__ import annotations

import pytest

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config, compose_job
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.model.megatron_config import transformer_config
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import megatron_lm_args, torchrun_command
from cfp_megatron.search.formats import set_formats, with_format
from cfp_megatron.sim.format_costs import param_gather_element_bytes
from cfp_megatron.sim.sharding import StateBytes
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.validate import predict_rows
from cfp_megatron.validation.rows import PUBLISHED_RUNS_DIR, read_rows

LLAMA_70B = ["model=llama3_70b", "cluster.nodes=8", "parallel.tp=8", "parallel.pp=4", "parallel.sp=true",
             "parallel.distributed_optimizer=true", "train.global_batch_size=64", "train.micro_batch_size=1",
             "train.seq_length=4096"]
BLOCK = 1 + 4 / (128 * 128)  # FP8 data and an fp32 scale per 128 x 128 weight block
MX = 1 + 1 / 32  # FP8 data and an E8M0 scale per 32 elements
NV = 0.5 + 1 / 16  # FP4 data and an E4M3 scale per 16 elements


def _job(cluster: str, *more: str):
    return compose_job([*LLAMA_70B, f"cluster={cluster}", *more])


@pytest.mark.parametrize(("cluster", "fmt", "bf16_params", "fp8_params"), [
    # Hopper runs FP8 GEMMs only TN: a per-tensor FP8 weight keeps its transpose beside its data
    ("dgx_h100", ["train.fp8_recipe=delayed"], 2 + 2.0, 2.0),
    ("dgx_h100", ["train.fp8_recipe=tensorwise"], 2 + 2.0, 2.0),
    ("dgx_h100", ["train.fp8_recipe=blockwise"], 2 + 2 * BLOCK, 2 * BLOCK),
    # Blackwell runs them in every layout: the column-wise usage is the row-wise data; block formats keep both
    ("b200", ["train.fp8_recipe=delayed"], 2 + 1.0, 1.0),
    ("b200", ["train.fp8_recipe=tensorwise"], 2 + 1.0, 1.0),
    ("b200", ["train.fp8_recipe=blockwise"], 2 + 2 * BLOCK, 2 * BLOCK),
    ("b200", ["train.fp8_recipe=mxfp8"], 2 + 2 * MX, 2 * MX),
])
def test_weight_bytes_per_format_with_and_without_fp8_parameters(cluster: str, fmt: list[str], bf16_params: float,
                                                                  fp8_params: float) -> None:
    cached = StateBytes.megatron(_job(cluster, "train.precision=fp8", *fmt))
    kept = StateBytes.megatron(_job(cluster, "train.precision=fp8", *fmt, "parallel.fp8_param_gather=true"))
    assert cached.weights == pytest.approx(bf16_params) and kept.weights == pytest.approx(fp8_params)
    # the fp32 master weights, the gradients and the optimizer states are the same either way
    assert (kept.master_weights, kept.gradients, kept.optimizer_states) == (
        cached.master_weights, cached.gradients, cached.optimizer_states) and kept.master_weights == 4.0


def test_16_bit_and_fp4_weights() -> None:
    assert StateBytes.megatron(_job("dgx_h100", "train.precision=bf16")).weights == 2.0
    assert StateBytes.megatron(_job("b200", "train.precision=fp4")).weights == pytest.approx(2 + 2 * NV)


def test_fp8_parameters_lower_the_weight_memory_and_halve_the_parameter_gather() -> None:
    cached = _job("dgx_h100", "train.precision=fp8", "train.fp8_recipe=tensorwise")
    kept = _job("dgx_h100", "train.precision=fp8", "train.fp8_recipe=tensorwise", "parallel.fp8_param_gather=true")
    a, b = simulate(cached), simulate(kept)
    c = simulate(_job("dgx_h100", "train.precision=bf16"))
    # the TE layers' 4 bytes a parameter (bf16 and the cached data and transpose) become 2 (data and transpose),
    # as many as bf16 alone holds; the embedding and output layer hold bf16 throughout
    assert b.memory.parameters == pytest.approx(c.memory.parameters) and b.memory.parameters < a.memory.parameters
    assert b.memory.activations == a.memory.activations and b.memory.gradients == a.memory.gradients
    assert param_gather_element_bytes(cached, 2.0) == 2.0 and param_gather_element_bytes(kept, 2.0) == 1.0
    assert b.time.dp_comm_s < a.time.dp_comm_s
    # MXFP8 parameters are gathered in bf16, through the gradient buffer
    mx = _job("b200", "train.precision=fp8", "train.fp8_recipe=mxfp8", "parallel.fp8_param_gather=true")
    assert param_gather_element_bytes(mx, 2.0) == 2.0


@pytest.mark.parametrize(("more", "names"), [
    (["train.precision=fp8", "parallel.distributed_optimizer=false"], "parallel.distributed_optimizer=true"),
    (["train.precision=bf16"], "train.precision=fp8"),
    (["train.precision=fp4"], "train.precision=fp8"),
])
def test_fp8_parameters_are_refused_where_megatron_cannot_keep_them(more: list[str], names: str) -> None:
    with pytest.raises(ConfigError) as info:
        _job("b200", "parallel.fp8_param_gather=true", *more)
    issue = next(i for i in info.value.issues if i.key == "parallel.fp8_param_gather")
    assert issue.value is True and names in issue.fix


def test_under_auto_the_search_keeps_fp8_parameters_only_with_an_fp8_format() -> None:
    job = _job("dgx_h100", "parallel.fp8_param_gather=true")  # auto: a set may still choose FP8
    with pytest.raises(ConfigError) as info:  # no set: auto trains in bf16, which would ignore them
        set_formats(job, cfp_from_config(compose_config(["+cfp=auto"])), te_available=True)
    assert info.value.issues[0].key == "parallel.fp8_param_gather" and "bf16" in info.value.issues[0].problem
    assert not with_format(job, NumberFormat.parse("bf16")).parallel.fp8_param_gather
    assert with_format(job, NumberFormat.parse("fp8-tensorwise")).parallel.fp8_param_gather


@pytest.mark.parametrize(("recipe", "extra"), [("tensorwise", []), ("mxfp8", ["--reuse-grad-buf-for-mxfp8-param-ag"])])
def test_the_plan_carries_fp8_parameters_to_megatron(recipe: str, extra: list[str]) -> None:
    job = _job("b200", "train.precision=fp8", f"train.fp8_recipe={recipe}", "parallel.fp8_param_gather=true")
    plan = Plan.from_job(job, world_size=64, prediction=None, inputs_fingerprint="")
    assert ",fp8pg=" in plan.canonical() and Plan.parse(plan.canonical()) == plan
    assert Plan.from_json(plan.to_json()) == plan and plan.parallel.fp8_param_gather
    args = megatron_lm_args(plan)
    assert "--fp8-param-gather" in args and ("--reuse-grad-buf-for-mxfp8-param-ag" in args) == bool(extra)
    assert "parallel.fp8_param_gather=true" in torchrun_command(plan)
    assert plan.apply(_job("b200", "train.precision=fp8", f"train.fp8_recipe={recipe}")).parallel.fp8_param_gather
    config = transformer_config(job, ParallelDims.build(job, 64), on_gpu=False)
    assert config.fp8_param and config.fp8_recipe == recipe
    assert NumberFormat.of(job.train).param_fields(True) == {"fp8_param_gather": True,
                                                             "reuse_grad_buf_for_mxfp8_param_ag": bool(extra)}
    # without the setting the canonical string is what it was (no key), and Megatron-Core keeps 16-bit weights
    plain = _job("b200", "train.precision=fp8", f"train.fp8_recipe={recipe}")
    plain_plan = Plan.from_job(plain, world_size=64, prediction=None, inputs_fingerprint="")
    assert "fp8pg" not in plain_plan.canonical() and "--fp8-param-gather" not in megatron_lm_args(plain_plan)
    assert not transformer_config(plain, ParallelDims.build(plain, 64), on_gpu=False).fp8_param


def test_the_rows_keep_fp8_parameters_as_their_recipes_did() -> None:
    rows = [r for name in ("published_runs.csv", "published_runs_moe.csv")
            for r in read_rows(PUBLISHED_RUNS_DIR / name) if r["id"] in ("51", "81", "86")]
    results, _ = predict_rows(rows)
    kept = {r.plan.row_id: r.plan.job.parallel.fp8_param_gather for r in results}
    # NeMo 24.07's launcher set no fp8_params; Megatron-Bridge's FP8 precision configs set fp8_param_gather
    assert kept == {"51": False, "81": True, "86": True}


def test_the_embedding_and_output_layer_keep_16_bit_weights_and_no_copies() -> None:
    bf16, fp8 = (_job("dgx_h100", "parallel.pp=1", "cluster.nodes=1", f"train.precision={p}",
                      "train.global_batch_size=8") for p in ("bf16", "fp8"))
    a, b = simulate(bf16), simulate(fp8)
    vocab = 2 * fp8.model.padded_vocab_size * fp8.model.hidden_size / 8  # embedding and (untied) output layer, TP=8
    decoder = a.memory.parameters / 2 - vocab  # bf16: 2 bytes each (one rank: nothing is sharded)
    # fp8 adds 2 bytes a parameter for the TE layers' copies, none for the embedding and the output layer
    assert b.memory.parameters - a.memory.parameters == pytest.approx(2 * decoder, rel=1e-6)
