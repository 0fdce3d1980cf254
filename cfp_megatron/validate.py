"""``python -m cfp_megatron.validate FILE.csv [FILE.csv ...]``: predict published training runs and report the error.

Reads rows of the schema of ``shared/data/published_runs.csv`` (one measured run per row: model shape, GPUs, parallel
layout, measured step time), builds the plan of each row, simulates it on the hardware preset of its GPU, and prints
one line per row (id, model, layout, measured, predicted step time, error, predicted peak memory), the rows it cannot
model with the reason, the coverage (rows modelled of the rows with a step time), the MAPE and largest error per
class (dense, MoE, CP, FSDP; GPU generation), and last ``MAPE <x>% over <n> rows``. The measured step time is
``step_time_s``, else ``derived_step_time_s``, else global batch x sequence / (``tokens_per_s_per_gpu`` x GPUs).

Defaults for fields a row leaves blank (documented, the same for every row):

* ``vocab``: 51200 (GPT-2's BPE padded as Megatron-LM does); ``ffn_hidden``: 4 x hidden; ``kv_heads``: one per head;
  except for the model families of :data:`FAMILY_ARCHITECTURES` (Nemotron, Qwen3, Llama 2/3, Mixtral, DeepSeek-V3,
  GPT-OSS), which also fix what no column holds (Nemotron's dropout-free rotary layers, Qwen3's 128-channel heads).
* ``dp``: GPUs / (TP x PP x CP); ``cp``, ``ep``, ``vp``, ``micro_batch``: 1; ``global_batch_seqs``: micro-batch x
  DP x ``grad_accum`` when that is given.
* ``sequence_parallel``: on with TP for NeMo / Megatron-Core / Megatron-Bridge (their recipes' default) and where
  Megatron-Core requires it (MoE with TP), else off.
* ``recompute``: none. ``precision``: bf16 (``fp16`` when the row says fp16; FP8 GEMMs when it says FP8).
* ``zero_or_fsdp``: blank means Megatron's distributed optimizer for NeMo / Megatron-Core / Megatron-Bridge (their
  default) and plain data parallelism otherwise; "distributed optimizer" turns it on; "FSDP"/"ZeRO-3" models fully
  sharded data parallelism.
* ``global_batch_seqs`` blank with one layer: a layer-level measurement (one forward and backward of the layer
  alone, no embedding, logits, optimizer or gradient sync).
* MLP: SwiGLU when ``ffn_hidden`` is not 4 x hidden or the model is MoE, else GELU (with dropout 0.1); positions
  rotary with SwiGLU (the LLaMA-family convention), learned with GELU (GPT-3's).
* Gradients: accumulated and reduced in fp32 (Megatron-LM forces it for bf16), except for NeMo and Megatron-Bridge
  rows: their performance runs keep the gradient buffers and their reduction in bf16 (NeMo 1's launcher scripts
  pass ``optim.grad_sync_dtype=bf16``, NeMo 2's performance recipes ``grad_reduce_in_fp32=False``, Megatron-Bridge's
  ``scripts/performance`` ``grad_reduce_in_fp32 = False``: in one stored version of ``set_basic_perf_overrides``,
  for every recipe, and in the stored versions of its Qwen3 presets read for this).
* ``framework`` naming Megatron-LM from before 2023: unfused attention (no FlashAttention) and no overlap of the
  gradient all-reduce with backward, as those versions ran; every other framework: fused attention, overlap on.
  NeMo / Megatron-Core / Megatron-Bridge: TP communication overlapped with the GEMMs (their performance recipes turn
  ``tp_comm_overlap`` on).
* A decoder whose layers do not split into ``pp x vp`` chunks while its layers plus two do: the embedding and the
  loss counted as layers of the split (``account_for_embedding/loss_in_pipeline_split``, as Megatron-Bridge's recipes
  run Qwen3-235B's 94 layers over 8 x 4 chunks).
* A decoder that splits into ``pp x vp`` chunks neither alone nor with two more layers: Megatron-Core's per-stage
  layout (``pipeline_model_parallel_layout``) that counts the embedding, each multi-token-prediction (MTP) layer and
  the loss as one layer each and spreads them as evenly as possible over the chunks, the MTP layers with the loss
  (:func:`~cfp_megatron.base.pipeline_layout.balanced_layout` with ``ends_counted``): the layout Megatron-Bridge's
  DeepSeek-V3 performance recipe for 1,024 H100s at TP=2 x PP=8 x VP=4 x EP=64 writes, ``Et|(tt|)*30mL``
  (``set_deepseek_v3_pipeline_model_parallel_layout(cfg.model, "Et|(tt|)*30mL")``; its library recipes'
  ``layout_map`` has no PP=8 x VP=4 entry).
* DeepSeek-V3 rows of NeMo / Megatron-Bridge: one MTP layer (``mtp_num_layers=1``, those recipes' setting; the
  layout above places it).
* MoE: the alltoall dispatcher without overlap, except for Megatron-Bridge rows that ran one of its H100 presets
  (same container range, model, GPUs, TP, PP, VP, EP, global batch): that preset's dispatcher (HybridEP or DeepEP,
  modelled as DeepEP's ``flex``), expert all-to-all overlap, TP overlap and gradient-reduce overlap
  (:data:`MEGATRON_BRIDGE_MOE_RECIPES`: Qwen3-235B-A22B and Qwen3-30B-A3B from 26.x, DeepSeek-V3 in 25.x and 26.x),
  and the same for its 26.x Blackwell presets, by precision where they differ
  (:data:`MEGATRON_BRIDGE_BLACKWELL_MOE_RECIPES`); the layout column shows ``flex`` / ``a2ao``.
* MoE rows whose shape (layers, hidden, heads, vocabulary, experts, top-k, expert FFN) is that of a model preset in
  ``conf/model``: that preset's head width, attention (multi-head latent attention and its ranks), shared expert,
  dense first layers and router score, which no column states (:func:`preset_architecture`; DeepSeek-V3 and GPT-OSS
  120B, whose rows name them in ``arch_source``); the layout column shows ``as <preset>``.
* A power limit stated in the ``gpu`` column, or next to "power", "cap", "limit" or "TDP" in ``notes``,
  ``source_detail`` or ``other_measured`` (``power-capped to 500 W``): ``cluster.power_limit_w``, which scales the
  compute peaks by the clock it sustains (:attr:`~cfp_megatron.base.config.ClusterSpec.clock_scale`); the layout
  column shows it (``500W``). At or above the preset's TDP it changes nothing.
* ``tp``, ``pp`` blank where ``dp`` is given (SC21's Table 2 states only the model-parallel size): TP as wide as a
  node allows where it divides that size and the heads, PP the rest (:func:`unstated_split`); the layout column
  marks such rows with ``?``.
* GPUs that are not A100/H100/H200/B200, rows without a measured step time, and rows whose layout does not
  multiply out are listed as not modelled, with the reason.
* Rows it cannot model as they ran are refused with the reason and left out of the figures: a count that is not a
  whole number or is outside the training config's bounds (:func:`_count`), a shape or layout the training config
  refuses (:func:`refusal`), an id given before, a blank id, a line whose fields do not match the header, a
  predicted peak memory over :data:`MEMORY_REFUSE_FACTOR` times the GPU's; one above the GPU's memory but within
  that factor is kept and flagged. Exit status 0 when a row is modelled, 1 when none is, 2 for a file it cannot read
  or write (``--bands``, ``--plot``, ``--json``: written atomically, :mod:`cfp_megatron.base.files`).
"""

from __future__ import annotations

import argparse
import csv
import difflib
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base.compose import CONF_DIR, group_presets
from cfp_megatron.base.config import (
    MAX_EXPERTS,
    MAX_FFN,
    MAX_GLOBAL_BATCH,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_MICROBATCHES,
    MAX_SEQUENCE,
    MAX_VOCAB,
    MAX_WORLD_SIZE,
    AttentionKernel,
    JobSpec,
    job_from_config,
)
from cfp_megatron.base.errors import CfpError, ConfigError
from cfp_megatron.base.files import (
    FileWriteError,
    atomic_writer,
    regular_file_problem,
    writable_file_problem,
    write_atomic,
)
from cfp_megatron.base.flops import training_flops_per_token
from cfp_megatron.base.parallel_dims import data_parallel_size
from cfp_megatron.base.pipeline_layout import balanced_layout
from cfp_megatron.sim.calibration import generation
from cfp_megatron.sim.kernels import target_peak_tflops
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.uncertainty import BAND_QUANTILE, quantile

