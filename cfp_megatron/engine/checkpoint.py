"""Checkpoints with ``megatron.core.dist_checkpointing``: crash-safe saves, exact resume, any layout on load.

Layout of ``train.checkpoint_dir``::

    iter_0000010/        a complete dist_checkpointing checkpoint (model, optimizer, scheduler, step)
    iter_0000020/
    latest_checkpointed_iteration.txt   the newest complete step, replaced atomically

A save writes into ``iter_XXXXXXX.partial`` and renames it only after every rank has finished; the ``latest`` file
is replaced last with ``os.replace``. A crash mid-save therefore leaves the previous checkpoint and the ``latest``
pointer intact (the stale ``.partial`` folder is removed by the job's next save). Before the rename, rank 0 writes the
folder's manifest (:mod:`.manifest`); a resume verifies it before anything in the folder is unpickled. A folder is
owned by one job at a time (:mod:`.checkpoint_lock`); a save never removes a step folder or a ``.partial`` it did not
write, and a failed write on any rank is one CheckpointError on every rank (docs/checkpoints.md).
Weights are stored by their global keys,
so a checkpoint saved under one TP/PP/VPP/EP layout loads under another; the optimizer uses Megatron's
reshardable formats.
"""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.core import CheckpointingException

from cfp_megatron.base.config import DataKind, DataSpec, Precision, TokenizerKind
from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.base.files import NotRegularFileError, read_regular, write_error
from cfp_megatron.base.jsonio import json_plain
from cfp_megatron.compat import optimizer as optimizer_compat
from cfp_megatron.engine import checkpoint_lock, manifest, save_workers

LATEST = "latest_checkpointed_iteration.txt"
"""Name of the pointer file (as Megatron-LM names it)."""
KEY = checkpoint_lock.KEY
"""The setting naming the checkpoint folder."""


@dataclass(frozen=True, kw_only=True)
class Scheme:
    """How a backend names its step folders and its pointer file (the rules below are shared by both)."""

    backend: str
    """The backend, as messages name it."""
    folder: str
    """Format of a step folder's name, given the step (``iter_{:07d}``)."""
    pattern: str
    """Regular expression of a step folder's name; group 1 is the step (ASCII digits only)."""
    pointer: str
    """Name of the pointer file naming the newest complete step folder."""
    pointer_text: str
    """What the pointer file holds, given the step."""
    pointer_pattern: str
    """Regular expression of the pointer file's content (stripped); group 1 is the step."""
    choose: str
    """The setting that trains with this backend, as a fix names it."""
    state_differences: Callable[[dict[str, Any], dict[str, Any]], list[str]] | None = None
    """The differences between a checkpoint's saved training state and a resume's that stop the resume (``None``:
    :func:`state_differences`, every setting both record)."""

    def step_dir(self, root: Path, step: int) -> Path:
        """Folder of the checkpoint at ``step``."""
        return root / self.folder.format(step)

    def step_of(self, name: str) -> int | None:
        """The step a folder named ``name`` holds, when it is exactly this scheme's name for it (``iter_0000004``;
        not ``iter_4`` nor ``iter_00000004``, which :func:`near_misses` reports), else ``None``."""
        match = re.fullmatch(self.pattern, name, flags=re.ASCII)
        if match is None:
            return None
        step = int(match.group(1))
        return step if self.folder.format(step) == name else None


def state_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``<setting>: saved <a>, now <b>`` for each setting of a checkpoint's training state (``train.precision``)
    that both record and that differs."""
    return [f"{key}: saved {saved[key]!r}, now {now[key]!r}" for key in sorted(set(saved) & set(now))
            if saved[key] != now[key]]


MEGATRON = Scheme(backend="Megatron", folder="iter_{:07d}", pattern=r"iter_([0-9]+)", pointer=LATEST,
                  pointer_text="{}", pointer_pattern=r"([0-9]+)", choose="backend=megatron")
"""The Megatron backend's folders (Megatron-LM's names: seven digits, more from step 10,000,000)."""
DEEPSPEED_NAMES = Scheme(backend="DeepSpeed", folder="global_step{}", pattern=r"global_step([0-9]+)",
                         pointer="latest", pointer_text="global_step{}", pointer_pattern=r"global_step([0-9]+)",
                         choose="backend=deepspeed")
"""DeepSpeed's folder names (its backend adds its rules on the saved state:
:data:`cfp_megatron.backends.deepspeed.checkpoint.SCHEME`), known here to recognise its checkpoints in a folder
another backend is pointed at."""
SCHEMES = (MEGATRON, DEEPSPEED_NAMES)
"""Every backend's folder names."""


