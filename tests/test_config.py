"""The real Hydra configs in conf/: every preset composes into frozen specs, command-line overrides reach the specs,
bad input is rejected with the key, the value and the fix, and the real model presets have their published sizes.

Composition uses Hydra's compose API on the repository's own conf/ directory (as lightning-hydra-template's tests
do), so a new preset file is picked up and tested without editing this file.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig

from cfp_megatron.base.compose import compose_config, register_configs
from cfp_megatron.base.config import (
    Activation,
    AttentionKind,
    Backend,
    JobSpec,
    ModelSpec,
    Normalization,
    PositionEmbedding,
    RecomputeMethod,
    RouterScore,
    job_from_config,
)
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.sim.layout import build_layout

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
MODEL_PRESETS = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
CLUSTER_PRESETS = sorted(p.stem for p in (CONF_DIR / "cluster").glob("*.yaml"))

# Published total parameter counts (the paper or model card of each model; see the comment on top of each preset).
PUBLISHED_PARAMS: dict[str, float] = {
    "gpt3_175b": 175e9,  # Brown et al. 2020, Table 2.1
    "llama2_7b": 6.74e9,  # Llama 2 model card (6,738,415,616)
    "llama3_8b": 8.03e9,  # Meta-Llama-3-8B model card
    "llama3_70b": 70.6e9,  # Meta-Llama-3-70B model card
    "llama3_405b": 405.9e9,  # Llama-3.1-405B model card
    "mixtral_8x7b": 46.7e9,  # Jiang et al. 2024
    "deepseek_v3": 671e9,  # DeepSeek-V3 technical report, without the 14B multi-token-prediction module
    "gpt_oss_120b": 116.83e9,  # gpt-oss model card
}
# Published parameters used per token (MoE models only).
PUBLISHED_ACTIVE_PARAMS: dict[str, float] = {
    "mixtral_8x7b": 12.9e9,
    "deepseek_v3": 37e9,
}
PARAM_TOLERANCE = 0.03


@pytest.fixture(scope="module", autouse=True)
def _schema() -> None:
    register_configs()


def compose_cfg(*overrides: str) -> DictConfig:
    """Compose conf/config.yaml with command-line style overrides."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def make_job(*overrides: str) -> JobSpec:
    """Compose and build frozen specs (runs every ``__post_init__`` check)."""
    return job_from_config(compose_cfg(*overrides))


def build_errors(world_size: int, *overrides: str, te_available: bool = False) -> ConfigError:
    """The ConfigError that ParallelDims.build raises for the composed job."""
    job = make_job(*overrides)
    with pytest.raises(ConfigError) as info:
        ParallelDims.build(job, world_size, te_available=te_available)
    return info.value


# --------------------------------------------------------------------------------------------------------------------
# Parameter count of a ModelSpec, written independently of the code under test.


def _norm(m: ModelSpec, width: int) -> int:
    return 2 * width if m.normalization is Normalization.LayerNorm else width


def _mlp(m: ModelSpec, ffn: int) -> int:
    gated = m.activation.gated
    weights = (3 if gated else 2) * m.hidden_size * ffn
    biases = ((2 if gated else 1) * ffn + m.hidden_size) if m.add_bias_linear else 0
    return weights + biases


def _attention(m: ModelSpec) -> int:
    h, heads = m.hidden_size, m.num_attention_heads
    if m.attention is AttentionKind.mla:
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        if m.q_lora_rank is None:
            q = h * heads * qk
        else:
            q = h * m.q_lora_rank + _norm(m, m.q_lora_rank) + m.q_lora_rank * heads * qk
        kv_down = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + _norm(m, m.kv_lora_rank)
        kv_up = m.kv_lora_rank * heads * (m.qk_head_dim + m.v_head_dim)
        out = heads * m.v_head_dim * h
        return q + kv_down + kv_up + out + (h if m.add_bias_linear else 0)
    d = m.kv_channels or h // heads
    groups = m.num_query_groups or heads
    qkv = h * (heads + 2 * groups) * d
    out = heads * d * h
    qkv_bias = (heads + 2 * groups) * d if (m.add_bias_linear or m.add_qkv_bias) else 0
    out_bias = h if m.add_bias_linear else 0
    qk_norm = 2 * _norm(m, d) if m.qk_layernorm else 0
    return qkv + out + qkv_bias + out_bias + qk_norm


def count_params(m: ModelSpec, *, active: bool = False) -> int:
    """Parameters of the model (unpadded vocabulary); with ``active``, only those one token uses."""
    h = m.hidden_size
    embedding = m.vocab_size * h
    if m.position_embedding is PositionEmbedding.learned_absolute:
        embedding += m.max_position_embeddings * h
    output = 0 if m.tie_embeddings else m.vocab_size * h
    per_layer = _attention(m) + 2 * _norm(m, h)
    dense_mlp = _mlp(m, m.ffn_size)
    if m.num_experts is None:
        layers = m.num_layers * (per_layer + dense_mlp)
    else:
        expert = _mlp(m, m.moe_ffn_hidden_size or m.ffn_size)
        routed = (m.moe_router_topk if active else m.num_experts) * expert
        shared = _mlp(m, m.moe_shared_expert_intermediate_size) if m.moe_shared_expert_intermediate_size else 0
        router = h * m.num_experts
        moe_mlp = routed + shared + router
        dense = m.moe_first_dense_layers
        layers = dense * (per_layer + dense_mlp) + (m.num_layers - dense) * (per_layer + moe_mlp)
    return embedding + layers + _norm(m, h) + output


def test_count_params_matches_hand_count_for_gpt_tiny() -> None:
    m = make_job("model=gpt_tiny").model
    h, v, s, ffn, n = 64, 257, 256, 256, 4
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * ffn + ffn) + (ffn * h + h) + 2 * 2 * h
    assert count_params(m) == v * h + s * h + n * per_layer + 2 * h


