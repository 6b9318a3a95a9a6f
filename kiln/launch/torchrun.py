"""`kiln train job.yaml --nproc N`: the same command run by torchrun on N local processes."""

from __future__ import annotations

import sys

from kiln.errors import KilnError


def strip_nproc(argv: list[str]) -> list[str]:
    """The command line without its --nproc option (the workers run one process each)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == "--nproc":
            skip = True
        elif not item.startswith("--nproc="):
            out.append(item)
    return out


def run_torchrun(nproc: int, kiln_argv: list[str]) -> int:
    """Run `python -m torch.distributed.run --standalone --nproc-per-node N -m kiln ARGS`.

    torchrun runs in this process rather than as a child, so a failed worker ends in one line
    and its exit code instead of torchrun's traceback (the workers print their own errors).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if nproc < 1:
        raise KilnError(f"--nproc {nproc}: the number of processes must be at least 1")
    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", "kiln", *kiln_argv])
    try:
        run(args)
    except ChildFailedError as e:
        codes = sorted({f.exitcode for f in e.failures.values()})
        ranks = sorted(e.failures)  # keyed by global rank
        print(f"kiln: {len(ranks)} of {nproc} processes failed (ranks {', '.join(map(str, ranks))}, "
              f"exit codes {', '.join(map(str, codes))}); their errors are above", file=sys.stderr)
        return next((c for c in codes if c > 0), 1)
    return 0
