"""Every parallel layout trains like the single-rank reference (torchrun, gloo, CPU).

Each layout runs ``launch/train.py`` under torchrun with real Megatron-Core process groups and compares its
per-step loss and gradient norm with a single-rank run of the same model, seed and data. The same seed gives the
same weights under every layout (layout-independent initialisation) and the per-token loss makes the global-batch
loss independent of how the batch is split, so the only differences left are floating-point reduction order.

Tolerance (fp32): |loss - reference| <= 1e-4 absolute at every one of the 4 steps (losses are about 5.9, so about
2e-5 relative; measured differences are below 1e-6), and grad norms within 1e-3 relative.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cfp_megatron.base.parallel_dims import transformer_engine_available
from cfp_megatron.engine import checkpoint
from tests.launcher import RunResult, run_train
from tests.multirank import TMP, Case, MultiRankRuns, case

pytestmark = pytest.mark.slow

STEPS = 4
COMMON = [f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=64",
          "train.warmup_steps=0", "train.precision=fp32"]
LOSS_ATOL = 1e-4
GRAD_RTOL = 1e-3


def reference_case(model: str, *model_overrides: str) -> Case:
    """The single-rank run of a model with optional ``model.*`` overrides (one run per session, in the multirank
    fixture's world-1 job, whichever tests read it)."""
    return case(1, f"model={model}", *model_overrides, *COMMON)


def reference_of(runs: MultiRankRuns, model: str, *model_overrides: str) -> RunResult:
    """:func:`reference_case`'s run, checked: it trained every step."""
    result = runs[reference_case(model, *model_overrides)]
    assert result.returncode == 0, result.output[-4000:]
    assert sorted(result.losses) == list(range(1, STEPS + 1))
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., RunResult]:
    """Single-rank run of a model with optional ``model.*`` overrides in a torchrun of its own, computed once per
    module on first use (for the drill below, whose layouts run in torchruns of their own too)."""
    cache: dict[tuple[str, ...], RunResult] = {}

    def get(model: str, *model_overrides: str) -> RunResult:
        key = (model, *model_overrides)
        if key not in cache:
            folder = tmp_path_factory.mktemp(f"ref_{model}")
            result = run_train(1, [f"model={model}", *model_overrides, *COMMON], folder)
            assert result.returncode == 0, result.output[-4000:]
            assert sorted(result.losses) == list(range(1, STEPS + 1))
            cache[key] = result
        return cache[key]

    return get


def _model_overrides(overrides: list[str]) -> list[str]:
    """The ``model.*`` overrides of a layout, which its single-rank reference must share."""
    return [o for o in overrides if o.startswith("model.")]