CONF_CLUSTER = CONF_DIR / "cluster"
DEFAULT_VOCAB = 51200
"""Vocabulary used when a row leaves it blank (and names no model of :data:`FAMILY_ARCHITECTURES`)."""
FAMILY_ARCHITECTURES: tuple[tuple[str, dict[str, object]], ...] = (
    (r"^(?!.*(llama|mistral)).*\bnemotron[ _-]?(3|4)?\b(?!.*\b(h|nano|super|ultra)\b)", {
        "vocab_size": 256000, "hidden_dropout": 0.0, "attention_dropout": 0.0, "position_embedding": "rope"}),
    (r"\bqwen[ _-]?3", {"kv_channels": 128, "vocab_size": 151936}),
    (r"\bllama[ _-]?3", {"vocab_size": 128256, "num_query_groups": 8}),
    (r"\bllama[ _-]?2", {"vocab_size": 32000}),
    (r"\bmixtral", {"vocab_size": 32000, "num_query_groups": 8}),
    (r"\bdeepseek[ _-]?v3", {"vocab_size": 129280}),
    (r"\bgpt[ _-]?oss", {"vocab_size": 201088}),
    (r"\bmpt[ _-]", {"hidden_dropout": 0.0, "attention_dropout": 0.0, "add_bias_linear": False,
                      "position_embedding": "none"}),
)
"""(pattern on ``model`` or ``arch_source``, model fields) of model families whose rows leave blank what their
architecture fixes. The vocabulary (``vocab``) and the KV heads (``kv_heads``) apply only where the row leaves that
column blank; the other fields, which no column holds, always.

* Nemotron-3 and Nemotron-4 (the dense GPT models of NeMo's performance tables): a 256,000-token vocabulary, rotary
  positions and no dropout (Megatron-Bridge's ``NemotronModelProvider``: ``hidden_dropout = attention_dropout =
  0.0``, ``rotary_percent = 0.5``; squared-ReLU MLP without gating, which costs what GELU's does). The rows' own
  FLOP rates agree: NeMo's formula with this vocabulary gives the ``tflops_per_gpu`` of rows 49-51 from their
  ``tokens_per_s_per_gpu`` to 0.1%; with GPT-2's 51,200 it gives 10% less for the 8B.
* Qwen3: 128-channel heads whatever the hidden size (``head_dim`` 128 in every Qwen3 config; Megatron-Bridge's
  ``Qwen3MoEModelProvider`` sets ``kv_channels = 128``): Qwen3-30B-A3B's 32 heads are 4,096 wide on a 2,048 hidden
  size, Qwen3-235B-A22B's 64 heads 8,192 wide on 4,096. With them, Megatron-Bridge's FLOP formula (causal attention
  counted half) gives the Qwen3 rows' ``tflops_per_gpu`` to 0.6%; with hidden / heads it gave 11-14% less.
* The tokenizers' vocabularies of Llama 2 (32,000), Llama 3 (128,256), Mixtral (32,000), Qwen3 (151,936),
  DeepSeek-V3 (129,280) and GPT-OSS (201,088), and the 8 KV heads of every Llama 3 and Mixtral model: the
  shared rows state them, a row that does not gets them (and, for DeepSeek-V3 and GPT-OSS, the preset architecture
  its shape then matches, :func:`preset_architecture`).
* MPT (llm-foundry's ``mpt-*.yaml``): no dropout (``attn_pdrop = resid_pdrop = emb_pdrop = 0``), no biases
  (``no_bias``) and ALiBi instead of a position embedding; their memory, not their time, moves (by 1-4%)."""
BLANK_ONLY_FIELDS = {"vocab_size": "vocab", "num_query_groups": "kv_heads"}
"""Model fields of :data:`FAMILY_ARCHITECTURES` a row's own column (the value) overrides."""


class RowError(CfpError, ValueError):
    """A row cannot be modelled; the message says why."""


@dataclass(frozen=True, kw_only=True)
class MoeRecipe:
    """The communication settings of one Megatron-Bridge MoE performance preset, for the rows that ran it."""

    model: str
    """Regular expression the row's ``model`` matches (case-insensitive)."""
    preset: str
    """Hardware preset of the row's GPU."""
    layout: tuple[int, int, int, int, int, int]
    """(GPUs, TP, PP, VP, EP, global batch) of the preset: a row with another layout ran another configuration."""
    containers: tuple[tuple[int, int], tuple[int, int] | None]
    """First and last NeMo container (year, month) whose preset files set this; ``None``: up to now."""
    dispatcher: str
    """``model.moe_token_dispatcher``: ``flex`` where the preset sets ``moe_token_dispatcher_type="flex"`` (HybridEP
    or DeepEP, modelled as DeepEP), else ``alltoall``."""
    a2a_overlap: bool
    """``parallel.moe_a2a_overlap`` (the preset's ``moe_a2a_overlap``)."""
    tp_comm_overlap: bool
    """``parallel.tp_comm_overlap`` (the preset's ``CommOverlapConfig(tp_comm_overlap=...)``)."""
    overlap_grad_reduce: bool = True
    """``parallel.overlap_grad_reduce`` (the preset's ``comm_overlap.overlap_grad_reduce``)."""
    recompute_modules: str | None = None
    """The preset's selective recomputation (``recompute_modules``, joined by ``+``; ``parallel.recompute=selective``
    with them), unless the row states its recomputation; ``None``: none."""
    precision: str = ""
    """Regular expression the row's ``precision`` matches (case-insensitive) where the preset differs by precision
    (MXFP8 against FP8 current scaling or BF16); empty: any."""


MEGATRON_BRIDGE_MOE_RECIPES = (
    MoeRecipe(model=r"qwen3.?235b", preset="dgx_h100", layout=(256, 2, 8, 4, 32, 8192), containers=((26, 1), None),
              dispatcher="alltoall", a2a_overlap=True, tp_comm_overlap=False),
    MoeRecipe(model=r"qwen3.?30b", preset="dgx_h100", layout=(16, 1, 1, 1, 16, 1024), containers=((26, 1), None),
              dispatcher="flex", a2a_overlap=False, tp_comm_overlap=True),
    MoeRecipe(model=r"deepseek.?v3", preset="dgx_h100", layout=(1024, 2, 8, 4, 64, 8192),
              containers=((25, 1), (25, 12)), dispatcher="flex", a2a_overlap=True, tp_comm_overlap=True,
              overlap_grad_reduce=False, recompute_modules="mla_up_proj+mlp"),
    MoeRecipe(model=r"deepseek.?v3", preset="dgx_h100", layout=(1024, 2, 8, 4, 64, 8192),
              containers=((26, 1), None), dispatcher="flex", a2a_overlap=False, tp_comm_overlap=True,
              overlap_grad_reduce=False, recompute_modules="mla_up_proj+mlp"),
    MoeRecipe(model=r"gpt.?oss.?120b", preset="dgx_h100", layout=(64, 1, 4, 1, 8, 1280), containers=((26, 1), None),
              dispatcher="alltoall", a2a_overlap=False, tp_comm_overlap=True, recompute_modules="layernorm+moe_act"),
)
"""Megatron-Bridge's H100 MoE performance presets, from its ``scripts/performance/configs/``:

* Qwen3-235B-A22B ("V2", global batch 8,192) and Qwen3-30B-A3B, 26.x: ``qwen/qwen3_workload_base_configs.py`` and
  ``qwen/qwen3_llm_pretrain.py``, the files that replaced ``qwen3/workload_base_configs.py``, whose H100 presets ran
  235B at global batch 2,048 without the all-to-all overlap and 30B at PP=2 x VP=12 (the 25.x rows keep the
  defaults).
* DeepSeek-V3 on 1,024 H100s, 25.x: ``deepseek/deepseek_llm_pretrain.py`` (every stored version of its
  ``deepseek_v3_h100_1024gpus_*_config``): ``enable_deepep=True``, the all-to-all overlap
  (``set_moe_a2a_overlap_overrides``, earlier ``set_moe_a2a_1f1b_overrides``), ``overlap_grad_reduce=False``.
* DeepSeek-V3 on 1,024 H100s, 26.x: ``deepseek/deepseek_workload_base_configs.py`` (``..._H100_V1``): HybridEP
  without the all-to-all overlap; its llm_pretrain file keeps ``overlap_grad_reduce=False``. Both recompute the MLA
  up-projections and the dense MLPs (``recompute_modules=["mla_up_proj", "mlp"]``).
* GPT-OSS 120B on 64 H100s at global batch 1,280, 26.x: ``gpt_oss/gpt_oss_workload_base_configs.py``
  (``..._H100_BF16_V2``): PP=4, EP=8, ``recompute_modules=["layernorm", "moe_act"]``, the default dispatcher. Its
  25.x rows (micro-batch 4, global batch 512) ran another configuration and keep the defaults."""


