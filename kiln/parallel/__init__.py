"""Parallelism and other wrappers, applied to a plain model from outside, in torchtitan's
order: tensor parallel, activation checkpointing, compile, then FSDP2 (see parallelize.py)."""

from kiln.parallel.parallelize import parallelize

__all__ = ["parallelize"]
