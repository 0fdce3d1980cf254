"""Recorded ProfileDBs seeded into a test's cache, so that a launch with ``+cfp=auto`` finds its profile instead of
measuring it for minutes (docs/testing.md, "Seeded ProfileDBs").

``tests/data/profile_gpt_tiny_4ranks_cpu.json`` is a complete profile of gpt_tiny (seq_length 64, fp32) on 4 gloo
ranks of this project's 2-core CPU machine (every round of ``+cfp=auto`` with ``cfp.profile_budget_s`` large enough,
2026-11-28; its plan checks left out). A DB is stored under the fingerprint of the machine it was measured on
(:mod:`cfp_megatron.profile.fingerprint`) and its records under the job's model key, so :func:`seed_profile_db`
writes it under this machine's fingerprint for the job's world and nodes and the job's model key: the launch then
reads it as its own. Left out records (``drop``) are what the launch still profiles.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from cfp_megatron.base.config import JobSpec
from cfp_megatron.profile.db import ProfileDB
from cfp_megatron.profile.fingerprint import current_fingerprint, model_key

RECORDED = Path(__file__).resolve().parent / "data" / "profile_gpt_tiny_4ranks_cpu.json"
"""A real profile of gpt_tiny on 4 gloo ranks; it holds every entry a 2-rank job of the same model needs too."""


def seed_profile_db(cache: Path, job: JobSpec, *, world: int, nodes: int = 1,
                    drop: Callable[[str, dict], bool] | None = None) -> Path:
    """Write :data:`RECORDED` as the ProfileDB of ``job`` on ``world`` ranks over ``nodes`` of this machine into
    ``cache`` (``CFP_CACHE_DIR``), without the records ``drop(section, record)`` picks; return its path."""
    data = json.loads(RECORDED.read_text())
    fingerprint = current_fingerprint(world_size=world, nodes=nodes, backend="gloo")
    key = model_key(job, on_gpu=False)
    data["fingerprint"], data["fingerprint_key"] = fingerprint.to_json(), fingerprint.key
    for section in ("collectives", "gemms", "segments", "overheads", "rounds"):
        kept = [r for r in data[section] if drop is None or not drop(section, r)]
        data[section] = [{**r, "model": key} if r.get("model") else r for r in kept]
    db = ProfileDB.from_json(data, source=RECORDED)
    path = cache / "profile" / f"{fingerprint.key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(db.to_json(), indent=1))
    return path
