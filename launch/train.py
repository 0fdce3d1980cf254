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

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Megatron-Core warns at import, per module and rank, that Transformer Engine/Apex are absent: filter exactly those
# before it is imported and say it once (rank 0) in one line (cfp_megatron.compat.quiet).
from cfp_megatron.compat.quiet import quiet_expected_warnings, say_once  # noqa: E402

_EXPECTED_NOTE = quiet_expected_warnings()

from cfp_megatron.base.compose import register_configs  # noqa: E402
from cfp_megatron.base.cuda_env import set_runtime_env  # noqa: E402
from cfp_megatron.engine.rank_watch import tie_to_launcher  # noqa: E402
from cfp_megatron.planner.entry import check_run_dir_arg, main_with_errors  # noqa: E402
from cfp_megatron.planner.hydra_args import check_command_line  # noqa: E402

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    """Hydra entry point."""
    main_with_errors(cfg)


if __name__ == "__main__":
    tie_to_launcher()  # under torchrun: end with it (kill -9 leaves no orphan); Ctrl-C said in one line
    set_runtime_env()  # one CUDA work queue, expandable segments, where the user set neither; before CUDA starts
    say_once(_EXPECTED_NOTE)
    # Hydra's composition errors (a typo, ~model, cfp.tp without +cfp=...) once per node, exit 2, before Hydra runs
    check_command_line(sys.argv[1:])
    # Every rank composes the same config; only rank 0 writes Hydra's files into the shared run directory.
    if os.environ.get("RANK", "0") != "0":
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]
    check_run_dir_arg(sys.argv[1:])  # a run directory that cannot be written: a clean error, not Hydra's traceback
    main()
