"""`kiln ARGS` (the real CLI, in this process) with faults injected from the environment, for
tests that run it under torchrun and need a bad step, a hang or a process id:

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/workers/kiln_faults.py train job.yaml

KILN_FAULT_SPIKE=12,13  those steps' loss and gradients are multiplied by 50 on every rank (a
                        loss spike as the guards see it; needs guards.skip_bad_steps, which is
                        what routes a step through Trainer.forward_backward)
KILN_FAULT_HANG=6       rank 0 blocks for good at the start of that step (`injected_hang`); the
                        other ranks then wait for it in their next collective
KILN_FAULT_PIDS=DIR     each process writes DIR/rank<R>.pid (restart<N>) when it starts
KILN_FAULT_EXITS=FILE   each process appends "rank R restart N exit CODE" when the CLI returns

The hooks wrap kiln's own functions; nothing of kiln is changed for them. Imported (not run as
a script), the module installs only what its environment asks for: tests take `spiking` from it.
"""

import os
import sys
import threading
from pathlib import Path

from kiln.cli import main
from kiln.train.trainer import Trainer

RANK = int(os.environ.get("RANK", "0"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
SPIKE = {int(s) for s in os.environ.get("KILN_FAULT_SPIKE", "").split(",") if s}
HANG = int(os.environ.get("KILN_FAULT_HANG", "0"))


def injected_hang() -> None:
    """Never returns: what a rank stuck in a driver call or a lost collective looks like."""
    threading.Event().wait()


def spiking(plain_forward_backward, steps: set[int]):
    """Trainer.forward_backward with those steps' loss and gradients x50 (also in-process:
    tests import this module and monkeypatch Trainer with it)."""

    def spiking_forward_backward(self, batches):
        loss = plain_forward_backward(self, batches)
        if self.step + 1 in steps:
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(50.0)
            loss = loss * 50.0
        return loss

    return spiking_forward_backward


if SPIKE:
    Trainer.forward_backward = spiking(Trainer.forward_backward, SPIKE)

if HANG:
    plain_train_step = Trainer.train_step

    def hanging_train_step(self, batches):
        if self.step + 1 == HANG and RANK == 0:
            injected_hang()
        return plain_train_step(self, batches)

    Trainer.train_step = hanging_train_step

if __name__ == "__main__":
    if os.environ.get("KILN_FAULT_PIDS"):
        pid_dir = Path(os.environ["KILN_FAULT_PIDS"])
        pid_dir.mkdir(parents=True, exist_ok=True)
        (pid_dir / f"rank{RANK}.pid").write_text(f"{os.getpid()} restart{RESTART}\n")

    code = main(sys.argv[1:])
    if os.environ.get("KILN_FAULT_EXITS"):
        with open(os.environ["KILN_FAULT_EXITS"], "a") as f:
            f.write(f"rank {RANK} restart {RESTART} exit {code}\n")
    sys.exit(code)
