"""The Megatron-Core backend: its training loop (:mod:`.trainer`) on the engine's model chunks and schedules."""