def training_state(precision: Precision | str, data: DataSpec | None = None) -> dict[str, Any]:
    """What a Megatron checkpoint's saved state depends on beyond the model, recorded by a save and compared by a
    resume: ``train.precision``, resolved (``auto`` is bf16 on GPUs, fp32 on CPU; the optimizer keeps fp32 main
    weights under bf16/fp16, none under fp32), and the tokenizer of ``data`` (:func:`tokenizer_state`)."""
    return {"train.precision": Precision(precision).value, **tokenizer_state(data)}


def tokenizer_state(data: DataSpec | None) -> dict[str, Any]:
    """``data.tokenizer`` of an indexed dataset: ``byte``, or ``huggingface:`` and the hash of its
    ``tokenizer.json``, so a resume under another tokenizer with a vocabulary of the same size (whose ids mean other
    tokens to the saved embeddings) is refused; nothing for synthetic data (no tokenizer) or a file that cannot be
    read (the data checks report it)."""
    if data is None or data.kind is not DataKind.indexed:
        return {}
    kind = data.tokenizer.value
    if data.tokenizer is not TokenizerKind.huggingface or data.tokenizer_path is None:
        return {"data.tokenizer": kind}
    try:
        return {"data.tokenizer": f"{kind}:{manifest.file_digest(Path(data.tokenizer_path))}"}
    except OSError:
        return {}


def step_dir(root: Path, step: int) -> Path:
    """Folder of the checkpoint at ``step``."""
    return MEGATRON.step_dir(root, step)


POINTER_LIMIT = 4096
"""Most bytes a pointer file holds (a step number, or DeepSpeed's tag)."""


def read_pointer(root: str | os.PathLike[str], scheme: Scheme = MEGATRON) -> int | None:
    """The step the pointer file names, ``None`` when there is no pointer file; a CheckpointError when it holds
    anything but a step in ASCII digits (``²`` and ``٣`` are digits to Python, not to the pointer) or names a
    folder that is missing."""
    pointer = Path(root) / scheme.pointer
    fix = (f"Fix: write the newest complete step into it (as {scheme.pointer_text.format('<step>')!r}), or remove "
           f"it (train.resume=true then resumes the newest step folder that verifies), or choose another {KEY}.")
    try:
        if pointer.is_dir():
            raise CheckpointError(f"{pointer} is a folder, not the pointer file. {fix}")
        raw = read_regular(pointer, POINTER_LIMIT)
    except FileNotFoundError:
        return None
    except NotRegularFileError as err:
        raise CheckpointError(f"{err.strerror} It is not the pointer file. {fix}") from None
    except OSError as err:
        raise CheckpointError(f"{pointer} cannot be read ({err.strerror or err}). {fix}") from None
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        text = None
    match = re.fullmatch(scheme.pointer_pattern, text, flags=re.ASCII) if text is not None else None
    if match is None:
        shown = raw.decode("utf-8", errors="backslashreplace").strip()[:60]
        raise CheckpointError(f"{pointer} holds {shown!r}, not a step "
                              f"({scheme.pointer_text.format('N')} in ASCII digits). {fix}")
    step = int(match.group(1))
    folder = scheme.step_dir(Path(root), step)
    if not folder.is_dir():
        raise CheckpointError(f"{pointer} names step {step} but {folder} is missing. Fix: restore that folder, or "
                              "write the newest complete step into the pointer file.")
    return step


