"""Profiling rounds on the live cluster and the ProfileDB they fill.

- :mod:`~cfp_megatron.profile.db`: the versioned JSON ProfileDB keyed by a hardware/software
  :mod:`~cfp_megatron.profile.fingerprint`; implements :class:`~cfp_megatron.cluster.measured.Measurements`.
- :mod:`~cfp_megatron.profile.runner`: one run under torchrun (rounds in :mod:`.collectives`, :mod:`.gemm`,
  :mod:`.segments`, kept in step by :mod:`.control`).
- :mod:`~cfp_megatron.profile.cluster`: a ``ClusterSpec`` with the measured figures.
- ``torchrun --nproc_per_node=N -m cfp_megatron.profile``: the command (:mod:`.cli`).
"""
