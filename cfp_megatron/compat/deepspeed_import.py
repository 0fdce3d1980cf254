"""DeepSpeed imported for training on this machine's accelerator.

Without a GPU DeepSpeed must be told to use its CPU accelerator before it is imported (it reads ``DS_ACCELERATOR``
then). On that accelerator its communication backend builds, at its start (the first ``deepspeed.initialize``), a
C++ extension for a shared-memory all-reduce that only ``inference_all_reduce`` (DeepSpeed's inference and AutoTP
layers) calls; training's collectives are ``torch.distributed``'s. Marked unavailable in DeepSpeed's own table of
compatible operators, the backend skips the build and leaves inference on ``torch.distributed``'s all-reduce
(docs/deepspeed.md, "On CPU ranks").
"""

from __future__ import annotations

import os
from typing import Any

import torch


def import_deepspeed() -> Any:
    """``deepspeed``, on the CPU accelerator when there is no GPU, without the CPU accelerator's shared-memory
    all-reduce build (module docstring). Call it before the process's first ``deepspeed.initialize``."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    shm = get_accelerator().get_op_builder("ShareMemCommBuilder")  # None where the accelerator has none (CUDA)
    if shm is not None:
        deepspeed.ops.__compatible_ops__[shm.NAME] = False
    return deepspeed
