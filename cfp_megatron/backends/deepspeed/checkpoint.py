"""DeepSpeed checkpoints with the Megatron backend's guarantees (:mod:`cfp_megatron.engine.checkpoint`).

Layout of ``train.checkpoint_dir`` (DeepSpeed's own, so ``zero_to_fp32.py`` and ``engine.load_checkpoint`` read it)::

    global_step10/   a complete DeepSpeed checkpoint and its manifest (cfp_manifest.json)
    latest           the newest complete tag, replaced atomically

A save writes into ``global_stepN.partial`` (``engine.save_checkpoint(save_latest=False)``: DeepSpeed's own
``latest`` is written before the ranks agree that every shard is on disk), then rank 0, after a barrier, writes the
manifest, renames the folder and replaces ``latest`` last: a kill mid-save leaves the previous checkpoint current.
A resume verifies the manifest before any rank unpickles a file, and DeepSpeed's ``torch.load`` runs weights-only
(a checkpoint engine that allows only the few DeepSpeed classes its ZeRO states hold). Which step a run starts
from, the folder lock, the model check and a failed save follow the Megatron backend's rules, on these names
(:data:`SCHEME`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cfp_megatron.base.config import DataSpec, Precision
from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.base.jsonio import json_plain
from cfp_megatron.engine import checkpoint_lock, manifest
from cfp_megatron.engine.checkpoint import (
    DEEPSPEED_NAMES,
    agree,
    check_folder,
    check_state,
    finish_save,
    is_save_error,
    prepare_save,
    read_pointer,
    recovery_fix,
    state_differences,
)
from cfp_megatron.engine.checkpoint import training_state as megatron_training_state

LATEST = DEEPSPEED_NAMES.pointer
"""DeepSpeed's pointer file: the tag (folder name) of the newest complete checkpoint."""
STAGE = "backend.zero_stage"
"""The setting of the ZeRO stage, as a checkpoint's training state records it."""
DP = "data_parallel_size"
"""Key of the data-parallel size (every rank: the DeepSpeed backend has no model parallelism) in that state."""


def zero_family(stage: int) -> str:
    """Which ZeRO stages share a checkpoint's optimizer-state form: 0 (the optimizer's own), 1-2 (the partitioned
    fp32 states, read by either), 3 (parameters partitioned too)."""
    return "0" if stage == 0 else "3" if stage == 3 else "1-2"