LAYOUTS = [
    pytest.param("gpt_tiny", 2, [], id="gpt-dp2"),
    pytest.param("gpt_tiny", 2, ["parallel.distributed_optimizer=true"], id="gpt-dp2-distopt"),
    # Megatron-FSDP, ZeRO-3: each layer's weights gathered before its passes, gradients reduce-scattered per
    # micro-batch (parallel.fsdp); and the distributed optimizer in two instances (HSDP's groups, shards of 1 rank).
    pytest.param("gpt_tiny", 2, ["parallel.distributed_optimizer=true", "parallel.fsdp=optim_grads_params"],
                 id="gpt-dp2-fsdp"),
    pytest.param("gpt_tiny", 2, ["parallel.distributed_optimizer=true", "parallel.dp_shard_size=1"],
                 id="gpt-dp2-distopt-hybrid"),
    pytest.param("gpt_tiny", 2, ["parallel.tp=2"], id="gpt-tp2"),
    pytest.param("gpt_tiny", 2, ["parallel.tp=2", "parallel.sp=true"], id="gpt-tp2-sp"),
    pytest.param("gpt_tiny", 2, ["parallel.pp=2"], id="gpt-pp2-1f1b"),
    pytest.param("gpt_tiny", 2, ["parallel.pp=2", "parallel.vpp=2"], id="gpt-pp2-vpp2-interleaved"),
    pytest.param("llama_tiny", 4, ["parallel.tp=2", "parallel.pp=2"], id="llama-tp2-pp2"),
    pytest.param("llama_tiny", 2, ["parallel.tp=2", "parallel.sp=true", "parallel.recompute=full"],
                 id="llama-tp2-sp-recompute"),
    # Selective recomputation of the norms and the MLPs (Megatron-Core's recompute_modules) instead of core attention.
    pytest.param("llama_tiny", 2, ["parallel.tp=2", "parallel.sp=true", "parallel.recompute=selective",
                                   "parallel.recompute_modules=layernorm+mlp"], id="llama-tp2-sp-recompute-modules"),
    # Block recomputation: the first of each stage's 2 layers recomputed, the second keeps its activations.
    pytest.param("gpt_tiny", 2, ["parallel.pp=2", "parallel.recompute=full", "parallel.recompute_method=block",
                                 "parallel.recompute_num_layers=1"], id="gpt-pp2-recompute-block"),
    pytest.param("gpt_tiny", 2, ["parallel.pp=2", "parallel.first_stage_layers=1"], id="gpt-pp2-uneven-1-3"),
    # The embedding and the loss counted as layers of the split (6 + 2 units over 2 x 2 chunks of 2): the first
    # chunk of rank 0 holds layer 0, the last chunk of rank 1 layer 5, the others two layers each.
    pytest.param("gpt_tiny", 2, ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=6",
                                 "parallel.account_for_embedding_in_pipeline_split=true",
                                 "parallel.account_for_loss_in_pipeline_split=true"], id="gpt-pp2-vpp2-emb-loss-split"),
    # Megatron-Core's per-stage layout (parallel.pipeline_model_parallel_layout): three of gpt_tiny's four layers
    # with the embedding on rank 0, one with the loss on rank 1.
    pytest.param("gpt_tiny", 2, ["parallel.pp=2", "parallel.pipeline_model_parallel_layout=Et*3|tL"],
                 id="gpt-pp2-layout-3-1"),
    # Interleaved under a layout, in virtual-pipeline order: rank 0 holds chunks Et and tt, rank 1 t and the loss
    # alone (a chunk without decoder layers, as DeepSeek-V3's layouts end).
    pytest.param("gpt_tiny", 2, ["parallel.pp=2", "parallel.vpp=2",
                                 "parallel.pipeline_model_parallel_layout=Et|t|tt|L"],
                 id="gpt-pp2-vpp2-layout-empty-last"),
    # A remainder split: 5 layers over 2 x 2 chunks as the balanced layout spreads them (Megatron-DeepSpeed's
    # uniform partition: the first chunk holds the extra layer), pipeline_split.balanced_layout(5, 2, 2).
    pytest.param("gpt_tiny", 2, ["parallel.pp=2", "parallel.vpp=2", "model.num_layers=5",
                                 "parallel.pipeline_model_parallel_layout='Ett|(t|)*2tL'"],
                 id="gpt-pp2-vpp2-balanced-5"),
    pytest.param("moe_tiny", 2, ["parallel.ep=2"], id="moe-ep2"),
    # PrimePar's 2x2 square runs the dense MLP (GELU with biases; SwiGLU without). llama_tiny's 2 KV groups do not
    # split over TP=4, so that case and its single-rank reference set model.num_query_groups=4.
    pytest.param("gpt_tiny", 4, ["parallel.tp=4", "parallel.mlp=primepar"], id="gpt-tp4-primepar"),
    pytest.param("llama_tiny", 4, ["parallel.tp=4", "parallel.mlp=primepar", "model.num_query_groups=4"],
                 id="llama-tp4-primepar-swiglu"),
    # Under sequence parallelism the MLP all-gathers its input's sequence shards and keeps its output's; fc2's bias
    # (gpt_tiny) is added to the shard and its gradient summed over TP by finalize_model_grads. (SwiGLU under SP is
    # checked in float64 by tests/test_primepar_mlp.py; its llama_tiny training run is left out of the default
    # suite for time.)
    pytest.param("gpt_tiny", 4, ["parallel.tp=4", "parallel.sp=true", "parallel.mlp=primepar"],
                 id="gpt-tp4-sp-primepar"),
    # PrimePar on the first of the four layers only (parallel.primepar_layers, what the planner picks when every
    # layer's PrimePar MLP does not fit): layers 1-3 keep Megatron's split; under SP their boundaries differ.
    pytest.param("gpt_tiny", 4, ["parallel.tp=4", "parallel.sp=true", "parallel.mlp=primepar",
                                 "parallel.primepar_layers=1"], id="gpt-tp4-sp-primepar-first1"),
]


def layout_case(model: str, nproc: int, overrides: list[str]) -> Case:
    """A layout's run: ``COMMON`` and its overrides on ``nproc`` ranks."""
    return case(nproc, f"model={model}", *COMMON, *overrides)