# --------------------------------------------------------------------------------------------------------------------
# Every preset composes.


def test_presets_found() -> None:
    assert {"gpt_tiny", "llama_tiny", "moe_tiny"} <= set(MODEL_PRESETS)
    assert set(PUBLISHED_PARAMS) <= set(MODEL_PRESETS)
    assert {"local", "dgx_a100", "dgx_h100", "h200", "b200"} <= set(CLUSTER_PRESETS)


def test_default_config_composes() -> None:
    job = make_job()
    assert job.model.name == "gpt_tiny"
    assert job.cluster.name == "local"
    assert ParallelDims.build(job, 1, te_available=False).dp == 1


@pytest.mark.parametrize("group", ["model", "cluster"])
def test_preset_files_start_with_a_comment(group: str) -> None:
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        assert path.read_text().startswith("#"), f"{path} should say on top what it is and where its numbers come from"


@pytest.mark.parametrize("name", MODEL_PRESETS)
def test_model_preset_builds(name: str) -> None:
    job = make_job(f"model={name}")
    assert job.model.name == name, "a preset's name must be its file name"
    # The preset is a valid model on one rank with the default (short) training run.
    dims = ParallelDims.build(job, 1, te_available=False)
    assert (dims.tp, dims.pp, dims.dp) == (1, 1, 1)


@pytest.mark.parametrize("name", CLUSTER_PRESETS)
def test_cluster_preset_builds(name: str) -> None:
    job = make_job(f"cluster={name}")
    c = job.cluster
    assert c.name == name, "a preset's name must be its file name"
    assert c.nodes == 1
    assert c.backend is Backend.auto
    if c.gpus_per_node is None:
        return
    world = c.nodes * c.gpus_per_node
    job = make_job(f"cluster={name}", f"train.global_batch_size={2 * world}")
    assert ParallelDims.build(job, world, te_available=False).dp == world
    assert build_layout(job).domain_size == c.domain_size()  # the NVLink domain the simulator places in


@pytest.mark.parametrize("name", [n for n in CLUSTER_PRESETS if n != "local"])
def test_gpu_cluster_presets_are_complete(name: str) -> None:
    c = make_job(f"cluster={name}").cluster
    assert c.gpus_per_node in (4, 8)  # 4: a compute tray of an NVL72 rack
    for figure in ("peak_tflops_bf16", "peak_tflops_fp32", "hbm_gib", "hbm_bandwidth_gbps",
                   "intra_node_bandwidth_gbps", "intra_node_latency_us", "inter_node_bandwidth_gbps",
                   "inter_node_latency_us"):
        assert getattr(c, figure) is not None, f"cluster={name} leaves {figure} unset"
    assert c.intra_node_bandwidth_gbps > c.inter_node_bandwidth_gbps
    assert c.intra_node_latency_us < c.inter_node_latency_us
    if c.peak_tflops_fp8 is not None:
        assert c.peak_tflops_fp8 == pytest.approx(2 * c.peak_tflops_bf16, rel=0.01)


def test_cluster_figures() -> None:
    a100, h100, h200, b200 = (make_job(f"cluster={n}").cluster for n in ("dgx_a100", "dgx_h100", "h200", "b200"))
    assert (a100.peak_tflops_bf16, a100.peak_tflops_fp8, a100.peak_tflops_fp32) == (312.0, None, 156.0)
    assert (a100.hbm_gib, a100.hbm_bandwidth_gbps) == (80.0, 2039.0)
    assert (a100.intra_node_bandwidth_gbps, a100.inter_node_bandwidth_gbps) == (300.0, 25.0)
    assert (h100.peak_tflops_bf16, h100.peak_tflops_fp8, h100.peak_tflops_fp32) == (989.0, 1979.0, 494.7)
    assert (h100.hbm_gib, h100.hbm_bandwidth_gbps) == (80.0, 3350.0)
    assert (h100.intra_node_bandwidth_gbps, h100.inter_node_bandwidth_gbps) == (450.0, 50.0)
    assert (h200.peak_tflops_bf16, h200.hbm_gib, h200.hbm_bandwidth_gbps) == (989.0, 141.0, 4800.0)
    assert (b200.peak_tflops_bf16, b200.peak_tflops_fp8) == (2250.0, 4500.0)
    assert (b200.hbm_gib * 8, b200.hbm_bandwidth_gbps) == (1440.0, 8000.0)
    assert (b200.intra_node_bandwidth_gbps, b200.inter_node_bandwidth_gbps) == (900.0, 50.0)


# --------------------------------------------------------------------------------------------------------------------
# Real shapes.


def test_every_real_model_has_a_published_size() -> None:
    real = [n for n in MODEL_PRESETS if not n.endswith("_tiny")]
    missing = [n for n in real if n not in PUBLISHED_PARAMS]
    assert not missing, f"add the published parameter count of {missing} to PUBLISHED_PARAMS"


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_parameter_count_matches_published(name: str) -> None:
    computed = count_params(make_job(f"model={name}").model)
    published = PUBLISHED_PARAMS[name]
    assert computed == pytest.approx(published, rel=PARAM_TOLERANCE), f"{name}: {computed / 1e9:.2f}B"


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE_PARAMS))
def test_active_parameter_count_matches_published(name: str) -> None:
    computed = count_params(make_job(f"model={name}").model, active=True)
    published = PUBLISHED_ACTIVE_PARAMS[name]
    assert computed == pytest.approx(published, rel=PARAM_TOLERANCE), f"{name}: {computed / 1e9:.2f}B"