def latest_step(root: str | os.PathLike[str]) -> int | None:
    """The step the pointer names (the newest complete checkpoint), or ``None`` when there is no pointer."""
    return read_pointer(root, MEGATRON)


def step_folders(root: str | os.PathLike[str], scheme: Scheme = MEGATRON) -> dict[int, Path]:
    """Every step folder under ``root`` by step (whatever the pointer says; ``.partial`` folders excluded)."""
    found = {}
    for path in _entries(root):
        step = scheme.step_of(path.name)
        if step is not None and path.is_dir():
            found[step] = path
    return dict(sorted(found.items()))


def _entries(root: str | os.PathLike[str]) -> list[Path]:
    """What ``root`` holds (nothing when it is not a readable folder: :func:`check_place` says why first)."""
    try:
        return sorted(Path(root).iterdir())
    except OSError:
        return []


def near_misses(root: str | os.PathLike[str], scheme: Scheme) -> list[str]:
    """Folders in ``root`` named like ``scheme``'s step folders but not exactly (``iter_4``, ``iter_00000004``,
    ``global_step04``): not checkpoints to this project (their step's folder has another name), said in the
    messages of a folder holding none."""
    prefix = scheme.folder.split("{")[0]
    return [p.name for p in _entries(root) if p.name.startswith(prefix) and p.is_dir()
            and re.fullmatch(scheme.pattern, p.name, flags=re.ASCII) and scheme.step_of(p.name) is None]


def _names(folders: dict[int, Path]) -> str:
    """The newest three step folders' names, and how many more."""
    shown = ", ".join(p.name for p in list(folders.values())[-3:])
    return shown + (f" and {len(folders) - 3} more" if len(folders) > 3 else "")


def _what_is_there(base: Path, scheme: Scheme) -> str:
    """Why a folder holding no checkpoint of ``scheme`` holds none, as far as it can be seen: missing, the other
    backend's checkpoints, step folders with odd names, unfinished saves (empty when nothing is there)."""
    if not base.exists():
        return f"; {base} does not exist"
    said = []
    for other in SCHEMES:
        theirs = step_folders(base, other) if other.backend != scheme.backend else {}
        if theirs:
            said.append(f"it holds {other.backend} checkpoints ({_names(theirs)}): resume those with {other.choose}")
    odd = near_misses(base, scheme)
    if odd:
        said.append(f"{', '.join(odd[:3])} {'is' if len(odd) == 1 else 'are'} named like a step folder but not as "
                    f"{scheme.backend} names them ({scheme.folder.format(4)} for step 4), so not read: rename "
                    "one to resume from it")
    partial = [p.name for p in _entries(base) if p.name.endswith(".partial") and p.is_dir()]
    if partial:
        said.append(f"{', '.join(partial[:3])}: unfinished save(s) (a job ended before publishing), which cannot "
                    "be resumed")
    return "".join(f"; {line}" for line in said)


def enclosing_step_folder(root: str | os.PathLike[str]) -> Path | None:
    """The step folder ``root`` is, or lies inside (a folder holding a manifest, or named as a step folder, or an
    unfinished one, in a folder holding that backend's pointer or a lock), else ``None``: a run saving there would
    add files to that checkpoint, which then fails its verification."""
    real = Path(os.path.realpath(root))
    for folder in (real, *real.parents):
        try:
            if (folder / manifest.MANIFEST).is_file():
                return folder
            for scheme in SCHEMES:
                name = folder.name.removesuffix(".partial")
                if scheme.step_of(name) is not None and ((folder.parent / scheme.pointer).exists()
                                                         or (folder.parent / checkpoint_lock.LOCK).exists()):
                    return folder
        except OSError:
            continue
    return None


