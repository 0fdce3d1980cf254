"""Compatibility layers; the CPU one is installed only when CUDA is absent."""