def test_real_model_shapes() -> None:
    gpt3 = make_job("model=gpt3_175b").model
    assert (gpt3.num_layers, gpt3.hidden_size, gpt3.num_attention_heads, gpt3.ffn_size) == (96, 12288, 96, 49152)
    assert (gpt3.vocab_size, gpt3.max_position_embeddings) == (50257, 2048)
    assert gpt3.position_embedding is PositionEmbedding.learned_absolute
    assert gpt3.normalization is Normalization.LayerNorm and gpt3.activation is Activation.gelu
    assert gpt3.add_bias_linear and gpt3.tie_embeddings

    for name, ffn in (("llama3_8b", 14336), ("llama3_70b", 28672), ("llama3_405b", 53248)):
        m = make_job(f"model={name}").model
        assert (m.query_groups, m.vocab_size, m.rotary_base, m.ffn_size) == (8, 128256, 500000.0, ffn)
        assert m.normalization is Normalization.RMSNorm and m.activation is Activation.swiglu
        assert not m.add_bias_linear and not m.tie_embeddings and not m.is_moe

    mixtral = make_job("model=mixtral_8x7b").model
    assert (mixtral.num_experts, mixtral.moe_router_topk, mixtral.moe_ffn_hidden_size) == (8, 2, 14336)
    assert (mixtral.query_groups, mixtral.vocab_size, mixtral.rotary_base) == (8, 32000, 1e6)
    assert mixtral.moe_aux_loss_coeff == 0.01

    ds = make_job("model=deepseek_v3").model
    assert (ds.num_layers, ds.hidden_size, ds.num_attention_heads, ds.vocab_size) == (61, 7168, 128, 129280)
    assert ds.attention is AttentionKind.mla
    assert (ds.q_lora_rank, ds.kv_lora_rank, ds.qk_head_dim, ds.qk_pos_emb_head_dim, ds.v_head_dim) == (
        1536, 512, 128, 64, 128)
    assert (ds.num_experts, ds.moe_router_topk, ds.moe_ffn_hidden_size) == (256, 8, 2048)
    assert (ds.moe_shared_expert_intermediate_size, ds.moe_first_dense_layers, ds.ffn_size) == (2048, 3, 18432)
    assert ds.moe_router_score is RouterScore.sigmoid
    assert ds.rotary_base == 10000.0 and ds.moe_aux_loss_coeff == 0.0


def test_real_layouts_validate() -> None:
    # Llama 3 70B on 4 DGX H100 nodes: TP 8 with SP inside a node, interleaved PP 4 x 5 chunks of 4 layers.
    job = make_job("model=llama3_70b", "cluster=dgx_h100", "cluster.nodes=4", "parallel.tp=8", "parallel.sp=true",
                   "parallel.pp=4", "parallel.vpp=5", "train.seq_length=8192", "train.micro_batch_size=1",
                   "train.global_batch_size=32")
    dims = ParallelDims.build(job, 32, te_available=False)
    assert (dims.dp, dims.vpp, dims.num_microbatches) == (1, 5, 32)
    # Mixtral on 2 nodes: TP 2 + SP, EP 8.
    job = make_job("model=mixtral_8x7b", "cluster=dgx_h100", "cluster.nodes=2", "parallel.tp=2", "parallel.sp=true",
                   "parallel.ep=8", "train.seq_length=4096", "train.micro_batch_size=1", "train.global_batch_size=64")
    dims = ParallelDims.build(job, 16, te_available=True)
    assert (dims.dp, dims.ep, dims.expert_dp, dims.num_microbatches) == (8, 8, 2, 8)
    # DeepSeek-V3 with EP 64 over 8 nodes (61 layers do not split evenly over pipeline stages).
    job = make_job("model=deepseek_v3", "cluster=dgx_h100", "cluster.nodes=8", "parallel.ep=64",
                   "train.seq_length=4096", "train.micro_batch_size=1", "train.global_batch_size=128")
    dims = ParallelDims.build(job, 64, te_available=True)
    assert (dims.dp, dims.ep, dims.expert_dp, dims.num_microbatches) == (64, 64, 1, 2)


# --------------------------------------------------------------------------------------------------------------------
# Overrides.


@pytest.mark.parametrize(
    ("override", "attr", "expected"),
    [
        ("parallel.tp=2", ("parallel", "tp"), 2),
        ("parallel.pp=4", ("parallel", "pp"), 4),
        ("parallel.vpp=3", ("parallel", "vpp"), 3),
        ("parallel.cp=2", ("parallel", "cp"), 2),
        ("parallel.ep=4", ("parallel", "ep"), 4),
        ("parallel.sp=true", ("parallel", "sp"), True),
        ("train.steps=123", ("train", "steps"), 123),
        ("train.global_batch_size=64", ("train", "global_batch_size"), 64),
        ("train.micro_batch_size=4", ("train", "micro_batch_size"), 4),
        ("train.seq_length=512", ("train", "seq_length"), 512),
        ("cluster.nodes=16", ("cluster", "nodes"), 16),
        ("cluster.gpus_per_node=4", ("cluster", "gpus_per_node"), 4),
    ],
)
def test_override_reaches_spec(override: str, attr: tuple[str, str], expected: object) -> None:
    # Some overrides need a partner to be valid on their own (SP needs TP, VPP needs PP).
    partners = {"parallel.sp": ["parallel.tp=2"], "parallel.vpp": ["parallel.pp=2"]}
    extra = partners.get(override.split("=")[0], [])
    group, name = attr
    job = make_job("model=moe_tiny", override, *extra)
    assert getattr(getattr(job, group), name) == expected
    assert getattr(getattr(make_job(), group), name) != expected, "the default must differ for the test to mean much"