def check_place(root: str | os.PathLike[str]) -> None:
    """Refuse a checkpoint folder that cannot be one whatever it holds: not a folder, a symbolic link to nothing
    or a loop, unreadable (:func:`.checkpoint_lock.folder_problem`), or inside another checkpoint's step folder
    (:func:`enclosing_step_folder`)."""
    problem = checkpoint_lock.folder_problem(root)
    if problem is not None:
        raise CheckpointError(f"{KEY}={str(root)!r}: {problem}. Fix: point {KEY} at a folder this user can read "
                              "and write (it is created when missing), or fix what is in its place.")
    inside = enclosing_step_folder(root)
    if inside is not None:
        parent = inside.parent
        where = "is" if inside == Path(os.path.realpath(root)) else "lies inside"
        raise CheckpointError(
            f"{KEY}={str(root)!r} {where} the step folder {inside} of the checkpoint folder {parent}: a run saving "
            f"there would add its files to that checkpoint, which would then fail its verification. Fix: to resume "
            f"from it, set {KEY}={str(parent)!r} with train.resume=true (and, for an older step than the newest, "
            f"write its step into the pointer file there); to start afresh, choose a folder outside {parent}.")


def recovery_fix(root: Path, folder: Path, scheme: Scheme = MEGATRON) -> str:
    """The ``Fix:`` of a checkpoint that fails verification: the previous step folder under ``root`` (what to
    write into ``scheme``'s pointer file to resume it), or a fresh run."""
    current = scheme.step_of(folder.name)
    earlier = [(s, p) for s, p in step_folders(root, scheme).items()
               if p != folder and (current is None or s < current)]
    fresh = "start afresh with train.resume=false and a new train.checkpoint_dir"
    if not earlier:
        return f"Fix: restore the folder from a copy, or {fresh} (no earlier checkpoint is in {root})."
    step, previous = earlier[-1]
    return (f"Fix: resume from the previous checkpoint, {previous}, instead (write "
            f"{scheme.pointer_text.format(step)!r} into {root / scheme.pointer}; it is verified in turn), or {fresh}.")


def verify_folder(root: str | os.PathLike[str], step: int, *, trust_unverified: bool,
                  scheme: Scheme = MEGATRON) -> bool:
    """Verify the checkpoint at ``step`` against its manifest before anything in it is loaded
    (:func:`.manifest.verify`); returns whether a manifest was there."""
    base = Path(root)
    folder = scheme.step_dir(base, step)
    return manifest.verify(folder, trust_unverified=trust_unverified, fix=recovery_fix(base, folder, scheme))


def verify_step(root: str | os.PathLike[str], step: int, *, trust_unverified: bool) -> bool:
    """:func:`verify_folder` for the Megatron backend's folders."""
    return verify_folder(root, step, trust_unverified=trust_unverified)


def save_steps(start: int, steps: int, save_interval: int | None) -> list[int]:
    """The steps a run from ``start`` to ``steps`` saves at (every ``save_interval`` steps, and the last one)."""
    every = [s for s in range(start + 1, steps + 1) if save_interval and s % save_interval == 0]
    return sorted({*every, steps}) if steps > start else []


MODEL_KEYS_FREE = frozenset({"name", "init_method_std", "hidden_dropout", "attention_dropout", "moe_aux_loss_coeff",
                             "moe_token_dispatcher", "mtp_loss_scaling_factor"})
"""ModelSpec fields a resume may change: they set how the model trains (dropout, loss weights, the MoE dispatcher),
or how it was initialised, or its label, not which weights it has."""


