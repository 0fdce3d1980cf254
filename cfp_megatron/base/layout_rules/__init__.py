"""The rules a parallel layout must follow, once each, by topic: :mod:`.tensor`, :mod:`.sequence` (sequence and
context parallelism), :mod:`.pipeline`, :mod:`.moe`, :mod:`.recompute`, :mod:`.batch` (the batch and the world
size).

Each rule is a pure function of plain sizes and flags that returns the :class:`~.problem.Problem` values it finds
(empty: the layout follows it). Three callers render them: the config checks
(:class:`~cfp_megatron.base.config.ParallelSpec`, :meth:`~cfp_megatron.base.parallel_dims.ParallelDims.build`) as
:class:`~cfp_megatron.base.errors.ConfigIssue` values naming the key and the fix, the CFP analysis' partition options
(:mod:`cfp_megatron.model.options`) and the search's screens (:mod:`cfp_megatron.search.space`) by their short
``brief``. The modules import nothing from :mod:`cfp_megatron.base.config` (which calls them).
"""