def test_overrides_together_on_a_preset_cluster() -> None:
    job = make_job("model=moe_tiny", "cluster=dgx_a100", "cluster.nodes=2", "parallel.tp=2", "parallel.sp=true",
                   "parallel.pp=2", "parallel.vpp=2", "parallel.ep=2", "train.steps=5", "train.seq_length=128",
                   "train.micro_batch_size=1", "train.global_batch_size=16")
    assert (job.cluster.nodes, job.cluster.gpus_per_node, job.cluster.name) == (2, 8, "dgx_a100")
    dims = ParallelDims.build(job, 16, te_available=False)
    assert (dims.tp, dims.pp, dims.vpp, dims.dp, dims.ep, dims.num_microbatches) == (2, 2, 2, 4, 2, 4)


# --------------------------------------------------------------------------------------------------------------------
# Bad input is rejected.


def test_unknown_key_rejected_by_hydra() -> None:
    with pytest.raises(ConfigCompositionException, match="not_a_key"):
        compose_cfg("model.not_a_key=1")


@pytest.mark.parametrize("override", ["+model.not_a_key=1", "+train.not_a_key=1"])
def test_added_unknown_key_rejected_by_specs(override: str) -> None:
    # Hydra lets '+' add a key even to a structured config; building the specs still refuses it.
    with pytest.raises(ConfigError) as info:
        make_job(override)
    assert info.value.keys == [override[1:].split("=")[0]]
    assert "is not a known setting" in str(info.value)


def test_unknown_group_rejected() -> None:
    with pytest.raises(ConfigError) as info:
        make_job("+nonsense=1")
    assert info.value.keys == ["nonsense"]
    assert "is not a known config group" in str(info.value)


def test_unknown_preset_rejected() -> None:
    with pytest.raises(MissingConfigException):
        compose_cfg("model=gpt_nonexistent")


@pytest.mark.parametrize(
    "override",
    ["model.normalization=BatchNorm", "model.activation=relu", "model.attention=linear", "parallel.recompute=some",
     "train.precision=fp64", "cluster.backend=mpi", "train.micro_batch_size=two"],
)
def test_bad_value_rejected_by_hydra(override: str) -> None:
    with pytest.raises(ConfigCompositionException):
        compose_cfg(override)


def test_bad_enum_rejected_by_specs() -> None:
    # The same check without Hydra, e.g. for a config built in Python or read from a plain dict.
    with pytest.raises(ConfigError) as info:
        job_from_config({"model": {"normalization": "BatchNorm"}, "train": {"lr_schedule": "step"}})
    assert info.value.keys == ["model.normalization", "train.lr_schedule"]
    assert "use one of ['LayerNorm', 'RMSNorm']" in str(info.value)


# --------------------------------------------------------------------------------------------------------------------
# Pinned messages of ParallelDims.build.


def test_world_size_not_divisible() -> None:
    err = build_errors(3, "parallel.tp=2")
    assert err.keys == ["parallel.tp"]
    assert "world size 3 is not divisible by parallel.tp x parallel.cp x parallel.pp = 2 x 1 x 1 = 2." in str(err)
    assert "start 2*k ranks (torchrun --nproc_per_node)" in str(err)


def test_heads_not_divisible_by_tp() -> None:
    # MLA has no key/value groups, so the head count is the only attention check.
    err = build_errors(3, "model=deepseek_v3", "parallel.tp=3", "model.make_vocab_size_divisible_by=384")
    assert set(err.keys) == {"parallel.tp", "parallel.sp"}  # and a MoE model under TP needs SP
    assert "model.moe_shared_expert_intermediate_size=2048 is not divisible by parallel.tp=3." in str(err)
    assert "model.num_attention_heads=128 is not divisible by parallel.tp=3." in str(err)
    assert "use a parallel.tp that divides 128." in str(err)


def test_kv_heads_not_divisible_by_tp() -> None:
    err = build_errors(16, "model=llama3_8b", "parallel.tp=16")
    assert err.keys == ["parallel.tp"]
    assert "model.num_query_groups=8 (key/value heads) is not divisible by parallel.tp=16." in str(err)
    assert "use a parallel.tp that divides 8." in str(err)


def test_ffn_and_vocab_not_divisible_by_tp() -> None:
    err = build_errors(3, "model=llama_tiny", "parallel.tp=3", "model.num_attention_heads=6",
                       "model.num_query_groups=3", "model.hidden_size=66", "model.ffn_hidden_size=176")
    assert err.keys == ["parallel.tp"]
    assert "model.ffn_hidden_size=176 is not divisible by parallel.tp=3." in str(err)
    assert "use a parallel.tp that divides 176." in str(err)
    err = build_errors(3, "model=llama_tiny", "parallel.tp=3", "model.num_attention_heads=6",
                       "model.num_query_groups=3", "model.hidden_size=66", "model.ffn_hidden_size=180",
                       "model.make_vocab_size_divisible_by=64")
    assert err.keys == ["parallel.tp"]
    assert "the padded vocabulary 320 is not divisible by parallel.tp=3." in str(err)
    assert "raise model.make_vocab_size_divisible_by to a multiple of parallel.tp." in str(err)


def test_layers_vs_pp_times_vpp() -> None:
    err = build_errors(2, "parallel.pp=2", "parallel.vpp=3")
    assert err.keys == ["parallel.pp"]
    assert "model.num_layers=4 is not divisible by parallel.pp x parallel.vpp = 2 x 3." in str(err)
    assert "use a parallel.pp (and parallel.vpp) whose product divides 4, or give the first/last stage" in str(err)
    err = build_errors(2, "model=deepseek_v3", "parallel.pp=2")
    assert err.keys == ["parallel.pp"]
    assert "model.num_layers=61 is not divisible by parallel.pp x parallel.vpp = 2 x 1." in str(err)
    # An uneven split that Megatron accepts is valid; one that leaves the middle stages uneven is named.
    dims = ParallelDims.build(make_job("parallel.pp=2", "parallel.first_stage_layers=1"), 2, te_available=False)
    assert dims.pp == 2
    err = build_errors(4, "parallel.pp=4", "parallel.first_stage_layers=2")
    assert err.keys == ["parallel.first_stage_layers"]
    assert "2 of model.num_layers=4 layers remain for 3 middle stages" in str(err)