# Each layout's run and its single-rank reference come from the multirank fixture's jobs (one torchrun per world
# size for every layout, tests/multirank.py), not from a torchrun each.
LAYOUTS = [pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.multirank(
    layout_case(*p.values), reference_case(p.values[0], *_model_overrides(p.values[2])))]) for p in LAYOUTS]


@pytest.mark.parametrize(("model", "nproc", "overrides"), LAYOUTS)
def test_layout_matches_single_rank(model: str, nproc: int, overrides: list[str], multirank: MultiRankRuns) -> None:
    result = multirank[layout_case(model, nproc, overrides)]
    assert result.returncode == 0, result.output[-4000:]
    ref = reference_of(multirank, model, *_model_overrides(overrides))
    assert sorted(result.losses) == list(range(1, STEPS + 1))
    for step, loss in ref.losses.items():
        assert result.losses[step] == pytest.approx(loss, abs=LOSS_ATOL), f"step {step}"
        assert result.grad_norms[step] == pytest.approx(ref.grad_norms[step], rel=GRAD_RTOL), f"step {step}"
    start = next(r for r in result.records if r["event"] == "start")
    assert f"world={nproc}" in start["layout"]
    layout = next((o.split("=", 1)[1].strip("'") for o in overrides
                   if o.startswith("parallel.pipeline_model_parallel_layout=")), None)
    if layout is not None:  # rank 0 builds the embedding and the decoder layers the layout gives its chunks
        _check_rank0_holds_its_layout_layers(model, overrides, layout, start["params_on_rank0"], ref)
    # The model learns: the loss after the last step is below the first (data have structure).
    assert result.losses[STEPS] < result.losses[1]


def _check_rank0_holds_its_layout_layers(model: str, overrides: list[str], layout: str, params_on_rank0: int,
                                         ref: RunResult) -> None:
    """Rank 0's parameters are the embedding's and those of as many decoder layers as the layout gives rank 0's
    chunks (gpt_tiny: tied embeddings, LayerNorm; the single-rank reference holds every layer and the final
    norm)."""
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.base.pipeline_split import stage_counts

    m = compose_job([f"model={model}", *_model_overrides(overrides)]).model
    pp = int(next(o.split("=")[1] for o in overrides if o.startswith("parallel.pp=")))
    embedding = (m.padded_vocab_size + m.max_position_embeddings) * m.hidden_size
    total = next(r for r in ref.records if r["event"] == "start")["params_on_rank0"]
    per_layer = (total - embedding - 2 * m.hidden_size) / m.num_layers
    assert params_on_rank0 == embedding + stage_counts(m.num_layers, pp, layout=layout)[0] * per_layer


Turns = list[tuple[int, int, list[str]]]
"""Runs that train on from where the last stopped: ``(ranks, to step, overrides)`` each."""


def _turn_cases(runs: Turns, common: list[str]) -> list[Case]:
    """The multirank cases of ``runs`` on ``common`` (a world's cases run in this order; the largest world first)."""
    return [case(nproc, *common, f"train.steps={last}", *overrides) for nproc, last, overrides in runs]


def _train_in_turns(runs: Turns, common: list[str], ref: RunResult, tmp_path: Path) -> None:
    """:func:`_check_turns` of ``runs`` on ``common``, each in a torchrun of its own (the drill)."""
    results = [run_train(nproc, [*common, f"train.steps={last}", *overrides], tmp_path / f"to_step{last}")
               for nproc, last, overrides in runs]
    _check_turns(results, runs, ref)


def _check_turns(results: list[RunResult], runs: Turns, ref: RunResult) -> None:
    """Each of ``runs`` (``results``, in order) trained the steps after the previous one's, with the reference's
    loss and gradient norm at every step."""
    done = 0
    for result, (_, last, _) in zip(results, runs, strict=True):
        assert result.returncode == 0, result.output[-4000:]
        assert sorted(result.losses) == list(range(done + 1, last + 1))
        done = last
        for step in result.losses:
            assert result.losses[step] == pytest.approx(ref.losses[step], abs=LOSS_ATOL), f"step {step}"
            assert result.grad_norms[step] == pytest.approx(ref.grad_norms[step], rel=GRAD_RTOL), f"step {step}"