def zero_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What stops DeepSpeed 0.19 loading a checkpoint saved under ``saved`` (:func:`training_state`) into a run
    under ``now``: another precision (bf16 keeps its states in other files), a ZeRO stage of another family
    (:func:`zero_family`), or, from stage 1 up (partitioned states), another data-parallel size (DeepSpeed: "not
    currently supported"; its universal checkpoints are not written here)."""
    out = state_differences({k: v for k, v in saved.items() if k not in (STAGE, DP)},
                            {k: v for k, v in now.items() if k not in (STAGE, DP)})
    was, will = saved.get(STAGE), now.get(STAGE)
    if isinstance(was, int) and isinstance(will, int) and zero_family(was) != zero_family(will):
        out.append(f"{STAGE}: saved {was}, now {will} (ZeRO {zero_family(was)} and {zero_family(will)} keep the "
                   "optimizer's state in different forms)")
    ranks, now_ranks = saved.get(DP), now.get(DP)
    if isinstance(was, int) and was >= 1 and ranks is not None and now_ranks is not None and ranks != now_ranks:
        out.append(f"data-parallel ranks: saved {ranks}, now {now_ranks} (ZeRO stage {was} partitioned the "
                   f"optimizer's state over {ranks} ranks: resume with {ranks})")
    return out


SCHEME = dataclasses.replace(DEEPSPEED_NAMES, state_differences=zero_differences)
"""DeepSpeed's folder names; the rules on them are the Megatron backend's (:func:`.checkpoint.check_folder`), and
its saved state's are :func:`zero_differences`."""


def training_state(precision: Precision | str, zero_stage: int | None, ranks: int | None,
                   data: DataSpec | None = None) -> dict[str, Any]:
    """What a DeepSpeed checkpoint's saved state depends on, recorded by a save and compared by a resume: the
    Megatron backend's (:func:`.checkpoint.training_state`: precision, tokenizer), the ZeRO stage and the
    data-parallel size (each left out where not known yet: a stage the search will choose)."""
    state = megatron_training_state(precision, data)
    if zero_stage is not None:
        state[STAGE] = zero_stage
    if ranks is not None:
        state[DP] = ranks
    return state
_TAG = re.compile(SCHEME.pattern, flags=re.ASCII)
_SAFE_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                 "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                 "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address")
"""The classes DeepSpeed's ZeRO optimizer states hold (found by loading stage 0-3 checkpoints weights-only)."""


def tag(step: int) -> str:
    """The folder (tag) of the checkpoint at ``step``."""
    return f"global_step{step}"


def latest_tag(root: str | os.PathLike[str]) -> str | None:
    """The tag the pointer names (the newest complete checkpoint), or ``None`` when there is no pointer."""
    step = read_pointer(root, SCHEME)
    return None if step is None else tag(step)


def verify_tag(root: str | os.PathLike[str], name: str, *, trust_unverified: bool) -> bool:
    """Verify the checkpoint ``name`` against its manifest before anything in it is loaded."""
    base = Path(root)
    fix = recovery_fix(base, base / name, SCHEME)
    return manifest.verify(base / name, trust_unverified=trust_unverified, fix=fix)


def check_before_start(root: str | None, *, resume: bool, restarted: bool, trust_unverified: bool,
                       steps: int | None = None, save_interval: int | None = None, model: Any = None,
                       state: dict[str, Any] | None = None, writer: str | None = None,
                       note: Callable[[str], None] | None = None) -> int | None:
    """The step to resume from (``None``: a fresh start), decided before any process group exists by the Megatron
    backend's rules (:func:`.checkpoint.check_folder`) on DeepSpeed's folder names and saved state."""
    return check_folder(root, SCHEME, resume=resume, restarted=restarted, trust_unverified=trust_unverified,
                        steps=steps, save_interval=save_interval, model=model, state=state, writer=writer,
                        note=note)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save(engine: Any, root: str, step: int, client_state: dict[str, Any], *, model: Any = None,
         state: dict[str, Any] | None = None) -> Path:
    """Save a complete checkpoint for ``step`` from every rank (see the module docstring); return its folder. A
    failure on any rank (a full disk) is one CheckpointError on every rank, the previous checkpoint current."""
    base = Path(root)
    final = base / tag(step)
    partial = final.with_name(final.name + ".partial")
    agree(prepare_save(base, final, SCHEME) if _rank() == 0 else None)
    error: BaseException | None = None
    try:
        engine.save_checkpoint(root, tag=partial.name, client_state=client_state, save_latest=False)
    except BaseException as err:  # noqa: BLE001 - a failed write is agreed on below; anything else is re-raised
        if not is_save_error(err):
            raise
        error = err
        # DeepSpeed 0.19's save_checkpoint ends with a barrier the other ranks wait in: join it before agreeing.
        if dist.is_initialized():
            dist.barrier()
    record = {"model": json_plain(model) if model is not None else None, "layout": client_state.get("plan"),
              "writer": checkpoint_lock.held_token(base) if _rank() == 0 else None, "state": state}
    finish_save(partial, final, base / LATEST, final.name, record, error)
    return final


def saved_state(root: str | os.PathLike[str], step: int) -> dict[str, Any]:
    """The training state the checkpoint at ``step`` recorded (:func:`training_state`; empty for checkpoints saved
    before it was recorded)."""
    state = manifest.read_record(Path(root) / tag(step)).get("state")
    return state if isinstance(state, dict) else {}


def _weights_only_engine(current: Any, *, trust_unverified: bool) -> Any:
    """DeepSpeed's torch checkpoint engine with ``torch.load(weights_only=True)`` (``current`` itself when it is
    another kind of engine: Nebula, fast, decoupled)."""
    import importlib

    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if type(current) is not TorchCheckpointEngine or trust_unverified:
        return current
    allowed = []
    for name in _SAFE_GLOBALS:
        module, _, attr = name.rpartition(".")
        found = getattr(importlib.import_module(module), attr, None)
        if found is not None:
            allowed.append(found)

    class WeightsOnlyCheckpointEngine(TorchCheckpointEngine):
        """Loads with ``torch.load(weights_only=True)``, allowing only DeepSpeed's ZeRO state classes."""

        def load(self, path: str, map_location: Any = None) -> Any:
            with torch.serialization.safe_globals(allowed):
                try:
                    return torch.load(path, map_location=map_location, weights_only=True)
                except pickle.UnpicklingError as err:
                    raise CheckpointError(
                        f"{path} holds an object the weights-only loader refuses ({str(err).splitlines()[0]}). "
                        "Fix: if you or your own job wrote this folder (e.g. with another DeepSpeed version), set "
                        "train.trust_unverified_checkpoint=true to unpickle it in full.") from None

    engine = WeightsOnlyCheckpointEngine(None)
    engine.zipfile_serialization = current.zipfile_serialization
    return engine


_READ_ERRORS = (OSError, EOFError, RuntimeError, ValueError, KeyError, AttributeError, pickle.UnpicklingError)


def load(engine: Any, root: str, *, trust_unverified: bool, step: int | None = None,
         state: dict[str, Any] | None = None) -> tuple[str, int]:
    """Load the checkpoint at ``step`` (decided and verified before the start: :func:`check_before_start`; default
    the one the pointer names) into ``engine``; return (folder, step). ``state``: this run's training state
    (:func:`training_state` of its plan), which DeepSpeed must be able to load the saved one into."""
    name = tag(step) if step is not None else latest_tag(root)
    if name is None:
        raise CheckpointError(f"train.checkpoint_dir={root!r} holds no complete DeepSpeed checkpoint ({LATEST} is "
                              "missing). Fix: set train.resume=false, or point it at the folder a run saved into.")
    folder = Path(root) / name
    check_state(folder, SCHEME, state)
    fix = recovery_fix(Path(root), folder, SCHEME)
    engine.checkpoint_engine = _weights_only_engine(engine.checkpoint_engine, trust_unverified=trust_unverified)
    try:
        path, _ = engine.load_checkpoint(root, tag=name)
    except CheckpointError:
        raise
    except _READ_ERRORS as err:
        raise CheckpointError(f"{folder} cannot be loaded ({type(err).__name__}: {str(err)[:300]}). {fix}") from err
    if path is None:
        raise CheckpointError(f"DeepSpeed found no model states in {folder}. {fix}")
    saved = engine.global_steps
    match = _TAG.fullmatch(name)
    if match is not None and int(match.group(1)) != saved:
        raise CheckpointError(f"{folder} holds step {saved}, its name says {match.group(1)}. {fix}")
    return str(path), saved
