"""The DeepSpeed backend: plan ZeRO (stage, micro-batch, activation checkpointing, offload) with the simulator,
write ``ds_config.json``, and train a Megatron-Core model (or any model, :func:`initialize`) with
``deepspeed.initialize``."""