def _blackwell(model: str, presets: tuple[str, ...], layouts: tuple[tuple[int, int, int, int, int, int], ...], *,
               a2a_overlap: bool = False, recompute_modules: str | None = None, precision: str = "",
               overlap_grad_reduce: bool = True, dispatcher: str = "flex") -> tuple[MoeRecipe, ...]:
    """Megatron-Bridge's 26.x Blackwell presets of one setting on every listed GPU and layout (HybridEP, ``flex``,
    unless ``dispatcher`` says otherwise)."""
    return tuple(MoeRecipe(model=model, preset=preset, layout=layout, containers=((26, 1), None), dispatcher=dispatcher,
                           a2a_overlap=a2a_overlap, tp_comm_overlap=True, overlap_grad_reduce=overlap_grad_reduce,
                           recompute_modules=recompute_modules, precision=precision)
                 for preset in presets for layout in layouts)


_MX, _BF16, _NOT_MX, _NOT_MX_BF16 = r"mx", r"bf16", r"^(?!.*mx)", r"^(?!.*(mx|bf16)).*fp8"
MEGATRON_BRIDGE_BLACKWELL_MOE_RECIPES = (
    # DeepSeek-V3 on 256 GPUs, global batch 2,048 (V1) or 4,096 (V2); deepseek/deepseek_workload_base_configs.py.
    *_blackwell(r"deepseek.?v3", ("gb300_nvl72",), ((256, 1, 2, 8, 32, 2048), (256, 1, 2, 8, 32, 4096)),
                recompute_modules="mla_up_proj", precision=_NOT_MX_BF16, overlap_grad_reduce=False),
    *_blackwell(r"deepseek.?v3", ("gb300_nvl72",), ((256, 1, 4, 4, 64, 2048), (256, 1, 4, 4, 64, 4096)),
                recompute_modules="moe_act", precision=_BF16, overlap_grad_reduce=False),
    *_blackwell(r"deepseek.?v3", ("gb300_nvl72",), ((256, 1, 2, 8, 32, 2048), (256, 1, 2, 8, 32, 4096),
                                                    (256, 1, 2, 8, 32, 15360)),
                a2a_overlap=True, precision=_MX, overlap_grad_reduce=False),
    *_blackwell(r"deepseek.?v3", ("gb200_nvl72",), ((256, 1, 4, 4, 64, 2048), (256, 1, 4, 4, 64, 4096)),
                recompute_modules="mlp", precision=_NOT_MX_BF16, overlap_grad_reduce=False),
    *_blackwell(r"deepseek.?v3", ("gb200_nvl72",), ((256, 1, 4, 4, 64, 2048), (256, 1, 4, 4, 64, 4096)),
                recompute_modules="mla_up_proj", precision=_BF16, overlap_grad_reduce=False),
    *_blackwell(r"deepseek.?v3", ("gb200_nvl72",), ((256, 1, 4, 4, 64, 2048), (256, 1, 4, 4, 64, 4096)),
                a2a_overlap=True, recompute_modules="mla_up_proj", precision=_MX, overlap_grad_reduce=False),
    *_blackwell(r"deepseek.?v3", ("b300",), ((256, 1, 8, 2, 8, 2048), (256, 1, 8, 2, 8, 4096)),
                recompute_modules="mla_up_proj", precision=_NOT_MX, overlap_grad_reduce=False),
    *_blackwell(r"deepseek.?v3", ("b300",), ((256, 1, 8, 2, 8, 2048), (256, 1, 8, 2, 8, 4096)),
                a2a_overlap=True, recompute_modules="mla_up_proj", precision=_MX, overlap_grad_reduce=False),
    *_blackwell(r"deepseek.?v3", ("b200",), ((256, 1, 16, 1, 8, 2048), (256, 1, 16, 1, 8, 4096)),
                recompute_modules="mla_up_proj", overlap_grad_reduce=False),
    *_blackwell(r"deepseek.?v3", ("b200",), ((256, 1, 8, 2, 32, 4096),), a2a_overlap=True,
                recompute_modules="mla_up_proj+mlp", precision=_MX, overlap_grad_reduce=False),
    # Qwen3-235B-A22B (V1: 64 GPUs, global batch 1,024; V2: 256 GPUs, 8,192) and Qwen3-30B-A3B (8 GPUs, EP=8,
    # global batch 512); qwen/qwen3_workload_base_configs.py. B200/B300's 235B presets run the defaults (alltoall).
    *_blackwell(r"qwen3.?235b", ("gb300_nvl72",), ((64, 1, 1, 1, 64, 1024), (256, 1, 4, 1, 32, 8192),
                                                   (256, 1, 4, 12, 32, 8192))),
    *_blackwell(r"qwen3.?235b", ("gb200_nvl72",), ((64, 1, 8, 1, 8, 1024), (256, 1, 8, 1, 8, 8192),
                                                   (256, 1, 8, 1, 32, 8192), (256, 1, 8, 3, 32, 8192))),
    *_blackwell(r"qwen3.?30b", ("gb300_nvl72", "gb200_nvl72", "b300", "b200"), ((8, 1, 1, 1, 8, 512),)),
    # GPT-OSS 120B on 64 GPUs, global batch 512 (V1) or 1,280 (V2); gpt_oss/gpt_oss_workload_base_configs.py. Where
    # a preset sets nothing of this (GB300/B300 at EP=64) the defaults are what it ran.
    *_blackwell(r"gpt.?oss.?120b", ("gb300_nvl72",), ((64, 1, 1, 1, 16, 1280),), a2a_overlap=True, precision=_MX),
    *_blackwell(r"gpt.?oss.?120b", ("gb200_nvl72", "b200"), ((64, 1, 1, 1, 64, 512),), dispatcher="alltoall",
                recompute_modules="layernorm+moe_act"),
    *_blackwell(r"gpt.?oss.?120b", ("gb200_nvl72",), ((64, 1, 1, 1, 64, 1280),), dispatcher="alltoall",
                a2a_overlap=True, recompute_modules="layernorm+moe_act", precision=_BF16),
    *_blackwell(r"gpt.?oss.?120b", ("gb200_nvl72",), ((64, 1, 1, 1, 64, 1280),), a2a_overlap=True, precision=_MX),
    *_blackwell(r"gpt.?oss.?120b", ("b300",), ((64, 1, 1, 1, 8, 1280),), precision=_BF16),
    *_blackwell(r"gpt.?oss.?120b", ("b300",), ((64, 1, 1, 1, 8, 1280),), a2a_overlap=True, precision=_MX),
    *_blackwell(r"gpt.?oss.?120b", ("b200",), ((64, 1, 1, 1, 8, 1280),), dispatcher="alltoall",
                recompute_modules="layernorm+moe_act"),
)
"""Megatron-Bridge's Blackwell MoE performance presets (26.x, the files of the H100 presets above, their ``V1`` and
``V2`` variants): HybridEP on GB200/GB300 and for DeepSeek-V3 and Qwen3-30B-A3B on B200/B300 too (GPT-OSS where
its preset sets it), the all-to-all overlap and the recomputation where a precision's preset sets them (MXFP8
against FP8 current scaling or BF16), no gradient-reduce overlap for DeepSeek-V3 as on H100. Full-iteration and
per-module CUDA graphs, which most of them also set, are not modelled."""


def moe_recipe(row: dict, preset: str, layout: tuple[int, int, int, int, int, int]) -> MoeRecipe | None:
    """The Megatron-Bridge MoE preset a row ran, or None: a Megatron-Bridge row whose container, model, GPU, layout
    (and precision, where the preset depends on it) are those of a preset (:data:`MEGATRON_BRIDGE_MOE_RECIPES`,
    :data:`MEGATRON_BRIDGE_BLACKWELL_MOE_RECIPES`)."""
    if "megatron-bridge" not in (row.get("framework") or "").lower():
        return None
    found = re.search(r"\b(\d\d)\.(\d\d)", row.get("source_detail") or row.get("framework") or "")
    if found is None:
        return None
    container = (int(found.group(1)), int(found.group(2)))
    for recipe in (*MEGATRON_BRIDGE_MOE_RECIPES, *MEGATRON_BRIDGE_BLACKWELL_MOE_RECIPES):
        first, last = recipe.containers
        if (recipe.preset == preset and recipe.layout == layout and first <= container
                and (last is None or container <= last)
                and re.search(recipe.model, row.get("model") or "", re.IGNORECASE)
                and re.search(recipe.precision, row.get("precision") or "", re.IGNORECASE)):
            return recipe
    return None


ARCHITECTURE_FIELDS = ("kv_channels", "attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                       "v_head_dim", "moe_shared_expert_intermediate_size", "moe_first_dense_layers",
                       "moe_router_score", "window_size", "window_attn_skip_freq")
