"""The project's Hydra configs: the schema stored in Hydra's ConfigStore and composition from ``conf/``.

The frozen specs of :mod:`cfp_megatron.base.config` are the source of truth; the schema is their mutable twin plus the
planner's ``cfp`` group (:mod:`cfp_megatron.base.cfp_spec`) and the ``backend`` group
(:mod:`cfp_megatron.base.backend_spec`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import JobSchema, JobSpec, job_from_config, mutable_twin
from cfp_megatron.base.launch_env import run_id


def _root_schema() -> type:
    """The schema of the whole composed config: :data:`JobSchema`'s groups plus the planner's optional ``cfp`` group
    (``None`` unless a ``cfp`` option such as ``+cfp=auto`` is chosen)."""
    cfp = mutable_twin(CfpSpec, {})
    backend = mutable_twin(BackendSpec, {})
    extra = [(f.name, f.type, field(default_factory=f.default_factory)) for f in dataclasses.fields(JobSchema)]
    return dataclasses.make_dataclass("CfpRootSchema", [*extra, ("cfp", cfp | None, field(default=None)),
                                                        ("backend", backend, field(default_factory=backend))],
                                      kw_only=True)


def register_configs() -> None:
    """Store the schema in Hydra's ConfigStore (``conf/config.yaml`` lists ``cfp_schema`` first in its defaults)
    and register the ``cfp_run_id`` resolver used by ``hydra.run.dir``."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="cfp_schema", node=_root_schema())
    if not OmegaConf.has_resolver("cfp_run_id"):
        OmegaConf.register_new_resolver("cfp_run_id", run_id)


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
"""The project's Hydra config folder."""


def compose_config(overrides: Sequence[str]) -> Any:
    """The project's Hydra config composed with ``overrides`` (an OmegaConf ``DictConfig``), as the command-line
    tools (``analyze``, ``profile``, ``plan``) and the tests compose it."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=list(overrides))


def compose_job(overrides: Sequence[str]) -> JobSpec:
    """The job of :func:`compose_config`."""
    return job_from_config(compose_config(overrides))
