"""The scale-out fabrics (``cluster.network``) as data: ``fabrics.yaml`` beside this module, each fabric's words (how
free text names it), its link rates by generation, the share of line rate NCCL's collectives reach on it and its
link latency, each with its source.

The simulator's network efficiency (``inter_node_comm`` in ``sim/efficiencies.json``) was fitted on InfiniBand
rows, so it already holds InfiniBand's share; another fabric's bandwidth is scaled by its share over InfiniBand's
(:func:`bandwidth_scale`: Omni-Path 0.34 / 0.85 = 0.40). A fabric without a measured share is priced as the
reference, and :attr:`Fabric.bus_share` is ``None`` so that a caller can say so.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cfp_megatron.base.config import Network
from cfp_megatron.base.errors import CfpError

FABRICS_FILE = Path(__file__).resolve().parent / "fabrics.yaml"
VERSION = 1
"""The format version ``fabrics.yaml`` states."""


class FabricDataError(CfpError, ValueError):
    """``fabrics.yaml`` cannot be read; the message names the file, the fabric and the fix."""


@dataclass(frozen=True, kw_only=True)
class Fabric:
    """One scale-out fabric (an entry of ``fabrics.yaml``)."""

    network: Network
    """Its ``cluster.network`` value."""
    words: tuple[str, ...]
    """Regular expressions (case-insensitive) that name it in free text."""
    link_gbps: dict[str, float]
    """Line rate of one link in Gb/s by the generation word that names it (upper case: ``HDR`` -> 200)."""
    default_link_gbps: float | None
    """Line rate where the text names the fabric but no generation or speed; ``None``: the preset's."""
    bus_share: float | None
    """Share of the links' line rate NCCL's large collectives reach; ``None``: not measured."""
    latency_us: dict[str, float]
    """One-way small-message link latency in microseconds by generation word (where a source states one)."""
    source: str
    """Where the figures come from."""

    def named_in(self, text: str) -> bool:
        """Whether ``text`` names this fabric."""
        return any(re.search(word, text, re.IGNORECASE) for word in self.words)

    def generation(self, text: str) -> str | None:
        """The generation word of :attr:`link_gbps` that ``text`` names (the longest: ``NDR200`` over ``NDR``)."""
        found = [name for name in self.link_gbps
                 if re.search(rf"\b{re.escape(name)}\b", text, re.IGNORECASE)]
        return max(found, key=len) if found else None


@dataclass(frozen=True, kw_only=True)
class Fabrics:
    """``fabrics.yaml``, loaded."""

    fabrics: tuple[Fabric, ...]
    """In the file's order: the first that a text names is the one it names."""
    reference: Fabric
    """The fabric the fitted network efficiency holds the share of."""

    def named_in(self, text: str) -> Fabric | None:
        """The first fabric that ``text`` names, or ``None``."""
        return next((fabric for fabric in self.fabrics if fabric.named_in(text)), None)

    def of(self, network: Network | None) -> Fabric:
        """The entry of ``network`` (the reference for ``None``)."""
        return next((fabric for fabric in self.fabrics if fabric.network is network), self.reference)

    def bandwidth_scale(self, network: Network | None) -> float:
        """Bandwidth on ``network`` relative to the reference fabric at the same line rate: the ratio of their
        :attr:`Fabric.bus_share`; 1.0 where either is not measured or ``network`` is ``None``."""
        share, reference = self.of(network).bus_share, self.reference.bus_share
        return share / reference if share and reference else 1.0


def _fail(path: Path, where: str, problem: str) -> FabricDataError:
    return FabricDataError(f"{path}: {where} {problem}. Fix: correct the file (its header says the format).")


def _figures(path: Path, name: str, key: str, raw: Any) -> dict[str, float]:
    figures = raw.values() if isinstance(raw, dict) else ()
    if not isinstance(raw, dict) or any(not isinstance(v, int | float) or v <= 0 for v in figures if v is not None):
        raise _fail(path, f"fabric {name!r}", f"has {key}={raw!r}, not a mapping of names to positive figures")
    return {str(k).upper(): float(v) for k, v in raw.items() if v is not None and str(k) != "default"}


@functools.lru_cache(maxsize=4)
def load_fabrics(path: Path = FABRICS_FILE) -> Fabrics:
    """``fabrics.yaml`` (or another file in its format); :class:`FabricDataError` for a file that does not read, a
    fabric that is not a ``cluster.network`` value, a pattern that does not compile, a figure that is not positive, an
    entry without a source, or a reference that is not one of the fabrics."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise FabricDataError(f"{path}: cannot be read as YAML ({err}). Fix: correct the file.") from None
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("fabrics"), list):
        raise _fail(path, "the file", f"states no 'version: {VERSION}' and 'fabrics:' list")
    fabrics = []
    for raw in data["fabrics"]:
        name = raw.get("name") if isinstance(raw, dict) else None
        try:
            network = Network(name)
        except ValueError:
            raise _fail(path, f"fabric {name!r}", f"is not a cluster.network value "
                        f"({', '.join(n.value for n in Network)})") from None
        words = raw.get("words")
        if not isinstance(words, list) or not words:
            raise _fail(path, f"fabric {name!r}", "lists no words")
        for word in words:
            try:
                re.compile(word)
            except (re.error, TypeError) as err:
                raise _fail(path, f"fabric {name!r}", f"has the word {word!r}, not a regular expression ({err})") \
                    from None
        share = raw.get("bus_share")
        if share is not None and not (isinstance(share, int | float) and 0 < share <= 1):
            raise _fail(path, f"fabric {name!r}", f"has bus_share={share!r}, not a share in (0, 1] or null")
        if not isinstance(raw.get("source"), str) or not raw["source"].strip():
            raise _fail(path, f"fabric {name!r}", "names no source")
        links = raw.get("link_gbps", {})
        default = links.get("default") if isinstance(links, dict) else None
        fabrics.append(Fabric(network=network, words=tuple(words), link_gbps=_figures(path, name, "link_gbps", links),
                              default_link_gbps=float(default) if default is not None else None,
                              bus_share=float(share) if share is not None else None,
                              latency_us=_figures(path, name, "latency_us", raw.get("latency_us", {})),
                              source=raw["source"].strip()))
    reference = next((fabric for fabric in fabrics if fabric.network.value == data.get("reference")), None)
    if reference is None:
        raise _fail(path, "the file", f"names the reference {data.get('reference')!r}, which is not one of its fabrics")
    return Fabrics(fabrics=tuple(fabrics), reference=reference)


@functools.lru_cache(maxsize=16)
def bandwidth_scale(network: Network | None) -> float:
    """The shipped fabrics' :meth:`Fabrics.bandwidth_scale` of ``network`` (cached: the cost model asks per layout)."""
    return load_fabrics().bandwidth_scale(network)
