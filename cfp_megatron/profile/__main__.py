"""``torchrun --nproc_per_node=N -m cfp_megatron.profile``: see :mod:`cfp_megatron.profile.cli`."""

import sys

from cfp_megatron.profile.cli import main

if __name__ == "__main__":
    sys.exit(main())