"""Model fields the CSV schema has no column for, taken from a model preset of the same shape
(:func:`preset_architecture`)."""
SHAPE_FIELDS = (("layers", "num_layers"), ("hidden", "hidden_size"), ("heads", "num_attention_heads"),
                ("vocab", "vocab_size"), ("moe_experts", "num_experts"), ("moe_topk", "moe_router_topk"),
                ("moe_expert_ffn", "moe_ffn_hidden_size"))
"""(CSV column, model preset key) pairs that must all be equal for a preset's architecture to apply."""
SETTING_COLUMNS = {**{f"model.{key}": column for column, key in SHAPE_FIELDS}, "model.ffn_hidden_size": "ffn_hidden",
                   "model.num_query_groups": "kv_heads", "train.seq_length": "seq_len",
                   "train.global_batch_size": "global_batch_seqs", "train.micro_batch_size": "micro_batch",
                   **{f"parallel.{key}": key for key in ("tp", "pp", "cp", "ep")}, "parallel.vpp": "vp",
                   "cluster.nodes": "num_gpus"}
"""The CSV column each training setting of a row's plan comes from, for the reason a row is refused."""


def refusal(err: ConfigError) -> str:
    """The reason a row whose plan the training config's checks refuse (:class:`ModelSpec`, :class:`ParallelDims`:
    the same rules a training run meets) is not modelled: each problem on one line, named by the row's column where
    one holds the setting (``column hidden (model.hidden_size=1000): is not divisible by ...``)."""
    return "; ".join(f"column {SETTING_COLUMNS[issue.key]} ({issue.key}={issue.value!r}): {issue.problem}"
                     if issue.key in SETTING_COLUMNS else f"{issue.key}={issue.value!r}: {issue.problem}"
                     for issue in err.issues) + " Fix: correct the row."


def family_architecture(row: dict) -> dict[str, object]:
    """The model fields of the :data:`FAMILY_ARCHITECTURES` entry whose pattern the row's ``model`` or
    ``arch_source`` matches, else ``{}``."""
    text = f"{row.get('model') or ''} {row.get('arch_source') or ''}"
    for pattern, fields in FAMILY_ARCHITECTURES:
        if re.search(pattern, text, re.IGNORECASE):
            return {key: value for key, value in fields.items()
                    if key not in BLANK_ONLY_FIELDS or _count(row, BLANK_ONLY_FIELDS[key]) is None}
    return {}


def preset_architecture(row: dict) -> tuple[str, dict]:
    """The name and :data:`ARCHITECTURE_FIELDS` of the model preset (``conf/model``) whose shape
    (:data:`SHAPE_FIELDS`) is the row's, or ``("", {})``: DeepSeek-V3's multi-head latent attention, shared expert,
    dense first layers and sigmoid router, GPT-OSS's 64-channel heads (4096 wide on a 2880 hidden size), which their
    rows name in ``arch_source`` but no column states."""
    for name, preset in group_presets("model"):
        if all(_count(row, column) == preset.get(key) for column, key in SHAPE_FIELDS):
            return name, {key: preset[key] for key in ARCHITECTURE_FIELDS if key in preset}
    return "", {}


@dataclass(frozen=True, kw_only=True)
class RowPlan:
    """One row turned into what the simulator needs."""

    row_id: str
    """The row's ``id``."""
    source: str
    """The row's ``source`` (for grouping results)."""
    source_detail: str = ""
    """The row's ``source_detail`` (which table of the source)."""
    model: str
    """The row's model name (for display only)."""
    layout: str
    """Short layout string for display."""
    job: JobSpec
    """The plan."""
    options: SimOptions
    """Simulator options from the row (FP8, FSDP, layer-only)."""
    measured_s: float
    """Measured (or derived from measurements) step time."""


@dataclass(frozen=True, kw_only=True)
class RowResult:
    """Prediction for one row."""

    plan: RowPlan
    """The row."""
    predicted_s: float
    """Predicted step time."""
    memory_gib: float
    """Predicted peak memory per GPU."""
    flag: str = ""
    """Why the prediction may not be what ran, though the row is kept in the figures (:func:`memory_problem`);
    empty: nothing to say."""

    @property
    def error_pct(self) -> float:
        """Signed relative error of the prediction, percent."""
        return 100.0 * (self.predicted_s - self.plan.measured_s) / self.plan.measured_s


def gpu_preset(gpu: str) -> str:
    """Cluster preset for a row's ``gpu`` column; the more specific names are tried first (GB300 before B300, H100 NVL
    before H100, H200 before H20, A100-40GB before A100), so an "A100" or "H100" of unstated variant stays the
    80 GB SXM preset."""
    g = gpu.upper()
    rules = ((r"GB300", "gb300_nvl72"), (r"GB200", "gb200_nvl72"), (r"B300", "b300"), (r"B200", "b200"),
             (r"MI355", "mi355x"), (r"MI325", "mi325x"), (r"MI300X", "mi300x"),
             (r"H100\W*NVL|H100.*\bNVL\b", "h100_nvl"), (r"H100", "dgx_h100"), (r"H200", "h200"),
             (r"H800", "h800"), (r"H20(?!\d)", "h20"),
             (r"A100\W*(SXM\d?\W*|PCIE\W*)?40\s*G", "dgx_a100_40gb"), (r"A100", "dgx_a100"),
             (r"A800", "a800"))
    for pattern, preset in rules:
        if re.search(pattern, g):
            return preset
    raise RowError(f"GPU {gpu!r} has no hardware preset (known: A100-80GB, A100-40GB, A800, H100 SXM, H100 NVL, H200, "
                   "H800, H20, B200, B300, GB200, GB300, MI300X, MI325X, MI355X)")


POWER_WORDS = r"power|cap|limit|watt|tdp|tgp|board"
"""Words that make a wattage in a row's notes a statement of the GPUs' power (:func:`power_limit`)."""


def power_limit(row: dict) -> float | None:
    """The GPUs' power limit in watts a row states, or None: a wattage (``500 W``, ``450W``) in its ``gpu`` column,
    or in ``notes``, ``source_detail`` or ``other_measured`` within a few words of "power", "cap", "limit", "TDP"...
    A figure at or above the preset's TDP changes nothing (the clock is capped at its maximum)."""
    watts = r"(\d{3,4}(?:\.\d+)?)\s*W\b"
    found = re.search(watts, row.get("gpu") or "")
    for column in ("notes", "source_detail", "other_measured"):
        if found:
            break
        text = row.get(column) or ""
        found = (re.search(rf"(?:{POWER_WORDS})\w*\W+(?:\w+\W+){{0,4}}?{watts}", text, re.IGNORECASE)
                 or re.search(rf"{watts}\W+(?:\w+\W+){{0,2}}?(?:{POWER_WORDS})", text, re.IGNORECASE))
    return float(found.group(1)) if found else None


