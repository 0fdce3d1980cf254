"""The segments round (CFP): forward and backward of each segment class of the model, on the live process groups,
under each candidate tensor-parallel size that fits the world, at a few micro-batch sizes.

The segments are the real Megatron-Core modules of a one-layer (or, for an MoE model with leading dense layers,
two-layer) ``GPTModel`` built by :mod:`cfp_megatron.engine.model` under Megatron's own TP layout: the embedding,
each decoder-layer kind (``dense``, ``moe``) and the head (final norm, output layer, cross entropy).
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cfp_megatron.base.config import (
    JobSpec,
    MlpPartition,
    ParallelSpec,
    Recompute,
    primepar_grid_side,
)
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims, sequence_parallel_required
from cfp_megatron.cluster.measured import partition_name
from cfp_megatron.engine import rank_watch
from cfp_megatron.engine.distributed import destroy_model_parallel_groups, model_groups
from cfp_megatron.engine.memory import tensor_tracker
from cfp_megatron.engine.model import build_model_chunks
from cfp_megatron.model.analysis import analyze
from cfp_megatron.model.megatron_config import transformer_config
from cfp_megatron.model.megatron_layers import cast_for_training, layer_kind_name
from cfp_megatron.profile.control import Step, StepResult
from cfp_megatron.profile.records import SegmentRecord, segment_entry

MEMORY_SUFFIX = " memory"
"""Label suffix of a segment's memory step (next to its timing step of the same label without it)."""


@dataclass(frozen=True, kw_only=True)
class SegmentCase:
    """One tensor-parallel size to profile: the probe job (a short model) and its validated layout."""

    tp: int
    """Tensor-parallel size."""
    job: JobSpec
    """The job with one layer per decoder kind, ``parallel.tp = tp`` and a batch that fits."""
    dims: ParallelDims
    """Its layout over the whole world."""

    @property
    def partition(self) -> str:
        """The canonical partition string its records are stored under (``tp4``, ``tp2-sp``, ``tp4-primepar``,
        ``tp2-selective``, ``tp2-full``)."""
        p = self.job.parallel
        return partition_name(self.tp, sp=self.dims.sp, mlp=p.mlp, recompute=p.recompute)

    @property
    def layers_only(self) -> bool:
        """Whether only the decoder layers differ from the Megatron case of the same TP size (PrimePar's MLP, or
        recomputation), so the embedding and the head are not timed again."""
        p = self.job.parallel
        return p.mlp is not MlpPartition.megatron or p.recompute is not Recompute.none


MAX_POW2_MICRO_BATCH = 8
"""Powers of two up to this size (capped by the global batch) are timed besides the job's sizes: a pass's time is
not linear in the micro-batch on a busy CPU, so the sizes a layout search tries are measured, not extrapolated."""


def micro_batches(job: JobSpec) -> list[int]:
    """Micro-batch sizes to time: 1, the job's, twice the job's, and the powers of two up to
    :data:`MAX_POW2_MICRO_BATCH` that fit the global batch."""
    mbs = job.train.micro_batch_size
    cap = min(MAX_POW2_MICRO_BATCH, job.train.global_batch_size)
    return sorted({1, mbs, 2 * mbs} | {2**k for k in range(cap.bit_length()) if 2**k <= cap})


