"""Apply a parallel layout to Megatron-Core and train with it."""
