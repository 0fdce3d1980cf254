"""The project's enumerations hash by identity (cfp_megatron.base.enums)."""

from __future__ import annotations

import copy
import pickle

from cfp_megatron.base.config import FsdpStrategy, MlpPartition, Recompute, RecomputeModule
from cfp_megatron.base.enums import IdentityEnum
from cfp_megatron.sim.options import PipelineSchedule


def test_a_member_keys_a_dict_and_a_set_as_the_same_member_does_after_a_copy_and_a_pickle() -> None:
    for enum_class in (Recompute, RecomputeModule, MlpPartition, FsdpStrategy, PipelineSchedule):
        assert issubclass(enum_class, IdentityEnum)
        for member in enum_class:
            table = {(member, 1): member.value}
            assert table[(enum_class(member.value), 1)] == member.value
            assert {copy.deepcopy(member), pickle.loads(pickle.dumps(member))} == {member}
            assert hash(member) == hash(enum_class[member.name])
        assert len({*enum_class}) == len(enum_class)
