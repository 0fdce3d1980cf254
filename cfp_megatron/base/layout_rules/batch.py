"""The batch and the world: the model-parallel sizes against the ranks, the global batch against the data-parallel
ranks and micro-batches, and what data-parallel sharding needs."""

from __future__ import annotations

from cfp_megatron.base.layout_rules.problem import Problem


def model_parallel_world(world: int, tp: int, cp: int, pp: int) -> list[Problem]:
    """TP x CP x PP divides the world; data parallelism takes what it leaves."""
    product = tp * cp * pp
    if not world % product:
        return []
    return [Problem(key="parallel.tp", value=tp,
                    problem=f"world size {world} is not divisible by parallel.tp x parallel.cp x parallel.pp "
                            f"= {tp} x {cp} x {pp} = {product}.",
                    fix=f"choose sizes whose product divides {world}, or start {product}*k ranks "
                        f"(torchrun --nproc_per_node).",
                    brief=f"does not divide the world size {world}")]


def cluster_world(world: int, nodes: int, gpus_per_node: int | None) -> list[Problem]:
    """The cluster's nodes x GPUs per node (where stated) are the ranks started."""
    if gpus_per_node is None or world == nodes * gpus_per_node:
        return []
    return [Problem(key="cluster.nodes", value=nodes,
                    problem=f"cluster.nodes x cluster.gpus_per_node = {nodes} x {gpus_per_node} = "
                            f"{nodes * gpus_per_node} but {world} ranks were started.",
                    fix="start that many ranks, or set cluster.nodes/cluster.gpus_per_node to match torchrun.",
                    brief=f"{nodes} nodes of {gpus_per_node} GPUs are not {world} ranks")]


def global_batch(global_batch: int, micro_batch: int, dp: int) -> list[Problem]:
    """The global batch splits into whole micro-batches on every data-parallel rank."""
    per_step = micro_batch * dp
    if not global_batch % per_step:
        return []
    brief = (f"the global batch {global_batch} is not divisible by the DP size {dp}" if global_batch % dp else
             f"{micro_batch} does not divide the {global_batch // dp} sequences of a step per data-parallel rank "
             f"(train.global_batch_size={global_batch} over DP {dp})")
    return [Problem(key="train.global_batch_size", value=global_batch,
                    problem=f"is not divisible by train.micro_batch_size x data-parallel size = {micro_batch} x {dp}"
                            f" = {per_step}.",
                    fix=f"use a multiple of {per_step}, e.g. "
                        f"train.global_batch_size={per_step * max(1, global_batch // per_step)}.",
                    brief=brief)]


