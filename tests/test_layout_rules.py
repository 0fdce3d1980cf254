"""The layout rules (cfp_megatron/base/layout_rules/): each topic's rules on a table of sizes, and for each rule
with more than one caller, the config checks, the analysis' options and the search's screens agreeing on the same
sizes (each renders the rule's own problem: the config checks its key and sentence, the others its brief)."""

from __future__ import annotations

import functools

import pytest

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.layout_rules import batch, moe, pipeline, recompute, sequence, tensor
from cfp_megatron.base.layout_rules.problem import Problem
from cfp_megatron.base.parallel_dims import ParallelDims, model_parts
from cfp_megatron.model.options import SizeContext, choice_fits, model_options, size_reasons
from cfp_megatron.search.space import Family, build_space, knob_reasons, no_layout_issues, offered_modules

MLA = ["model=moe_tiny", "model.attention=mla", "model.position_embedding=rope", "model.q_lora_rank=32",
       "model.kv_lora_rank=32", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16",
       "model.moe_first_dense_layers=1"]
"""A small DeepSeek-style model (as tests/test_options.py's)."""


@functools.cache
def _composed(overrides: tuple[str, ...]) -> JobSpec:
    return compose_job(list(overrides))


def _job(overrides: list[str]) -> JobSpec:
    """The composed job (each composed once: Hydra's composition is the slow part of these tests)."""
    return _composed(tuple(overrides))


def _keys(problems: list[Problem]) -> list[str]:
    return [p.key for p in problems]


# --- each topic's rules on a table of sizes ---------------------------------------------------------------------

