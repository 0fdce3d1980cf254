"""A disk cache of capture summaries, keyed by a hash of everything the capture depends on.

Key: the model spec (or ``TransformerConfig`` fields), sequence length, micro-batch size, precision, the summary
schema version and the torch and megatron-core versions. Value: :class:`~cfp_megatron.model.summary.CaptureSummary`
JSON (per-kind counts and operator lists, not live ``OpGraph`` objects) under ``$CFP_CACHE_DIR/capture/`` (default
``~/.cache/cfp-megatron/capture/``). Writes are atomic (temporary file + rename), so concurrent ranks never read a
half-written entry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cfp_megatron.base.config import JobSpec, Precision
from cfp_megatron.base.files import CACHE_KEY, cache_dir, write_atomic
from cfp_megatron.base.jsonio import installed_version, json_plain
from cfp_megatron.model.layer_spec import keyed_model
from cfp_megatron.model.summary import SCHEMA_VERSION, CaptureSummary


def cache_key(inputs: dict[str, Any]) -> str:
    """SHA-256 of ``inputs`` plus the schema and library versions."""
    payload = {"inputs": json_plain(inputs), "schema": SCHEMA_VERSION, "torch": installed_version("torch"),
               "megatron": installed_version("megatron-core")}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def job_cache_inputs(job: JobSpec, *, seq_length: int, micro_batch_size: int,
                     precision: Precision | None = None) -> dict[str, Any]:
    """What a capture of ``job`` depends on (with ``model.spec``, its identity: the path and a hash of the spec's
    structure and source, :func:`~cfp_megatron.model.layer_spec.spec_identity`)."""
    return {"model": keyed_model(job.model), "seq_length": seq_length, "micro_batch_size": micro_batch_size,
            "precision": (precision or job.train.precision).value}


def load_json(key: str, *, section: str = "capture") -> Any | None:
    """The JSON stored under ``key`` in ``section`` (``capture``, ``analysis``), or ``None`` (also when unreadable)."""
    try:
        with (cache_dir() / section / f"{key}.json").open() as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def store_json(key: str, data: Any, *, section: str = "capture") -> Path:
    """Write ``data`` as JSON under ``key`` in ``section`` atomically (temporary file + rename); return the file."""
    return write_atomic(cache_dir() / section / f"{key}.json", json.dumps(data, separators=(",", ":")), key=CACHE_KEY)


def load(key: str) -> CaptureSummary | None:
    """The cached summary for ``key``, or ``None`` (also for an unreadable entry)."""
    data = load_json(key)
    try:
        return CaptureSummary.from_json(data) if data is not None else None
    except (ValueError, KeyError, TypeError):
        return None


def store(key: str, summary: CaptureSummary) -> Path:
    """Write ``summary`` under ``key``; return the file."""
    return store_json(key, summary.to_json())


def cached_summary(inputs: dict[str, Any], make: Callable[[], CaptureSummary], *,
                   use_cache: bool = True) -> CaptureSummary:
    """The summary stored under the key of ``inputs``, else ``make()`` (then stored)."""
    key = cache_key(inputs)
    if use_cache:
        found = load(key)
        if found is not None:
            return found
    summary = make()
    store(key, summary)
    return summary


def capture_summary(job: JobSpec, *, seq_length: int | None = None, micro_batch_size: int = 1,
                    precision: Precision | None = None, use_cache: bool = True) -> CaptureSummary:
    """The capture summary of ``job``, from the cache when present, else captured (and stored)."""

    from cfp_megatron.model.capture import capture_job

    seq = seq_length or job.train.seq_length

    def make() -> CaptureSummary:
        return capture_job(job, seq_length=seq, micro_batch_size=micro_batch_size, precision=precision).summary()

    inputs = job_cache_inputs(job, seq_length=seq, micro_batch_size=micro_batch_size, precision=precision)
    return cached_summary(inputs, make, use_cache=use_cache)


def config_summary(config: Any, *, vocab_size: int, seq_length: int, micro_batch_size: int = 1,
                   use_cache: bool = True, **kwargs: Any) -> CaptureSummary:
    """:func:`~cfp_megatron.model.capture.capture_transformer_config`'s summary, cached by the config's fields."""

    from cfp_megatron.model.capture import capture_transformer_config

    def make() -> CaptureSummary:
        return capture_transformer_config(config, vocab_size=vocab_size, seq_length=seq_length,
                                          micro_batch_size=micro_batch_size, **kwargs).summary()

    inputs = {"config": config, "vocab_size": vocab_size, "seq_length": seq_length,
              "micro_batch_size": micro_batch_size, "kwargs": kwargs}
    return cached_summary(inputs, make, use_cache=use_cache)