def probe_job(job: JobSpec, tp: int, world: int, micro_batch: int,
              mlp: MlpPartition = MlpPartition.megatron, recompute: Recompute = Recompute.none, *,
              sp: bool | None = None) -> JobSpec:
    """``job`` cut to one layer per decoder kind under ``parallel.tp = tp`` (the rest data-parallel), the MLP
    partition ``mlp`` and the recomputation ``recompute`` (full: each layer checkpointed on its own, Megatron's
    ``uniform`` method with one layer per group); sequence parallelism ``sp`` (default: only where Megatron-Core
    requires it, :func:`~cfp_megatron.base.parallel_dims.sequence_parallel_required`)."""
    m = job.model
    two = m.is_moe and m.moe_first_dense_layers > 0
    model = dataclasses.replace(m, num_layers=2 if two else 1, moe_first_dense_layers=1 if two else 0)
    dp = max(world // tp, 1)
    train = dataclasses.replace(job.train, micro_batch_size=micro_batch, global_batch_size=micro_batch * dp,
                                checkpoint_dir=None, resume=False, save_interval=0)
    parallel = ParallelSpec(tp=tp, sp=sequence_parallel_required(job.model, tp) if sp is None else sp,
                            order=job.parallel.order, mlp=mlp, recompute=recompute)
    return dataclasses.replace(job, model=model, train=train, parallel=parallel)


def segment_cases(job: JobSpec, world: int,
                  recompute: Recompute = Recompute.none) -> tuple[list[SegmentCase], list[str]]:
    """Every TP size dividing the world that the model allows (and, on TP groups of 4^k ranks, PrimePar's MLP:
    :mod:`cfp_megatron.layers`), under ``recompute`` (``selective``: the same layers checkpointing their core
    attention, which changes what they keep for the backward pass; ``full``: each layer checkpointed whole, which
    changes what its passes cost), and why the others were left out."""
    cases, skipped = [], []
    biggest = max(micro_batches(job))
    for tp in (t for t in range(1, world + 1) if world % t == 0):
        for mlp in MlpPartition:
            if mlp is MlpPartition.primepar and (primepar_grid_side(tp) is None or job.model.is_moe):
                continue  # not a square grid of 4^k ranks, or no dense MLP to replace
            # a dense model's Megatron layout also with sequence parallelism (the search tries both)
            sps = (False, True) if tp > 1 and mlp is MlpPartition.megatron and not job.model.is_moe else (None,)
            for sp in sps:
                probe = probe_job(job, tp, world, biggest, mlp, recompute, sp=sp)
                try:
                    dims = ParallelDims.build(probe, world)
                except ConfigError as err:
                    skipped.append(f"{partition_name(tp, sp=bool(sp), mlp=mlp, recompute=recompute)}: "
                                   + "; ".join(str(i) for i in err.issues))
                    continue
                cases.append(SegmentCase(tp=tp, job=probe, dims=dims))
    return cases, skipped


def analysis_classes(job: JobSpec, tp: int) -> dict[str, dict[str, Any]]:
    """Per layer kind, its segment class id in the analysis of ``job`` on the ``tp<N>`` mesh and whether Megatron's
    TP layout is among the class's candidates. Pure (the ``fake`` process group): call it before any real group."""
    cluster = dataclasses.replace(job.cluster, nodes=1, gpus_per_node=None)
    parallel = ParallelSpec(tp=tp, sp=sequence_parallel_required(job.model, tp), order=job.parallel.order)
    train = dataclasses.replace(job.train, global_batch_size=job.train.micro_batch_size, checkpoint_dir=None,
                                resume=False, save_interval=0)
    result = analyze(dataclasses.replace(job, cluster=cluster, parallel=parallel, train=train))
    found: dict[str, dict[str, Any]] = {}
    for cls in result["classes"]:
        confirmed = tp == 1 or any(block["megatron_tp"] for block in cls["blocks"])
        for kind in cls["kinds"]:
            found[kind] = {"segment": cls["id"], "confirmed": confirmed}
    return found


def _drop_grad(param: torch.Tensor) -> None:
    """Megatron's DDP adds each ``.grad`` into its ``main_grad`` buffer and frees it; do the freeing here."""
    param.grad = None


def init_probe_groups(dims: ParallelDims, seed: int) -> None:
    """Megatron's model-parallel groups for a probe (TP and the pipeline as ``dims`` says), replacing earlier ones,
    and its seeds."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    destroy_model_parallel_groups()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp, pipeline_model_parallel_size=dims.pp, context_parallel_size=1,
        expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=dims.etp, order=dims.order,
        distributed_timeout_minutes=rank_watch.timeout_s() / 60)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


class SegmentBench:
    """The probe model of one case on this rank, and timed forward/backward of its parts."""

    def __init__(self, case: SegmentCase, *, repeats: int) -> None:

        d = case.dims
        init_probe_groups(d, case.job.train.seed)
        self.on_gpu = torch.cuda.is_available()
        self.config = transformer_config(case.job, d, on_gpu=self.on_gpu)
        # Cast as the runtime's Float16Module casts the model under bf16/fp16 (norm weights included).
        (self.model,) = (cast_for_training(m, self.config)
                         for m in build_model_chunks(case.job, self.config, d, model_groups()))
        self.case = case
        self.repeats = repeats
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")
        self.layers = {layer_kind_name(layer): layer for layer in self.model.decoder.layers}
        self.plain_layers = self.layers
        """The layers timed alternately with recomputed ones: the same modules under full recomputation (called
        without the checkpoint around them), a twin built without recomputation under selective (Megatron sets
        core attention's checkpointing when it builds the layer)."""
        if case.job.parallel.recompute is Recompute.selective:
            plain = dataclasses.replace(case.job, parallel=dataclasses.replace(case.job.parallel,
                                                                               recompute=Recompute.none))
            twin_config = transformer_config(plain, d, on_gpu=self.on_gpu)
            (twin,) = (cast_for_training(m, twin_config)
                       for m in build_model_chunks(plain, twin_config, d, model_groups()))
            self.plain_layers = {layer_kind_name(layer): layer for layer in twin.decoder.layers}

    def _part(self, kind: str, micro_batch: int, *, plain: bool = False) -> tuple[Any, Any]:
        """(forward function, gradient of its output) for one part at ``micro_batch``; with ``plain``, a decoder
        layer without recomputation (:attr:`plain_layers`)."""
        model, seq = self.model, self.case.job.train.seq_length
        vocab = self.case.job.model.padded_vocab_size
        dtype = self.config.params_dtype
        # Under sequence parallelism the layers and the head see this rank's slice of the sequence.
        local_seq = seq // self.case.tp if self.config.sequence_parallel else seq
        shape = (local_seq, micro_batch, self.config.hidden_size)
        if kind == "embedding":
            ids = torch.randint(0, vocab, (micro_batch, seq), device=self.device)
            pos = torch.arange(seq, device=self.device).unsqueeze(0).expand(micro_batch, seq)
            return (lambda: model.embedding(input_ids=ids, position_ids=pos)), torch.randn(shape, dtype=dtype,
                                                                                           device=self.device)
        x = torch.randn(shape, dtype=dtype, device=self.device, requires_grad=True)
        if kind == "head":
            labels = torch.randint(0, vocab, (micro_batch, seq), device=self.device)
            tied = model.share_embeddings_and_output_weights

            def head() -> torch.Tensor:
                h = model.decoder.final_layernorm(x) if model.decoder.final_layernorm is not None else x
                weight = model.shared_embedding_or_output_weight() if tied else None
                logits, _ = model.output_layer(h, weight=weight)
                return model.compute_language_model_loss(labels, logits)

            return head, torch.ones(micro_batch, seq, dtype=torch.float32, device=self.device)
        layer = (self.plain_layers if plain else self.layers)[kind]
        rope = model.rotary_pos_emb(seq) if getattr(model, "position_embedding_type", "") == "rope" else None

        def decoder_layer(hidden: torch.Tensor) -> torch.Tensor:
            out = layer(hidden_states=hidden, attention_mask=None, rotary_pos_emb=rope)
            return out[0] if isinstance(out, tuple) else out

        grad = torch.randn(shape, dtype=dtype, device=self.device)
        if self.config.recompute_granularity == "full" and not plain:
            # As Megatron's TransformerBlock runs a layer under full recomputation (uniform, one layer a group).
            from megatron.core import tensor_parallel

            return (lambda: tensor_parallel.checkpoint(decoder_layer, self.config.distribute_saved_activations,
                                                       x)), grad
        return (lambda: decoder_layer(x)), grad

    def time(self, kind: str, micro_batch: int) -> list[float]:
        """Median (forward, backward) seconds of ``kind`` at ``micro_batch`` over the repeats, CUDA events as on GPU
        (wall clock on CPU through the compat layer); the median, since other ranks' work preempts a busy CPU.

        Under recomputation a third figure, the median forward plus backward of the same layer without it, timed
        alternately with the recomputed one (:attr:`~cfp_megatron.profile.records.SegmentRecord.baseline_s`)."""
        parts = [self._part(kind, micro_batch)]
        if self.case.job.parallel.recompute is not Recompute.none and kind not in ("embedding", "head"):
            parts.append(self._part(kind, micro_batch, plain=True))
        for forward, grad in parts:  # warm-up
            forward().backward(grad)
        torch.cuda.synchronize()
        timed: list[list[tuple[float, float]]] = [[] for _ in parts]
        for _ in range(self.repeats):
            for (forward, grad), found in zip(parts, timed, strict=True):
                e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
                e0.record()
                out = forward()
                e1.record()
                out.backward(grad)
                e2.record()
                torch.cuda.synchronize()
                found.append((e0.elapsed_time(e1) / 1000.0, e1.elapsed_time(e2) / 1000.0))
        self.model.zero_grad(set_to_none=True)
        for layer in self.plain_layers.values():
            layer.zero_grad(set_to_none=True)
        fwd, bwd = zip(*timed[0], strict=True)
        result = [statistics.median(fwd), statistics.median(bwd)]
        return result + [statistics.median(f + b for f, b in found) for found in timed[1:]]

    def memory(self, kind: str, micro_batch: int, *, repeats: int = 3) -> list[float]:
        """(activation, transient, workspace) bytes of ``kind`` at ``micro_batch`` (:meth:`memory_once`): the median
        of ``repeats`` measurements on every rank of the world (all run the same step). A collective's buffer that
        one pass still holds and the next does not moves single figures by a tensor now and then; the median does
        not follow it (the round's maximum over ranks would)."""
        found = torch.tensor([self.memory_once(kind, micro_batch) for _ in range(max(repeats, 1))],
                             dtype=torch.float64)
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            every = [torch.zeros_like(found) for _ in range(torch.distributed.get_world_size())]
            torch.distributed.all_gather(every, found)
            found = torch.cat(every)
        return [float(v) for v in found.sort(dim=0).values[(len(found) - 1) // 2]]

    def memory_once(self, kind: str, micro_batch: int) -> list[float]:
        """(activation, transient, workspace) bytes of ``kind`` at ``micro_batch``, counted as the training step's
        memory is (:mod:`cfp_megatron.engine.memory`, PyTorch's ``MemTracker``).

        Two forward passes run under one tracker, then the second one's backward pass. Activation: what the second
        forward pass leaves alive (saved tensors, masks, its output; not its input, which the part before it
        created). Workspace: what the first pass kept beyond that, i.e. persistent buffers it allocated or first
        touched (Megatron's global memory buffer, sized by the largest request so far: the sizes run in ascending
        order). Transient: how far the live bytes rose above both passes' activations (the forward's and the
        backward's transients, the input gradient; each parameter's gradient is freed once accumulated, as
        Megatron's DDP does with ``main_grad``). This rank, one measurement."""
        forward, grad = self._part(kind, micro_batch)
        # The part's inputs (created before, as the previous part's output would be) are not its activations.
        inputs = [c.cell_contents for c in forward.__closure__ or () if isinstance(c.cell_contents, torch.Tensor)]
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.model.zero_grad(set_to_none=True)
        hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]
        tracker = tensor_tracker()
        tracker.track_external(self.model, grad, *inputs)

        def total(which: str) -> int:
            return int(tracker.get_tracker_snapshot(which).get(self.device, {}).get("Total", 0))

        def settled() -> int:  # what a pass leaves once reference cycles (collectives', autograd's) are gone
            gc.collect()
            return total("current")

        gc.freeze()  # objects from before stay out of the collections: each one scans only what the passes made
        try:
            with tracker:
                base = settled()
                first = forward()
                middle = settled()
                second = forward()
                top = settled()
                second.backward(grad)
                del first, second
            rise = total("peak") - top
        finally:
            gc.unfreeze()
            for hook in hooks:
                hook.remove()
            self.model.zero_grad(set_to_none=True)
        kept = top - middle
        return [float(kept), float(max(rise, 0)), float(max(middle - base - kept, 0))]


def segment_steps(cases: Sequence[SegmentCase], micro_batch_sizes: Sequence[int], kinds: Sequence[str], *,
                  repeats: int) -> tuple[list[Step], dict[str, tuple[int, int, str, bool]]]:
    """Per case: build the probe model, then time each kind at each micro-batch size and measure its memory (a
    step labelled like the timing step plus :data:`MEMORY_SUFFIX`)."""
    holder: dict[str, SegmentBench] = {}
    steps: list[Step] = []
    meaning: dict[str, tuple[int, int, str, str]] = {}
    for case in cases:
        name = case.partition

        def setup(case: SegmentCase = case, name: str = name) -> list[float]:
            holder.clear()  # free the previous case's model first
            holder[name] = SegmentBench(case, repeats=repeats)
            return []

        build = f"build {name} model"
        steps.append(Step(label=build, run=setup))
        timed = [k for k in kinds if k not in ("embedding", "head")] if case.layers_only else list(kinds)
        for mbs in micro_batch_sizes:
            for kind in timed:
                label = segment_entry(kind, name, mbs)
                steps.append(Step(label=label, run=lambda name=name, kind=kind, mbs=mbs: holder[name].time(kind, mbs),
                                  entry=label, needs=build))
                steps.append(Step(label=label + MEMORY_SUFFIX,
                                  run=lambda name=name, kind=kind, mbs=mbs: holder[name].memory(kind, mbs),
                                  entry=label, needs=build))
                meaning[label] = (case.tp, mbs, kind, name)
    return steps, meaning


def segment_records(results: Sequence[StepResult], meaning: dict[str, tuple[int, int, str, str]], *, job: JobSpec,
                    key: str, classes: dict[int, dict[str, dict[str, Any]]]) -> list[SegmentRecord]:
    """Records of the finished timing steps, with their memory steps' figures where those finished too; the class id
    comes from the analysis (the kind name without one)."""
    memory = {res.label.removesuffix(MEMORY_SUFFIX): res.values for res in results
              if res.label.endswith(MEMORY_SUFFIX) and len(res.values) == 3}
    rows = []
    for res in results:
        if res.label not in meaning:
            continue
        mem = memory.get(res.label)
        tp, mbs, kind, partition = meaning[res.label]
        info = classes.get(tp, {}).get(kind, {"segment": kind, "confirmed": False})
        rows.append(SegmentRecord(model=key, model_name=job.model.name, segment=info["segment"], kind=kind,
                                  partition=partition, tp=tp, micro_batch=mbs,
                                  seq_length=job.train.seq_length, forward_s=res.values[0],
                                  backward_s=res.values[1], confirmed=bool(info["confirmed"]),
                                  activation_bytes=mem[0] if mem else None,
                                  transient_bytes=mem[1] if mem else None,
                                  workspace_bytes=mem[2] if mem else None,
                                  baseline_s=res.values[2] if len(res.values) > 2 else None))
    return rows


def model_kinds(job: JobSpec) -> list[str]:
    """Segment kinds of ``job``'s model, in model order."""
    m = job.model
    layers = ["moe"] if m.is_moe else ["dense"]
    if m.is_moe and m.moe_first_dense_layers > 0:
        layers = ["dense", "moe"]
    return ["embedding", *layers, "head"]
