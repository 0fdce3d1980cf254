"""DeepSpeed checkpoints with the Megatron backend's guarantees (:mod:`cfp_megatron.engine.checkpoint`).

Layout of ``train.checkpoint_dir`` (DeepSpeed's own, so ``zero_to_fp32.py`` and ``engine.load_checkpoint`` read it)::

    global_step10/   a complete DeepSpeed checkpoint and its manifest (cfp_manifest.json)
    latest           the newest complete tag, replaced atomically

A save writes into ``global_stepN.partial`` (``engine.save_checkpoint(save_latest=False)``: DeepSpeed's own
``latest`` is written before the ranks agree that every shard is on disk), then rank 0, after a barrier, writes the
manifest, renames the folder and replaces ``latest`` last: a kill mid-save leaves the previous checkpoint current.
A resume verifies the manifest before any rank unpickles a file, and DeepSpeed's ``torch.load`` runs weights-only
(a checkpoint engine that allows only the few DeepSpeed classes its ZeRO states hold).
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

from cfp_megatron.base.errors import CheckpointError, ConfigError, ConfigIssue
from cfp_megatron.engine import manifest
from cfp_megatron.engine.checkpoint import recovery_fix

LATEST = "latest"
"""DeepSpeed's pointer file: the tag (folder name) of the newest complete checkpoint."""
_TAG = re.compile(r"global_step(\d+)")
_SAFE_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                 "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                 "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address")
"""The classes DeepSpeed's ZeRO optimizer states hold (found by loading stage 0-3 checkpoints weights-only)."""


def tag(step: int) -> str:
    """The folder (tag) of the checkpoint at ``step``."""
    return f"global_step{step}"


def latest_tag(root: str | os.PathLike[str]) -> str | None:
    """The newest complete checkpoint's tag, or ``None`` when the folder holds none."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text or "/" in text or text.startswith("."):
        raise CheckpointError(f"{pointer} holds {text!r}, not a checkpoint tag. Fix: restore the file (it names the "
                              "newest global_stepN folder) or point train.checkpoint_dir at another folder.")
    if not (Path(root) / text).is_dir():
        raise CheckpointError(f"{pointer} names {text} but {Path(root) / text} is missing. Fix: restore that "
                              "folder, or write the newest complete tag into the pointer file.")
    return text


def verify_tag(root: str | os.PathLike[str], name: str, *, trust_unverified: bool) -> bool:
    """Verify the checkpoint ``name`` against its manifest before anything in it is loaded."""
    base = Path(root)
    fix = recovery_fix(base, base / name, base / LATEST, _TAG.pattern, "global_step{}")
    return manifest.verify(base / name, trust_unverified=trust_unverified, fix=fix)


def check_before_start(root: str | None, *, resume: bool, restarted: bool, trust_unverified: bool) -> bool:
    """Whether to resume, decided before any process group exists, as the Megatron backend decides it:
    ``train.resume=true`` needs a complete checkpoint; a fresh run refuses a folder holding one unless torchrun
    restarted this job (then it is the job's own: it continues from it). The checkpoint is verified here."""
    if root is None:
        return False
    found = latest_tag(root) if Path(root).exists() else None
    if resume and found is None:
        raise CheckpointError(f"train.resume=true but train.checkpoint_dir={root!r} holds no complete DeepSpeed "
                              f"checkpoint ({LATEST} is missing). Fix: point train.checkpoint_dir at the folder an "
                              "earlier run saved into, or set train.resume=false.")
    if found is not None and not (resume or restarted):
        raise ConfigError(ConfigIssue(key="train.checkpoint_dir", value=root,
                                      problem=f"holds a DeepSpeed checkpoint ({found}), which this run would write "
                                              "over.",
                                      fix="set train.resume=true to continue it, or choose another folder."))
    if found is None:
        return False
    verify_tag(root, found, trust_unverified=trust_unverified)
    return True


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(engine: Any, root: str, step: int, client_state: dict[str, Any]) -> Path:
    """Save a complete checkpoint for ``step`` from every rank (see the module docstring); return its folder."""
    base = Path(root)
    final = base / tag(step)
    partial = final.with_name(final.name + ".partial")
    if _rank() == 0:
        base.mkdir(parents=True, exist_ok=True)
        for stale in base.glob("global_step*.partial"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier()
    engine.save_checkpoint(root, tag=partial.name, client_state=client_state, save_latest=False)
    _barrier()
    if _rank() == 0:
        manifest.publish(partial, final, base / LATEST, final.name)
    _barrier()
    return final


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


def load(engine: Any, root: str, *, trust_unverified: bool) -> tuple[str, int]:
    """Load the newest complete checkpoint (verified before the start) into ``engine``; return (folder, step)."""
    name = latest_tag(root)
    if name is None:
        raise CheckpointError(f"train.checkpoint_dir={root!r} holds no complete DeepSpeed checkpoint ({LATEST} is "
                              "missing). Fix: set train.resume=false, or point it at the folder a run saved into.")
    folder = Path(root) / name
    fix = recovery_fix(Path(root), folder, Path(root) / LATEST, _TAG.pattern, "global_step{}")
    engine.checkpoint_engine = _weights_only_engine(engine.checkpoint_engine, trust_unverified=trust_unverified)
    try:
        path, _ = engine.load_checkpoint(root, tag=name)
    except CheckpointError:
        raise
    except _READ_ERRORS as err:
        raise CheckpointError(f"{folder} cannot be loaded ({type(err).__name__}: {str(err)[:300]}). {fix}") from err
    if path is None:
        raise CheckpointError(f"DeepSpeed found no model states in {folder}. {fix}")
    step = engine.global_steps
    match = _TAG.fullmatch(name)
    if match is not None and int(match.group(1)) != step:
        raise CheckpointError(f"{folder} holds step {step}, its name says {match.group(1)}. {fix}")
    return str(path), step
