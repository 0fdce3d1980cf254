"""The engine: builds Megatron-Core models and process groups and runs training steps on them, for the profiling
rounds and the backends' trainers alike (process groups, model chunks, one training step, checkpoints, measured
memory, logged metrics)."""