def model_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``model.<key>: saved <a>, now <b>`` for each ModelSpec field (as plain JSON) that differs, except
    :data:`MODEL_KEYS_FREE`."""
    return [f"model.{key}: saved {saved.get(key)!r}, now {now.get(key)!r}"
            for key in sorted(set(saved) | set(now))
            if key not in MODEL_KEYS_FREE and saved.get(key) != now.get(key)]


def _check_model(folder: Path, model: Any) -> None:
    saved = manifest.read_record(folder).get("model")
    if not isinstance(saved, dict) or model is None:
        return  # saved before manifests recorded the model: loads as it always did
    now = json_plain(model)
    differences = model_differences(saved, now)
    if differences:
        raise CheckpointError(
            f"{folder} was saved from another model than this run builds: {'; '.join(differences)}. A checkpoint "
            "resumes only into the model it was saved from (another layout, TP/PP/DP, is fine). Fix: resume with "
            f"the saved model (model={saved.get('name')} and its settings as saved), or start afresh with "
            f"train.resume=false and a new {KEY}.")


def check_state(folder: Path, scheme: Scheme, state: dict[str, Any] | None) -> None:
    """Refuse a resume from ``folder`` whose saved training state (the manifest's ``state``: the precision, and
    for DeepSpeed the ZeRO stage and data-parallel size) differs from ``state``, this run's, where the backend
    cannot load it (``scheme.state_differences``); checkpoints saved before the state was recorded load as before.
    Called before the start with what is known then, and again by the load with the plan's settings."""
    saved = manifest.read_record(folder).get("state")
    if not isinstance(saved, dict) or not state:
        return
    differences = (scheme.state_differences or state_differences)(saved, state)
    if differences:
        raise CheckpointError(
            f"{folder} was saved under other training settings than this run's: {'; '.join(differences)}. A "
            f"checkpoint resumes only under the settings its state depends on (the {scheme.backend} backend's "
            "optimizer state follows the precision, DeepSpeed's also its ZeRO stage and data-parallel size; the "
            "embeddings follow the tokenizer). Fix: resume with the saved values, or start afresh with "
            f"train.resume=false and a new {KEY}.")


def _newest_verified(root: Path, folders: dict[int, Path], scheme: Scheme, *, trust_unverified: bool,
                     note: Callable[[str], None] | None) -> int:
    """The newest step folder that verifies against its manifest, when the pointer file is missing; said in a
    note. A CheckpointError naming what is there when none does."""
    failed: list[str] = []
    for step in sorted(folders, reverse=True):
        try:
            manifest.verify(folders[step], trust_unverified=trust_unverified, fix="")
        except CheckpointError as err:
            failed.append(f"{folders[step].name}: {str(err).strip().rstrip(':.')}")
            continue
        if note is not None:
            skipped = f" (newer, failing verification: {'; '.join(failed)})" if failed else ""
            note(f"{root / scheme.pointer} is missing: resuming from {folders[step]}, the newest step folder that "
                 f"verifies against its manifest{skipped}.")
        return step
    raise CheckpointError(
        f"{KEY}={str(root)!r} has no {scheme.pointer} and none of its {len(folders)} step folder(s) verifies: "
        f"{'; '.join(failed[:3])}. Fix: restore a step folder (or the pointer file) from a copy; if you or your "
        "own job wrote a folder without a manifest, set train.trust_unverified_checkpoint=true; or start afresh "
        f"with train.resume=false and a new {KEY}.")


