"""Evaluation: held-out loss, multiple-choice and generation tasks from local JSONL files."""