TABLE = [
    # tensor
    (lambda: tensor.attention_heads(32, 8, 4), []),
    (lambda: tensor.attention_heads(32, 8, 16), ["parallel.tp"]),  # 8 key/value heads
    (lambda: tensor.attention_heads(32, None, 16), []),  # MLA: no key/value groups
    (lambda: tensor.attention_heads(12, 4, 8), ["parallel.tp", "parallel.tp"]),
    (lambda: tensor.dense_mlp(250, 4), ["parallel.tp"]),
    (lambda: tensor.dense_mlp(None, 3), []),  # no dense MLP
    (lambda: tensor.vocabulary(257, 2), ["parallel.tp"]),
    (lambda: tensor.vocabulary(384, 8), []),
    (lambda: tensor.primepar_grid(4), []),
    (lambda: tensor.primepar_grid(8), ["parallel.mlp"]),
    (lambda: tensor.primepar_grid(1), ["parallel.mlp"]),
    (lambda: tensor.primepar_sizes(model="m", moe=True, hidden=64, ffn=256, tokens=63, tp=4),
     ["parallel.mlp", "parallel.mlp"]),
    (lambda: tensor.primepar_sizes(model="m", moe=False, hidden=64, ffn=256, tokens=63, tp=8), []),  # not a grid
    (lambda: tensor.sequence_parallel_needs_tp(True, 1), ["parallel.sp"]),
    (lambda: tensor.sequence_parallel_needs_tp(True, 2), []),
    (lambda: tensor.tp_overlap_needs_sp(True, False), ["parallel.tp_comm_overlap"]),
    (lambda: tensor.tp_overlap_runs(True, on_cpu=False, te=False), ["parallel.tp_comm_overlap"]),
    (lambda: tensor.tp_overlap_runs(True, on_cpu=False, te=True), []),
    # sequence and context
    (lambda: sequence.context_chunks(63, 2), ["train.seq_length"]),
    (lambda: sequence.context_chunks(63, 1), []),  # no CP: nothing split
    (lambda: sequence.context_chunks(64, 4), []),
    (lambda: sequence.context_needs_te(2, False), ["parallel.cp"]),
    (lambda: sequence.context_needs_te(1, False), []),
    (lambda: sequence.context_attention(True, 2), ["parallel.cp"]),
    (lambda: sequence.context_attention(False, 2), []),
    (lambda: sequence.context_all_to_all(comm_type="a2a", a2a_size=4, heads_per_rank=6, groups_per_rank=2),
     ["parallel.cp_comm_type"]),
    (lambda: sequence.sequence_parallel_split(True, 64, 2, 4), []),
    (lambda: sequence.sequence_parallel_split(True, 64, 2, 64), ["train.seq_length"]),
    (lambda: sequence.sequence_parallel_split(False, 63, 1, 2), []),
    (lambda: sequence.sequence_parallel_missing(False, True, 2), ["parallel.sp"]),
    (lambda: sequence.sequence_parallel_missing(False, False, 2), []),
    (lambda: sequence.learned_positions(value="learned_absolute", mtp_layers=1, pp=2, seq=512, max_positions=256),
     ["model.position_embedding", "train.seq_length"]),
    # pipeline
    (lambda: pipeline.stages_filled(4, 8), ["parallel.pp"]),
    (lambda: pipeline.interleave_needs_pp(2, 1), ["parallel.vpp"]),
    (lambda: pipeline.interleave_needs_pp(2, 2), []),
    (lambda: pipeline.interleaved_microbatches(microbatches=3, pp=2, vpp=2, global_batch=3, per_step=1),
     ["train.global_batch_size"]),
    (lambda: pipeline.interleaved_microbatches(microbatches=3, pp=2, vpp=1, global_batch=3, per_step=1), []),
    (lambda: pipeline.counted_in_split(counted=["account_for_loss_in_pipeline_split"], first=2, last=None, pp=1),
     ["parallel.account_for_loss_in_pipeline_split"] * 2),
    # MoE
    (lambda: moe.experts(4, 3), ["parallel.ep"]),
    (lambda: moe.experts(None, 1), []),
    (lambda: moe.expert_ffn(128, 3), ["parallel.etp"]),
    (lambda: moe.shared_expert(96, 64), ["parallel.tp"]),
    (lambda: moe.expert_world(4, 1, 4, 2), ["parallel.ep"]),
    (lambda: moe.overlap_dispatcher(overlaps=list(moe.OVERLAPS), dispatcher="allgather"),
     ["parallel.moe_a2a_overlap", "parallel.moe_shared_expert_overlap"]),
    (lambda: moe.overlap_dispatcher(overlaps=list(moe.OVERLAPS), dispatcher="flex"), []),
    (lambda: moe.a2a_overlap_needs_ep(True, 1), ["parallel.moe_a2a_overlap"]),
    (lambda: moe.a2a_overlap_schedule(a2a_overlap=True, shared_overlap=True, full_recompute=True, pp=2, vpp=1),
     ["parallel.moe_shared_expert_overlap", "parallel.moe_a2a_overlap", "parallel.moe_a2a_overlap"]),
    (lambda: moe.a2a_overlap_schedule(a2a_overlap=True, shared_overlap=False, full_recompute=False, pp=2,
                                      vpp=None), []),  # some chunk count may interleave
    (lambda: moe.overlaps_on_gpu(a2a_overlap=True, shared_overlap=True, has_shared=False, model="m", flex=True,
                                 on_cpu=True),
     ["parallel.moe_shared_expert_overlap", "parallel.moe_a2a_overlap", "model.moe_token_dispatcher"]),
    (lambda: moe.dense_model(model="m", a2a_overlap=False, shared_overlap=False, ep=2, etp=1), ["parallel.ep"]),
    (lambda: moe.flex_backend(backend="hybridep", dispatcher="alltoall"), ["parallel.moe_flex_dispatcher_backend"]),
    (lambda: moe.flex_backend(backend="hybridep", dispatcher="flex"), []),
    (lambda: moe.flex_backend(backend="deepep", dispatcher="alltoall"), []),  # Megatron-Core's default: no choice
    (lambda: moe.flex_padding(pad=True, dispatcher="flex", backend="deepep"),
     ["model.moe_pad_expert_input_to_capacity"]),
    (lambda: moe.flex_padding(pad=True, dispatcher="flex", backend="hybridep"), []),
    (lambda: moe.flex_padding(pad=True, dispatcher="alltoall", backend="deepep"), []),
    # recomputation
    (lambda: recompute.settings(recompute="full", modules="moe_act", method="block"), ["parallel.recompute_modules"]),
    (lambda: recompute.settings(recompute="none", modules=None, method="block"), ["parallel.recompute_method"]),
    (lambda: recompute.modules_fit({"moe_act", "mla_up_proj"}, recompute.ModelParts(
        name="m", moe=False, dense_layers=True, shared_expert=False, attention="standard"), te=False),
     ["parallel.recompute_modules"] * 3),  # moe_act without experts and without TE, mla_up_proj without MLA
    (lambda: recompute.modules_fit({"mlp"}, recompute.ModelParts(
        name="m", moe=True, dense_layers=False, shared_expert=False, attention="standard")),
     ["parallel.recompute_modules"]),
    (lambda: recompute.block_layers(3, 2), ["parallel.recompute_num_layers"]),
    (lambda: recompute.block_layers(1, 0), []),  # an invalid split is the pipeline rules' to report
    # batch and world
    (lambda: batch.model_parallel_world(8, 2, 2, 3), ["parallel.tp"]),
    (lambda: batch.cluster_world(8, 2, 8), ["cluster.nodes"]),
    (lambda: batch.cluster_world(8, 2, None), []),
    (lambda: batch.global_batch(12, 1, 8), ["train.global_batch_size"]),
    (lambda: batch.global_batch(16, 4, 4), []),
    (lambda: batch.microbatch_count(1 << 20, 1, 1, 1 << 16), ["train.global_batch_size"]),
    (lambda: batch.sharded_optimizer(True, dp=1), ["parallel.distributed_optimizer"]),
    (lambda: batch.sharded_optimizer(True, dp=1, expert_dp=2), []),
    (lambda: batch.param_gather_overlap(True, False), ["parallel.overlap_param_gather"]),
]