def microbatch_count(global_batch: int, micro_batch: int, dp: int, limit: int) -> list[Problem]:
    """A step runs at most ``limit`` micro-batches per data-parallel rank."""
    per_step = micro_batch * dp
    count = max(global_batch // per_step, 1)
    if count <= limit:
        return []
    return [Problem(key="train.global_batch_size", value=global_batch,
                    problem=f"means {count:,} micro-batches per step on each data-parallel rank "
                            f"(train.global_batch_size / (train.micro_batch_size x data-parallel size {dp})), more "
                            f"than {limit:,}: one step would run for hours (published runs accumulate at most 128).",
                    fix=f"set train.global_batch_size to at most {limit * per_step}, or raise "
                        "train.micro_batch_size or the data-parallel size.",
                    brief=f"{count:,} micro-batches per step, more than {limit:,}")]


def sharded_optimizer(distributed_optimizer: bool, *, dp: int, expert_dp: int | None = None) -> list[Problem]:
    """The distributed optimizer shards over data-parallel ranks: it needs some (dense, or with ``expert_dp`` given
    for a MoE model, expert ones)."""
    if not distributed_optimizer or dp > 1 or (expert_dp is not None and expert_dp > 1):
        return []
    return [Problem(key="parallel.distributed_optimizer", value=True,
                    problem="the distributed optimizer shards over data-parallel ranks; this layout leaves one.",
                    fix="set parallel.distributed_optimizer=false, or leave data-parallel ranks.",
                    brief="the distributed optimizer shards over data parallelism")]


def param_gather_overlap(overlap: bool, distributed_optimizer: bool) -> list[Problem]:
    """Overlapping the parameter all-gather needs the distributed optimizer (which gathers them)."""
    if not overlap or distributed_optimizer:
        return []
    return [Problem(key="parallel.overlap_param_gather", value=True,
                    problem="overlapping the parameter all-gather needs the distributed optimizer.",
                    fix="set parallel.distributed_optimizer=true or parallel.overlap_param_gather=false.",
                    brief="the parameter gather overlap needs the distributed optimizer")]


def fp8_param_gather_sharding(on: bool, distributed_optimizer: bool) -> list[Problem]:
    """Parameters kept in FP8 need the distributed optimizer (or Megatron-FSDP, which steps with it), whose fp32
    shards they are quantised from (Megatron-LM's arguments.py asserts the same)."""
    if not on or distributed_optimizer:
        return []
    return [Problem(key="parallel.fp8_param_gather", value=True,
                    problem="keeping the parameters in FP8 needs the distributed optimizer (or parallel.fsdp), "
                            "whose fp32 master shards they are quantised from.",
                    fix="set parallel.distributed_optimizer=true or parallel.fp8_param_gather=false.",
                    brief="FP8 parameters need the distributed optimizer")]


def fsdp_settings(*, fsdp: str, distributed_optimizer: bool, shard_size: int | None) -> list[Problem]:
    """Megatron-FSDP steps its shards with the distributed optimizer, and its ``optim`` strategy is not trained (its
    gradient norm is not the reference's); hybrid sharding splits a sharded state."""
    out = []
    if fsdp == "optim":
        out.append(Problem(key="parallel.fsdp", value=fsdp,
                           problem="Megatron-Core 0.16.1's Megatron-FSDP under 'optim' keeps whole gradients on every "
                                   "rank and counts each rank's copy in the gradient norm (2x the single-rank "
                                   "reference's on 2 ranks), so gradient clipping differs (docs/simulator.md, "
                                   "\"Sharded data parallelism\").",
                           fix="set parallel.fsdp=none with parallel.distributed_optimizer=true (Megatron-Core's "
                               "distributed optimizer shards the same states), or parallel.fsdp=optim_grads.",
                           brief="Megatron-FSDP's 'optim' is not trained"))
    if fsdp != "none" and not distributed_optimizer:
        out.append(Problem(key="parallel.fsdp", value=fsdp,
                           problem="Megatron-FSDP's shards are stepped by Megatron-Core's distributed optimizer; "
                                   "parallel.distributed_optimizer=false.",
                           fix="set parallel.distributed_optimizer=true, or parallel.fsdp=none.",
                           brief="Megatron-FSDP needs the distributed optimizer"))
    if shard_size is not None and fsdp == "none" and not distributed_optimizer:
        out.append(Problem(key="parallel.dp_shard_size", value=shard_size,
                           problem="hybrid sharding splits a sharded state into groups; this layout shards nothing "
                                   "(parallel.distributed_optimizer=false, parallel.fsdp=none).",
                           fix="set parallel.distributed_optimizer=true (and parallel.fsdp), or "
                               "parallel.dp_shard_size=null.",
                           brief="hybrid sharding needs a sharded state"))
    return out


def shard_groups(shard_size: int | None, *, dp_cp: int, fsdp: str, on_cpu: bool, ep: int = 1) -> list[Problem]:
    """A hybrid shard group is a whole part of DP x CP (Megatron-Core's distributed-optimizer instances);
    Megatron-FSDP's hybrid sharding does not train as the reference does on CPU, nor shard experts."""
    if shard_size is not None and fsdp != "none" and ep > 1 and shard_size < dp_cp:
        return [Problem(key="parallel.dp_shard_size", value=shard_size,
                        problem=f"Megatron-FSDP's hybrid sharding (parallel.fsdp={fsdp}) builds no expert mesh in "
                                "Megatron-Core 0.16.1 (mcore_fsdp_adapter._init_dist_index), so experts split over "
                                f"parallel.ep={ep} would be sharded as dense weights.",
                        fix="set parallel.dp_shard_size=null (Megatron-FSDP over all of DP x CP), or hybrid-shard "
                            "with the distributed optimizer alone (parallel.fsdp=none).",
                        brief="Megatron-FSDP's hybrid sharding has no expert groups")]
    if shard_size is not None and fsdp != "none" and on_cpu and shard_size < dp_cp:
        return [Problem(key="parallel.dp_shard_size", value=shard_size,
                        problem=f"Megatron-FSDP's hybrid sharding (parallel.fsdp={fsdp}) trains away from the "
                                "single-rank reference on CPU with gloo under Megatron-Core 0.16.1 (2 ranks, shard "
                                "groups of 1: the loss moves from step 3).",
                        fix="on CPU set parallel.dp_shard_size=null (one shard group), or hybrid-shard with the "
                            "distributed optimizer alone (parallel.fsdp=none); on GPUs it runs as planned.",
                        brief="Megatron-FSDP's hybrid sharding does not run on CPU")]
    if shard_size is None or (shard_size <= dp_cp and not dp_cp % shard_size):
        return []
    return [Problem(key="parallel.dp_shard_size", value=shard_size,
                    problem=f"does not divide the {dp_cp} data-parallel x context-parallel ranks the states are "
                            "sharded over.",
                    fix=f"use a divisor of {dp_cp} (e.g. the GPUs of a node), or parallel.dp_shard_size=null.",
                    brief=f"does not divide DP x CP = {dp_cp}")]


def fsdp_checkpoints(fsdp: str, checkpoint_dir: str | None) -> list[Problem]:
    """Megatron-FSDP's state is saved only in its own format, which this project's checkpoints do not write."""
    if fsdp == "none" or checkpoint_dir is None:
        return []
    return [Problem(key="parallel.fsdp", value=fsdp,
                    problem=f"checkpoints (train.checkpoint_dir={checkpoint_dir}) are not saved under Megatron-FSDP: "
                            "Megatron-Core 0.16.1 saves its state only in the fsdp_dtensor format, not in the "
                            "resharding dist_checkpointing format this project saves and resumes across layouts.",
                    fix="set parallel.fsdp=none (cfp.fsdp=none when planning; the distributed optimizer shards the "
                        "optimizer states), or train.checkpoint_dir=null to train without checkpoints.",
                    brief="Megatron-FSDP saves no checkpoint here")]


def distributed_optimizer_kind(distributed_optimizer: bool, optimizer: str) -> list[Problem]:
    """Megatron-Core's distributed optimizer steps Adam only (0.16.1: "Only Adam and HybridDeviceOptimizer currently
    supported, due to checkpointing requirements")."""
    if not distributed_optimizer or optimizer == "adam":
        return []
    return [Problem(key="parallel.distributed_optimizer", value=True,
                    problem="Megatron-Core's distributed optimizer (and Megatron-FSDP, which it steps) runs Adam "
                            f"only; train.optimizer={optimizer}.",
                    fix="set train.optimizer=adam, or parallel.distributed_optimizer=false (and parallel.fsdp=none).",
                    brief=f"the distributed optimizer runs Adam, not {optimizer}")]