def test_interleaved_schedule_needs_microbatches_multiple_of_pp() -> None:
    err = build_errors(2, "parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=1", "train.global_batch_size=3")
    assert err.keys == ["train.global_batch_size"]
    assert "the interleaved schedule needs the micro-batch count (3) to be a multiple of parallel.pp=2." in str(err)
    assert "use train.global_batch_size=6." in str(err)


def test_experts_vs_ep() -> None:
    err = build_errors(3, "model=moe_tiny", "parallel.ep=3", "train.global_batch_size=6")
    assert err.keys == ["parallel.ep"]
    assert "model.num_experts=4 is not divisible by parallel.ep=3." in str(err)
    assert "use a parallel.ep that divides 4." in str(err)


def test_ep_on_dense_model() -> None:
    err = build_errors(2, "model=llama_tiny", "parallel.ep=2")
    assert err.keys == ["parallel.ep"]
    assert "parallel.ep=2: model llama_tiny has no experts." in str(err)
    assert "set parallel.ep=1, or choose a MoE model (e.g. model=moe_tiny)." in str(err)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_with_tp_needs_sp(ep: int) -> None:
    """With or without EP: Megatron-Core's MoELayer raises in its first training forward pass under TP without SP
    (a planned dp2 tp2 moe_tiny run without SP did, 2026-11-26)."""
    err = build_errors(4, "model=moe_tiny", "parallel.tp=2", f"parallel.ep={ep}")
    assert err.keys == ["parallel.sp"]
    assert "Megatron-Core needs sequence parallelism for MoE with TP" in str(err)
    assert "set parallel.sp=true." in str(err)


def test_global_batch_vs_micro_times_dp() -> None:
    err = build_errors(4, "train.global_batch_size=8", "train.micro_batch_size=4")
    assert err.keys == ["train.global_batch_size"]
    assert ("train.global_batch_size=8: is not divisible by train.micro_batch_size x data-parallel size = 4 x 4 = 16."
            in str(err))
    assert "use a multiple of 16, e.g. train.global_batch_size=16." in str(err)


def test_seq_vs_cp_without_transformer_engine() -> None:
    err = build_errors(2, "parallel.cp=2", "train.seq_length=66", te_available=False)
    assert err.keys == ["train.seq_length", "parallel.cp"]
    assert "context parallelism splits the sequence into 2 x parallel.cp = 4 chunks." in str(err)
    assert "use a multiple of 4." in str(err)
    assert "context parallelism needs Transformer Engine's attention" in str(err)
    assert "install transformer-engine (GPU only), or set parallel.cp=1." in str(err)


def test_seq_vs_cp_with_transformer_engine() -> None:
    err = build_errors(2, "parallel.cp=2", "train.seq_length=66", te_available=True)
    assert err.keys == ["train.seq_length"]
    assert "context parallelism splits the sequence into 2 x parallel.cp = 4 chunks." in str(err)
    dims = ParallelDims.build(make_job("parallel.cp=2", "train.seq_length=64"), 2, te_available=True)
    assert (dims.cp, dims.dp) == (2, 1)
    err = build_errors(2, "parallel.cp=2", "train.seq_length=64", te_available=False)
    assert err.keys == ["parallel.cp"]


def test_mla_rejects_cp() -> None:
    err = build_errors(2, "model=deepseek_v3", "parallel.cp=2", te_available=True)
    assert err.keys == ["parallel.cp"]
    assert "multi-latent attention does not support context parallelism." in str(err)


def test_seq_vs_tp_with_sp() -> None:
    err = build_errors(2, "parallel.tp=2", "parallel.sp=true", "train.seq_length=63")
    assert err.keys == ["train.seq_length"]
    assert "train.seq_length=63: sequence parallelism shards each context-parallel rank's 63 tokens over " \
           "parallel.tp=2." in str(err)
    assert "use a multiple of 2, or set parallel.sp=false." in str(err)


def test_primepar_mlp_runs_with_sp() -> None:
    """The PrimePar MLP gathers its input's sequence shards itself, so sequence parallelism is accepted with it; the
    sequence must still split over the TP group."""
    dims = ParallelDims.build(make_job("parallel.tp=4", "parallel.sp=true", "parallel.mlp=primepar"), 4)
    assert dims.tp == 4 and dims.sp
    err = build_errors(4, "parallel.tp=4", "parallel.sp=true", "parallel.mlp=primepar", "train.seq_length=66")
    assert err.keys == ["train.seq_length"]
    assert "use a multiple of 4, or set parallel.sp=false." in str(err)


def test_seq_vs_learned_positions() -> None:
    err = build_errors(1, "model=gpt3_175b", "train.seq_length=4096")
    assert err.keys == ["train.seq_length"]
    assert "exceeds model.max_position_embeddings=2048." in str(err)


def test_sp_without_tp() -> None:
    with pytest.raises(ConfigError) as info:
        make_job("parallel.sp=true")
    assert info.value.keys == ["parallel.sp"]
    assert "sequence parallelism needs parallel.tp > 1." in str(info.value)
    assert "set parallel.sp=false or parallel.tp to 2 or more." in str(info.value)


def test_vpp_without_pp() -> None:
    with pytest.raises(ConfigError) as info:
        make_job("parallel.vpp=2")
    assert info.value.keys == ["parallel.vpp"]
    assert "virtual pipeline stages need parallel.pp > 1." in str(info.value)
    assert "set parallel.vpp=null or parallel.pp to 2 or more." in str(info.value)


