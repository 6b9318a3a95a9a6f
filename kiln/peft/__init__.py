"""Tuning methods (full | lora | dora | qlora), applied to the plain model from outside:
`apply_tuning` on the meta device before parallelize, `finalize_tuning` once weights are loaded."""

from kiln.peft.adapter import record_run
from kiln.peft.lora import apply_tuning, check_layout, finalize_tuning, merge_tuning, trainable_parameters

__all__ = ["apply_tuning", "check_layout", "finalize_tuning", "merge_tuning", "record_run",
           "trainable_parameters"]
