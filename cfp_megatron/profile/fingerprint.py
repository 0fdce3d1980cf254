"""The hardware and software a ProfileDB was measured on: what decides whether a later run may reuse it.

Kept: device model and count, nodes, devices per node, backend, torch / megatron-core / CUDA / NCCL versions (and on
CPU the logical core count, which sets GEMM speed). Left out on purpose: host name, time, paths.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from dataclasses import dataclass
from typing import Any

from cfp_megatron.base.config import JobSpec, resolve_precision
from cfp_megatron.base.jsonio import installed_version
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.model.layer_spec import keyed_model


@dataclass(frozen=True, kw_only=True)
class Fingerprint:
    """Hardware and software of one profiled cluster."""

    device_name: str
    """Accelerator model (``torch.cuda.get_device_name``), or the CPU model on CPU."""
    device_count: int
    """Ranks (devices) in the job."""
    nodes: int
    """Nodes in the job."""
    gpus_per_node: int
    """Ranks per node."""
    backend: str
    """torch.distributed backend (``nccl``, ``gloo``)."""
    torch: str
    """torch version."""
    megatron_core: str
    """megatron-core version (``absent`` when not installed)."""
    cuda: str | None = None
    """CUDA version torch was built with; ``None`` on CPU."""
    nccl: str | None = None
    """NCCL version; ``None`` without NCCL."""
    cpu_cores: int | None = None
    """Logical CPU cores of a node, recorded on CPU only (it sets matmul speed there)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Fingerprint:
        """Parse :meth:`to_json`'s output (unknown keys are an error)."""
        return cls(**data)

    @property
    def key(self) -> str:
        """Short stable hash: the DB's file name."""
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def current_fingerprint(*, world_size: int, nodes: int, backend: str) -> Fingerprint:
    """The fingerprint of this process's device and libraries for a job of ``world_size`` ranks on ``nodes``."""
    import torch

    on_gpu = torch.cuda.is_available()
    nccl = None
    if on_gpu and torch.distributed.is_nccl_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return Fingerprint(
        device_name=torch.cuda.get_device_name() if on_gpu else cpu_model(),
        device_count=world_size, nodes=nodes, gpus_per_node=max(world_size // max(nodes, 1), 1), backend=backend,
        torch=torch.__version__, megatron_core=installed_version("megatron-core"),
        cuda=torch.version.cuda if on_gpu else None, nccl=nccl,
        cpu_cores=None if on_gpu else os.cpu_count())


KEYED_WHEN_SET: dict[str, object] = {"window_size": None, "window_attn_skip_freq": None,
                                     "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False,
                                     "activation_clamp": None, "moe_router_fp32": True,
                                     "moe_router_fusion": False}
"""Model fields added after profiles were stored, with their defaults: they enter :func:`model_key` only when set
to something else, so a model that does not use them keeps the key (and the profile) it had before they existed. A
new model field goes here."""


def model_key(job: JobSpec, *, on_gpu: bool) -> str:
    """Key of what segment times depend on: model shape, sequence length, precision (an FP8/FP4 job's format with
    its recipe: its segments run their GEMMs in it, so bf16 timings are not reused for it)."""
    model = keyed_model(job.model)  # with model.spec: its identity (the custom layer's structure and source)
    model.pop("mtp_loss_scaling_factor")  # a loss weight times nothing (and profiles from before it keep their key)
    for name, default in KEYED_WHEN_SET.items():
        if model[name] == default:
            model.pop(name)
    fmt = NumberFormat.of(job.train)
    payload = {"model": model, "seq_length": job.train.seq_length,
               "precision": fmt.name if fmt.low else resolve_precision(job.train.precision, on_gpu).value}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
