"""The host-side term: time the host spends that the GPU work does not cover (kernel launches, synchronisations).
A slot: it costs nothing yet (issue N models it); it shows how an after-schedule term adds its lane
(docs/simulator.md, "Cost terms")."""

from __future__ import annotations

from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, Placement, StepInputs


class HostWork(CostTerm):
    """Host work the step waits for beyond its GPU work."""

    name = "host"
    lanes = (Lane(name="host_s", label="host work", part="host", kind=LaneKind.host, placement=Placement.after,
                  key="host", trace="host", style=("host work (launches, syncs)", "#64B5CD", "generic_work")),)

    def after_s(self, inputs: StepInputs) -> dict[str, list[float]]:
        """Zero on every pipeline rank (not modelled yet)."""
        return {"host_s": [0.0] * inputs.layout.dims.pp}
