"""Tensor parallelism: ranks, collectives, workers."""