@pytest.mark.parametrize(("rule", "keys"), TABLE)
def test_each_rule_on_a_table_of_sizes(rule, keys: list[str]) -> None:
    problems = rule()
    assert _keys(problems) == keys
    for p in problems:  # each problem is whole in both renderings
        assert p.problem and p.fix and p.brief and isinstance(p.issue(), ConfigIssue)


def test_the_briefs_name_the_numbers() -> None:
    assert [p.brief for p in tensor.attention_heads(12, 4, 8)] == ["12 attention heads are not divisible by it",
                                                                   "4 key/value heads are not divisible by it"]
    assert sequence.context_chunks(63, 2)[0].brief == "the sequence 63 does not split into 2 x 2 chunks"
    assert batch.global_batch(12, 1, 8)[0].brief == "the global batch 12 is not divisible by the DP size 8"
    assert pipeline.stages_filled(4, 8)[0].brief == "4 layers do not fill 8 stages"


# --- the callers agree ------------------------------------------------------------------------------------------


def _config(overrides: list[str], world: int, *, te: bool = True) -> list[ConfigIssue]:
    """The config checks' issues for the composed job on ``world`` ranks (the spec's and ParallelDims.build's)."""
    try:
        ParallelDims.build(_job(overrides), world, te_available=te)
    except ConfigError as err:
        return err.issues
    return []


def _said(issues: list[ConfigIssue], problems: list[Problem]) -> bool:
    return all(p.issue() in issues for p in problems)


def _rejected(job: JobSpec, world: int, what: str, *, te: bool = True, cfp: CfpSpec | None = None) -> list[str]:
    return [r.reason for r in build_space(job, world, cfp or CfpSpec(), te_available=te).rejected if r.what == what]


def test_attention_heads_three_callers() -> None:
    base = ["model=gpt_tiny"]  # 4 heads, 4 key/value heads
    rule = tensor.attention_heads(4, 4, 8)
    assert _said(_config([*base, "parallel.tp=8"], 8), rule)
    model = _job(base).model
    assert size_reasons(model_options(model), "tp", model, 8, SizeContext(seq_length=64, micro_batch=1)) == [
        p.brief for p in rule]
    assert _rejected(_job(base), 8, "tp=8") == ["; ".join(p.brief for p in rule)]
    assert not tensor.attention_heads(4, 4, 2) and not _rejected(_job(base), 8, "tp=2")


