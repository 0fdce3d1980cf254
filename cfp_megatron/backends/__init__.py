"""Training backends: Megatron-Core's own loop (:mod:`.megatron`) and DeepSpeed (:mod:`.deepspeed`,
``backend=deepspeed``)."""
