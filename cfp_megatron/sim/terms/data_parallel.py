"""The data-parallel sharding term: FSDP's per-layer parameter gather and gradient scatter inside the passes, the
gradient sync (and distributed-optimizer parameter gather) left exposed after the backward passes, and the
weights, gradients and optimizer states each rank keeps, all as the parameterised sharding model
(:mod:`cfp_megatron.sim.sharding`) prices them (docs/simulator.md, "Cost terms", "Data-parallel sharding")."""

from __future__ import annotations

from cfp_megatron.base.config import JobSpec, Normalization, PositionEmbedding
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.backward_memory import dummy_wgrad_bytes
from cfp_megatron.sim.format_costs import param_gather_element_bytes
from cfp_megatron.sim.grad_accumulation import accumulation_bytes, accumulation_mode
from cfp_megatron.sim.kernels import grad_element_bytes
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.memory import Stage
from cfp_megatron.sim.sharding import Sharding
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, MemoryCategory, Placement, StepInputs
from cfp_megatron.sim.terms.overlap import overlapped

BUCKET_PARAMS = 40_000_000
"""Megatron DDP's default gradient bucket size in parameters."""

def fsdp_sync(job: JobSpec, layout: Layout, costs: CollectiveCosts, *, params: float, elem_bytes: float,
              expert_params: float = 0.0, torch_fsdp: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of FSDP's collectives around one layer of ``params`` parameters on one rank
    (``expert_params`` of them routed experts') in one micro-batch's passes: under ``optim_grads_params`` its
    weights gathered before the forward and again before the backward, under ``optim_grads`` and
    ``optim_grads_params`` its gradients scattered after the backward, the dense ones over the shard group and the
    experts' over the expert-DP group (:meth:`~cfp_megatron.sim.sharding.Sharding.pass_sync_s`); PyTorch's FSDP2
    under a pipeline (``torch_fsdp``, :attr:`~cfp_megatron.sim.sharding.Sharding.gathers_once`) gathers once a step,
    a micro-batch's share in each forward, and scatters after the passes (:func:`step_sync`). Zero without data
    parallelism. What the passes leave exposed of them: :func:`fsdp_exposed`."""
    dims = layout.dims
    if dims.dp * dims.cp <= 1:
        return 0.0, 0.0
    sharding = Sharding.megatron(job, dims, torch_fsdp=torch_fsdp)
    gather_s, scatter_s = sharding.pass_sync_s(
        costs, params, weight_bytes=param_gather_element_bytes(job, elem_bytes), per_node=layout.dp_per_node,
        expert_params=expert_params, expert_per_node=layout.edp_per_node)
    if sharding.gathers_once:
        return gather_s / dims.num_microbatches, 0.0
    return gather_s, gather_s + scatter_s


def fsdp_beside_experts(job: JobSpec, layout: Layout) -> bool:
    """Whether FSDP's collectives and the expert all-to-all run on different links, one inside the NVLink domain
    and the other across domains (EP inside a node, the expert-DP group one rank per node; or the other way round):
    then the prefetched gather and the scatter, on their own streams, also go on while the pass waits for the
    exchange. On the same link they share its bandwidth and hide nothing behind each other."""
    dims = layout.dims
    if dims.ep <= 1:
        return False
    sharding = Sharding.megatron(job, dims)
    experts = sharding.expert_group or sharding.group
    fsdp_crosses = (min(layout.dp_per_node, sharding.group) < sharding.group
                    or (experts > 1 and layout.edp_per_node < experts))
    return fsdp_crosses != (layout.ep_per_node < dims.ep)


def fsdp_exposed(comm_s: float, window_s: float, *, beside_s: float = 0.0) -> float:
    """Seconds of ``comm_s`` of FSDP communication a pass leaves on its critical path beside ``window_s`` of the
    layer's computation (which still loses the SM share it runs on, :func:`~cfp_megatron.sim.terms.overlap.
    overlapped`) and ``beside_s`` of exposed exchange on another link (:func:`fsdp_beside_experts`), which hides the
    rest without slowing anything."""
    exposed, slowdown = overlapped(comm_s, window_s)
    return max(exposed - beside_s, 0.0) + slowdown


def tied_embedding_sync(job: JobSpec, layout: Layout, costs: CollectiveCosts, vocab_params: float, rank: int) -> float:
    """Seconds of Megatron's all-reduce of the tied word-embedding gradient (``vocab_params`` on one rank, in the
    gradient buffer's precision) between the first and the last pipeline stage (``finalize_model_grads``'s
    ``_allreduce_word_embedding_grads``, after the data-parallel sync), on those two stages, within or across NVLink
    domains as they sit; zero elsewhere and with untied embeddings unless MTP layers embed on the last stage
    (Megatron-Core then reduces that embedding's gradient with the first stage's)."""
    pp = job.parallel.pp
    shared = job.model.tie_embeddings or job.model.mtp_num_layers > 0
    if pp == 1 or not shared or rank not in (0, pp - 1):
        return 0.0
    crosses = layout.pair_crossings[-1]  # the last rank's pair is the one with the first
    return costs.seconds(Collective.all_reduce, vocab_params * grad_element_bytes(job), 2, 1 if crosses else 2)


def token_count_sync(costs: CollectiveCosts, layout: Layout) -> float:
    """Seconds of the rest of Megatron's ``finalize_model_grads`` under the per-token loss: the token count's
    broadcast over the pipeline group and all-reduce over DP x CP, on every rank (docs/simulator.md,
    "Gradient sync and optimizer step")."""
    dims = layout.dims
    broadcast_s = (costs.seconds(Collective.all_gather, 4.0 * dims.pp, dims.pp, dims.pp if layout.pp_intra_node else 1)
                   if dims.pp > 1 else 0.0)
    return broadcast_s + costs.seconds(Collective.all_reduce, 4.0, dims.dp * dims.cp, layout.dp_per_node)


def step_sync(inputs: StepInputs) -> dict[str, list[float]]:
    """Seconds per pipeline rank of what Megatron's ``finalize_model_grads`` leaves exposed after the passes, by
    lane: the gradient sync and parameter gather over DP (``dp_comm_s``) as the sharding prices them
    (:meth:`~cfp_megatron.sim.sharding.Sharding.step_sync_s`), the backward passes hiding all but the last bucket
    under ``overlap_grad_reduce`` (at the SM share the hidden part takes from them), the next forward all but the
    last bucket's gather under ``overlap_param_gather``; the tied embedding's all-reduce between the first and the
    last stage (``embedding_sync_s``); and, on a profiled cluster, the token count's syncs (``token_sync_s``). All
    scaled as the overheads probes timed the gradient finalisation."""
    job, layout, options, costs, overheads = (inputs.job, inputs.layout, inputs.options, inputs.collectives,
                                              inputs.overheads)
    dims, model = layout.dims, job.model
    sharding = Sharding.megatron(job, dims, torch_fsdp=options.torch_fsdp, deepspeed_engine=options.deepspeed_engine)
    overlap = job.parallel.overlap_grad_reduce if options.overlap_grad_reduce is None else options.overlap_grad_reduce
    overlap = overlap and not sharding.gathers_once  # FSDP2 under a pipeline reduces after the last backward
    lanes: dict[str, list[float]] = {"dp_comm_s": [], "embedding_sync_s": [], "token_sync_s": []}
    grad_bytes = sharding.state.reduced  # Megatron's buffer (grad_reduce_in_fp32), DeepSpeed's communication dtype
    gather_bytes = param_gather_element_bytes(job, inputs.kernels.elem)  # FP8 under parallel.fp8_param_gather
    token_count_s = token_count_sync(costs, layout) if overheads is not None else 0.0  # the same on every rank
    # The gradient finalisation as the overheads probes timed it inside a step, over what the collective fits say
    # (1 without probes): collectives in a training step wait for the other ranks and share the cores.
    finalize_share = overheads.finalize_share if overheads is not None else 1.0
    token_count_s *= finalize_share
    vocab_params = model.padded_vocab_size * model.hidden_size / dims.tp
    for rank in range(dims.pp):
        if options.measured_layer_only:
            for seconds in lanes.values():
                seconds.append(0.0)
            continue
        stage_params, expert_params = inputs.params[rank], inputs.expert_params[rank]
        sync_s, gather_s = sharding.step_sync_s(costs, stage_params - expert_params, expert_params,
                                                grad_bytes=grad_bytes, weight_bytes=gather_bytes,
                                                per_node=layout.dp_per_node, expert_per_node=layout.edp_per_node)
        sync_s *= finalize_share
        bucket_share = min(1.0, BUCKET_PARAMS / max(stage_params, 1.0))
        if overlap:
            sync_s = sum(overlapped(sync_s, min(inputs.backward_s[rank], sync_s * (1.0 - bucket_share))))
        if job.parallel.overlap_param_gather:
            gather_s *= bucket_share
        lanes["dp_comm_s"].append(sync_s + gather_s)
        lanes["embedding_sync_s"].append(tied_embedding_sync(job, layout, costs, vocab_params, rank) * finalize_share)
        lanes["token_sync_s"].append(token_count_s)
    return lanes


def after_backward_accumulation_s(inputs: StepInputs) -> list[float]:
    """Seconds per pipeline rank of adding every micro-batch's weight gradients to the step's where the run adds them
    once after the micro-batch's whole backward (:attr:`~cfp_megatron.sim.options.WeightGradAccumulation.
    after_backward`: DeepSpeed's ``BF16_Optimizer.update_hp_grads``, on the compute stream: nothing hides it), the
    rank's parameters at :func:`~cfp_megatron.sim.grad_accumulation.accumulation_bytes` each at HBM speed; zero
    where they are added inside each layer's backward (:func:`~cfp_megatron.sim.layer_cost.grad_accumulation_s`).
    Priced after the schedule, once per micro-batch: the pipeline's ramp of ``pp - 1`` more backward passes on the
    slowest rank is not counted."""
    job, dims, kernels = inputs.job, inputs.layout.dims, inputs.kernels
    how = accumulation_mode(job, inputs.options)
    if not how.after_backward or inputs.options.measured_layer_only:
        return [0.0] * dims.pp
    per_param = accumulation_bytes(job, how, elem=kernels.elem, microbatches=dims.num_microbatches)
    return [dims.num_microbatches * kernels.memory(params * per_param) for params in inputs.params]


def rank_params(stage: Stage) -> float:
    """Parameters on one rank of ``stage``: its decoder layers' (with the biases and norms their count leaves out),
    the embedding's and the head's where it holds them, and the table an MTP layer embeds with where the rank has
    none (the loss rank's output weight where they are tied)."""
    job, dims = stage.job, stage.layout.dims
    model = job.model
    vocab_params = model.padded_vocab_size * model.hidden_size / dims.tp
    params = stage.layer_params + stage.layers * stage.common.extra_params
    if stage.first:
        params += vocab_params
        if model.position_embedding is PositionEmbedding.learned_absolute:
            params += model.max_position_embeddings * model.hidden_size  # replicated over TP
    if stage.last:
        params += model.hidden_size * (2 if model.normalization is Normalization.LayerNorm else 1)  # final norm
    if stage.last and (dims.pp > 1 or not model.tie_embeddings):
        params += vocab_params
    if stage.mtp and not stage.first and not (stage.last and model.tie_embeddings):
        params += vocab_params  # the MTP block's embedding (the loss rank's output weight where they are tied)
    return params


class DataParallel(CostTerm):
    """DDP, the distributed optimizer and FSDP: what their communication leaves exposed."""

    name = "data_parallel"
    lanes = (Lane(name="fsdp_comm_s", label="FSDP comm", part="TP/CP/EP/FSDP comm", kind=LaneKind.comm,
                  placement=Placement.in_pass, pass_field="fsdp_comm_s", key="fsdp", trace="FSDP comm",
                  style=("FSDP gather/scatter", "#DA8BC3", "rail_animation"), overlaps=("the layer's computation",)),
             Lane(name="dp_comm_s", label="DP sync (exposed)", part="DP sync", kind=LaneKind.comm,
                  placement=Placement.after, key="dp_sync", trace="DP comm",
                  style=("DP gradient sync", "#CCB974", "yellow"),
                  overlaps=("the backward passes (overlap_grad_reduce)", "the next forward (overlap_param_gather)")),
             Lane(name="embedding_sync_s", label="tied-embedding all-reduce", part="tied-embedding sync",
                  kind=LaneKind.comm, placement=Placement.after, key="embedding_sync", trace="embedding sync",
                  style=("tied-embedding all-reduce (first and last stage)", "#E1A35B", "yellow")),
             Lane(name="token_sync_s", label="token-count syncs", part="token-count sync", kind=LaneKind.comm,
                  placement=Placement.after, key="token_sync", trace="token sync",
                  style=("token-count broadcast and all-reduce", "#A89B6A", "yellow")),
             Lane(name="grad_accum_s", label="weight-gradient accumulation (after the backward)",
                  part="weight-gradient accumulation", kind=LaneKind.compute, placement=Placement.after,
                  key="grad_accum", trace="compute",
                  style=("weight-gradient accumulation (BF16_Optimizer)", "#B0A36B", "olive")))
    stores = (MemoryCategory(name="weights", label="weights", field="parameters"),
              MemoryCategory(name="gradients", label="gradients", field="gradients"),
              MemoryCategory(name="optimizer_states", label="optimizer states", field="optimizer_states"),
              MemoryCategory(name="fsdp_buffers", label="gathered FSDP layers", field="comm_buffers"),
              MemoryCategory(name="dummy_wgrads", label="placeholder weight gradients", field="comm_buffers"))

    def after_s(self, inputs: StepInputs) -> dict[str, list[float]]:
        """What the gradient finalisation leaves exposed per pipeline rank, by lane (:func:`step_sync`), and the
        weight-gradient accumulation run after the backward passes (:func:`after_backward_accumulation_s`)."""
        return {**step_sync(inputs), "grad_accum_s": after_backward_accumulation_s(inputs)}

    def memory(self, stage: Stage) -> dict[str, float]:
        """The weights, gradients and optimizer states as the plan's sharding keeps them
        (:class:`~cfp_megatron.sim.sharding.Sharding`), the whole layers FSDP gathers, and the placeholder weight
        gradients Transformer Engine's fused accumulation hands autograd
        (:func:`~cfp_megatron.sim.backward_memory.dummy_wgrad_bytes`)."""
        sharding = stage.common.sharding
        params = rank_params(stage)
        states = sharding.memory(params, stage.expert_params)
        gathered = 0.0
        if stage.layers and stage.measured is None:
            gathered = sharding.gathered_bytes(stage.layer_params / stage.layers, stage.expert_params / stage.layers,
                                               layers=stage.layers)
        if sharding.megatron_fsdp is not None and sharding.gathers_per_pass:
            # Megatron-FSDP's units are the decoder layers; the modules outside them (the embedding, the output
            # layer, the final norm) are gathered in their forward and never released (megatron_fsdp.py registers
            # no post-forward release for them), in the compute precision
            gathered += _outside_layers(stage, params) * stage.common.elem_bytes
        weights = states.weights - _not_te_weight_excess(stage, params) - _bf16_layer_weight_excess(stage)
        dense = stage.layers > stage.moe_layers
        dummies = dummy_wgrad_bytes(stage.job, stage.layout, stage.options, dense=dense, moe=stage.moe_layers > 0,
                                    head=stage.last)
        return {"weights": weights, "gradients": states.gradients,
                "optimizer_states": states.optimizer_states, "fsdp_buffers": gathered, "dummy_wgrads": dummies}


def _bf16_layer_weight_excess(stage: Stage) -> float:
    """Bytes :meth:`Sharding.memory <cfp_megatron.sim.sharding.Sharding.memory>` counts for the rank's decoder layers
    kept in bf16 at the stack's ends beyond what they hold: outside the FP8/FP4 context Transformer Engine keeps no
    quantised copy of their weights, and Megatron-Core builds them in bf16 also under FP8 parameters
    (``fp8_utils.get_fp8_context`` and ``fp4_utils.get_fp4_context`` return no quantised context for them, at
    initialisation too); zero without them."""
    sharding, elem = stage.common.sharding, stage.common.elem_bytes
    per_param = sharding.state.weights
    if stage.bf16_params <= 0 or per_param <= 0 or per_param == elem:
        return 0.0
    return sharding.memory(stage.bf16_params).weights * (1.0 - elem / per_param)


def _not_te_weight_excess(stage: Stage, params: float) -> float:
    """Bytes :meth:`Sharding.memory <cfp_megatron.sim.sharding.Sharding.memory>` counts for the rank's embedding,
    position table, output layer and final norm beyond what they hold: they are not Transformer Engine layers
    (Megatron-Core's VocabParallelEmbedding and ColumnParallelLinear), so under FP8/FP4 they keep their weights in
    the compute precision, with no quantised copies and never as FP8 parameters; zero in 16/32 bits."""
    sharding, elem = stage.common.sharding, stage.common.elem_bytes
    per_param = sharding.state.weights
    outside = _outside_layers(stage, params)
    if outside <= 0 or per_param <= 0 or per_param == elem:
        return 0.0
    return sharding.memory(outside).weights * (1.0 - elem / per_param)


def _outside_layers(stage: Stage, params: float) -> float:
    """Parameters of the rank's ``params`` outside its decoder layers: the embedding, the position table, the output
    layer and the final norm where it holds them."""
    return max(params - stage.layer_params - stage.layers * stage.common.extra_params, 0.0)
