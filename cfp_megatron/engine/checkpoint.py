"""Checkpoints with ``megatron.core.dist_checkpointing``: crash-safe saves, exact resume, any layout on load.

Layout of ``train.checkpoint_dir``::

    iter_0000010/        a complete dist_checkpointing checkpoint (model, optimizer, scheduler, step)
    iter_0000020/
    latest_checkpointed_iteration.txt   the newest complete step, replaced atomically

A save writes into ``iter_XXXXXXX.partial`` and renames it only after every rank has finished; the ``latest`` file
is replaced last with ``os.replace``. A crash mid-save therefore leaves the previous checkpoint and the ``latest``
pointer intact (the stale ``.partial`` folder is removed by the next save). Before the rename, rank 0 writes the
folder's manifest (:mod:`.manifest`); a resume verifies it before anything in the folder is unpickled.
Weights are stored by their global keys,
so a checkpoint saved under one TP/PP/VPP/EP layout loads under another; the optimizer uses Megatron's
reshardable formats.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.compat import optimizer as optimizer_compat
from cfp_megatron.engine import manifest, save_workers

LATEST = "latest_checkpointed_iteration.txt"
"""Name of the pointer file (as Megatron-LM names it)."""


def step_dir(root: Path, step: int) -> Path:
    """Folder of the checkpoint at ``step``."""
    return root / f"iter_{step:07d}"


def latest_step(root: str | os.PathLike[str]) -> int | None:
    """The newest complete checkpoint's step, or ``None`` when the folder holds none."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{pointer} holds {text!r}, not a step number. Fix: restore the file or point "
                              "train.checkpoint_dir at another folder.")
    step = int(text)
    if not step_dir(Path(root), step).is_dir():
        raise CheckpointError(f"{pointer} names step {step} but {step_dir(Path(root), step)} is missing. Fix: "
                              "restore that folder, or write the newest complete step into the pointer file.")
    return step


def recovery_fix(root: Path, folder: Path, pointer: Path, pattern: str, write: str) -> str:
    """The ``Fix:`` of a checkpoint that fails verification: the previous step folder under ``root`` (``pattern``
    captures the step; ``write`` formats what goes into ``pointer``), or a fresh run."""
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if p != folder and p.is_dir()
                   and (m := re.fullmatch(pattern, p.name))) if root.is_dir() else []
    current = re.fullmatch(pattern, folder.name)
    earlier = [(s, p) for s, p in steps if current is None or s < int(current.group(1))]
    fresh = "start afresh with train.resume=false and a new train.checkpoint_dir"
    if not earlier:
        return f"Fix: restore the folder from a copy, or {fresh} (no earlier checkpoint is in {root})."
    step, previous = earlier[-1]
    return (f"Fix: resume from the previous checkpoint, {previous}, instead (write {write.format(step)!r} into "
            f"{pointer}; it is verified in turn), or {fresh}.")


def verify_step(root: str | os.PathLike[str], step: int, *, trust_unverified: bool) -> bool:
    """Verify the checkpoint at ``step`` against its manifest before anything in it is loaded
    (:func:`.manifest.verify`); returns whether a manifest was there."""
    base = Path(root)
    folder = step_dir(base, step)
    fix = recovery_fix(base, folder, base / LATEST, r"iter_(\d{7})", "{}")
    return manifest.verify(folder, trust_unverified=trust_unverified, fix=fix)


def check_before_start(root: str | None, *, resume: bool, restarted: bool,
                       trust_unverified: bool = False) -> int | None:
    """Decide, before any process group exists, which step a run starts from; never overwrite a user's work.

    A fresh run (``train.resume=false``) refuses a folder that already holds checkpoints, unless torchrun
    restarted this job's workers (then the checkpoints are this job's own and it continues from them). The
    checkpoint to resume is verified against its manifest here, before anything unpickles it
    (``trust_unverified``: accept one without a manifest).
    """
    if root is None:
        return None
    found = latest_step(root) if Path(root).exists() else None
    if resume or restarted:
        if resume and found is None:
            raise CheckpointError(f"train.resume=true but train.checkpoint_dir={root!r} holds no complete "
                                  f"checkpoint ({LATEST} is missing). Fix: point train.checkpoint_dir at the folder "
                                  "an earlier run saved into, or set train.resume=false.")
        if found is not None:
            verify_step(root, found, trust_unverified=trust_unverified)
        return found
    if found is not None:
        raise CheckpointError(f"train.checkpoint_dir={root!r} already holds checkpoints (latest step {found}) and "
                              "train.resume=false; starting afresh would overwrite them. Fix: set train.resume=true "
                              "to continue, or choose another train.checkpoint_dir.")
    return None


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
"""How Megatron-Core's distributed optimizer lays out its state in a checkpoint (ignored by the others)."""


