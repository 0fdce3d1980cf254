"""The lowest layer: the job's specs and Hydra schema, the validated parallel sizes, pipeline splits, FLOPs, typed
errors, safe file writes and JSON helpers. Pure Python: no torch, no process groups; every other layer may use it."""
