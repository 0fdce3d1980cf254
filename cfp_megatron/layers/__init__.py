"""PrimePar spatial-temporal partitioned layers (../papers/NOTES.md 1.4): the 2^k x 2^k grid and its linear layer."""

from cfp_megatron.layers.errors import PrimeParError, PrimeParShapeError
from cfp_megatron.layers.primepar_grid import PrimeParGrid, RankOrder, new_grids, new_replica_groups
from cfp_megatron.layers.primepar_linear import PrimeParLinear

__all__ = ["PrimeParError", "PrimeParGrid", "PrimeParLinear", "PrimeParShapeError", "RankOrder", "new_grids",
           "new_replica_groups"]
