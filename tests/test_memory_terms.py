"""The memory model's terms against first principles: the loss's logits, what full recomputation keeps and makes
again, what sequence parallelism divides, the element size of activations, the allocator's band in the fit check,
and the validator's memory failures (docs/simulator.md, "memory.py" and "Allocator band")."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config, compose_job
from cfp_megatron.base.config import Recompute, RecomputeModule
from cfp_megatron.base.cuda_env import ALLOC_CONF_VARS
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.search.search import search
from cfp_megatron.sim.backward_memory import backward_flow_bytes
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import (
    BAND_FILE,
    NORM_STATISTIC_BYTES,
    MemoryBand,
    layer_activation_bytes,
    loss_bytes_per_logit,
    memory_band,
    projection_input_bytes,
)
from cfp_megatron.sim.options import AttentionKernel, SimOptions, WeightGradAccumulation
from cfp_megatron.sim.prediction import GIB
from cfp_megatron.sim.sharding import Sharding
from cfp_megatron.sim.simulate import predict_memory
from cfp_megatron.validation.memory_failures import memory_failure_lines, memory_failures
from cfp_megatron.validation.results import RowPlan, RowResult

H100 = ["cluster=dgx_h100", "cluster.nodes=1", "cluster.gpus_per_node=1", "train.global_batch_size=2",
        "train.micro_batch_size=1"]


def _job(*overrides: str):
    return compose_job([*H100, *overrides])


def _parts(job, options: SimOptions | None = None) -> dict[str, float]:
    return dict(predict_memory(job, options=options or SimOptions(), world_size=1).parts)


def test_the_loss_keeps_its_fp32_softmax_and_one_logit_tensor_beside_it() -> None:
    # Megatron-Core's vocab-parallel cross entropy: the fp32 softmax (4 bytes, made in place in the fp32 copy) and
    # the bf16 logits beside it; in fp32 the copy is the tensor itself.
    assert loss_bytes_per_logit(2.0) == 6.0
    assert loss_bytes_per_logit(4.0) == 4.0
    assert loss_bytes_per_logit(2.0, mtp_layers=1) == 10.0  # each MTP layer's softmax is kept too
    job = _job("model=llama_tiny", "train.seq_length=512")
    tokens = 512
    assert _parts(job)["logits"] == pytest.approx(tokens * job.model.padded_vocab_size * 6.0)


def test_transformer_engines_fused_cross_entropy_keeps_the_logits_alone() -> None:
    # TE's Triton kernel (Megatron-Core's cross_entropy_fusion_impl='te', NVIDIA's performance recipes) reads the
    # logits in their dtype and writes their gradient over them: no fp32 softmax beside them.
    assert loss_bytes_per_logit(2.0, te_cross_entropy=True) == 2.0
    assert loss_bytes_per_logit(2.0, mtp_layers=1, te_cross_entropy=True) == 4.0
    job = _job("model=llama_tiny", "train.seq_length=512")
    fused = _parts(job, SimOptions(te_cross_entropy=True))["logits"]
    assert fused == pytest.approx(512 * job.model.padded_vocab_size * 2.0)
    assert fused * 3 == pytest.approx(_parts(job)["logits"])


def test_tp_buffers_are_megatrons_global_buffer_and_te_s_gathers_in_the_backward() -> None:
    # Without SP the TP all-reduces run in place (mappings.py, _reduce) and a flash core asks for no global buffer;
    # with SP the output layer (and every column-parallel linear of the local spec) gathers its input into the global
    # buffer, one [tokens, hidden] tensor held for the run; Transformer Engine's linears gather again in a layer's
    # backward pass, hidden under the loss's logits on the last stage, on top of the activations on the others.
    tp = ["model=llama_tiny", "train.seq_length=512", "parallel.tp=2", "cluster.gpus_per_node=2"]
    plain = dict(predict_memory(_job(*tp, "parallel.sp=false")).parts)
    sp_job = _job(*tp, "parallel.sp=true")
    with_sp = dict(predict_memory(sp_job).parts)
    gather = 512 * sp_job.model.hidden_size * 2
    assert plain["tp_buffers"] == 0.0
    assert with_sp["tp_buffers"] == gather
    pipelined = _job(*tp, "parallel.sp=true", "parallel.pp=2", "cluster.gpus_per_node=4",
                     "train.global_batch_size=4")
    first = predict_memory(pipelined, world_size=4)
    assert first.stage == 0 and dict(first.parts)["tp_buffers"] == 2 * gather
    # The unfused core's baddbmm input (b x heads / tp x s x s) is the same buffer: the larger of the two requests.
    unfused = SimOptions(attention=AttentionKernel.fused_softmax)
    scores = 1 * 4 / 2 * 512 * 512 * 2
    assert dict(predict_memory(_job(*tp, "parallel.sp=false"), options=unfused).parts)["tp_buffers"] == scores
    assert dict(predict_memory(sp_job, options=unfused).parts)["tp_buffers"] == max(scores, gather)


def test_a_fully_recomputed_layer_makes_its_scores_again_in_its_backward_pass() -> None:
    # Under full recomputation a layer keeps its input; its backward pass runs its forward again, so the working
    # set is the layer's whole activations, the unfused core's scores included (8.17 GiB tracked on one H200 for
    # llama3_8b x 4 layers at 4,096 tokens, bench/allocator_share.py; 4.66 GiB predicted without the scores).
    job = _job("model=llama_tiny", "train.seq_length=1024", "parallel.recompute=full")
    layout = build_layout(job)
    unfused = SimOptions(attention=AttentionKernel.fused_softmax)
    working, kept = layer_activation_bytes(job, layout, unfused, moe=False)
    none = layer_activation_bytes(job, layout, unfused, moe=False, recompute=Recompute.none)[0]
    assert working == none
    assert kept == 1024 * job.model.hidden_size * 2  # the layer's input only


def test_tp_comm_overlap_holds_transformer_engines_userbuffers() -> None:
    # initialize_ub: one [tokens, hidden] buffer per overlapped GEMM name, 6 all-gathers (uint8 under FP8) and 4
    # reduce-scatters; the backward's re-gather goes through them, so no transient beside them.
    tp = ["model=llama_tiny", "train.seq_length=512", "parallel.tp=2", "cluster.gpus_per_node=2", "parallel.sp=true",
          "parallel.tp_comm_overlap=true"]
    hidden_tokens = 512 * 64
    for precision, gathered in (("bf16", 2), ("fp8", 1)):
        job = _job(*tp, f"train.precision={precision}")
        first = dict(predict_memory(_job(*tp, f"train.precision={precision}", "parallel.pp=2",
                                         "cluster.gpus_per_node=4", "train.global_batch_size=4"),
                                    world_size=4).parts)
        for parts in (dict(predict_memory(job).parts), first):
            assert parts["tp_buffers"] == hidden_tokens * (2 + 6 * gathered + 4 * 2), precision


def test_uniform_recomputation_keeps_one_input_a_group_and_recomputes_the_group_at_once() -> None:
    # transformer_block.py, _checkpointed_forward: "uniform" checkpoints groups of recompute_num_layers layers, each
    # keeping its input alone; a group's backward pass runs all its layers' forward again.
    full = ["model=llama_tiny", "model.num_layers=4", "train.seq_length=1024", "parallel.recompute=full",
            "parallel.recompute_method=uniform"]
    one, two = (_job(*full, f"parallel.recompute_num_layers={k}") for k in (1, 2))
    layer, layer_input = layer_activation_bytes(one, build_layout(one), SimOptions(), moe=False)
    parts_one, parts_two = _parts(one), _parts(two)
    logits = parts_one["logits"]
    flow = backward_flow_bytes(one, build_layout(one), SimOptions(), moe=False)  # one linear's backward at a time
    assert parts_one["layer_activations"] == pytest.approx(4 * layer_input + max(layer + flow - logits, 0.0))
    assert parts_two["layer_activations"] == pytest.approx(2 * layer_input + max(2 * layer + flow - logits, 0.0))


def test_an_unfused_core_keeps_k_and_v_repeated_to_every_head() -> None:
    # Megatron-Core's DotProductAttention repeats a GQA model's K and V to every head (repeat_interleave) before its
    # GEMMs, which keep them; a flash kernel keeps them per query group.
    job = _job("model=llama_tiny", "train.seq_length=512")  # 4 heads, 2 query groups, head dim 16
    layout = build_layout(job)
    model = job.model
    head_dim = model.hidden_size // model.num_attention_heads
    extra = 512 * 2 * (model.num_attention_heads - model.query_groups) * head_dim * 2  # bytes, bf16
    flash = layer_activation_bytes(job, layout, SimOptions(attention=AttentionKernel.flash), moe=False)[0]
    unfused = SimOptions(attention=AttentionKernel.fused_softmax)
    scores = model.num_attention_heads * 512 * 512 * 2  # the fused softmax's bf16 probabilities
    assert layer_activation_bytes(job, layout, unfused, moe=False)[0] == flash + scores + extra


def test_the_loss_and_a_layers_backward_working_set_are_not_held_at_once() -> None:
    # The backward pass frees the loss's logits before any layer's backward runs: the rank's peak holds the larger.
    job = _job("model=llama_tiny", "train.seq_length=1024", "parallel.recompute=full")
    options = SimOptions(attention=AttentionKernel.fused_softmax)
    parts = _parts(job, options)
    layout = build_layout(job)
    working, kept = layer_activation_bytes(job, layout, options, moe=False)
    layers = job.model.num_layers
    scores = job.model.num_attention_heads * 1024 * 1024 * 4.0  # the fused softmax's bf16 gradient in and out
    flow = backward_flow_bytes(job, layout, options, moe=False)  # the linears' moments, not the core's
    assert parts["layer_activations"] + parts["logits"] == pytest.approx(
        layers * kept + max(working + max(scores, flow), parts["logits"]))


def test_sequence_parallelism_divides_what_full_recomputation_keeps() -> None:
    common = ("model=llama_tiny", "cluster.gpus_per_node=2", "parallel.tp=2", "train.seq_length=1024",
              "parallel.recompute=full")
    with_sp, without = _job(*common, "parallel.sp=true"), _job(*common, "parallel.sp=false")
    options = SimOptions()
    kept_sp = layer_activation_bytes(with_sp, build_layout(with_sp), options, moe=False)[1]
    kept = layer_activation_bytes(without, build_layout(without), options, moe=False)[1]
    assert kept == 2 * kept_sp == 1024 * with_sp.model.hidden_size * 2


def test_activations_are_counted_in_the_compute_precision() -> None:
    bf16 = _job("model=llama_tiny", "train.seq_length=512", "train.precision=bf16")
    fp32 = dataclasses.replace(bf16, train=dataclasses.replace(bf16.train, precision=type(bf16.train.precision).fp32))
    flash = SimOptions(attention=AttentionKernel.flash)
    # The norms' statistics (rstd, one a token and RMSNorm) are fp32 in either precision.
    statistics = 512 * 2 * NORM_STATISTIC_BYTES
    assert (layer_activation_bytes(fp32, build_layout(fp32), flash, moe=False)[0] - statistics
            == 2 * (layer_activation_bytes(bf16, build_layout(bf16), flash, moe=False)[0] - statistics))


def test_the_issues_70b_fsdp_run_fits_its_96_gb_with_sequence_parallel_norms() -> None:
    # Llama 3 70B, FSDP over 8 nodes, TP8 with sequence-parallel norms, 16 x 8k tokens a rank, full recomputation:
    # it ran on 96 GB H100s. With SP the layers keep their input over TP; without, 80 x 2 GiB of layer inputs.
    common = ["model=llama3_70b", "cluster=h100_nvl", "cluster.nodes=8", "cluster.hbm_gib=96", "parallel.tp=8",
              "parallel.recompute=full", "train.micro_batch_size=16", "train.seq_length=8192",
              "train.global_batch_size=128", "train.precision=bf16", "parallel.distributed_optimizer=true",
              "parallel.fsdp=optim_grads_params"]
    with_sp = predict_memory(compose_job([*common, "parallel.sp=true"])).total_gib
    without = predict_memory(compose_job([*common, "parallel.sp=false"])).total_gib
    assert with_sp < 96 < without
    # the layer inputs SP divides, less the global buffer its gathers use (131,072 tokens x 8,192 x 2 bytes), and
    # the recomputed layer's backward working set beyond the logits (11.8 GiB) without SP: its activations and its
    # linears' flowing gradients; with SP it and the gather Transformer Engine's linears make again are under them
    # and Megatron-FSDP's unsharded gradients in that backward (its default unit queues 11 layers of 107 M
    # parameters on a TP rank, each beyond the input its backward freed)
    beyond = []
    layer_params = 855_638_016 / 8 + 4 * 8192  # QKV, projection, FC1, FC2 over TP; the norms as the layer cost counts
    for sp in (True, False):
        job = compose_job([*common, f"parallel.sp={str(sp).lower()}"])
        layout, parts = build_layout(job), dict(predict_memory(job).parts)
        working = layer_activation_bytes(job, layout, SimOptions(), moe=False)[0]
        grads = Sharding.megatron(job, layout.dims).backward_grad_bytes(
            layer_params, layers=80, freed_per_layer=16 * 8192 * 8192 * 2 / (8 if sp else 1))
        flows = backward_flow_bytes(job, layout, SimOptions(), moe=False)
        beyond.append(max(working + flows + grads - parts["logits"], 0.0))
    assert beyond[0] == 0.0 < beyond[1]
    assert without - with_sp == pytest.approx(80 * 2 * 7 / 8 - 2 + beyond[1] / GIB)


def test_the_output_projection_keeps_the_cores_output_as_megatron_core_saves_it() -> None:
    """Under FP8 current scaling (and FP4) Megatron-Core's linear_proj saves its original bf16 input, the tensor the
    fused core already keeps (set_save_original_input): 2 bytes an element, not the 1-byte copy; under delayed
    scaling the projection's FP8 copy sits beside the core's bf16 output (1 + 2), the copy alone where the core is
    recomputed; in bf16 one tensor."""
    current = _job("model=llama3_8b", "train.precision=fp8", "train.fp8_recipe=tensorwise")
    delayed = _job("model=llama3_8b", "train.precision=fp8", "train.fp8_recipe=delayed")
    bf16 = _job("model=llama3_8b", "train.precision=bf16")
    flash, none, core = SimOptions(), frozenset(), frozenset({RecomputeModule.core_attn})
    assert projection_input_bytes(current, flash, none, 1.0) == 2.0
    assert projection_input_bytes(delayed, flash, none, 1.0) == 3.0
    assert projection_input_bytes(delayed, flash, core, 1.0) == 1.0
    assert projection_input_bytes(bf16, flash, none, 2.0) == 2.0
    # The two FP8 recipes keep every other input alike (1 byte): a layer differs by one byte a core output element.
    layout = build_layout(delayed)
    kept = {name: layer_activation_bytes(job, build_layout(job), flash, moe=False)[0]
            for name, job in (("current", current), ("delayed", delayed))}
    q_width = delayed.model.num_attention_heads * (delayed.model.hidden_size // delayed.model.num_attention_heads)
    assert kept["delayed"] - kept["current"] == pytest.approx(layout.micro_batch * layout.seq_length * q_width)


def test_the_issues_70b_megatron_fsdp_run_fits_its_gb200_as_its_recipe_ran() -> None:
    # Megatron-Bridge's llama3_70b_pretrain_64gpu_gb200_fp8cs_config: Megatron-FSDP, TP1, 2 x 8k tokens, FP8 current
    # scaling with FP8 parameters, bf16 gradient reduction, 40 layers' activations offloaded, TE's fused cross
    # entropy, gradient_accumulation_fusion off, Megatron-FSDP's double buffer and an 800M-parameter unit. Without the
    # offloading 80 layers x 3.4 GiB are kept.
    job = compose_job(["model=llama3_70b", "cluster=gb200_nvl72", "cluster.nodes=16", "parallel.tp=1",
                       "parallel.distributed_optimizer=true", "parallel.fsdp=optim_grads_params",
                       "train.precision=fp8", "train.fp8_recipe=tensorwise", "parallel.fp8_param_gather=true",
                       "parallel.grad_reduce_in_fp32=false", "train.micro_batch_size=2", "train.seq_length=8192",
                       "train.global_batch_size=256"])
    offloaded = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, cpu_offloading_num_layers=40))
    recipe = SimOptions(te_cross_entropy=True, weight_grad_accumulation=WeightGradAccumulation.main_grad_hook,
                        fsdp_double_buffer=True, fsdp_unit_size=800_000_000)
    hbm = job.cluster.hbm_gib
    assert predict_memory(job, options=recipe).total_gib > hbm
    ran = predict_memory(offloaded, options=recipe)
    assert ran.total_gib < hbm
    # Megatron-FSDP's defaults (no double buffer, a unit of twice a layer) queue four layers' bf16 gradients in the
    # backward where the recipe's double buffer holds two (each beside two layers' FP8 weights); the fusion's
    # placeholders only with the fusion
    default = predict_memory(offloaded, options=SimOptions(te_cross_entropy=True))
    assert dict(default.parts)["fsdp_buffers"] == dict(ran.parts)["fsdp_buffers"]
    assert dict(ran.parts)["dummy_wgrads"] == 0.0 < dict(default.parts)["dummy_wgrads"]
    assert default.total_gib > ran.total_gib


def test_the_allocator_band_is_measured_data_and_a_cpu_has_none() -> None:
    data = json.loads(BAND_FILE.read_text())
    cluster = _job("model=llama_tiny").cluster
    measured = {"default": "default_allocator", "expandable_segments": "expandable_segments"}
    for setting, expandable in (("default", False), ("expandable_segments", True)):
        gpu = memory_band(cluster, expandable_segments=expandable)
        assert (gpu.low, gpu.high) == (data["low"], data["high"][setting])
        assert 1.0 <= gpu.low <= gpu.high
        assert gpu.high == max(data["measured"][measured[setting]]["reserved_over_allocated"])
    assert memory_band(cluster, expandable_segments=True).high < memory_band(cluster, expandable_segments=False).high
    assert memory_band(compose_job(["model=llama_tiny"]).cluster) == MemoryBand(low=1.0, high=1.0)
    with pytest.raises(ConfigError, match="low <= high"):
        MemoryBand(low=1.2, high=1.1)


def test_the_band_follows_the_allocator_the_ranks_will_run(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = _job("model=llama_tiny").cluster
    for var in ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    assert memory_band(cluster) == memory_band(cluster, expandable_segments=True)  # what the runtime sets
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # the user's: PyTorch's allocator as it comes
    assert memory_band(cluster) == memory_band(cluster, expandable_segments=False)


@pytest.mark.parametrize(("conf", "binds"), [("", "band"), (None, "headroom")])
def test_the_search_fits_the_predictions_upper_band(monkeypatch: pytest.MonkeyPatch, conf: str | None,
                                                    binds: str) -> None:
    for var in ALLOC_CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    if conf is not None:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
    cfg = compose_config([*H100, "model=llama_tiny", "+cfp=auto", "cfp.constraints.memory_headroom=0.1"])
    job = compose_job([*H100, "model=llama_tiny"])
    result = search(job, 1, cfp_from_config(cfg))
    high = memory_band(job.cluster).high
    if binds == "band":  # the default allocator's band leaves less than the headroom: it applies
        assert high > 1 / 0.9
        assert result.memory_limit_gib == pytest.approx(job.cluster.hbm_gib / high)
    else:  # expandable segments hold less than the headroom reserves
        assert high < 1 / 0.9
        assert result.memory_limit_gib == pytest.approx(job.cluster.hbm_gib * 0.9)
    assert all(r.prediction.memory.total_gib <= result.memory_limit_gib for r in result.ranked)


def _result(memory_gib: float, hbm: float) -> RowResult:
    job = _job("model=llama_tiny", f"cluster.hbm_gib={hbm}")
    plan = RowPlan(row_id=f"r{memory_gib:g}", source="s", model="llama_tiny", layout="tp1", job=job,
                   options=SimOptions(), measured_s=1.0)
    return RowResult(plan=plan, predicted_s=1.0, memory_gib=memory_gib)


def test_the_validator_counts_runs_predicted_above_their_gpus_memory_as_failures() -> None:
    results = [_result(70.0, 80.0), _result(80.0, 80.0), _result(96.0, 80.0)]
    found = memory_failures(results)
    assert (found["count"], found["checked"]) == (1, 3)
    assert [row["id"] for row in found["rows"]] == ["r96"] and found["rows"][0]["times"] == pytest.approx(1.2)
    lines = memory_failure_lines(results)
    assert lines[0].startswith("memory failures: 1 of 3 rows") and "r96" in lines[1]
    assert GIB == 2**30
