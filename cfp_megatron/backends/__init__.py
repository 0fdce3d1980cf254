"""Training backends other than Megatron-Core's own loop (``backend=deepspeed``)."""
