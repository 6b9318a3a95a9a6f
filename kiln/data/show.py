"""`kiln data show JOB`: the first training rows a fresh run reads, trained-on tokens marked."""

from __future__ import annotations

import numpy as np

from kiln.config import JobConfig

OPEN, CLOSE = "\u27e6", "\u27e7"  # around trained-on text when not on a terminal
GREEN, RESET = "\x1b[32m", "\x1b[0m"


def show_rows(cfg: JobConfig, n: int, color: bool = False) -> str:
    from kiln.tasks import build_task  # the tasks import torch: only when asked

    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    data = build_task(cfg.task).build_data(cfg, cfg.run_dir, 0, 1)
    loader = data.train
    rows: list = []
    while len(rows) < n:
        picks, _ = loader.sampler.next_batch()
        rows += [(loader.names[s], loader.sources[s].sample(i)) for s, i in picks]
    decode = data.tokenizer.decode
    lines = [f"kiln: the first {n} training rows of {cfg.task} job {cfg.name!r} "
             f"(data.seq_len={cfg.data.seq_len}); trained-on tokens "
             + ("in green" if color else f"between {OPEN} and {CLOSE}")]
    for r, (name, row) in enumerate(rows[:n], 1):
        # A pretraining window is one stretch of text whose every token but the first is a target.
        examples = row if isinstance(row, list) else [(row, np.arange(len(row)) > 0)]
        positions = sum(len(ids) - 1 for ids, _ in examples)
        targets = sum(int(trained[1:].sum()) for _, trained in examples)
        lines.append(f"=== row {r} (source {name!r}): {len(examples)} example(s), {positions} "
                     f"positions, {targets} targets ===")
        for k, (ids, trained) in enumerate(examples, 1):
            if len(examples) > 1:
                lines.append(f"--- example {k}: {len(ids)} tokens, positions restart at 0 ---")
            lines.append(_marked(ids, trained, decode, color))
    return "\n".join(lines)


def _marked(ids: np.ndarray, trained: np.ndarray, decode, color: bool) -> str:
    """The text, each run of trained-on tokens decoded together and marked."""
    out = []
    cut = np.flatnonzero(np.diff(trained.astype(np.int8))) + 1
    for part_ids, part_flags in zip(np.split(ids, cut), np.split(trained, cut)):
        text = decode(part_ids.tolist(), skip_special_tokens=False)
        if part_flags[0]:
            text = f"{GREEN}{text}{RESET}" if color else f"{OPEN}{text}{CLOSE}"
        out.append(text)
    return "".join(out)
