"""cfp-megatron: plan how to parallelize large-model training, then train with that plan on Megatron-Core."""

__version__ = "0.1.0"
