"""The hardware presets of ``conf/cluster`` and the names their accelerators go by.

Each preset states what its accelerator is as data (``generation``, ``supports_tp_overlap``, ``number_formats``,
``nvlink_domain_size``) and ``aliases``, the names published tables give it; :func:`preset_for_gpu` maps such a name
to its preset, the longest alias contained winning (``GB300`` over ``B300``, ``H100 NVL`` over ``H100``);
:func:`preset_for_device` does the same for a device's own name and lets its memory size pick between the variants
a bare name leaves open (``A100`` of 40 or 80 GB). Nothing here guesses from substrings of a device name: a name no
alias covers has no preset.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from cfp_megatron.base.compose import group_presets

IDENTITY_KEYS: tuple[str, ...] = ("generation", "supports_tp_overlap", "number_formats", "aliases")
"""The keys of a preset that say what its accelerator is (the others are its figures)."""


def cluster_preset_names() -> list[str]:
    """The presets of ``conf/cluster`` (``dgx_h100``, ``local``, ...), sorted."""
    return [name for name, _ in group_presets("cluster")]


def cluster_preset(name: str) -> dict[str, Any]:
    """Preset ``name``'s YAML as a plain dict (a copy: the caller may change it); ``KeyError`` for an unknown name."""
    for found, values in group_presets("cluster"):
        if found == name:
            return copy.deepcopy(values)
    raise KeyError(f"no cluster preset {name!r} (known: {', '.join(cluster_preset_names())})")


def squashed(name: str) -> str:
    """``name`` as aliases are compared: upper case, without spaces or punctuation (``H100-SXM5 80GB`` ->
    ``H100SXM580GB``)."""
    return re.sub(r"[^0-9A-Z]", "", name.upper())


def _alias_at(text: str, key: str) -> int:
    """Where the squashed alias ``key`` is in ``text`` (upper case, punctuation kept), spaces and punctuation between
    its characters allowed, or -1; a model number is whole: an alias ending in a digit is not found where the name
    goes on with digits (``A100`` is not in ``RTX A1000``, nor ``H100`` in ``H1000``)."""
    if not key:
        return -1
    pattern = "[^0-9A-Z]*".join(map(re.escape, key)) + ("(?![0-9])" if key[-1].isdigit() else "")
    found = re.search(pattern, text)
    return len(squashed(text[:found.start()])) if found else -1


def _best_alias(name: str) -> tuple[str, str] | None:
    """(preset, squashed alias) of :func:`preset_for_gpu`'s answer for ``name``; ``None`` where no alias is
    contained (:func:`_alias_at`)."""
    text = name.upper()
    best: tuple[int, int, str, str] | None = None
    for preset, values in group_presets("cluster"):
        for alias in values.get("aliases") or ():
            key = squashed(str(alias))
            at = _alias_at(text, key)
            if at >= 0 and (best is None or (-len(key), at) < best[:2]):
                best = (-len(key), at, preset, key)
    return (best[2], best[3]) if best is not None else None


def preset_for_gpu(name: str) -> str | None:
    """The preset whose GPU ``name`` (a published table's ``gpu`` column, a device name) names: of the presets with
    an alias that ``name`` contains as a whole model number (:func:`_alias_at`), the one with the longest such alias
    (so ``GB300`` wins over ``B300``, ``H100 NVL`` over ``H100``, ``A100 40GB`` over ``A100``), then the alias found
    first in ``name``; ``None`` where no alias is contained."""
    found = _best_alias(name)
    return found[0] if found is not None else None


def preset_for_device(device_name: str, memory_gib: float) -> str | None:
    """The preset of an accelerator as the device reports itself (torch's ``NVIDIA H100 80GB HBM3``,
    ``NVIDIA A100-SXM4-40GB``, ``AMD Instinct MI300X``) with ``memory_gib`` of memory: :func:`preset_for_gpu`'s, where
    the name is as specific as its aliases; where the alias it matched also lies inside other presets' aliases (a
    bare ``A100`` inside ``A100-40GB``, ``H100`` inside ``H100 NVL``), the name leaves the variant open and the
    memory decides: of those presets, the one whose ``hbm_gib`` is nearest ``memory_gib`` (ties: the alias
    lookup's). ``None`` where no alias is contained."""
    found = _best_alias(device_name)
    if found is None:
        return None
    preset, key = found
    variants = [(abs(float(values["hbm_gib"]) - memory_gib), name != preset, name)
                for name, values in group_presets("cluster")
                if values.get("hbm_gib") is not None
                and any(key in squashed(str(alias)) for alias in values.get("aliases") or ())]
    return min(variants)[2] if variants else preset


def known_gpus() -> list[str]:
    """Each preset's first alias (the name it is best known by), in preset order: what an unknown GPU is told."""
    return [str(values["aliases"][0]) for _, values in group_presets("cluster") if values.get("aliases")]


def identity(preset: dict[str, Any] | None) -> dict[str, Any]:
    """The :data:`IDENTITY_KEYS` of a preset's YAML (copies), each ``None`` where the preset (or ``preset``) has
    none: what a cluster takes over when it learns which accelerator it runs on."""
    values = preset or {}
    return {key: copy.deepcopy(values.get(key)) for key in IDENTITY_KEYS}