def check_folder(root: str | None, scheme: Scheme, *, resume: bool, restarted: bool, trust_unverified: bool,
                 steps: int | None = None, save_interval: int | None = None, model: Any = None,
                 state: dict[str, Any] | None = None, writer: str | None = None,
                 note: Callable[[str], None] | None = None) -> int | None:
    """Decide, before any process group exists, which step a run starts from; never overwrite a user's work
    (both backends, each with its :class:`Scheme`).

    The folder must be able to serve (:func:`check_place`: a readable folder or nothing yet, not inside another
    checkpoint's step folder). Every step folder counts, whatever the pointer says, and so does another backend's.
    A fresh run (``train.resume=false``) refuses a folder holding any, unless torchrun restarted this job's workers
    (then they are the job's own and it continues from them). A resume takes the step the pointer names, or without
    a pointer the newest folder that verifies (said in ``note``); a folder holding none says what it holds instead.
    The checkpoint is verified against its manifest here, before anything unpickles it (``trust_unverified``:
    accept one without a manifest), its recorded model compared with ``model`` and its training state with
    ``state`` (:func:`check_state`). With ``steps``, the folders the run would save into (:func:`save_steps`) must
    not exist unless this job wrote them (``writer``: the token of this job's lock, :mod:`.checkpoint_lock`)."""
    if root is None:
        return None
    base = Path(root)
    check_place(base)
    pointed = read_pointer(base, scheme) if base.is_dir() else None
    folders = step_folders(base, scheme)
    found: int | None = None
    if resume or restarted:
        if pointed is not None:
            found = pointed
            verify_folder(base, found, trust_unverified=trust_unverified, scheme=scheme)
            newer = [p.name for s, p in folders.items() if s > found]
            if newer and note is not None:
                note(f"{base / scheme.pointer} names step {found}, but newer step folders are there too "
                     f"({', '.join(newer)}): resuming from step {found}, as the pointer says (to resume from a newer "
                     "one, write its step into the pointer file).")
        elif folders:
            found = _newest_verified(base, folders, scheme, trust_unverified=trust_unverified, note=note)
        elif resume:
            raise CheckpointError(f"train.resume=true but {KEY}={root!r} holds no complete {scheme.backend} "
                                  f"checkpoint (no step folder, no {scheme.pointer}){_what_is_there(base, scheme)}. "
                                  f"Fix: point {KEY} at the folder an earlier run saved into, or set "
                                  "train.resume=false.")
    else:
        others = {o: found_ for o in SCHEMES if o.backend != scheme.backend and (found_ := step_folders(base, o))}
        if folders or pointed is not None or others:
            held = [(s, f) for s, f in ((scheme, folders), *others.items()) if f]
            names = "; ".join(f"{s.backend}: {_names(f)}" for s, f in held)
            said = f"; {scheme.pointer} names step {pointed}" if pointed is not None else f"; no {scheme.pointer}"
            other = next(iter(others), None)
            cont = ("set train.resume=true to continue" if other is None else
                    f"to continue, set train.resume=true (with {other.choose} for its {other.backend} checkpoints)")
            raise CheckpointError(f"{KEY}={root!r} already holds checkpoints ({names}{said}) and train.resume=false; "
                                  f"starting afresh would mix with or overwrite them. Fix: {cont}, or choose another "
                                  f"{KEY}.")
    if found is not None:
        _check_model(scheme.step_dir(base, found), model)
        check_state(scheme.step_dir(base, found), scheme, state)
    if steps is not None:
        for step in save_steps(found or 0, steps, save_interval):
            folder = scheme.step_dir(base, step)
            if os.path.lexists(folder) and (writer is None or manifest.read_record(folder).get("writer") != writer):
                raise CheckpointError(
                    f"{KEY}={root!r}: this run would save step {step} into {folder}, which is already there (newer "
                    f"than the step it starts from, {found or 0}); a save never replaces a step folder another run "
                    f"wrote. Fix: to continue from it, write {scheme.pointer_text.format(step)!r} into "
                    f"{base / scheme.pointer} (it is verified in turn); to train those steps again, move {folder} "
                    f"away; or choose another {KEY}.")
    return found


def check_before_start(root: str | None, *, resume: bool, restarted: bool, trust_unverified: bool = False,
                       steps: int | None = None, save_interval: int | None = None, model: Any = None,
                       state: dict[str, Any] | None = None, writer: str | None = None,
                       note: Callable[[str], None] | None = None) -> int | None:
    """:func:`check_folder` for the Megatron backend: the step to resume from, or ``None`` for a fresh start."""
    return check_folder(root, MEGATRON, resume=resume, restarted=restarted, trust_unverified=trust_unverified,
                        steps=steps, save_interval=save_interval, model=model, state=state, writer=writer,
                        note=note)


def nothing_left(root: str, found: int, steps: int) -> str:
    """The report of a resume whose checkpoint is already at or past ``train.steps``."""
    return (f"cfp: nothing to train: {KEY}={root!r} is at step {found} and train.steps={steps}. To train further, "
            f"set train.steps above {found} (with train.resume=true).")


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


