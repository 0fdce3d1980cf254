"""Model capture with no memory: per-kind graphs of Megatron-Core models built on meta, hooks, DeepSpeed-style
capture and the summary cache. One process, no torchrun; every Megatron build here runs under the ``fake`` group."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import yaml

from cfp_megatron.backends.deepspeed.hook import DeepSpeedUnavailable, capture_deepspeed_model, initialize
from cfp_megatron.base.config import JobSpec, job_from_config
from cfp_megatron.base.files import CACHE_ENV
from cfp_megatron.base.flops import attention_params, mlp_params
from cfp_megatron.graph.opgraph import OpGraph, Phase
from cfp_megatron.model import cache as capture_cache
from cfp_megatron.model import megatron_layers
from cfp_megatron.model.capture import ModelCapture, capture_job, capture_model, parameters_on_meta
from cfp_megatron.model.errors import CaptureError
from cfp_megatron.model.hooks import capture_model_provider, wrap_model_provider
from cfp_megatron.model.meta_env import megatron_meta_env
from cfp_megatron.model.moe_meta import BalancedMetaDispatcher
from cfp_megatron.model.summary import CaptureSummary

CONF = os.path.join(os.path.dirname(__file__), "..", "conf", "model")

DEEPSEEK_TINY = {
    "name": "deepseek_tiny", "num_layers": 4, "hidden_size": 64, "ffn_hidden_size": 96, "num_attention_heads": 4,
    "vocab_size": 257, "max_position_embeddings": 256, "position_embedding": "rope", "normalization": "RMSNorm",
    "activation": "swiglu", "add_bias_linear": False, "tie_embeddings": False, "attention": "mla",
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_head_dim": 16, "qk_pos_emb_head_dim": 8, "v_head_dim": 16,
    "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 32,
    "moe_first_dense_layers": 1, "moe_router_score": "sigmoid",
}


def model_conf(name: str) -> dict:
    if name == "deepseek_tiny":
        return dict(DEEPSEEK_TINY)
    with open(os.path.join(CONF, f"{name}.yaml")) as fh:
        return yaml.safe_load(fh)


def make_job(name: str, precision: str = "fp32") -> JobSpec:
    return job_from_config({"model": model_conf(name), "train": {"precision": precision}})


@pytest.fixture(autouse=True)
def no_process_group() -> Iterator[None]:
    """Every test starts and ends without a process group (capture must clean up after itself)."""
    assert not dist.is_initialized()
    yield
    assert not dist.is_initialized()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def real_cpu_model(job: JobSpec) -> torch.nn.Module:
    """The same model built for real (fp32 weights on the CPU), single stage."""
    from cfp_megatron.base.parallel_dims import ParallelDims
    from cfp_megatron.engine.distributed import model_groups
    from cfp_megatron.engine.model import build_model_chunks
    from cfp_megatron.model.capture import capture_job_config

    config = dataclasses.replace(capture_job_config(job), perform_initialization=True)
    from cfp_megatron.model.mla import local_mla_layer_spec

    dims = ParallelDims.build(job, 1, te_available=False)
    import megatron.core.models.gpt.gpt_layer_specs as specs

    original = specs.get_gpt_decoder_block_spec

    def patched(*args, **kwargs):  # the same local MLA attention the capture uses
        block = original(*args, **kwargs)
        return dataclasses.replace(block, layer_specs=[local_mla_layer_spec(s) for s in block.layer_specs])

    import cfp_megatron.engine.model as runtime_model

    runtime_model.get_gpt_decoder_block_spec = patched
    try:
        (model,) = build_model_chunks(job, config, dims, model_groups())
    finally:
        runtime_model.get_gpt_decoder_block_spec = original
    return model


EXPECTED_KINDS = {
    "gpt_tiny": ("dense",) * 4,
    "llama_tiny": ("dense",) * 4,
    "moe_tiny": ("moe",) * 4,
    "deepseek_tiny": ("dense", "moe", "moe", "moe"),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_KINDS))
def test_kinds_and_parameters_match_the_real_model(name: str) -> None:
    job = make_job(name)
    cap = capture_job(job, seq_length=32, micro_batch_size=2)
    assert cap.layer_kinds == EXPECTED_KINDS[name]
    assert set(cap.graphs) == {"embedding", "head", *EXPECTED_KINDS[name]}
    with megatron_meta_env():
        model = real_cpu_model(job)
        assert all(p.device.type == "cpu" for p in model.parameters())
        by_kind: dict[str, int] = {}
        for kind, layer in zip(cap.layer_kinds, model.decoder.layers, strict=True):
            by_kind.setdefault(kind, sum(p.numel() for p in layer.parameters()))
        real_total = sum(p.numel() for p in model.parameters())
        real_embedding = sum(p.numel() for p in model.embedding.parameters())
    for kind, params in by_kind.items():
        assert cap.graphs[kind].param_count == params, kind
    assert cap.graphs["embedding"].param_count == real_embedding
    assert cap.total_params == real_total
    assert cap.counts == {"embedding": 1, "head": 1, **{k: EXPECTED_KINDS[name].count(k) for k in by_kind}}


def test_llama3_8b_total_parameters() -> None:
    cap = capture_job(job_from_config({"model": model_conf("llama3_8b")}), seq_length=128)
    assert cap.total_params == pytest.approx(8.03e9, rel=0.01)
    assert cap.layer_kinds == ("dense",) * 32


def _matmul_flops(graph: OpGraph, phase: Phase | None = None, *, skip_attention_core: bool = False) -> int:
    ops = graph.operators if phase is None else graph.phase(phase)
    return sum(o.flops for o in ops if o.flops and o.name.split(".")[1] in ("mm", "addmm", "bmm", "baddbmm")
               and not (skip_attention_core and "core_attention" in o.module))


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
def test_dense_layer_flops(name: str) -> None:
    job = make_job(name)
    seq, mbs = 64, 2
    cap = capture_job(job, seq_length=seq, micro_batch_size=mbs)
    dense = cap.graphs["dense"]
    forward = _matmul_flops(dense, Phase.forward)
    assert forward > 0
    assert _matmul_flops(dense) == pytest.approx(3 * forward, rel=0.03)
    m = job.model
    linear = _matmul_flops(dense, Phase.forward, skip_attention_core=True)
    assert linear == 2 * (attention_params(m) + mlp_params(m, m.ffn_size)) * seq * mbs
    # The head's logits: 2 x hidden x vocab per token forward.
    assert _matmul_flops(cap.graphs["head"], Phase.forward) == 2 * m.hidden_size * m.padded_vocab_size * seq * mbs


def test_operators_carry_modules_shapes_and_phases() -> None:
    cap = capture_job(make_job("llama_tiny"), seq_length=16)
    dense = cap.graphs["dense"]
    fc1 = [o for o in dense.operators if o.module.endswith("mlp.linear_fc1")]
    assert fc1 and {o.phase for o in fc1} == {Phase.forward, Phase.backward}
    assert any(o.name == "aten.mm.default" and o.flops > 0 for o in fc1)
    assert any(o.module.endswith("self_attention.linear_qkv") for o in dense.operators)
    assert dense.tensors[dense.inputs[0]].shape == (16, 1, 64)
    assert any(t.param and t.param.endswith("mlp.linear_fc1.weight") for t in dense.tensors.values())


def test_moe_layer_runs_routed_and_shared_experts() -> None:
    cap = capture_job(make_job("deepseek_tiny"), seq_length=16)
    modules = {o.module for o in cap.graphs["moe"].operators}
    assert any("shared_experts" in m for m in modules)
    assert any("router" in m for m in modules)
    experts = {m.split("local_experts.")[1].split(".")[0] for m in modules if "local_experts." in m}
    assert experts == {"0", "1", "2", "3"}
    assert any("core_attention" in m for m in modules)  # MLA's attention ran (local adapter)
    # Balanced routing: the routed experts' forward matmuls are top-k expert MLPs per token.
    m = make_job("deepseek_tiny").model
    routed = sum(o.flops for o in cap.graphs["moe"].phase(Phase.forward) if "local_experts." in o.module)
    assert routed == 2 * m.moe_router_topk * mlp_params(m, m.moe_ffn_hidden_size) * 16


def test_local_mla_adapter_runs_for_real_on_cpu() -> None:
    """The MLA core-attention adapter the capture uses also trains on real CPU tensors (forward + backward)."""
    job = make_job("deepseek_tiny")
    with megatron_meta_env():
        model = real_cpu_model(job)
        ids = torch.randint(0, 257, (2, 16))
        positions = torch.arange(16).unsqueeze(0).expand(2, -1)
        loss = model(ids, positions, None, labels=ids)
        assert loss.shape == (2, 16) and torch.isfinite(loss).all()
        loss.mean().backward()
        grad = model.decoder.layers[0].self_attention.linear_kv_up_proj.weight.grad
        assert grad is not None and grad.abs().sum() > 0


def test_balanced_dispatch_counts() -> None:
    d = BalancedMetaDispatcher(num_experts=3, topk=2, state={})
    assert d.tokens_per_expert(5) == [4, 3, 3]
    assert sum(d.tokens_per_expert(4096)) == 8192


def test_no_parameter_memory(monkeypatch) -> None:
    seen: list[str] = []
    original = megatron_layers.record_step

    def checked(module, inputs, **kwargs):
        assert parameters_on_meta([module]), f"{type(module).__name__} has non-meta parameters"
        assert all(t.device.type == "meta" for t in inputs)
        seen.append(kwargs["kind"])
        return original(module, inputs, **kwargs)

    monkeypatch.setattr(megatron_layers, "record_step", checked)
    cap = capture_job(job_from_config({"model": model_conf("llama3_70b")}), seq_length=64)
    assert sorted(seen) == ["dense", "embedding", "head"]
    assert cap.total_params > 6e10


def _gpt_provider(job: JobSpec):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from cfp_megatron.model.capture import capture_job_config

    def model_provider(pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
        # A user's provider: GPU-style config (no CPU initialisation), built wherever the caller puts it.
        config = dataclasses.replace(capture_job_config(job), use_cpu_initialization=False,
                                     perform_initialization=True)
        m = job.model
        return GPTModel(config=config, transformer_layer_spec=get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=m.normalization.value),
            vocab_size=m.padded_vocab_size, max_sequence_length=m.max_position_embeddings, pre_process=pre_process,
            post_process=post_process, share_embeddings_and_output_weights=m.tie_embeddings,
            position_embedding_type=m.position_embedding.value)

    return model_provider


@pytest.mark.parametrize(("name", "precision"), [("gpt_tiny", "fp32"), ("moe_tiny", "bf16")])
def test_model_provider_hook(name: str, precision: str) -> None:
    job = make_job(name, precision)
    provider = wrap_model_provider(_gpt_provider(job), seq_length=32)
    model = provider(pre_process=True, post_process=True)
    assert parameters_on_meta([model])
    (cap,) = provider.captures
    ref = capture_job(job, seq_length=32)
    assert cap.layer_kinds == ref.layer_kinds
    assert cap.total_params == ref.total_params
    assert cap.total_flops == ref.total_flops
    assert {t.dtype for t in cap.graphs[cap.layer_kinds[0]].tensors.values() if t.param} == {
        "float32" if precision == "fp32" else "bfloat16"}
    one = capture_model_provider(_gpt_provider(job), seq_length=32, pre_process=True, post_process=False)
    assert "head" not in one.graphs and one.total_params == ref.total_params - ref.graphs["head"].param_count + (
        ref.shared_params)


def test_capture_model_leaves_a_real_model_alone() -> None:
    job = make_job("llama_tiny")
    with megatron_meta_env():
        model = real_cpu_model(job)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cap = capture_model(model, seq_length=16, name="llama_tiny")
    assert cap.layer_kinds == ("dense",) * 4
    assert cap.total_params == sum(p.numel() for p in before.values())
    assert all(p.device.type == "cpu" and torch.equal(p, before[n]) for n, p in model.named_parameters())


class _Block(torch.nn.Module):
    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, ffn)
        self.fc2 = torch.nn.Linear(ffn, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class _PlainModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.blocks = torch.nn.ModuleList([_Block(16, 32), _Block(16, 32), _Block(16, 64), _Block(16, 32)])
        self.out = torch.nn.Linear(16, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def test_deepspeed_style_capture() -> None:
    model = _PlainModel()
    ids = torch.zeros(2, 8, dtype=torch.long)
    cap = capture_deepspeed_model(model, ids, name="plain")
    assert cap.layer_kinds == ("block", "block", "block_2", "block")
    assert cap.total_params == sum(p.numel() for p in model.parameters())
    assert cap.graphs["block"].param_count == sum(p.numel() for p in model.blocks[0].parameters())
    fc1 = [o for o in cap.graphs["block"].phase(Phase.forward) if o.module.endswith("fc1") and o.flops]
    assert sum(o.flops for o in fc1) == 2 * 16 * 32 * 2 * 8
    assert cap.graphs["rest"].param_count == sum(p.numel() for n, p in model.named_parameters()
                                                 if not n.startswith("blocks."))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert cap.seq_length == 8 and cap.micro_batch_size == 2


@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is not None, reason="deepspeed installed")
def test_initialize_captures_then_reports_missing_deepspeed() -> None:
    model = _PlainModel()
    with pytest.raises(DeepSpeedUnavailable):
        initialize(model=model, example_input=torch.zeros(1, 4, dtype=torch.long), config={})
    assert isinstance(model.cfp_capture, ModelCapture)
    assert model.cfp_capture.layer_kinds == ("block", "block", "block_2", "block")


def test_cache_returns_the_same_summary(monkeypatch, tmp_path) -> None:
    job = make_job("moe_tiny")
    first = capture_cache.capture_summary(job, seq_length=16)
    assert list((tmp_path / "cache" / "capture").glob("*.json"))

    def fail(*args, **kwargs):
        raise AssertionError("captured again instead of reading the cache")

    monkeypatch.setattr("cfp_megatron.model.capture.capture_job", fail)
    second = capture_cache.capture_summary(job, seq_length=16)
    assert second == first
    assert second.total_params == first.total_params > 0
    assert second.kinds["moe"].count == 4 and second.kinds["moe"].graph["operators"]
    with pytest.raises(AssertionError):  # another sequence length is another key
        capture_cache.capture_summary(job, seq_length=32)
    other = dataclasses.replace(job, model=dataclasses.replace(job.model, num_layers=2))
    assert capture_cache.cache_key(capture_cache.job_cache_inputs(other, seq_length=16, micro_batch_size=1)) != \
        capture_cache.cache_key(capture_cache.job_cache_inputs(job, seq_length=16, micro_batch_size=1))


def test_summary_round_trip() -> None:
    cap = capture_job(make_job("gpt_tiny"), seq_length=16)
    summary = cap.summary()
    back = CaptureSummary.from_json(summary.to_json())
    assert back == summary
    assert back.total_params == cap.total_params and back.total_flops == cap.total_flops
    assert back.sequence == ("embedding", "dense", "dense", "dense", "dense", "head")
    assert cap.to_json(with_graphs=False)["kinds"]["dense"] == {
        "kind": "dense", "count": 4, "params": cap.graphs["dense"].param_count, "flops": cap.graphs["dense"].flops,
        "forward_flops": sum(o.flops for o in cap.graphs["dense"].phase(Phase.forward)),
        "operators": len(cap.graphs["dense"].operators)}


def test_meta_env_creates_and_removes_a_fake_group() -> None:
    from megatron.core import parallel_state

    with megatron_meta_env() as created:
        assert created and dist.is_initialized() and dist.get_backend() == "fake"
        assert parallel_state.model_parallel_is_initialized()
    assert not parallel_state.model_parallel_is_initialized()


def test_meta_env_leaves_an_existing_group_alone() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        with pytest.raises(CaptureError, match="initialize_model_parallel"), megatron_meta_env():
            pass
        assert dist.is_initialized() and dist.group.WORLD is group
    finally:
        dist.destroy_process_group()


def test_bad_sizes_are_a_typed_error() -> None:
    with pytest.raises(CaptureError):
        capture_job(make_job("gpt_tiny"), seq_length=16, micro_batch_size=0)
    with pytest.raises(CaptureError):
        ModelCapture(model="x", seq_length=1, micro_batch_size=1, graphs={}, layer_kinds=("dense",))


def test_capture_from_a_users_transformer_config(monkeypatch) -> None:
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cfp_megatron.model.capture import capture_transformer_config

    config = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                               ffn_hidden_size=128, gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, normalization="RMSNorm", params_dtype=torch.bfloat16,
                               bf16=True)
    cap = capture_transformer_config(config, vocab_size=512, seq_length=32, name="user")
    assert cap.layer_kinds == ("dense",) * 3
    d = 64 // 8
    attention = 64 * d * (8 + 2 * 2) + 8 * d * 64
    assert cap.graphs["dense"].param_count == attention + 3 * 64 * 128 + 2 * 64  # two RMSNorm weights
    assert {t.dtype for t in cap.graphs["dense"].tensors.values() if t.param} == {"bfloat16"}
    first = capture_cache.config_summary(config, vocab_size=512, seq_length=32, name="user")
    monkeypatch.setattr("cfp_megatron.model.capture.capture_transformer_config",
                        lambda *a, **k: pytest.fail("not served from the cache"))
    assert capture_cache.config_summary(config, vocab_size=512, seq_length=32, name="user") == first
    assert first.total_params == cap.total_params


def test_the_jobs_parallel_layout_does_not_change_the_capture() -> None:
    conf = {"model": model_conf("llama3_8b"), "cluster": {"nodes": 4, "gpus_per_node": 8},
            "parallel": {"tp": 8, "pp": 4}, "train": {"global_batch_size": 64, "micro_batch_size": 1}}
    cap = capture_job(job_from_config(conf), seq_length=64)
    ref = capture_job(job_from_config({"model": model_conf("llama3_8b")}), seq_length=64)
    assert cap.layer_kinds == ref.layer_kinds and cap.total_params == ref.total_params
    assert cap.total_flops == ref.total_flops