def test_dense_mlp_three_callers() -> None:
    base = ["model=gpt_tiny", "model.ffn_hidden_size=250"]
    rule = tensor.dense_mlp(250, 4)
    assert _said(_config([*base, "parallel.tp=4"], 4), rule)
    model = _job(base).model
    assert size_reasons(model_options(model), "tp", model, 4, SizeContext(seq_length=64, micro_batch=1)) == [
        p.brief for p in rule]
    assert _rejected(_job(base), 4, "tp=4") == [rule[0].brief]
    assert not tensor.dense_mlp(250, 2) and not _rejected(_job(base), 4, "tp=2")


def test_vocabulary_three_callers() -> None:
    base = ["model=gpt_tiny", "model.make_vocab_size_divisible_by=1"]  # 257 tokens
    rule = tensor.vocabulary(257, 2)
    assert _said(_config([*base, "parallel.tp=2"], 2), rule)
    model = _job(base).model
    assert size_reasons(model_options(model), "tp", model, 2, SizeContext(seq_length=64, micro_batch=1)) == [
        rule[0].brief]
    assert _rejected(_job(base), 2, "tp=2") == [rule[0].brief]


def test_primepar_three_callers() -> None:
    base = ["model=gpt_tiny"]
    grid = tensor.primepar_grid(2)
    with pytest.raises(ConfigError) as info:  # the spec's own check
        _job([*base, "parallel.mlp=primepar", "parallel.tp=2"])
    assert _said(info.value.issues, grid)
    model = _job(base).model
    options, context = model_options(model), SizeContext(seq_length=64, micro_batch=1)
    primepar = next(o for o in options if o.choice == ("mlp", "primepar"))
    assert primepar.reasons(model, 2, context) == [grid[0].brief]
    assert not choice_fits(options, "mlp", "primepar", model, 2, context)
    assert choice_fits(options, "mlp", "primepar", model, 4, context)
    space = build_space(_job(base), 4, CfpSpec())
    assert space.mlp_values(Family(tp=2, cp=1, pp=1, ep=1, etp=1), 1) == ["megatron"]
    assert space.mlp_values(Family(tp=4, cp=1, pp=1, ep=1, etp=1), 1) == ["megatron", "primepar"]
    sizes = tensor.primepar_sizes(model="moe_tiny", moe=True, hidden=64, ffn=176, tokens=64, tp=4)
    moe_model = _job(["model=moe_tiny"]).model
    assert _said(_config(["model=moe_tiny", "parallel.mlp=primepar", "parallel.tp=4", "parallel.sp=true"], 4),
                 sizes)
    assert not any(o.choice for o in model_options(moe_model))  # no PrimePar option to offer a MoE model


def test_context_chunks_three_callers() -> None:
    base = ["model=gpt_tiny", "train.seq_length=63"]
    rule = sequence.context_chunks(63, 2)
    assert _said(_config([*base, "parallel.cp=2"], 2), rule)
    model = _job(base).model
    assert size_reasons(model_options(model), "cp", model, 2, SizeContext(seq_length=63, micro_batch=1)) == [
        rule[0].brief]
    assert _rejected(_job(base), 2, "cp=2") == [rule[0].brief]


def test_context_needs_te_config_and_search() -> None:
    base = ["model=gpt_tiny"]
    rule = sequence.context_needs_te(2, False)
    assert _said(_config([*base, "parallel.cp=2"], 2, te=False), rule)
    assert not _config([*base, "parallel.cp=2"], 2, te=True)
    assert _rejected(_job(base), 2, "cp=2", te=False) == [rule[0].brief]
    assert not _rejected(_job(base), 2, "cp=2", te=True)


