"""Orchestration: planning at launch (profile on every rank, search on rank 0, broadcast the plan), the training
entry point ``launch/train.py`` calls, and the command-line tools (``python -m cfp_megatron.plan``)."""