def _mlp_weight_blocks(folder: Path, name: str) -> set[tuple[int, int]]:
    """The (out, in) offsets of the blocks a checkpoint holds of every layer's ``mlp.<name>.weight``."""
    return {offsets for layer in _layer_blocks(folder, name).values() for offsets in layer}


def _layer_blocks(folder: Path, name: str) -> dict[int, set[tuple[int, int]]]:
    """Per decoder layer, the (out, in) offsets of the blocks a checkpoint holds of ``mlp.<name>.weight`` (each
    layer under its own keys, ``decoder.layers.<i>.``)."""
    from torch.distributed.checkpoint import FileSystemReader

    found: dict[int, set[tuple[int, int]]] = {}
    for key, meta in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.items():
        parts = key.split(".")
        if key.endswith(f".mlp.{name}.weight") and parts[:2] == ["decoder", "layers"] and parts[2].isdigit():
            found[int(parts[2])] = {tuple(int(o) for o in chunk.offsets[-2:]) for chunk in meta.chunks}
    return dict(sorted(found.items()))


def _fc1_input_splits(folder: Path) -> dict[int, int]:
    """Per decoder layer, the number of distinct offsets along fc1's input (hidden) axis a checkpoint holds: 2 for
    PrimePar's 2x2 blocks, 1 for Megatron's column split."""
    return {layer: len({i for _, i in blocks}) for layer, blocks in _layer_blocks(folder, "linear_fc1").items()}


def _primepar_turns(model: str, model_overrides: list[str], middle: str, ckpt: str) -> tuple[Turns, list[str]]:
    """The runs of :func:`test_primepar_checkpoint_resumes_under_megatron_tp2_and_back` and their common
    overrides."""
    common = [f"model={model}", *model_overrides, *(o for o in COMMON if not o.startswith("train.steps=")),
              f"train.lr_decay_steps={STEPS}", f"train.checkpoint_dir={ckpt}"]  # the reference's schedule
    primepar, resume = ["parallel.tp=4", "parallel.mlp=primepar"], ["train.resume=true"]
    between = (4, [*primepar, "parallel.primepar_layers=1", *resume]) if middle == "mixed" else (
        2, ["parallel.tp=2", *resume])
    return [(4, 2, primepar), (between[0], 3, between[1]), (4, 4, [*primepar, *resume])], common


PRIMEPAR_GPT_CKPT = "primepar_gpt_ckpt"
"""The gpt_tiny case's checkpoint folder in the multirank session folder (its three runs on 4 ranks are
cases of the world-4 job; the drill's SwiGLU twin changes world in between and runs torchruns of its own)."""


@pytest.mark.parametrize(("model", "model_overrides", "middle"), [
    # the middle run: PrimePar on the first layer only (parallel.primepar_layers=1), on 4 ranks
    pytest.param("gpt_tiny", [], "mixed", id="gpt-biases", marks=pytest.mark.multirank(
        *_turn_cases(*_primepar_turns("gpt_tiny", [], "mixed", f"{TMP}/{PRIMEPAR_GPT_CKPT}")),
        reference_case("gpt_tiny"))),
    # the SwiGLU twin (its 2x2 blocks of fused gate and up) runs with the drills (-m drill): the default suite keeps
    # to its 20 minutes, and the SwiGLU layer's PrimePar training is checked against one rank there
    pytest.param("llama_tiny", ["model.num_query_groups=4"], "tp2", id="llama-swiglu", marks=pytest.mark.drill),
])
def test_primepar_checkpoint_resumes_under_megatron_tp2_and_back(model: str, model_overrides: list[str], middle: str,
                                                                 tmp_path: Path, multirank: MultiRankRuns,
                                                                 request: pytest.FixtureRequest) -> None:
    """Steps 1-2 under TP=4 with the PrimePar MLP, step 3 under TP=2 with Megatron's MLP (llama_tiny) or under
    TP=4 with PrimePar's MLP on the first layer and Megatron's on the other three (gpt_tiny), step 4 under PrimePar
    again: each resume reads the other layout's blocks (PrimePar's 2-D blocks, Megatron's column/row shards, the
    gated fc1's gate and up halves, the replicated biases, Adam's moments) and the losses stay the reference's."""
    if middle == "mixed":  # the multirank cases
        ckpt = multirank.path(PRIMEPAR_GPT_CKPT)
        runs, common = _primepar_turns(model, model_overrides, middle, f"{TMP}/{PRIMEPAR_GPT_CKPT}")
        _check_turns([multirank[c] for c in _turn_cases(runs, common)], runs, reference_of(multirank, model))
    else:  # the drill: a torchrun per run
        ckpt = tmp_path / "ckpt"
        runs, common = _primepar_turns(model, model_overrides, middle, str(ckpt))
        _train_in_turns(runs, common, request.getfixturevalue("reference")(model, *model_overrides), tmp_path)
    # The PrimePar runs did save 2-D blocks: fc1 cut along its input (hidden) axis too, fc2 along its output axis,
    # which Megatron's column/row-parallel layers never do.
    blocks = _mlp_weight_blocks(ckpt / "iter_0000002", "linear_fc1")
    assert len(blocks) == (8 if model == "llama_tiny" else 4)  # 4 ranks' blocks; SwiGLU: a gate and an up part each
    assert len({i for _, i in blocks}) == 2
    assert len({o for o, _ in _mlp_weight_blocks(ckpt / "iter_0000004", "linear_fc2")}) == 2
    # Step 3: Megatron's TP=2 column split on both layers, or PrimePar's blocks on the first layer only.
    assert _fc1_input_splits(ckpt / "iter_0000003") == {0: 2 if middle == "mixed" else 1, 1: 1, 2: 1, 3: 1}
    assert _fc1_input_splits(ckpt / "iter_0000004") == {0: 2, 1: 2, 2: 2, 3: 2}
    assert checkpoint.saved_per_layer(ckpt / "iter_0000004")  # each layer under its own keys


