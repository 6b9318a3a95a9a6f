"""Tasks: what the data is and how a batch's loss is computed. The trainer runs any of them."""

from __future__ import annotations

from kiln.tasks.pretrain import Pretrain
from kiln.tasks.sft import Sft

TASKS = {"pretrain": Pretrain, "sft": Sft}


def build_task(name: str):
    return TASKS[name]()