def agree(problem: str | None) -> None:
    """Every rank raises one CheckpointError when any rank has a ``problem`` (the first rank's, by rank), so no
    rank waits in a collective for one that gave up; a no-op when every rank is fine."""
    problems: list[str | None] = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    first = next((p for p in problems if p), None)
    if first is not None:
        raise CheckpointError(first)


def prepare_save(base: Path, final: Path, scheme: Scheme) -> str | None:
    """Rank 0, before a save writes: make ``<final>.partial``; return why it cannot (``None``: it can). Unfinished
    saves (``*.partial``) are removed only while this job holds the folder's lock (they are its own, or a dead
    job's it took over; not those there before any job held it: :func:`.checkpoint_lock.kept_partials`); a step
    folder already there is kept unless this job wrote it (:func:`.manifest.publish`)."""
    partial = final.with_name(final.name + ".partial")
    writer = checkpoint_lock.held_token(base)
    try:
        base.mkdir(parents=True, exist_ok=True)
        if writer is not None:
            kept = checkpoint_lock.kept_partials(base)
            for stale in base.glob(scheme.folder.split("{")[0] + "*.partial"):
                if stale.name not in kept:
                    shutil.rmtree(stale, ignore_errors=True)
        if final.exists() and (writer is None or manifest.read_record(final).get("writer") != writer):
            return (f"saving step {final.name} into {KEY}={str(base)!r}: {final} is already there and was not "
                    f"written by this job; a save never replaces a step folder another run wrote. Fix: move {final} "
                    f"away, or choose another {KEY}, then resume with train.resume=true.")
        partial.mkdir()
    except FileExistsError:
        return (f"{partial} is already there: another job is saving into {KEY}={str(base)!r}, or one that died "
                f"left it (this job does not hold the folder's lock, {checkpoint_lock.LOCK}, so it is not removed). "
                f"Fix: if no other job writes there, remove {partial}; or choose another {KEY}.")
    except OSError as err:
        return str(write_error(err, partial, KEY))
    return None


def write_failed(err: BaseException, partial: Path, root: Path, rank: int) -> str:
    """The message of a save that failed while ranks wrote into ``partial``."""
    cause = err
    while not isinstance(cause, OSError) and cause.__cause__ is not None:
        cause = cause.__cause__
    if not isinstance(cause, OSError) and ("No space left" in str(err) or _nearly_full(root)):
        cause = OSError(errno.ENOSPC, "No space left on device")  # torch.save says "unexpected pos ..."
    text = str(write_error(cause, partial, KEY)) if isinstance(cause, OSError) else f"{type(err).__name__}: {err}"
    return (f"saving into {partial} failed on rank {rank}: {text[:400]} Nothing was published: the previous "
            f"checkpoint and its pointer are as they were, and the partial folder is removed. Resume with "
            f"train.resume=true once {root} can hold a checkpoint.")


