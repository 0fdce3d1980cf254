"""The partition options of each layer kind (model/options.py): what the analysis hands the search."""

from __future__ import annotations

import pytest

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.compose import compose_job
from cfp_megatron.model import options as options_module
from cfp_megatron.model.options import LayerPart, PartitionOption, SizeContext, model_options, size_reasons
from cfp_megatron.search.space import build_space

CONTEXT = SizeContext(seq_length=64, micro_batch=1)
MLA = ["model=moe_tiny", "model.attention=mla", "model.position_embedding=rope", "model.q_lora_rank=32",
       "model.kv_lora_rank=32", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16",
       "model.moe_first_dense_layers=1"]
"""A small DeepSeek-style model: multi-latent attention, a dense first layer, MoE after it."""


def _names(*overrides: str) -> set[tuple[str, str, str]]:
    return {(o.part.value, o.name, o.knob) for o in model_options(compose_job(list(overrides)).model)}


def test_each_layer_kind_brings_its_own_options() -> None:
    dense = _names("model=gpt_tiny")
    assert {("attention", "head-split", "tp"), ("attention", "context-split", "cp"), ("mlp", "megatron-1d", "tp"),
            ("mlp", "primepar-2d", "tp"), ("embedding", "vocab-split", "tp"), ("head", "vocab-split", "tp")} == dense
    moe = _names("model=moe_tiny")
    assert ("moe", "expert-split", "ep") in moe and ("moe", "expert-tensor-split", "etp") in moe
    assert not any(part == "mlp" for part, _, _ in moe)  # every layer MoE: no dense MLP to split
    mla = _names(*MLA)
    assert ("attention", "context-split", "cp") not in mla and ("attention", "head-split", "tp") in mla
    assert ("mlp", "megatron-1d", "tp") in mla and ("mlp", "primepar-2d", "tp") not in mla  # the dense first layer


def test_size_reasons_name_the_part_that_does_not_fit() -> None:
    model = compose_job(["model=gpt_tiny"]).model  # 4 heads, FFN 256, vocabulary 384
    found = model_options(model)
    assert size_reasons(found, "tp", model, 8, CONTEXT) == ["4 attention heads are not divisible by it",
                                                            "4 key/value heads are not divisible by it"]
    assert size_reasons(found, "tp", model, 4, CONTEXT) == []
    assert size_reasons(found, "cp", model, 64, CONTEXT) == ["the sequence 64 does not split into 2 x 64 chunks"]
    mla = compose_job(MLA).model
    assert size_reasons(model_options(mla), "cp", mla, 2, CONTEXT) == [
        "multi-latent attention does not support context parallelism"]


def test_primepar_is_an_alternative_checked_at_every_size() -> None:
    model = compose_job(["model=gpt_tiny"]).model
    primepar = next(o for o in model_options(model) if o.choice == ("mlp", "primepar"))
    assert primepar.reasons(model, 1, CONTEXT) and primepar.reasons(model, 2, CONTEXT)
    assert primepar.reasons(model, 4, CONTEXT) == []


def test_a_new_layer_kinds_option_reaches_the_search_without_editing_it(monkeypatch: pytest.MonkeyPatch) -> None:
    job = compose_job(["model=gpt_tiny", "cluster.gpus_per_node=4"])
    before = build_space(job, 4, CfpSpec())
    assert any(f.tp == 2 for f in before.families)
    odd = PartitionOption(part=LayerPart.attention, name="odd-split", knob="tp", choice=None, block="-",
                          communication="-", modules=frozenset(),
                          checks=lambda model, size, context: ["the odd layer has 3 rows"] if 3 % size else [])
    real = options_module.model_options
    monkeypatch.setattr("cfp_megatron.search.space.model_options", lambda model: (*real(model), odd))
    after = build_space(job, 4, CfpSpec())
    assert not any(f.tp > 1 for f in after.families)
    assert any(r.what == "tp=2" and "the odd layer has 3 rows" in r.reason for r in after.rejected)
