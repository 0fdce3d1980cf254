"""Search over parallel layouts: the space, the planner's settings, branch and bound on the simulator."""