def test_cluster_size_vs_world() -> None:
    err = build_errors(8, "cluster=dgx_h100", "cluster.nodes=2", "train.global_batch_size=16")
    assert err.keys == ["cluster.nodes"]
    assert "cluster.nodes x cluster.gpus_per_node = 2 x 8 = 16 but 8 ranks were started." in str(err)
    assert "start that many ranks, or set cluster.nodes/cluster.gpus_per_node to match torchrun." in str(err)
    # The local cluster follows torchrun, so any world size matches it.
    ParallelDims.build(make_job("train.global_batch_size=16"), 8, te_available=False)


def test_recompute_layers_vs_chunk() -> None:
    err = build_errors(2, "parallel.pp=2", "parallel.recompute=full", "parallel.recompute_num_layers=3")
    assert err.keys == ["parallel.recompute_num_layers"]
    assert "exceeds the 2 layers of each pipeline chunk." in str(err)


def test_block_recompute_needs_full() -> None:
    for recompute in ("none", "selective"):
        with pytest.raises(ConfigError) as info:
            make_job(f"parallel.recompute={recompute}", "parallel.recompute_method=block")
        assert info.value.keys == ["parallel.recompute_method"]
        assert f"needs parallel.recompute=full (got {recompute})." in str(info.value)
        assert "set parallel.recompute=full or parallel.recompute_method=uniform." in str(info.value)
    job = make_job("parallel.recompute=full", "parallel.recompute_method=block", "parallel.recompute_num_layers=2")
    assert job.parallel.recompute_method is RecomputeMethod.block
    assert make_job().parallel.recompute_method is RecomputeMethod.uniform


def test_block_recompute_layers_vs_chunk() -> None:
    err = build_errors(2, "parallel.pp=2", "parallel.recompute=full", "parallel.recompute_method=block",
                       "parallel.recompute_num_layers=3")
    assert err.keys == ["parallel.recompute_num_layers"]
    assert "exceeds the 2 layers of each pipeline chunk." in str(err)
    ParallelDims.build(make_job("parallel.pp=2", "parallel.recompute=full", "parallel.recompute_method=block",
                                "parallel.recompute_num_layers=2"), 2, te_available=False)


def test_block_recompute_reaches_megatron() -> None:
    from cfp_megatron.model.megatron_config import transformer_config

    job = make_job("parallel.recompute=full", "parallel.recompute_method=block", "parallel.recompute_num_layers=2")
    config = transformer_config(job, ParallelDims.build(job, 1, te_available=False), on_gpu=False)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "block", 2)
    uniform = make_job("parallel.recompute=full")
    config = transformer_config(uniform, ParallelDims.build(uniform, 1, te_available=False), on_gpu=False)
    assert (config.recompute_granularity, config.recompute_method, config.recompute_num_layers) == ("full", "uniform",
                                                                                                    1)


def test_recompute_modules_reach_megatron_and_are_checked_against_the_model() -> None:
    from cfp_megatron.model.megatron_config import transformer_config

    job = make_job("model=llama_tiny", "parallel.recompute=selective", "parallel.recompute_modules=mlp+layernorm")
    assert job.parallel.recompute_modules == "layernorm+mlp"  # Megatron-Core's order, whatever the user's
    config = transformer_config(job, ParallelDims.build(job, 1, te_available=False), on_gpu=False)
    assert (config.recompute_granularity, config.recompute_modules) == ("selective", ["layernorm", "mlp"])
    default = make_job("parallel.recompute=selective")
    config = transformer_config(default, ParallelDims.build(default, 1, te_available=False), on_gpu=False)
    assert config.recompute_modules == ["core_attn"]
    for overrides, says in (
            (("parallel.recompute_modules=layernorm",), "parallel.recompute is none"),
            (("parallel.recompute=selective", "parallel.recompute_modules=mlp+norms"), "unknown module(s) ['norms']"),
    ):
        with pytest.raises(ConfigError) as err:
            make_job(*overrides)
        assert "parallel.recompute_modules" in str(err.value) and says in str(err.value)
    for model, modules, says in (("gpt_tiny", "moe_act", "has no experts"),
                                 ("gpt_tiny", "mla_up_proj", "has standard attention"),
                                 ("moe_tiny", "mlp", "every layer of model moe_tiny is a MoE layer"),
                                 ("moe_tiny", "shared_experts", "has no shared expert"),
                                 ("moe_tiny", "moe_act", "Transformer Engine")):
        bad = make_job(f"model={model}", "parallel.recompute=selective", f"parallel.recompute_modules={modules}")
        with pytest.raises(ConfigError) as err:
            ParallelDims.build(bad, 1, te_available=False)
        assert "parallel.recompute_modules" in str(err.value) and says in str(err.value), str(err.value)


def test_many_problems_in_one_error() -> None:
    err = build_errors(12, "cluster=dgx_h100", "parallel.tp=3", "parallel.pp=3", "parallel.ep=2",
                       "train.micro_batch_size=3")
    assert sorted(set(err.keys)) == ["cluster.nodes", "parallel.ep", "parallel.pp", "parallel.tp",
                                     "train.global_batch_size"]
    text = str(err)
    assert text.startswith(f"{len(err.issues)} invalid setting(s):")
    assert len(err.issues) == 8
    for fragment in (
        "world size 12 is not divisible by parallel.tp x parallel.cp x parallel.pp = 3 x 1 x 3 = 9.",
        "choose sizes whose product divides 12",
        "cluster.nodes x cluster.gpus_per_node = 1 x 8 = 8 but 12 ranks were started.",
        "model.num_attention_heads=4 is not divisible by parallel.tp=3.",
        "model.num_query_groups=4 (key/value heads) is not divisible by parallel.tp=3.",
        "model.ffn_hidden_size=256 is not divisible by parallel.tp=3.",
        "model.num_layers=4 is not divisible by parallel.pp x parallel.vpp = 3 x 1.",
        "parallel.ep=2: model gpt_tiny has no experts. Fix: set parallel.ep=1",
        "train.global_batch_size=8: is not divisible by train.micro_batch_size x data-parallel size = 3 x 1 = 3.",
        "Fix: use a multiple of 3",
    ):
        assert fragment in text
    # Each issue reads as one line: key=value: problem Fix: fix.
    assert all(line.startswith("  - ") and " Fix: " in line for line in text.splitlines()[1:])


