"""Operator graphs, partition propagation, ParallelBlocks and segments (CFP)."""