def load_preset(name: str) -> dict:
    """The preset YAML as a dict."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(CONF_CLUSTER / f"{name}.yaml"), resolve=True)


COUNT_COLUMNS: dict[str, tuple[str, int, str]] = {
    "num_gpus": ("GPUs", MAX_WORLD_SIZE, "MAX_WORLD_SIZE"), "layers": ("layers", MAX_LAYERS, "MAX_LAYERS"),
    "hidden": ("a hidden size", MAX_HIDDEN, "MAX_HIDDEN"), "ffn_hidden": ("an MLP size", MAX_FFN, "MAX_FFN"),
    "heads": ("heads", MAX_HEADS, "MAX_HEADS"), "kv_heads": ("key/value heads", MAX_HEADS, "MAX_HEADS"),
    "vocab": ("a vocabulary", MAX_VOCAB, "MAX_VOCAB"), "seq_len": ("tokens", MAX_SEQUENCE, "MAX_SEQUENCE"),
    "moe_experts": ("experts", MAX_EXPERTS, "MAX_EXPERTS"), "moe_topk": ("experts", MAX_EXPERTS, "MAX_EXPERTS"),
    "moe_expert_ffn": ("an expert MLP size", MAX_FFN, "MAX_FFN"),
    **{name: ("ranks", MAX_WORLD_SIZE, "MAX_WORLD_SIZE") for name in ("tp", "pp", "dp", "cp", "ep", "vp")},
    "micro_batch": ("sequences", MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"),
    "global_batch_seqs": ("sequences", MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"),
    "grad_accum": ("micro-batches", MAX_MICROBATCHES, "MAX_MICROBATCHES"),
}
"""Columns that hold a count, with what they count and their largest value: the training config's own bound
(:mod:`cfp_megatron.base.config`, named here for the message)."""


def _count(row: dict, key: str, default: int | None = None) -> int | None:
    """A count column of the row (:data:`COUNT_COLUMNS`): ``default`` where blank; :class:`RowError` naming the
    column, the value and the fix where it is not a whole number from 1 to its bound (32.5 GPUs are not modelled as
    32; a count above the training config's bound is a typo, not a run)."""
    raw = (row.get(key) or "").strip()
    if not raw:
        return default
    what, bound, name = COUNT_COLUMNS.get(key, ("a count", MAX_WORLD_SIZE, "MAX_WORLD_SIZE"))
    try:
        value = float(raw)
    except ValueError:
        raise RowError(f"column {key} is not a number: {raw!r}. Fix: write a whole number of {what}, or leave it "
                       "blank") from None
    if not math.isfinite(value) or value != int(value):
        raise RowError(f"column {key}={raw}: a count of {what} is a whole number. Fix: correct the row")
    if not 1 <= value <= bound:
        raise RowError(f"column {key}={raw}: must be from 1 to {bound:,} ({name} in cfp_megatron/base/config.py). "
                       "Fix: correct the row, or leave the column blank where the row does not state it")
    return int(value)


def _float(row: dict, key: str) -> float | None:
    """A measured figure of the row: ``None`` where blank; :class:`RowError` naming the column where it is not a
    finite positive number (a negative, zero, NaN or text step time never enters the MAPE)."""
    raw = (row.get(key) or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise RowError(f"column {key} is not a number: {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise RowError(f"column {key} must be a finite positive number, not {raw!r}")
    return value


def _yes(raw: str) -> bool | None:
    raw = raw.strip().lower()
    if not raw:
        return None
    return raw.startswith(("y", "true", "on", "1"))


def row_plan(row: dict, presets: dict[str, dict] | None = None, *, split: tuple[int, int] | None = None) -> RowPlan:
    """Build the plan of one CSV row, or raise :class:`RowError` with the reason it cannot be modelled; ``split``:
    the (tp, pp) to model a row that states only its data-parallel size (:func:`unstated_split`)."""
    rid = (row.get("id") or "?").strip()
    measured = _float(row, "step_time_s") or _float(row, "derived_step_time_s")
    preset_name = gpu_preset(row.get("gpu", ""))
    presets = presets if presets is not None else {}
    if preset_name not in presets:
        presets[preset_name] = load_preset(preset_name)
    cluster = dict(presets[preset_name])
    watts = power_limit(row)
    if watts is not None and cluster.get("tdp_w") and watts < cluster["tdp_w"]:
        cluster["power_limit_w"] = watts
    gpus = _count(row, "num_gpus")
    if not gpus:
        raise RowError("num_gpus is blank")
    layers, hidden, heads = _count(row, "layers"), _count(row, "hidden"), _count(row, "heads")
    seq = _count(row, "seq_len")
    if not (layers and hidden and heads and seq):
        raise RowError("the model shape (layers, hidden, heads, seq_len) is incomplete")
    tp, pp, cp = _count(row, "tp", 1), _count(row, "pp", 1), _count(row, "cp", 1)
    if split is not None:
        tp, pp = split
    elif not row.get("tp", "").strip() or not row.get("pp", "").strip():
        raise RowError("the layout (tp, pp) is not stated")
    dp = _count(row, "dp") or data_parallel_size(gpus, tp, cp, pp)
    if tp * pp * cp * dp != gpus:
        raise RowError(f"tp x pp x cp x dp = {tp}x{pp}x{cp}x{dp} does not multiply out to {gpus} GPUs")
    per_node = cluster["gpus_per_node"]
    if gpus % per_node:
        if gpus < per_node:
            cluster["gpus_per_node"], cluster["nodes"] = gpus, 1
        else:
            raise RowError(f"{gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    else:
        cluster["nodes"] = gpus // per_node
    experts = _count(row, "moe_experts")
    ep = _count(row, "ep", 1) if experts else 1
    micro = _count(row, "micro_batch", 1)
    gbs = _count(row, "global_batch_seqs")
    layer_only = gbs is None and layers == 1
    accum = _count(row, "grad_accum")
    if gbs is None and accum and not layer_only:
        gbs = micro * dp * accum
    if gbs is None and not layer_only:
        raise RowError("global_batch_seqs is blank")
    tokens_per_gpu = _float(row, "tokens_per_s_per_gpu")
    if not measured and tokens_per_gpu and gbs:
        measured = gbs * seq / (tokens_per_gpu * gpus)
    if not measured:
        raise RowError("no measured step time (step_time_s, derived_step_time_s and tokens_per_s_per_gpu are blank)")
    if layer_only:
        gbs = micro * dp
    vp = _count(row, "vp", 1) or 1
    recompute_raw = (row.get("recompute") or "").strip().lower()
    recompute = "full" if recompute_raw.startswith("full") else "selective" if recompute_raw.startswith(
        "selective") else "none"
    precision_raw = (row.get("precision") or "").lower()
    fp8 = "fp8" in precision_raw
    precision = "fp16" if "fp16" in precision_raw and "bf16" not in precision_raw else "fp32" if (
        "fp32" in precision_raw and "16" not in precision_raw) else "bf16"
    year = re.search(r"\b(20\d\d)\b", row.get("framework") or "")
    framework = (row.get("framework") or "").lower()
    legacy = year is not None and int(year.group(1)) < 2023 and "megatron" in framework
    modern = not legacy and any(name in framework for name in ("nemo", "megatron-core", "megatron-bridge"))
    bf16_grads = framework.startswith("nemo") or "megatron-bridge" in framework  # their performance scripts
    sharding = (row.get("zero_or_fsdp") or "").lower()
    fsdp = "fsdp" in sharding or "zero-3" in sharding or "zero3" in sharding
    dist_opt = "distributed optimizer" in sharding or "zero-1" in sharding or (not sharding and modern)
    sp = _yes(row.get("sequence_parallel") or "")
    if sp is None:
        sp = modern or bool(experts)
    sp = sp and tp > 1
    ffn = _count(row, "ffn_hidden")
    swiglu = bool(experts) or (ffn is not None and ffn != 4 * hidden)
    model = {
        "name": f"row{rid}", "num_layers": layers, "hidden_size": hidden, "ffn_hidden_size": ffn,
        "num_attention_heads": heads, "num_query_groups": _count(row, "kv_heads"),
        "vocab_size": _count(row, "vocab", DEFAULT_VOCAB),
        "make_vocab_size_divisible_by": 128 * tp, "max_position_embeddings": max(seq, 4096),
        "activation": "swiglu" if swiglu else "gelu", "tie_embeddings": False,
        "position_embedding": "rope" if swiglu else "learned_absolute",
        "hidden_dropout": 0.0 if swiglu else 0.1, "attention_dropout": 0.0 if swiglu else 0.1,
    }
    model.update(family_architecture(row))  # its vocabulary and KV heads only where the row leaves them blank
    recipe = moe_recipe(row, preset_name, (gpus, tp, pp, vp, ep, gbs or 0)) if experts else None
    if experts:
        topk = _count(row, "moe_topk", 2)
        model.update(num_experts=experts, moe_router_topk=topk, moe_ffn_hidden_size=_count(row, "moe_expert_ffn"))
    architecture, fields = preset_architecture({**row, "vocab": str(model["vocab_size"])}) if experts else ("", {})
    model.update(fields)
    modules = None
    if recipe:
        model["moe_token_dispatcher"] = recipe.dispatcher
        if recipe.recompute_modules and not recompute_raw:
            recompute, modules = "selective", recipe.recompute_modules
    # Megatron-Bridge's recipes count the embedding and the loss as layers of the pipeline split where the decoder
    # alone does not split (Qwen3-235B's 94 layers over 8 x 4 chunks: 96 units, 3 per chunk).
    counted = pp > 1 and layers % (pp * vp) != 0 and (layers + 2) % (pp * vp) == 0
    # Megatron-Bridge's DeepSeek-V3 recipes train one multi-token-prediction layer.
    mtp = 1 if modern and re.search(r"deepseek[ _-]?v3", row.get("model") or "", re.IGNORECASE) else 0
    model["mtp_num_layers"] = mtp
    # Where neither splits, a per-stage layout as Megatron-Bridge writes DeepSeek-V3's at PP=8 x VP=4
    # (Et|(tt|)*30mL): the embedding, the MTP layers and the loss each counted as a layer, spread evenly.
    stages = (balanced_layout(layers, pp, vp, mtp_layers=mtp, ends_counted=True)
              if pp > 1 and layers % (pp * vp) and not counted else None)
    cfg = {
        "model": model, "cluster": cluster,
        "parallel": {"tp": tp, "pp": pp, "cp": cp, "ep": ep, "vpp": vp if vp > 1 else None, "sp": sp,
                     "recompute": recompute, "recompute_modules": modules, "distributed_optimizer": dist_opt,
                     "overlap_grad_reduce": not legacy and (recipe is None or recipe.overlap_grad_reduce),
                     "tp_comm_overlap": (recipe.tp_comm_overlap if recipe else modern) and sp,
                     "moe_a2a_overlap": bool(recipe and recipe.a2a_overlap),
                     "recompute_num_layers": 1, "grad_reduce_in_fp32": not bf16_grads,
                     "account_for_embedding_in_pipeline_split": counted,
                     "account_for_loss_in_pipeline_split": counted, "pipeline_model_parallel_layout": stages},
        "train": {"global_batch_size": gbs, "micro_batch_size": micro, "seq_length": seq, "precision": precision},
    }
    try:
        job = job_from_config(cfg)
    except ConfigError as err:
        raise RowError(refusal(err)) from None
    layout = f"tp{tp} pp{pp} dp{dp}" + ("?" if split is not None else "")
    layout += (f" cp{cp}" if cp > 1 else "") + (f" ep{ep}" if ep > 1 else "")
    layout += (f" vp{vp}" if vp > 1 else "") + (" emb+loss" if counted else "") + (f" {stages}" if stages else "")
    layout += " sp" if sp else ""
    layout += f" as {architecture}" if architecture else ""
    if recipe:
        layout += (" flex" if recipe.dispatcher == "flex" else "") + (" a2ao" if recipe.a2a_overlap else "")
    layout += f" mb{micro} gbs{gbs} {recompute}" + (f"[{job.parallel.recompute_modules}]" if modules else "")
    layout += (" fp8" if fp8 else "") + (" fsdp" if fsdp else "")
    layout += f" {cluster['power_limit_w']:g}W" if cluster.get("power_limit_w") else ""
    options = SimOptions(fp8=fp8, fsdp=fsdp, measured_layer_only=layer_only,
                         attention=AttentionKernel.fused_softmax if legacy else AttentionKernel.flash)
    return RowPlan(row_id=rid, source=row.get("source", ""), source_detail=row.get("source_detail", ""),
                   model=row.get("model", ""), layout=layout, job=job, options=options, measured_s=measured)


def unstated_split(row: dict, presets: dict[str, dict]) -> tuple[int, int]:
    """The (tp, pp) of a row that states its GPUs and data-parallel size but not how the model-parallel ranks divide
    into TP and PP (SC21's Table 2): TP as wide as a node allows where it divides the model-parallel size and the
    heads (the same source's Table 1 runs every model above 8B at TP = 8, one node), PP the rest. Raises
    :class:`RowError` where the row states too little to know the model-parallel size."""
    gpus, dp, cp = _count(row, "num_gpus"), _count(row, "dp"), _count(row, "cp", 1) or 1
    heads = _count(row, "heads")
    if not (gpus and dp and heads) or gpus % (dp * cp):
        raise RowError("the layout (tp, pp) is not stated, nor the data-parallel size it leaves")
    model_parallel = gpus // (dp * cp)
    preset = gpu_preset(row.get("gpu", ""))
    if preset not in presets:
        presets[preset] = load_preset(preset)
    per_node = presets[preset]["gpus_per_node"]
    tp = max(t for t in range(1, per_node + 1) if model_parallel % t == 0 and heads % t == 0)
    return tp, model_parallel // tp


COLUMNS = ("id", "source", "source_detail", "source_location", "model", "arch_type", "params_b", "layers", "hidden",
           "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len", "moe_experts", "moe_topk", "moe_expert_ffn", "gpu",
           "num_gpus", "interconnect", "framework", "tp", "pp", "dp", "cp", "ep", "vp", "pp_schedule",
           "sequence_parallel", "zero_or_fsdp", "micro_batch", "global_batch_seqs", "grad_accum", "recompute",
           "precision", "step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu_pct", "hfu_pct",
           "other_measured", "derived_step_time_s", "derived_fields", "arch_source", "notes")
"""The columns of the runs schema (``shared/data/published_runs.csv``), in its order."""
REQUIRED_COLUMNS = ("id", "layers", "hidden", "heads", "seq_len", "gpu", "num_gpus")
"""Columns without which no row of a file can be modelled."""


class InputFileError(CfpError, ValueError):
    """A file ``validate`` cannot read as runs; the message names the file and the fix."""


class CsvRow(dict):
    """One row of a runs file: its columns' text (a dict, as :class:`csv.DictReader` gives it) and where it was
    read, for the reasons and the report."""

    def __init__(self, values: dict[str, str], *, file: Path, line: int, problem: str | None = None) -> None:
        super().__init__(values)
        self.file = file
        """The file."""
        self.line = line
        """The line the row starts on (1 is the header)."""
        self.problem = problem
        """Why the row's fields do not line up with the header (too many or too few), else ``None``."""


def where(row: dict) -> str:
    """Where a row was read (``runs.csv line 5``), or ``row <id>`` for a row built in code."""
    if isinstance(row, CsvRow):
        return f"{row.file} line {row.line}"
    return f"row {row.get('id', '?')}"


def _header(path: Path, names: list[str], fix: str) -> list[str]:
    """The header's column names, stripped; :class:`InputFileError` for a name given twice, or one that is not in
    the schema but close to a schema column the file lacks (a misspelt column would leave its value unread)."""
    columns = [name.strip() for name in names]
    for index, name in enumerate(columns):
        if name and name in columns[:index]:
            raise InputFileError(f"{path}: column {name!r} appears twice in the header (columns "
                                 f"{columns.index(name) + 1} and {index + 1}); keep one. {fix}")
    for name in unread_columns(columns):
        near = difflib.get_close_matches(name.lower(), [c for c in COLUMNS if c not in columns], n=1, cutoff=0.75)
        if near:
            raise InputFileError(f"{path}: column {name!r} is not in the runs schema, so its values would not be "
                                 f"read; rename it {near[0]!r}. {fix}")
    return columns


def unread_columns(columns: list[str]) -> list[str]:
    """The header names of ``columns`` that are not in the runs schema (:data:`COLUMNS`), blank names left out."""
    return [name for name in columns if name and name not in COLUMNS]


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a CSV file as :class:`CsvRow` dicts (a UTF-8 byte-order mark, as spreadsheets write it, is skipped;
    header names are stripped). Raises :class:`InputFileError` for a file that is missing, a directory, not text,
    empty, without the columns a run needs (:data:`REQUIRED_COLUMNS`), or whose header names a column twice or
    misspells one (:func:`_header`). A row whose fields do not line up with the header is returned with its
    :attr:`CsvRow.problem` (and refused by :func:`predict_rows`)."""
    path = Path(path)
    fix = "pass a CSV file in the schema of shared/data/published_runs.csv."
    if not path.is_file():  # a named pipe or device is refused too, not waited on
        said = "is a directory" if path.is_dir() else "no such file" if not path.exists() else \
            regular_file_problem(path)
        raise InputFileError(f"{path}: {said}; {fix}")
    rows: list[dict] = []
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            columns = _header(path, next(reader, []), fix)
            last = reader.line_num
            for fields in reader:
                line, last = last + 1, reader.line_num
                if not any(field.strip() for field in fields):
                    continue
                problem = None if len(fields) == len(columns) else (
                    f"{path} line {line} has {len(fields)} fields where the header has {len(columns)} (a comma inside "
                    "an unquoted value, or a field left out). Fix: quote the value, or add the missing fields")
                rows.append(CsvRow(dict(zip(columns, fields, strict=False)), file=path, line=line, problem=problem))
    except (UnicodeDecodeError, csv.Error) as err:
        raise InputFileError(f"{path}: not a readable CSV text file ({err}); {fix}") from None
    missing = [name for name in REQUIRED_COLUMNS if name not in columns]
    if missing:
        raise InputFileError(f"{path}: no column {', '.join(missing)}; {fix}")
    if not rows:
        raise InputFileError(f"{path}: a header and no rows; {fix}")
    return rows


def predict_rows(rows: list[dict], efficiencies=None) -> tuple[list[RowResult], list[tuple[dict, str]]]:
    """Predict every row; returns (results, [(row, reason)] for rows not modelled).

    ``efficiencies`` maps a GPU generation to :class:`~cfp_megatron.sim.calibration.Efficiency` to override the
    fitted ones (used by the fitting script)."""
    presets: dict[str, dict] = {}
    results, skipped = [], []
    first: dict[str, dict] = {}
    for row in rows:
        rid = (row.get("id") or "").strip()
        problem = getattr(row, "problem", None)
        if problem is None and not rid:
            problem = f"{where(row)}: the id is blank. Fix: give each row its own id"
        elif problem is None and rid in first:
            problem = (f"id {rid} at {where(row)} is also the id of {where(first[rid])} (modelled there, counted "
                       "once). Fix: give each run its own id, or remove the repeated row")
        first.setdefault(rid, row)
        if problem is not None:
            skipped.append((row, problem))
            continue
        try:
            stated = bool((row.get("tp") or "").strip() and (row.get("pp") or "").strip())
            plan = row_plan(row, presets, split=None if stated else unstated_split(row, presets))
        except CfpError as err:
            skipped.append((row, str(err).replace("\n", " ")))
            continue
        except (ValueError, ArithmeticError, KeyError, TypeError) as err:  # malformed row: list it, keep going
            skipped.append((row, f"{type(err).__name__}: {err}"))
            continue
        eff = efficiencies.get(generation(plan.job.cluster)) if efficiencies else None
        try:
            pred = simulate(plan.job, options=plan.options, efficiency=eff)
        except ConfigError as err:  # a layout the training config's checks refuse (ParallelDims)
            skipped.append((row, refusal(err)))
            continue
        except CfpError as err:  # a layout the simulator refuses; a bug in the simulator is raised, not hidden
            skipped.append((row, str(err).replace("\n", " ")))
            continue
        memory = pred.memory.total_gib
        flag, refused = memory_problem(plan.job, memory)
        if refused:
            skipped.append((row, flag))
            continue
        results.append(RowResult(plan=plan, predicted_s=pred.step_time_s, memory_gib=memory, flag=flag))
    return results, skipped


MEMORY_REFUSE_FACTOR = 4.0
"""A row whose predicted peak memory per GPU is more than this many times its GPU's memory is refused: a measured
run fit its GPUs, and the simulator's memory is not that far off (its largest over-estimate on the shared files is
1.4x, GPT-OSS 120B's row 79): the row's sizes do not describe what ran (a million GPUs' batch on each GPU)."""


def memory_problem(job: JobSpec, memory_gib: float) -> tuple[str, bool]:
    """(what to say, refused) about a row's predicted peak memory per GPU against its GPU's memory: nothing where
    it fits; a flag where it does not (kept in the figures: a gap of the memory model, or a setting the row leaves
    out, such as recomputation); a refusal beyond :data:`MEMORY_REFUSE_FACTOR` times the GPU's memory."""
    hbm = job.cluster.hbm_gib
    if not hbm or memory_gib <= hbm:
        return "", False
    if memory_gib > MEMORY_REFUSE_FACTOR * hbm:
        return (f"predicted peak memory {memory_gib:,.0f} GiB per GPU is over {MEMORY_REFUSE_FACTOR:g} times the "
                f"GPU's {hbm:g} GiB: no measured run needed that, so the row's sizes (GPUs, layout, batch, model) do "
                "not describe what ran. Fix: correct the row"), True
    return (f"predicted peak memory {memory_gib:.1f} GiB per GPU is above the GPU's {hbm:g} GiB (a gap of the "
            "memory model, or a setting the row leaves out, such as recomputation)"), False


def mape(results: list[RowResult]) -> float:
    """Mean absolute percentage error of the step time."""
    return sum(abs(r.error_pct) for r in results) / len(results) if results else math.nan


def row_classes(row: dict) -> tuple[str, ...]:
    """The classes a row's error is reported under: ``MoE`` or ``dense``, and ``CP`` (context parallel) and ``FSDP``
    (fully sharded data parallel) where they apply."""
    moe = (row.get("arch_type") or "").strip().lower() == "moe" or bool((row.get("moe_experts") or "").strip())
    classes = ["MoE" if moe else "dense"]
    if (_count(row, "cp", 1) or 1) > 1:
        classes.append("CP")
    if re.search(r"fsdp|zero-?3", row.get("zero_or_fsdp") or "", re.IGNORECASE):
        classes.append("FSDP")
    return tuple(classes)


def has_step_time(row: dict) -> bool:
    """Whether a row measured a step time (``step_time_s``, ``derived_step_time_s`` or ``tokens_per_s_per_gpu``)."""
    return any((row.get(k) or "").strip() for k in ("step_time_s", "derived_step_time_s", "tokens_per_s_per_gpu"))


def class_errors(results: list[RowResult], rows_by_id: dict[str, dict]) -> dict[str, list[float]]:
    """Absolute percentage errors by class: each row's :func:`row_classes` and its GPU generation."""
    by_class: dict[str, list[float]] = {}
    for r in results:
        row = rows_by_id.get(r.plan.row_id, {})
        for name in (*row_classes(row), f"GPU {generation(r.plan.job.cluster)}"):
            by_class.setdefault(name, []).append(abs(r.error_pct))
    return by_class


def uncertainty_table(results: list[RowResult], rows_by_id: dict[str, dict]) -> dict:
    """What :mod:`cfp_megatron.sim.uncertainty` stores: per class the rows, MAPE and band (the
    :data:`~cfp_megatron.sim.uncertainty.BAND_QUANTILE` quantile of the absolute errors), the same over all rows, and
    per GPU generation and model kind the best MFU a measured run reached (against the dense bf16 peak, model FLOPs
    as the planner counts them; layer-only and FP8 rows left out)."""

    def summary(errors: list[float]) -> dict:
        return {"rows": len(errors), "mape": round(sum(errors) / len(errors), 3),
                "pct": round(quantile(errors, BAND_QUANTILE), 3)}

    classes = {name: summary(errors) for name, errors in sorted(class_errors(results, rows_by_id).items())}
    best: dict[str, dict] = {}
    for r in results:
        job, plan = r.plan.job, r.plan
        peak = target_peak_tflops(job)
        if plan.options.measured_layer_only or plan.options.fp8 or not peak:
            continue  # FP8 runs do more per second than the bf16 peak the planner's MFU is counted against
        world = job.cluster.nodes * (job.cluster.gpus_per_node or 1)
        tokens_per_s = job.train.global_batch_size * job.train.seq_length / plan.measured_s / world
        measured = tokens_per_s * training_flops_per_token(job.model, job.train.seq_length) / (peak * 1e12)
        key = f"{generation(job.cluster)} {'MoE' if job.model.is_moe else 'dense'}"
        if key not in best or measured > best[key]["mfu"]:
            best[key] = {"mfu": round(measured, 4), "row": f"{plan.row_id} {plan.model}".strip()}
    everything = [abs(r.error_pct) for r in results]
    return {"quantile": BAND_QUANTILE, "classes": classes, "all": summary(everything) if everything else None,
            "best_mfu": dict(sorted(best.items()))}


PLOT_BAND = 0.10
"""Relative error band the ``--plot`` scatter shades around y = x."""

_PLOT_STYLES = (("#4C72B0", "o"), ("#DD8452", "s"), ("#55A868", "^"), ("#C44E52", "D"), ("#8172B3", "v"),
                ("#937860", "P"), ("#DA8BC3", "X"), ("#8C8C8C", "*"))
"""Colour and marker of each class in the ``--plot`` scatter, in the order the classes sort."""


def plot_class(row: dict) -> str:
    """The one class a row is drawn under in the ``--plot`` scatter: its :func:`row_classes` joined (``MoE + CP``),
    CP named for what it serves (long context)."""
    return " + ".join("CP (long context)" if name == "CP" else name for name in row_classes(row))


def check_plot_path(path: str) -> str | None:
    """Why ``--plot`` cannot write ``path`` (a PNG, a new file in an existing folder), ``None`` when it can."""
    target = Path(path)
    if target.suffix.lower() != ".png":
        return f"--plot {path}: the picture is a PNG; name a file ending in .png"
    if target.is_dir():
        return f"--plot {path}: is a directory; name a .png file in it"
    if not target.parent.is_dir():
        return f"--plot {path}: folder {target.parent} does not exist; create it or name a .png file in another"
    if target.exists():
        return f"--plot {path}: the file exists and is never overwritten; remove it or name another .png file"
    return _unwritable("--plot", target)


def _unwritable(option: str, target: Path) -> str | None:
    """Why ``option``'s file ``target`` (in an existing folder) cannot be written, found before any row is predicted
    (a read-only file system, no permission); ``None`` when it can."""
    problem = writable_file_problem(target)
    return None if problem is None else (f"{option} {target}: {problem} Fix: name a file in a folder this user can "
                                         "write to.")


def write_plot(results: list[RowResult], rows_by_id: dict[str, dict], path: str | Path) -> Path:
    """Draw predicted against measured step time (seconds, log axes), a colour and marker per :func:`plot_class`
    with its rows and MAPE in the legend, the line y = x and the ±:data:`PLOT_BAND` band, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[RowResult]] = {}
    for r in results:
        groups.setdefault(plot_class(rows_by_id.get(r.plan.row_id, {})), []).append(r)
    fig, ax = plt.subplots(figsize=(8.5, 7.5))
    values = [v for r in results for v in (r.plan.measured_s, r.predicted_s)]
    low, high = min(values) / 1.6, max(values) * 1.6
    line = [low, high]
    ax.fill_between(line, [v * (1 - PLOT_BAND) for v in line], [v * (1 + PLOT_BAND) for v in line],
                    color="#DDDDDD", label=f"within ±{PLOT_BAND:.0%}", zorder=0)
    ax.plot(line, line, color="#555555", linewidth=1, label="predicted = measured", zorder=1)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    for index, (name, members) in enumerate(ordered):
        colour, marker = _PLOT_STYLES[index % len(_PLOT_STYLES)]
        ax.scatter([r.plan.measured_s for r in members], [r.predicted_s for r in members], s=42, color=colour,
                   marker=marker, edgecolor="black", linewidth=0.4, alpha=0.85, zorder=2,
                   label=f"{name}: {len(members)} rows, MAPE {mape(members):.1f}%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_aspect("equal")
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"predicted vs measured step time: MAPE {mape(results):.1f}% over {len(results)} rows", fontsize=11)
    ax.grid(which="major", color="#E5E5E5", linewidth=0.6)
    ax.legend(loc="upper left", fontsize=8.5, framealpha=0.9)
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_writer(path, "wb", key="--plot") as fh:  # a full disk leaves no half-drawn picture
            fig.savefig(fh, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


def check_bands_path(path: str) -> str | None:
    """Why ``--bands FILE`` cannot be written (``None`` when it can): a folder, a missing folder, one this user
    cannot write to, or an existing file that is not an error-band table this command wrote (replacing one of those
    is what ``--bands`` is for; anything else is kept)."""
    return _check_json_target("--bands", path, {"quantile", "classes"}, "an error-band table written by --bands")


REPORT_KEYS = frozenset({"rows", "refused", "coverage", "mape"})
"""Keys of the ``--json`` report (:func:`report`): an existing file holding them all is one this command wrote."""


def check_json_path(path: str) -> str | None:
    """Why ``--json FILE`` cannot be written, as :func:`check_bands_path` (an existing file is replaced only when it
    is a report this command wrote)."""
    return _check_json_target("--json", path, REPORT_KEYS, "a report written by validate --json")


def _check_json_target(option: str, path: str, keys: set[str] | frozenset[str], what: str) -> str | None:
    target = Path(path)
    if target.is_dir():
        return f"{option} {path}: is a folder. Fix: name a .json file."
    if not target.exists():
        return _unwritable(option, target) if target.parent.is_dir() else (
            f"{option} {path}: the folder {target.parent} does not exist. Fix: create it or name another file.")
    try:
        old = json.loads(target.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        old = None
    if isinstance(old, dict) and keys <= set(old):
        return _unwritable(option, target)
    return (f"{option} {path}: exists and is not {what}; it is left as it is. "
            "Fix: name a new file, or remove that one first.")


def rows_by_id(rows: list[dict]) -> dict[str, dict]:
    """Each id's row: the first of that id (a later row of the same id is refused, :func:`predict_rows`)."""
    found: dict[str, dict] = {}
    for row in rows:
        found.setdefault((row.get("id") or "").strip(), row)
    return found


def report(results: list[RowResult], skipped: list[tuple[dict, str]], rows: list[dict]) -> dict:
    """The ``--json`` report: each modelled row (its prediction and flag), each row not modelled with its reason,
    the coverage, the MAPE per class and over all rows (``None`` when no row was modelled)."""
    by_id = rows_by_id(rows)

    def located(row: dict) -> dict:
        return {"file": str(row.file), "line": row.line} if isinstance(row, CsvRow) else {}

    return {
        "rows": [{"id": r.plan.row_id, **located(by_id.get(r.plan.row_id, {})), "model": r.plan.model,
                  "layout": r.plan.layout, "measured_s": r.plan.measured_s, "predicted_s": r.predicted_s,
                  "error_pct": round(r.error_pct, 3), "memory_gib": round(r.memory_gib, 3), "flag": r.flag or None}
                 for r in results],
        "refused": [{"id": row.get("id"), **located(row), "model": row.get("model"), "reason": reason}
                    for row, reason in skipped],
        "coverage": {"modelled": len(results), "with_step_time": sum(has_step_time(row) for row in rows)},
        "classes": {name: {"rows": len(errors), "mape": round(sum(errors) / len(errors), 3)}
                    for name, errors in sorted(class_errors(results, by_id).items())},
        "mape": round(mape(results), 3) if results else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cfp_megatron.validate", description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="runs in the schema of shared/data/published_runs.csv")
    parser.add_argument("--bands", metavar="FILE", help="also write the error bands and best published MFU the "
                        "planner reports with (cfp_megatron/sim/error_bands.json) to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="also draw predicted vs measured step time per row "
                        "(log axes, a colour per class with its MAPE, y = x and a +-10%% band) to FILE.png, a new file")
    parser.add_argument("--json", metavar="FILE", dest="json_path", help="also write the report as JSON to FILE: "
                        "each row's prediction, each row not modelled with its reason, the coverage and the MAPE")
    args = parser.parse_args(argv)
    problem = check_plot_path(args.plot) if args.plot else None
    problem = problem or (check_bands_path(args.bands) if args.bands else None)
    problem = problem or (check_json_path(args.json_path) if args.json_path else None)
    if problem:
        print(f"validate: {problem}", file=sys.stderr)
        return 2
    try:
        rows = [row for path in args.csv for row in read_rows(path)]
    except InputFileError as err:
        print(f"validate: {err}", file=sys.stderr)
        return 2
    try:
        return _report(args, rows)
    except FileWriteError as err:  # a full or read-only disk met while writing: the file is left as it was
        print(f"validate: {err}", file=sys.stderr)
        return 2


def _report(args: argparse.Namespace, rows: list[dict]) -> int:
    """Predict ``rows``, print the table, write what ``--json``, ``--bands`` and ``--plot`` ask for; the exit
    status (1 when no row could be modelled)."""
    for path in args.csv:
        read = [row for row in rows if isinstance(row, CsvRow) and row.file == Path(path)]
        unread = unread_columns(list(dict.fromkeys(name for row in read for name in row)))
        if unread:
            print(f"note: {path}: column(s) {', '.join(unread)} are not in the runs schema and are not read")
    results, skipped = predict_rows(rows)
    by_id = rows_by_id(rows)
    print(f"{'id':>5}  {'model':<28} {'layout':<52} {'measured s':>11} {'predicted s':>11} {'error':>8} "
          f"{'mem GiB':>8}")
    for r in results:
        name = re.sub(r"\s+", " ", r.plan.model)[:28]
        print(f"{r.plan.row_id:>5}  {name:<28} {r.plan.layout:<52} {r.plan.measured_s:>11.4g} "
              f"{r.predicted_s:>11.4g} {r.error_pct:>+7.1f}% {r.memory_gib:>8.1f}" + (" !" if r.flag else ""))
    flagged = [r for r in results if r.flag]
    if flagged:
        print(f"\nflagged, kept in the figures ({len(flagged)} rows, ! above):")
        for r in flagged:
            name = re.sub(r"\s+", " ", r.plan.model)[:28]
            print(f"  {r.plan.row_id:>5}  {name:<28} {r.flag}")
    if skipped:
        print(f"\nnot modelled, left out of the figures ({len(skipped)} rows):")
        for row, reason in skipped:
            print(f"  {row.get('id', '?'):>5}  {row.get('model', '')[:28]:<28} {reason}")
    timed = [row for row in rows if has_step_time(row)]
    print(f"\ncoverage: {len(results)} of {len(timed)} rows with a step time modelled")
    print(f"{'class':<12} {'rows':>5} {'MAPE':>7} {'max error':>10}")
    for name, errors in sorted(class_errors(results, by_id).items()):
        print(f"{name:<12} {len(errors):>5} {sum(errors) / len(errors):>6.2f}% {max(errors):>9.1f}%")
    if args.json_path:
        write_atomic(args.json_path, json.dumps(report(results, skipped, rows), indent=1) + "\n", key="--json")
        print(f"\nreport written to {args.json_path}")
    if not results:
        print(f"\nvalidate: no row could be modelled (the {len(rows)} rows of {', '.join(args.csv)}, each listed "
              "above with its reason): no MAPE, and no --bands or --plot written. Fix: correct the rows, or pass "
              "runs in the schema of shared/data/published_runs.csv.", file=sys.stderr)
        return 1
    if args.bands:
        write_atomic(args.bands, json.dumps(uncertainty_table(results, by_id), indent=1) + "\n", key="--bands")
        print(f"\nerror bands ({BAND_QUANTILE:.0%} of each class's rows inside) written to {args.bands}")
    if args.plot:
        drawn = write_plot(results, by_id, args.plot)
        print(f"\npredicted vs measured step time drawn to {drawn}")
    print(f"\nMAPE {mape(results):.2f}% over {len(results)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