def test_spec_errors_from_every_group_come_together() -> None:
    with pytest.raises(ConfigError) as info:
        make_job("train.micro_batch_size=0", "parallel.tp=0", "model.num_layers=0", "cluster.nodes=0",
                 "data.split=abc", "model.moe_shared_expert_intermediate_size=64")
    err = info.value
    assert err.keys == ["model.num_layers", "model.moe_shared_expert_intermediate_size", "cluster.nodes",
                        "parallel.tp", "train.micro_batch_size", "data.split"]
    text = str(err)
    assert text.startswith("6 invalid setting(s):")
    for fragment in (
        "train.micro_batch_size=0: must be a positive integer. Fix: set train.micro_batch_size to 1 or more.",
        "parallel.tp=0: must be a positive integer. Fix: set parallel.tp to 1 or more.",
        "model.num_layers=0: must be a positive integer.",
        "cluster.nodes=0: must be a positive integer.",
        "model.moe_shared_expert_intermediate_size=64: shared experts need a MoE model.",
        "data.split='abc': must be three comma-separated weights.",
    ):
        assert fragment in text


def test_spec_errors_on_a_real_preset() -> None:
    with pytest.raises(ConfigError) as info:
        make_job("model=mixtral_8x7b", "model.moe_router_topk=9", "model.num_query_groups=5", "cluster=b200",
                 "cluster.hbm_gib=-1", "train.min_lr=1.0")
    assert info.value.keys == ["model.num_query_groups", "model.moe_router_topk", "cluster.hbm_gib", "train.min_lr"]
    assert "exceeds model.num_experts=8." in str(info.value)
    assert "must divide model.num_attention_heads=32." in str(info.value)


def test_seq_vs_tp_with_sp_counts_the_context_parallel_split() -> None:
    # 12 tokens split over CP=2 leave 6 per rank, which do not split over TP=4 even though 12 does.
    err = build_errors(8, "model.num_query_groups=4", "parallel.tp=4", "parallel.sp=true", "parallel.cp=2",
                       "train.seq_length=12", "train.global_batch_size=2", "train.micro_batch_size=2",
                       te_available=True)
    assert err.keys == ["train.seq_length"]
    assert "shards each context-parallel rank's 6 tokens over parallel.tp=4" in str(err)
    assert "use a multiple of 8" in str(err)


def test_shared_experts_vs_tp() -> None:
    err = build_errors(4, "model=moe_tiny", "model.moe_shared_expert_intermediate_size=6", "parallel.tp=4",
                       "parallel.sp=true")
    assert "model.moe_shared_expert_intermediate_size=6 is not divisible by parallel.tp=4." in str(err)


def _layout_errors(*overrides: str) -> ConfigError:
    """The ConfigError that composing and building the specs raises (ParallelSpec's own checks)."""
    with pytest.raises(ConfigError) as info:
        make_job(*overrides)
    return info.value


