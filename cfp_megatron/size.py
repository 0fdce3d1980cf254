"""``python -m cfp_megatron.size``: sizing clusters for a token budget (see :mod:`cfp_megatron.planner.size_cli`)."""

import sys

from cfp_megatron.planner.size_cli import main

if __name__ == "__main__":
    sys.exit(main())
