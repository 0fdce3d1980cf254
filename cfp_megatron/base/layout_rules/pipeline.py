"""Pipeline parallelism: stages against layers, interleaving, and counting the embedding and loss in the split.
The split of the layers itself (even, first/last stage counts, a per-stage layout) is
:func:`cfp_megatron.base.pipeline_split.split_issues`."""

from __future__ import annotations

import math

from cfp_megatron.base.layout_rules.problem import Problem


def stages_filled(num_layers: int, pp: int) -> list[Problem]:
    """Every pipeline stage holds at least one decoder layer."""
    if num_layers >= pp:
        return []
    return [Problem(key="parallel.pp", value=pp, problem=f"model.num_layers={num_layers} does not fill parallel.pp="
                    f"{pp} stages.", fix=f"use a parallel.pp of at most {num_layers}.",
                    brief=f"{num_layers} layers do not fill {pp} stages")]


def interleave_needs_pp(vpp: int, pp: int) -> list[Problem]:
    """Interleaving (``vpp`` model chunks per rank) needs pipeline parallelism."""
    if vpp <= 1 or pp != 1:
        return []
    return [Problem(key="parallel.vpp", value=vpp, problem="virtual pipeline stages need parallel.pp > 1.",
                    fix="set parallel.vpp=null or parallel.pp to 2 or more.",
                    brief=f"interleaving (vpp {vpp}) needs pipeline parallelism")]


def interleaves(microbatches: int, pp: int) -> bool:
    """Whether the interleaved schedule can run ``microbatches`` micro-batches a step over ``pp`` stages (it runs
    them in groups of ``pp``): :func:`interleaved_microbatches` without its message, for a search's screen."""
    return not microbatches % pp


def interleaved_microbatches(*, microbatches: int, pp: int, vpp: int, global_batch: int,
                             per_step: int) -> list[Problem]:
    """The interleaved schedule (``vpp > 1``) runs the micro-batches of a step in groups of ``pp``
    (``per_step``: sequences per micro-batch over all data-parallel ranks, for the fix)."""
    if vpp <= 1 or interleaves(microbatches, pp):
        return []
    return [Problem(key="train.global_batch_size", value=global_batch,
                    problem=f"the interleaved schedule needs the micro-batch count ({microbatches}) to be a multiple "
                            f"of parallel.pp={pp}.",
                    fix=f"use train.global_batch_size={math.lcm(microbatches, pp) * per_step}.",
                    brief=f"the interleaved schedule needs the micro-batches per step ({microbatches}) to be a "
                          f"multiple of PP {pp}")]


def counted_in_split(*, counted: list[str], first: int | None, last: int | None, pp: int) -> list[Problem]:
    """Counting the embedding or loss as a layer (``counted``: the ``account_for_*_in_pipeline_split`` fields that
    are on) splits pipeline stages, and excludes a first/last stage count of its own."""
    if not counted:
        return []
    found = []
    if first is not None or last is not None:
        found.append(Problem(key=f"parallel.{counted[0]}", value=True,
                             problem="Megatron-Core does not count the embedding or loss in the split together with "
                                     "a first/last stage layer count of its own.",
                             fix="set parallel.first_stage_layers=null and parallel.last_stage_layers=null, or "
                                 f"parallel.{counted[0]}=false.",
                             brief="the embedding or loss counted in the split with a first/last stage count"))
    if pp == 1:
        found.append(Problem(key=f"parallel.{counted[0]}", value=True,
                             problem="counting the embedding or loss as a layer splits pipeline stages; "
                                     "parallel.pp=1 has one.", fix="set parallel.pp to 2 or more.",
                             brief="the embedding or loss counted in the split without pipeline parallelism"))
    return found