def sharded_state(chunks: list[torch.nn.Module], optimizer: Any, *, is_loading: bool,
                  per_layer: bool = True) -> dict[str, Any]:
    """Model and optimizer state as ShardedTensors keyed globally (so any layout can read it).

    ``per_layer``: each decoder layer under its own keys (``decoder.layers.<i>.``, Megatron-Core's
    ``non_homogeneous_layers``), so layers sharded differently (PrimePar's 2-D blocks on some layers, Megatron's
    column/row split on the others: ``parallel.primepar_layers``) live in one checkpoint; ``False`` stacks every
    layer's tensor along a leading layer axis (``decoder.layers.``), the form checkpoints had before."""
    meta = {"non_homogeneous_layers": per_layer}
    model_state = {f"chunk{i}": chunk.sharded_state_dict(metadata=meta) for i, chunk in enumerate(chunks)}
    state: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        # The distributed optimizer's state in its canonical per-parameter form, so a checkpoint resumes under any
        # layout (Megatron-Core's default format keeps flattened ranges, which its own save path refuses on 0.16).
        state["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                          metadata=OPTIMIZER_METADATA)
    return state


def save(root: str, step: int, chunks: list[torch.nn.Module], optimizer: Any, scheduler: Any,
         extra: dict[str, Any]) -> Path:
    """Save a complete checkpoint for ``step`` from every rank; return its folder."""
    base = Path(root)
    final = step_dir(base, step)
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        base.mkdir(parents=True, exist_ok=True)
        for stale in base.glob("iter_*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
        partial.mkdir()
    _barrier()
    state = sharded_state(chunks, optimizer, is_loading=False)
    state["step"] = step
    state["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    state["extra"] = extra
    with save_workers.tied_to_this_process():
        dist_checkpointing.save(state, str(partial))
    _barrier()
    if rank == 0:
        manifest.publish(partial, final, base / LATEST, f"{step}\n")
    _barrier()
    return final


def _allocate_distributed_optimizer_state(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped yet its state tensors before a load: without Apex or
    Transformer Engine, Megatron-Core reads the step count from them while it builds the state to load into (its own
    Megatron-FSDP path does the same, with the same function). The values are replaced by the checkpoint's."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


_READ_ERRORS = (OSError, EOFError, RuntimeError, ValueError, KeyError, AttributeError, pickle.UnpicklingError)
"""What reading a damaged checkpoint raises; reached only by a folder loaded unverified
(``train.trust_unverified_checkpoint``) or changed after its check."""


def _unreadable(folder: Path, err: BaseException) -> CheckpointError:
    fix = recovery_fix(folder.parent, folder, folder.parent / LATEST, r"iter_(\d{7})", "{}")
    return CheckpointError(f"{folder} cannot be read ({type(err).__name__}: {str(err)[:300]}). {fix}")


def saved_distributed_optimizer(root: str, step: int) -> bool:
    """Whether the checkpoint at ``step`` holds Megatron's distributed optimizer's state (read from its common
    state, without process groups). Megatron-Core 0.16 loads one optimizer kind's state only into the same kind."""
    folder = step_dir(Path(root), step)
    try:
        common = dist_checkpointing.load_common_state_dict(str(folder))
    except _READ_ERRORS as err:
        raise _unreadable(folder, err) from err
    optimizer = common.get("optimizer") or {}
    return isinstance(optimizer, dict) and "param_state_sharding_type" in optimizer


def saved_per_layer(folder: Path) -> bool:
    """Whether the checkpoint in ``folder`` keys each decoder layer on its own (``decoder.layers.<i>.``) rather than
    stacking them (``decoder.layers.``); read from its metadata, without process groups."""
    try:
        keys = dist_checkpointing.load_tensors_metadata(str(folder)).keys()
    except _READ_ERRORS as err:
        raise _unreadable(folder, err) from err
    stacked = re.compile(r"(^|\.)decoder\.layers\.(?!\d)")
    return not any(stacked.search(k) for k in keys)


def load(root: str, step: int, chunks: list[torch.nn.Module], optimizer: Any, scheduler: Any, *,
         heterogeneous: bool = False) -> dict[str, Any]:
    """Load the checkpoint at ``step`` into this rank's chunks, optimizer and scheduler; return its extra state.
    ``heterogeneous``: the model's layers are split differently (it reads per-layer checkpoints only)."""
    optimizer_compat.install()
    folder = step_dir(Path(root), step)
    per_layer = saved_per_layer(folder)
    if not per_layer and heterogeneous:
        raise CheckpointError(f"{folder} stacks every decoder layer's tensors along one layer axis (a checkpoint "
                              "written before layers were keyed one by one), which a model whose layers are split "
                              "differently cannot read (parallel.primepar_layers). Fix: resume it under a layout with "
                              "parallel.primepar_layers=null, train one step and save, then switch.")
    _allocate_distributed_optimizer_state(optimizer)
    state = sharded_state(chunks, optimizer, is_loading=True, per_layer=per_layer)
    try:
        loaded = dist_checkpointing.load(state, str(folder))
    except _READ_ERRORS as err:
        raise _unreadable(folder, err) from err
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model"][f"chunk{i}"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        optimizer_compat.unshare_steps(optimizer)
    if scheduler is not None and loaded.get("scheduler") is not None:
        scheduler.load_state_dict(loaded["scheduler"])
    if int(loaded["step"]) != step:
        raise CheckpointError(f"{folder} holds step {loaded['step']}, expected {step}. Fix: check {LATEST}.")
    return dict(loaded.get("extra") or {})