LAYOUT_CKPT_RUNS: Turns = [
    (2, 2, ["parallel.pipeline_model_parallel_layout=Et*3|tL"]),
    (2, 4, ["parallel.vpp=2", "parallel.pipeline_model_parallel_layout=Et|t|tt|L", "train.resume=true"])]
LAYOUT_CKPT_COMMON = ["model=gpt_tiny", *(o for o in COMMON if not o.startswith("train.steps=")),
                      f"train.lr_decay_steps={STEPS}", f"train.checkpoint_dir={TMP}/layout_ckpt", "parallel.pp=2"]


@pytest.mark.multirank(*_turn_cases(LAYOUT_CKPT_RUNS, LAYOUT_CKPT_COMMON), reference_case("gpt_tiny"))
def test_layout_checkpoint_resumes_under_another_layout(multirank: MultiRankRuns) -> None:
    """Steps 1-2 under the layout Et*3|tL (rank 0 saves layers 0-2, rank 1 layer 3), steps 3-4 interleaved under
    Et|t|tt|L (rank 0 holds layers 0, 2 and 3): each decoder layer is keyed by its global number
    (``decoder.layers.<i>.``), so the other split reads it, and the losses stay the reference's."""
    results = [multirank[c] for c in _turn_cases(LAYOUT_CKPT_RUNS, LAYOUT_CKPT_COMMON)]
    _check_turns(results, LAYOUT_CKPT_RUNS, reference_of(multirank, "gpt_tiny"))
    assert checkpoint.saved_per_layer(multirank.path("layout_ckpt") / "iter_0000004")


MTP_MODEL = ["model=llama_tiny", "model.mtp_num_layers=1", "model.tie_embeddings=true",
             "model.mtp_loss_scaling_factor=1.0"]
MTP_RUNS: Turns = [(2, 2, ["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_model_parallel_layout=Et|t|tt|mL"]),
                   (1, 4, ["train.resume=true"])]  # the world-2 job runs before the world-1 job
MTP_COMMON = [*MTP_MODEL, *(o for o in COMMON if not o.startswith("train.steps=")), f"train.lr_decay_steps={STEPS}",
              f"train.checkpoint_dir={TMP}/mtp_ckpt"]


@pytest.mark.multirank(*_turn_cases(MTP_RUNS, MTP_COMMON), reference_case("llama_tiny", *MTP_MODEL[1:]),
                       reference_case("llama_tiny", "model.tie_embeddings=true"))
