"""Megatron's model-parallel groups kept between the cases of one multi-rank job, by layout.

tests/scripts/multirank_cases.py trains many cases in the same ranks; each used to make Megatron's groups
(``parallel_state.initialize_model_parallel``) and destroy them again at its end. A :class:`GroupPool` sets a case's
groups aside instead and hands them to the next case of the same layout (the same arguments to
``initialize_model_parallel``: sizes, order, timeout), with ``parallel_state`` as that call left it and a fresh
global memory buffer; a case of another layout gets groups of its own, made as before. docs/testing.md, "One job per
world size".
"""

from __future__ import annotations

import gc
import json
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from megatron.core import parallel_state

from cfp_megatron.engine import distributed

State = dict[str, Any]
"""``parallel_state``'s module globals (its groups, their ranks, the sizes), by name."""

_BUFFERS = ("_GLOBAL_MEMORY_BUFFER", "_GLOBAL_SYMMETRIC_MEMORY_BUFFER")
"""Globals of ``parallel_state`` a reused layout gets afresh (scratch tensors of the case before), not kept."""


def _state_names() -> tuple[str, ...]:
    """The names of ``parallel_state``'s state: its private module globals that are values (not functions,
    classes or modules)."""
    return tuple(name for name, value in vars(parallel_state).items()
                 if name.startswith("_") and not name.startswith("__") and not callable(value)
                 and not isinstance(value, types.ModuleType))


def layout_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """What makes two calls of ``initialize_model_parallel`` the same layout: their arguments."""
    return json.dumps([list(args), sorted(kwargs.items())], default=repr)


def _groups(state: State) -> list[dist.ProcessGroup]:
    return [g for g in (state.get("_global_process_group_list") or ()) if g is not None]


class GroupPool:
    """Megatron's initialised ``parallel_state`` per layout (:func:`layout_key`), reused by the next call of the
    same layout; :attr:`made` and :attr:`reused` count the calls of each kind."""

    def __init__(self) -> None:
        self._initialize: Callable[..., None] = parallel_state.initialize_model_parallel
        self._names = _state_names()
        self._pristine = self._read()  # before any layout: what a case starts from
        self._kept: dict[str, State] = {}
        self.made = 0
        self.reused = 0

    def _read(self) -> State:
        return {name: getattr(parallel_state, name) for name in self._names}

    def _write(self, state: State) -> None:
        for name, value in state.items():
            setattr(parallel_state, name, value)

    def _fresh(self) -> State:
        """The state before any layout, its containers copied (Megatron fills some in place)."""
        return {name: value.copy() if isinstance(value, dict | list) else value
                for name, value in self._pristine.items()}

    def initialize(self, *args: Any, **kwargs: Any) -> None:
        """``parallel_state.initialize_model_parallel(*args, **kwargs)``, or the groups a call with the same arguments
        made earlier, when they are set aside and still alive (none destroyed since)."""
        key = layout_key(args, kwargs)
        kept = self._kept.pop(key, None)
        registered = dist.distributed_c10d._world.pg_map
        if (kept is not None and not parallel_state.model_parallel_is_initialized()
                and all(g in registered for g in _groups(kept))):
            self._write({**kept, **{name: self._pristine[name] for name in _BUFFERS}})
            parallel_state._set_global_memory_buffer()  # as initialize_model_parallel ends
            self._kept[key] = kept
            self.reused += 1
            return
        self._initialize(*args, **kwargs)
        self._kept[key] = {name: value for name, value in self._read().items() if name not in _BUFFERS}
        self.made += 1

    def release(self) -> None:
        """End a case's use of Megatron's groups: a layout this pool made is set aside (``parallel_state`` as before
        any layout); groups made otherwise (a profiling probe's) are destroyed
        (:func:`~cfp_megatron.engine.distributed.destroy_model_parallel_groups`). Then a garbage collection: the
        case's model, DDP buffers and optimizer sit in reference cycles."""
        current = parallel_state._global_process_group_list
        if current is not None and not any(current is kept["_global_process_group_list"]
                                           for kept in self._kept.values()):
            distributed.destroy_model_parallel_groups()
        self._write(self._fresh())
        gc.collect()

    def clear(self) -> None:
        """Destroy every group set aside and the current ones (after a failed case, whose groups may be left
        mid-collective): the next case of any layout makes its own."""
        distributed.destroy_model_parallel_groups()
        registered = dist.distributed_c10d._world.pg_map
        for kept in self._kept.values():
            for group in _groups(kept):
                if group in registered:
                    dist.destroy_process_group(group)
        self._kept.clear()
        self._write(self._fresh())
        gc.collect()

    @contextmanager
    def serving(self) -> Iterator[None]:
        """While open, the launch path's :func:`~cfp_megatron.engine.distributed.init_distributed` takes its groups
        from the pool and its teardown (``destroy_distributed``) sets them aside; other callers of
        ``initialize_model_parallel`` (profiling's probes, capture's meta environment) make and destroy their own."""
        original_init, original_destroy = distributed.init_distributed, distributed.destroy_distributed

        def init_distributed(*args: Any, **kwargs: Any) -> None:
            parallel_state.initialize_model_parallel = self.initialize
            try:
                original_init(*args, **kwargs)
            finally:
                parallel_state.initialize_model_parallel = self._initialize

        distributed.init_distributed = init_distributed
        distributed.destroy_distributed = self.release
        try:
            yield
        finally:
            distributed.init_distributed, distributed.destroy_distributed = original_init, original_destroy
