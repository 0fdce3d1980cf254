"""The test package. Importing it (the test process, through tests/conftest.py; a spawned rank, when it unpickles a
test module's function) sets what every process of the tests shares before torch is imported."""

import os
import sys

# One OpenMP thread in the test process and every process it starts (the gloo spawns, the subprocesses), as the
# torchrun jobs have already: the tests' models are tiny, and a second thread per process only spins against the
# others on a 2-core machine (docs/testing.md, "Keeping the suite fast"). Set before torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported by a plugin before this file: its pool is sized already
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from cfp_megatron.compat.import_cost import import_megatron  # noqa: E402

# Megatron-Core, which most test files and the ranks they spawn import, imported once per process with its import
# costs cut (its heap then frozen out of the collector's sight: compat/import_cost.py).
import_megatron()
