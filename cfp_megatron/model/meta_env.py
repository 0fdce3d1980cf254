"""A process environment in which Megatron-Core modules can be built and run on the meta device in one process.

:func:`megatron_meta_env` gives Megatron the process groups it asks for (world size 1, on torch's ``fake`` backend,
so no collective moves data) when none exist, and :func:`meta_device` makes every tensor a module creates, including
the ones Megatron places explicitly on ``torch.cuda.current_device()``, a meta tensor.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

from cfp_megatron.compat import cpu, moe
from cfp_megatron.compat.device_mode import DeviceRewriteMode
from cfp_megatron.model.errors import CaptureError


@contextlib.contextmanager
def meta_device() -> Iterator[None]:
    """Build and run on the meta device: default device ``meta``, explicit CPU/GPU placements redirected to it.

    Megatron's global memory buffer (used by its local attention) is swapped for a fresh one while active, so meta
    buffers never leak into later real runs of the same process.
    """
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    saved = parallel_state._GLOBAL_MEMORY_BUFFER
    parallel_state._GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()
    try:
        with torch.device("meta"), DeviceRewriteMode(sources=("cpu", "cuda"), target="meta"):
            yield
    finally:
        parallel_state._GLOBAL_MEMORY_BUFFER = saved


ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
"""Environment variables Megatron's ``LanguageModule`` checks against, then sets from, the attention backend."""


@contextlib.contextmanager
def isolated_attention_env() -> Iterator[None]:
    """Hide and afterwards restore the ``NVTE_*`` attention variables, which Megatron sets process-wide when it
    builds a model: a capture with the local backend must not make a later build with another backend fail."""
    saved = {k: os.environ.pop(k) for k in ATTENTION_ENV if k in os.environ}
    try:
        yield
    finally:
        for k in ATTENTION_ENV:
            os.environ.pop(k, None)
        os.environ.update(saved)


@contextlib.contextmanager
def megatron_meta_env(seed: int = 1234) -> Iterator[bool]:
    """Megatron's parallel state for world size 1 on the ``fake`` backend, if no process group exists yet.

    Yields whether it created the state (and will tear it down on exit). When a process group already exists, it and
    Megatron's parallel state are used as they are (a :class:`CaptureError` if Megatron's is missing). Installs the
    CPU compatibility layer when CUDA is absent and the MoE fixes Megatron-Core needs without Transformer Engine, and
    restores the ``NVTE_*`` attention variables Megatron sets while building (:func:`isolated_attention_env`).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    cpu.install_if_needed()
    moe.install()
    if dist.is_initialized():
        if not parallel_state.model_parallel_is_initialized():
            raise CaptureError("a torch.distributed process group exists but Megatron's parallel state does not; "
                               "call megatron.core.parallel_state.initialize_model_parallel first, or capture "
                               "before init_process_group so capture can use its own fake group.")
        with isolated_attention_env():
            yield False
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
    try:
        # Gloo groups cannot be created over the fake store; capture needs none.
        parallel_state.initialize_model_parallel(create_gloo_process_groups=False)
        try:
            model_parallel_cuda_manual_seed(seed)
            with isolated_attention_env():
                yield True
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
