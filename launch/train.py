"""Train a Megatron-Core GPT model with a layout from Hydra; start it with torchrun.

    torchrun --nproc_per_node=4 launch/train.py parallel.tp=2 parallel.pp=2
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cfp_megatron.config import register_configs  # noqa: E402
from cfp_megatron.runtime.entry import main_with_errors  # noqa: E402

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    main_with_errors(cfg)


if __name__ == "__main__":
    # Every rank composes the same config; only rank 0 writes Hydra's files into the shared run directory.
    if os.environ.get("RANK", "0") != "0":
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    main()