def test_mtp_trains_like_one_rank_and_resumes_without_pipelining(multirank: MultiRankRuns) -> None:
    """Multi-token prediction (DeepSeek-V3's MTP, Megatron-Core's block) interleaved under a layout that ends in a
    chunk holding the MTP layer and the loss alone (mL), with tied embeddings: the MTP chunk computes its logits with
    its copy of the word embedding, whose gradient joins the first stage's. Steps 1-2 there, steps 3-4 on one rank
    from its checkpoint (the MTP layer and the embedding keyed as Megatron-Core keys them): the losses and gradient
    norms stay the single-rank reference's. The MTP loss at full weight (Megatron's default is 0.1) so that a wrong
    MTP gradient shows in the grad norm, which differs from the same model's without MTP at every step."""
    ref = reference_of(multirank, "llama_tiny", *MTP_MODEL[1:])
    _check_turns([multirank[c] for c in _turn_cases(MTP_RUNS, MTP_COMMON)], MTP_RUNS, ref)
    plain = reference_of(multirank, "llama_tiny", "model.tie_embeddings=true")
    assert all(abs(ref.grad_norms[s] / plain.grad_norms[s] - 1) > 0.05 for s in range(1, STEPS + 1))


BF16 = ["model=llama_tiny", *COMMON[:-1], "train.precision=bf16"]


@pytest.mark.multirank(case(1, *BF16), case(2, *BF16, "parallel.tp=2", "parallel.sp=true"))
def test_bf16_tensor_parallel_matches_bf16_single_rank(multirank: MultiRankRuns) -> None:
    # bf16 rounds each partial sum, so the tolerance is wider than fp32's (measured differences ~1e-3).
    single = multirank[case(1, *BF16)]
    split = multirank[case(2, *BF16, "parallel.tp=2", "parallel.sp=true")]
    assert single.returncode == 0 and split.returncode == 0, (single.output + split.output)[-4000:]
    assert next(r for r in split.records if r["event"] == "start")["precision"] == "bf16"
    for step, loss in single.losses.items():
        assert split.losses[step] == pytest.approx(loss, abs=2e-2), f"step {step}"


FP16 = case(2, "model=gpt_tiny", *COMMON[:-1], "train.precision=fp16", "train.steps=24", "parallel.pp=2")


@pytest.mark.multirank(FP16)
def test_fp16_skips_overflowing_steps_then_trains(multirank: MultiRankRuns) -> None:
    result = multirank[FP16]
    assert result.returncode == 0, result.output[-4000:]
    steps = result.steps
    assert not steps[0]["applied"]  # Megatron's dynamic loss scale starts at 2**32 and backs off
    assert steps[-1]["applied"] and steps[-1]["grad_norm"] > 0
    assert steps[-1]["loss"] < steps[0]["loss"]


CP2 = case(2, "model=llama_tiny", *COMMON, "parallel.cp=2")


@pytest.mark.skipif(transformer_engine_available(), reason="Transformer Engine present: CP=2 is supported")
@pytest.mark.multirank(CP2)
def test_context_parallel_without_transformer_engine_is_refused_before_any_group(multirank: MultiRankRuns) -> None:
    """The launch path refuses it in its checks (a ConfigError from validate_job, in the world-2 job); how
    torchrun then reports a ConfigError once and exits is tests/test_rank_errors.py's."""
    result = multirank[CP2]
    assert result.returncode != 0
    assert result.output.startswith("ConfigError") and "validate_job" in result.output
    assert "parallel.cp=2" in result.output
    assert "Transformer Engine" in result.output
    assert result.records == []  # rejected before training (and before Megatron's groups) started


UNEVEN = {name: case(2, "model=gpt_tiny", *COMMON, "parallel.pp=2", *extra)
          for name, extra in (("even", []), ("uneven", ["parallel.first_stage_layers=1"]))}
"""The layouts gpt-pp2-1f1b and gpt-pp2-uneven-1-3 above: the same runs (the multirank fixture trains them once)."""


@pytest.mark.multirank(*UNEVEN.values())
def test_uneven_first_stage_holds_its_own_layer_count(multirank: MultiRankRuns) -> None:
    """``parallel.first_stage_layers=1`` puts one of gpt_tiny's 4 layers on stage 0 (the even split puts 2): rank 0
    holds the embedding and one layer, so twice its parameters less the even split's are the embedding's."""
    from cfp_megatron.base.compose import compose_job

    runs = {}
    for name, c in UNEVEN.items():
        result = multirank[c]
        assert result.returncode == 0, result.output[-4000:]
        runs[name] = next(r for r in result.records if r["event"] == "start")["params_on_rank0"]
    m = compose_job(["model=gpt_tiny"]).model
    embedding = (m.padded_vocab_size + m.max_position_embeddings) * m.hidden_size
    assert runs["uneven"] < runs["even"]
    assert 2 * runs["uneven"] - runs["even"] == embedding