def _nearly_full(folder: Path) -> bool:
    """Whether the file system holding ``folder`` has under 1 MiB (or 0.1%) free: a failed write there is a full
    disk whatever the writer's error says."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    free = st.f_bavail * st.f_frsize
    return free < max(1 << 20, st.f_blocks * st.f_frsize // 1000)


SAVE_ERRORS = (OSError, RuntimeError, ValueError, EOFError, pickle.PicklingError)
"""What a rank's writing of a checkpoint raises when the disk refuses (torch DCP wraps a rank's error in a
``CheckpointException``, a ``BaseException``: caught by name below)."""


def is_save_error(err: BaseException) -> bool:
    """Whether ``err`` is a failed write of a checkpoint (rather than a bug or an interrupt)."""
    return isinstance(err, SAVE_ERRORS) or type(err).__name__ == "CheckpointException"


def finish_save(partial: Path, final: Path, pointer: Path, text: str, record: dict[str, Any],
                error: BaseException | None) -> None:
    """After every rank wrote into ``partial`` (``error``: this rank's failure): agree; then rank 0 publishes; any
    failure removes ``partial`` and is raised on every rank as one CheckpointError."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    problem = write_failed(error, partial, final.parent, rank) if error is not None else None
    try:
        agree(problem)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    problem = None
    if rank == 0:
        renamed = False
        try:
            manifest.publish(partial, final, pointer, text, record)
        except (CheckpointError, OSError) as err:
            renamed = not partial.exists() and final.exists()
            problem = str(err) if isinstance(err, CheckpointError) else str(write_error(err, final, KEY))
            shutil.rmtree(partial, ignore_errors=True)
            if renamed and record.get("writer"):  # the pointer could not be written: this job's folder goes too
                shutil.rmtree(final, ignore_errors=True)
    agree(problem)


def save(root: str, step: int, chunks: list[torch.nn.Module], optimizer: Any, scheduler: Any,
         extra: dict[str, Any], *, model: Any = None, state: dict[str, Any] | None = None) -> Path:
    """Save a complete checkpoint for ``step`` from every rank; return its folder. The manifest records ``model``
    (the ModelSpec), the layout (``extra["layout"]``), the training ``state`` (:func:`training_state`) and this
    job's lock token. A failure on any rank (a full disk)
    is one CheckpointError on every rank, with the previous checkpoint and pointer intact and no partial folder."""
    base = Path(root)
    final = step_dir(base, step)
    partial = final.with_name(final.name + ".partial")
    rank = dist.get_rank() if dist.is_initialized() else 0
    agree(prepare_save(base, final, MEGATRON) if rank == 0 else None)
    sharded = sharded_state(chunks, optimizer, is_loading=False)
    sharded["step"] = step
    sharded["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    sharded["extra"] = extra
    error: BaseException | None = None
    try:
        with save_workers.tied_to_this_process():
            dist_checkpointing.save(sharded, str(partial))
    except BaseException as err:  # noqa: BLE001 - a failed write is agreed on below; anything else is re-raised
        if not is_save_error(err):
            raise
        error = err
    record = {"model": json_plain(model) if model is not None else None, "layout": extra.get("layout"),
              "writer": checkpoint_lock.held_token(base) if rank == 0 else None, "state": state}
    finish_save(partial, final, base / LATEST, f"{step}\n", record, error)
    return final


def _allocate_distributed_optimizer_state(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped yet its state tensors before a load: without Apex or
    Transformer Engine, Megatron-Core reads the step count from them while it builds the state to load into (its own
    Megatron-FSDP path does the same, with the same function). The values are replaced by the checkpoint's."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


_READ_ERRORS = (OSError, EOFError, RuntimeError, ValueError, KeyError, AttributeError, pickle.UnpicklingError,
                CheckpointingException)
"""What reading a damaged checkpoint raises (``CheckpointingException``: a folder that is no distributed
checkpoint, e.g. Megatron-LM's older ``mp_rank_*`` format); reached only by a folder loaded unverified
(``train.trust_unverified_checkpoint``) or changed after its check."""


def _unreadable(folder: Path, err: BaseException) -> CheckpointError:
    fix = recovery_fix(folder.parent, folder)
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
         heterogeneous: bool = False, state: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load the checkpoint at ``step`` into this rank's chunks, optimizer and scheduler; return its extra state.
    ``heterogeneous``: the model's layers are split differently (it reads per-layer checkpoints only); ``state``:
    this run's training state, which must be the saved one (:func:`check_state`)."""
    optimizer_compat.install()
    folder = step_dir(Path(root), step)
    check_state(folder, MEGATRON, state)
    per_layer = saved_per_layer(folder)
    if not per_layer and heterogeneous:
        raise CheckpointError(f"{folder} stacks every decoder layer's tensors along one layer axis (a checkpoint "
                              "written before layers were keyed one by one), which a model whose layers are split "
                              "differently cannot read (parallel.primepar_layers). Fix: resume it under a layout with "
                              "parallel.primepar_layers=null, train one step and save, then switch.")
    _allocate_distributed_optimizer_state(optimizer)
    sharded = sharded_state(chunks, optimizer, is_loading=True, per_layer=per_layer)
    try:
        loaded = dist_checkpointing.load(sharded, str(folder))
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