def test_context_attention_three_callers() -> None:
    rule = sequence.context_attention(True, 2)
    assert _said(_config([*MLA, "parallel.cp=2"], 2), rule)
    model = _job(MLA).model
    assert size_reasons(model_options(model), "cp", model, 2, SizeContext(seq_length=64, micro_batch=1)) == [
        rule[0].brief]
    assert _rejected(_job(MLA), 2, "cp=2") == [rule[0].brief]


def test_sequence_parallel_rules_config_and_search() -> None:
    dense = _job(["model=gpt_tiny", "train.seq_length=63"])
    space = build_space(dense, 2, CfpSpec())
    tp2, tp1 = Family(tp=2, cp=1, pp=1, ep=1, etp=1), Family(tp=1, cp=1, pp=1, ep=1, etp=1)
    split = sequence.sequence_parallel_split(True, 63, 1, 2)  # 63 tokens over 2 TP ranks
    assert _said(_config(["model=gpt_tiny", "train.seq_length=63", "parallel.tp=2", "parallel.sp=true"], 2), split)
    assert space.sp_values(tp2) == [False] and space.sp_problems(tp2, True) == [split[0].brief]
    needs_tp = tensor.sequence_parallel_needs_tp(True, 1)
    with pytest.raises(ConfigError) as info:
        _job(["model=gpt_tiny", "parallel.sp=true"])
    assert _said(info.value.issues, needs_tp)
    assert space.sp_values(tp1) == [False] and space.sp_problems(tp1, True) == [needs_tp[0].brief]
    assert any(needs_tp[0].brief in why for why in knob_reasons(build_space(dense, 1, CfpSpec(sp=True)), "sp"))
    missing = sequence.sequence_parallel_missing(False, True, 2)  # MoE under TP
    assert _said(_config(["model=moe_tiny", "parallel.tp=2"], 2), missing)
    moe_space = build_space(_job(["model=moe_tiny"]), 2, CfpSpec())
    assert moe_space.sp_values(tp2) == [True] and moe_space.sp_problems(tp2, False) == [missing[0].brief]


def test_expert_rules_three_callers() -> None:
    base = ["model=moe_tiny"]  # 4 experts of FFN 128
    model = _job(base).model
    context = SizeContext(seq_length=64, micro_batch=1)
    for knob, size, rule in (("ep", 3, moe.experts(4, 3)), ("etp", 3, moe.expert_ffn(128, 3))):
        assert _said(_config([*base, f"parallel.{knob}={size}"], 3), rule)
        assert size_reasons(model_options(model), knob, model, size, context) == [rule[0].brief]
        space = build_space(_job(base), 6, CfpSpec())
        assert not any(getattr(f, knob) == size for f in space.families)
        assert any(getattr(f, knob) == 2 for f in space.families)  # and a size that fits is offered


def test_expert_world_config_and_search() -> None:
    base = ["model=moe_tiny"]
    rule = moe.expert_world(4, 1, 4, 2)
    assert _said(_config([*base, "parallel.ep=4", "parallel.pp=2"], 4), rule)
    families = build_space(_job(base), 4, CfpSpec()).families
    assert not any(f.ep == 4 and f.pp == 2 for f in families) and any(f.ep == 4 and f.pp == 1 for f in families)