@pytest.mark.parametrize(("overrides", "problem"), [
    (["parallel.pp=2", "parallel.pipeline_model_parallel_layout=Et*3|tX"], "cannot parse it: 'X'"),
    (["parallel.pp=2", "parallel.pipeline_model_parallel_layout=Et*4L"], "it has 1 stages; parallel.pp x parallel.vpp"
                                                                         " = 2 x 1 = 2"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_model_parallel_layout=Et*3|tL"], "= 2 x 2 = 4"),
    (["parallel.pp=2", "parallel.pipeline_model_parallel_layout=tE|ttL"], "embedding (E) once, first"),
    (["parallel.pp=2", "parallel.pipeline_model_parallel_layout=EtLt|tt"], "loss (L) once, last"),
    (["parallel.pp=2", "parallel.pipeline_model_parallel_layout=Etm|tttL"], "before the first MTP layer"),
    (["parallel.pp=2", "parallel.vpp=2", "parallel.pipeline_model_parallel_layout=Et|tm|tt|L"],
     "Megatron-Core builds them only in a rank's last chunk"),
    (["parallel.pp=2", "parallel.first_stage_layers=3", "parallel.pipeline_model_parallel_layout=Et*3|tL"],
     "a per-stage layout or parallel.first_stage_layers, not both"),
    (["parallel.pp=2", "parallel.account_for_loss_in_pipeline_split=true",
      "parallel.pipeline_model_parallel_layout=Et*3|tL"], "or parallel.account_for_loss_in_pipeline_split, not both"),
    (["parallel.pipeline_model_parallel_layout=Et*4L"], "parallel.pp=1 has one"),
])
def test_pipeline_layout_is_checked_before_any_group(overrides: list[str], problem: str) -> None:
    err = _layout_errors(*overrides)
    assert "parallel.pipeline_model_parallel_layout" in err.keys
    assert problem in str(err) and "Fix:" in str(err)


def test_pipeline_layout_layer_counts_against_the_model() -> None:
    dims = ParallelDims.build(make_job("parallel.pp=2", "parallel.pipeline_model_parallel_layout=Et*3|tL"), 2,
                              te_available=False)
    assert dims.pp == 2 and dims.vpp == 1
    err = build_errors(2, "parallel.pp=2", "parallel.pipeline_model_parallel_layout=Et*2|tL")
    assert err.keys == ["parallel.pipeline_model_parallel_layout"]
    assert "it places 3 decoder layers (t); model.num_layers=4." in str(err)
    err = build_errors(2, "parallel.pp=2", "model.mtp_num_layers=1", "parallel.pipeline_model_parallel_layout=Et*3|tL")
    assert "it places 0 MTP layers (m); model.mtp_num_layers=1." in str(err)
    # With MTP and no layout, Megatron puts the MTP layer with the loss: valid.
    assert ParallelDims.build(make_job("parallel.pp=2", "model.mtp_num_layers=1", "model.position_embedding=rope"), 2,
                              te_available=False).pp == 2
    with pytest.raises(ConfigError, match=r"model\.mtp_num_layers=-1: must not be negative"):
        make_job("model.mtp_num_layers=-1")
    # Block recomputation counts a layout's largest chunk (three layers on rank 0).
    assert ParallelDims.build(make_job("parallel.pp=2", "parallel.pipeline_model_parallel_layout=Et*3|tL",
                                       "parallel.recompute=full", "parallel.recompute_method=block",
                                       "parallel.recompute_num_layers=3"), 2, te_available=False).pp == 2


def test_mtp_trains_beside_the_loss_and_refuses_what_megatron_core_cannot_run() -> None:
    from cfp_megatron.planner.job_checks import validate_job

    # The MTP layer with the loss (as Megatron-Core places it without a layout, or as mL in one): accepted.
    rope = ["model=llama_tiny", "model.mtp_num_layers=1", "parallel.pp=2"]
    assert validate_job(make_job(*rope), 2).pp == 2
    assert validate_job(make_job(*rope, "parallel.vpp=2", "parallel.pipeline_model_parallel_layout=Et|t|tt|mL"),
                        2).vpp == 2
    assert validate_job(make_job("model.mtp_num_layers=1"), 1).pp == 1  # learned positions without pipelining
    # A standalone MTP stage (m without the L): planned, not trained.
    with pytest.raises(ConfigError) as info:
        validate_job(make_job(*rope, "parallel.vpp=2", "parallel.pipeline_model_parallel_layout=Et|t|ttm|L"), 2)
    assert info.value.keys == ["parallel.pipeline_model_parallel_layout"]
    assert "write the m's in the last stage" in str(info.value)
    # Learned positions under pipelining: the MTP stage's copy of the position table is never synced.
    with pytest.raises(ConfigError) as info:
        validate_job(make_job("model.mtp_num_layers=1", "parallel.pp=2"), 2)
    assert info.value.keys == ["model.position_embedding"]
    assert "model.position_embedding=rope" in str(info.value)
    with pytest.raises(ConfigError, match=r"model\.mtp_loss_scaling_factor=-0\.1: must not be negative"):
        make_job("model.mtp_loss_scaling_factor=-0.1")


def test_a_sliding_window_reaches_megatron_layer_by_layer() -> None:
    from megatron.core.transformer.utils import is_layer_window_attention

    from cfp_megatron.model.megatron_config import transformer_config

    job = make_job("model=gpt_oss_120b")
    assert (job.model.window_size, job.model.window_attn_skip_freq, job.model.windowed_layers) == (128, 2, 18)
    tiny = make_job("model.window_size=8", "model.window_attn_skip_freq=2")
    config = transformer_config(tiny, ParallelDims.build(tiny, 1, te_available=False), on_gpu=False)
    assert (config.window_size, config.window_attn_skip_freq) == ((8, 0), 2)
    windowed = [is_layer_window_attention(config.window_size, config.window_attn_skip_freq, n)
                for n in range(1, tiny.model.num_layers + 1)]
    assert sum(windowed) == tiny.model.windowed_layers and windowed[0] and not windowed[1]
    with pytest.raises(ConfigError) as err:
        make_job("model.window_attn_skip_freq=2")
    assert "model.window_attn_skip_freq" in str(err.value) and "model.window_size" in str(err.value)


def test_one_composition_serves_hydras_run_and_the_job() -> None:
    """``compose_config(keep_hydra=True)`` keeps Hydra's node (for ``HydraConfig``, as tests/scripts/multirank_cases.py
    sets it); :func:`without_hydra` of it is the job's config as ``compose_config`` gives it, flags included, and
    leaves the composed config whole."""
    from omegaconf import OmegaConf

    from cfp_megatron.base.compose import compose_config, without_hydra

    overrides = ["model=gpt_tiny", "parallel.tp=2", "train.steps=3"]
    full = compose_config(overrides, keep_hydra=True)
    assert list(full.hydra.overrides.task) == overrides and full.hydra.runtime.choices.model == "gpt_tiny"
    job = without_hydra(full)
    plain = compose_config(overrides)
    assert "hydra" not in job and "hydra" in full
    assert OmegaConf.to_container(job) == OmegaConf.to_container(plain)
    assert OmegaConf.is_struct(job) == OmegaConf.is_struct(plain)
    assert OmegaConf.get_type(job) is OmegaConf.get_type(plain)
    with pytest.raises(Exception, match="nonexistent_key"):
        job.train.nonexistent_key = 1  # still refuses a key the schema lacks


def test_the_schema_is_stored_once_a_process() -> None:
    """Every composition registers the configs; the schema already in Hydra's ConfigStore is kept, not converted
    and stored again, and compositions still check against it."""
    register_configs()
    stored = ConfigStore.instance().repo["cfp_schema.yaml"]
    register_configs()
    assert ConfigStore.instance().repo["cfp_schema.yaml"] is stored
    with pytest.raises(ConfigError, match="train.steps"):
        compose_config(["train.steps=many"])
