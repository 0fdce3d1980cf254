"""``python -m cfp_megatron.plan``: preflight planning (see :mod:`cfp_megatron.search.cli`)."""

import sys

from cfp_megatron.search.cli import main

sys.exit(main())
