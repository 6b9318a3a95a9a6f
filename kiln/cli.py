"""The `kiln` command: parse, call, print. User errors are one paragraph, never a traceback."""

from __future__ import annotations

import argparse
import sys

from kiln.config import load_config
from kiln.errors import KilnError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Train large language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="a YAML job file, e.g. configs/quickstart.yaml")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set optim.lr=1e-3 (repeatable)")

    with_config(commands.add_parser("train", help="train a model from a job config"))
    config = commands.add_parser("config", help="inspect job configs")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    with_config(config_commands.add_parser("show", help="print the fully resolved config"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        if args.command == "config":
            print(cfg.to_yaml(), end="")
        elif args.command == "train":
            from kiln.train.trainer import train  # torch is slow to import; only when needed

            result = train(cfg)
            first, last = result.val_losses[0][1], result.val_losses[-1][1]
            print(f"kiln: {result.steps} steps, {result.tokens:,} tokens; validation loss "
                  f"{first:.3f} -> {last:.3f} ({100 * (1 - last / first):.0f}% lower); "
                  f"weights in {cfg.run_dir / 'model.safetensors'}")
            if result.sample:
                print(f"--- sample ---\n{result.sample}\n--------------")
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
    return 0