def test_a2a_overlap_rules_config_and_search() -> None:
    base = ["model=moe_tiny", "cluster=dgx_h100", "cluster.nodes=1"]
    space = build_space(_job(base), 8, CfpSpec())
    schedule = moe.a2a_overlap_schedule(a2a_overlap=True, shared_overlap=False, full_recompute=True, pp=1, vpp=1)
    with pytest.raises(ConfigError) as info:
        _job([*base, "parallel.moe_a2a_overlap=true", "parallel.recompute=full"])
    assert _said(info.value.issues, schedule)
    assert not space.a2a_overlap(ep=2, pp=1, vpp=1, recompute="full")
    assert space.a2a_overlap(ep=2, pp=1, vpp=1, recompute="none")
    needs_ep = moe.a2a_overlap_needs_ep(True, 1)
    assert _said(_config([*base, "parallel.moe_a2a_overlap=true"], 8), needs_ep)
    assert not space.a2a_overlap(ep=1, pp=1, vpp=1, recompute="none")
    interleaved = moe.a2a_overlap_schedule(a2a_overlap=True, shared_overlap=False, full_recompute=False, pp=2, vpp=1)
    with pytest.raises(ConfigError) as info:
        _job([*base, "parallel.moe_a2a_overlap=true", "parallel.ep=2", "parallel.pp=2"])
    assert _said(info.value.issues, interleaved)
    assert not space.a2a_overlap(ep=2, pp=2, vpp=1, recompute="none")
    assert space.a2a_overlap(ep=2, pp=2, vpp=2, recompute="none")


def test_dense_model_expert_sizes_config_and_search() -> None:
    rule = moe.dense_model(model="gpt_tiny", a2a_overlap=False, shared_overlap=False, ep=2, etp=None)
    assert _said(_config(["model=gpt_tiny", "parallel.ep=2"], 2), rule)
    assert _rejected(_job(["model=gpt_tiny"]), 2, "ep=2", cfp=CfpSpec(ep=2)) == [rule[0].brief]


def test_global_batch_config_and_search() -> None:
    base = ["model=gpt_tiny", "train.global_batch_size=12", "train.micro_batch_size=1"]
    rule = batch.global_batch(12, 1, 8)
    assert _said(_config(base, 8), rule)
    assert _rejected(_job(base), 8, "tp1 cp1 pp1") == [rule[0].brief]
    assert not batch.global_batch(12, 1, 4) and not _rejected(_job(base), 8, "tp2 cp1 pp1")


def test_model_parallel_world_config_and_search() -> None:
    rule = batch.model_parallel_world(4, 1, 1, 3)
    assert _said(_config(["model=gpt_tiny", "parallel.pp=3"], 4), rule)
    assert not any(f.pp == 3 for f in build_space(_job(["model=gpt_tiny"]), 4, CfpSpec()).families)
    assert _rejected(_job(["model=gpt_tiny"]), 4, "pp=3", cfp=CfpSpec(pp=3)) == [rule[0].brief]


def test_interleaving_rules_config_and_search() -> None:
    base = ["model=gpt_tiny", "train.global_batch_size=3", "train.micro_batch_size=1"]
    rule = pipeline.interleaved_microbatches(microbatches=3, pp=2, vpp=2, global_batch=3, per_step=1)
    assert _said(_config([*base, "parallel.pp=2", "parallel.vpp=2"], 2), rule)
    job = _job(base)
    space = build_space(job, 2, CfpSpec())
    pp2 = Family(tp=1, cp=1, pp=2, ep=1, etp=1)
    assert all(vpp == 1 for vpp, *_ in space.pipeline_splits(pp2, 3))
    assert any(vpp == 2 for vpp, *_ in build_space(_job(["model=gpt_tiny", "train.global_batch_size=4"]), 2,
                                                   CfpSpec()).pipeline_splits(pp2, 4))
    needs_pp = pipeline.interleave_needs_pp(2, 1)
    with pytest.raises(ConfigError) as info:
        _job(["model=gpt_tiny", "parallel.vpp=2"])
    assert _said(info.value.issues, needs_pp)
    issues = no_layout_issues(_job(["model=gpt_tiny"]), 1, CfpSpec(vpp=2))
    assert needs_pp[0].brief in issues[0].problem


def test_recompute_modules_config_and_search() -> None:
    model = _job(["model=moe_tiny"]).model
    rule = recompute.modules_fit({"moe_act"}, model_parts(model), named="moe_act", te=False)
    assert _said(_config(["model=moe_tiny", "parallel.recompute=selective", "parallel.recompute_modules=moe_act"],
                         1, te=False), rule)
    assert offered_modules(model, te_available=False) is None  # the search offers no moe_act the rule refuses
    assert offered_modules(model, te_available=True) == "moe_act+layernorm"
    assert offered_modules(_job(MLA).model, te_available=True) == "moe_act+layernorm+mla_up_proj"
    assert offered_modules(_job(["model=gpt_tiny"]).model, te_available=True) is None


