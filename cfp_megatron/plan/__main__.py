"""``python -m cfp_megatron.plan``: preflight planning (see :mod:`cfp_megatron.planner.plan_cli`)."""

import sys

from cfp_megatron.planner.plan_cli import main

sys.exit(main())
