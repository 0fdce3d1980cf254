"""Train a Megatron-Core GPT model with a layout from Hydra; start it with torchrun.

    torchrun --nproc_per_node=4 launch/train.py parallel.tp=2 parallel.pp=2
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

# Megatron-Core warns at import that Transformer Engine/Apex are absent and that it falls back to PyTorch code;
# that is the expected state on CPU, so say it once in the README instead of eight times per rank.
_EXPECTED_ON_CPU = "Transformer Engine and Apex are not installed|Apex is not installed|full scope is deprecated"
warnings.filterwarnings("ignore", message=f".*({_EXPECTED_ON_CPU}).*")
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cfp_megatron.base.compose import register_configs  # noqa: E402
from cfp_megatron.planner.entry import main_with_errors  # noqa: E402

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    main_with_errors(cfg)


if __name__ == "__main__":
    # Megatron's TP/SP overlap relies on one CUDA work queue (as its own launch scripts set); harmless on CPU.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    # Every rank composes the same config; only rank 0 writes Hydra's files into the shared run directory.
    if os.environ.get("RANK", "0") != "0":
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    main()