def test_sharded_optimizer_search() -> None:
    space = build_space(_job(["model=gpt_tiny"]), 2, CfpSpec())
    assert space.dopt_values(Family(tp=2, cp=1, pp=1, ep=1, etp=1)) == [False]
    assert space.dopt_values(Family(tp=1, cp=1, pp=1, ep=1, etp=1)) == [False, True]
    assert space.dopt_problems(Family(tp=2, cp=1, pp=1, ep=1, etp=1), True) == [
        batch.sharded_optimizer(True, dp=1)[0].brief]


def test_a_layout_valid_without_recomputation_is_valid_with_it_where_the_recompute_checks_pass() -> None:
    """The search validates one representative of a layout in full and each other recompute choice of it by the
    checks that read the recompute choice alone (:func:`~cfp_megatron.base.parallel_dims.recompute_problems`),
    placing it as the first: on random layouts of a dense and a MoE model (CUDA graphs, uneven and interleaved
    splits, selective modules, uniform and block recomputation) a recompute choice passes ParallelDims.build exactly
    where those checks pass, and then its layout is the first's with its own ParallelSpec."""
    import dataclasses
    import random

    from cfp_megatron.base.config import CudaGraphImpl, ParallelSpec, Recompute, RecomputeMethod
    from cfp_megatron.base.parallel_dims import recompute_problems
    from cfp_megatron.sim.layout import build_layout

    rng = random.Random(5)
    common = ["cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=32", "train.seq_length=256"]
    passed = failed = 0
    for model in (["model=llama_tiny"], MLA):
        job = _job([*model, *common])
        moe_model = job.model.is_moe
        for _ in range(60):
            sizes = {"tp": rng.choice((1, 2, 4)), "pp": rng.choice((1, 2, 4)), "cp": rng.choice((1, 1, 2)),
                     "vpp": rng.choice((None, None, 2)), "first_stage_layers": rng.choice((None, None, 1))}
            sizes["sp"] = sizes["tp"] > 1 and rng.random() < 0.5
            if moe_model:
                sizes["ep"] = rng.choice((1, 2, 4))
            if rng.random() < 0.3:
                sizes.update(cuda_graph_impl=CudaGraphImpl.transformer_engine,
                             cuda_graph_scope=rng.choice((None, "attn")))
            train = dataclasses.replace(job.train, micro_batch_size=rng.choice((1, 2)))
            try:
                plain = dataclasses.replace(job, train=train, parallel=dataclasses.replace(job.parallel, **sizes))
                first = build_layout(plain, 8)
            except ConfigError:
                continue
            modules = rng.choice(("core_attn", "layernorm", "mla_up_proj", "moe_act+layernorm"))
            for choice in ({"recompute": Recompute.selective},
                           {"recompute": Recompute.selective, "recompute_modules": modules},
                           {"recompute": Recompute.full},
                           {"recompute": Recompute.full, "recompute_method": RecomputeMethod.block,
                            "recompute_num_layers": rng.choice((1, 2, 3, 5))}):
                try:
                    parallel = dataclasses.replace(plain.parallel, **choice)
                except ConfigError:
                    continue
                assert isinstance(parallel, ParallelSpec)
                sibling = dataclasses.replace(plain, parallel=parallel)
                try:
                    full = build_layout(sibling, 8)
                except ConfigError:
                    full = None
                problems = recompute_problems(sibling)
                assert (full is None) == bool(problems), (sizes, choice)
                if full is None:
                    failed += 1
                    continue
                passed += 1
                placed = dataclasses.replace(first, dims=ParallelDims(
                    parallel=parallel, world_size=8, num_microbatches=first.dims.num_microbatches))
                assert placed == full, (sizes, choice)
    assert passed > 100 and failed > 5, (passed, failed)
