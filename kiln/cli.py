"""The `kiln` command: parse, call, print. User errors are one paragraph, never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from kiln import launch
from kiln.config import load_config
from kiln.errors import KilnError, Preempted
from kiln.launch.process_group import env_rank_world, lost_peer, rank_label
from kiln.urls import scrub_credentials


def _number(kind: type, test: Callable[[float], bool], rule: str) -> Callable[[str], float]:
    """An argparse type: `kind` (int or float) within a range, said as `rule` when not."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range: {rule}")
        return value
    return parse


_FRACTION = _number(float, lambda v: 0 <= v < 1, "a fraction in [0, 1)")
_POSITIVE = _number(int, lambda v: v > 0, "it must be > 0")
_WORKERS = _number(int, lambda v: v >= 1, "at least 1 worker process")
# 256 byte symbols and <|endoftext|>: a byte-level BPE has at least this many tokens.
_VOCAB = _number(int, lambda v: v >= 257, "at least 257 (the 256 byte symbols and the "
                                         "end-of-text token)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Train large language models.")
    commands = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("config", help="a YAML job file, e.g. configs/quickstart.yaml")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config field, e.g. --set optim.lr=1e-3 (repeatable)")

    train = commands.add_parser("train", help="train a model from a job config")
    with_config(train)
    train.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                       help="auto (default): continue from the run's newest committed checkpoint; "
                            "none: start fresh; PATH: a step-NNNNNN checkpoint directory or URL")
    train.add_argument("--nproc", type=int, metavar="N",
                       help="run on N processes of this machine (kiln calls torchrun for you); "
                            "the layout comes from the config's parallel section")
    export = commands.add_parser("export-hf", help="write a Hugging Face model directory")
    export.add_argument("source", help="a run directory, a checkpoint root, or a step-NNNNNN checkpoint")
    export.add_argument("out", help="the directory to create")
    export.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    export.add_argument("--endpoint-url", help="an S3-compatible endpoint for s3:// sources")
    export.add_argument("--merge", action="store_true",
                        help="an adapter run: fold the adapter into its base and write the whole "
                             "model (default: a PEFT adapter directory)")
    adapters = commands.add_parser("adapters", help="list adapter runs and exported adapters")
    adapters.add_argument("directory", help="a folder to search, e.g. runs/")
    imp = commands.add_parser("import-hf", help="a job config that trains from a Hugging Face model")
    imp.add_argument("directory", help="a directory with config.json and safetensors weights")
    imp.add_argument("--out", help="write the job YAML here instead of printing it")
    imp.add_argument("--force", action="store_true", help="replace --out if it exists")
    config = commands.add_parser("config", help="inspect job configs")
    config_commands = config.add_subparsers(dest="config_command", required=True)
    with_config(config_commands.add_parser("show", help="print the fully resolved config"))

    def with_inputs(p: argparse.ArgumentParser) -> None:
        p.add_argument("inputs", nargs="+", help="files, directories, globs or fsspec URLs (s3://...)")
        p.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "parquet"])
        p.add_argument("--field", default="text", help="the JSONL field or Parquet column of the text")
        p.add_argument("--skip-bad-records", action="store_true",
                       help="skip and count JSONL lines that are not JSON or lack the field")
        p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                       help="an fsspec option for URLs, e.g. endpoint_url=http://... (never saved)")

    prep = commands.add_parser("prepare", help="tokenize raw text into shards for training")
    with_inputs(prep)
    prep.add_argument("--out", required=True, help="the output directory")
    prep.add_argument("--tokenizer", required=True, help="a tokenizer.json or a model directory")
    prep.add_argument("--score-field", help="a numeric field/column: per-document difficulty")
    prep.add_argument("--val-fraction", type=_FRACTION, default=0.0,
                      help="share of documents held out as the 'val' split, in [0, 1)")
    prep.add_argument("--shard-tokens", type=_POSITIVE, default=100_000_000,
                      help="start a new shard after this many tokens")
    prep.add_argument("--workers", type=_WORKERS, help="tokenizer processes (default: one per core)")
    prep.add_argument("--sft", action="store_true",
                      help="supervised fine-tuning examples: JSONL/Parquet records with 'messages' "
                           "or 'prompt' and 'response'; writes a loss mask next to the tokens")
    prep.add_argument("--chat-template", metavar="FILE",
                      help="with --sft: a Jinja chat template file used instead of the tokenizer's")
    data = commands.add_parser("data", help="look at a job's training data")
    data_commands = data.add_subparsers(dest="data_command", required=True)
    show = data_commands.add_parser("show", help="print the first training rows, trained-on "
                                                 "tokens marked")
    with_config(show)
    show.add_argument("--n", type=_POSITIVE, default=2, help="rows to print (default 2)")
    tok = commands.add_parser("tokenizer", help="tokenizers")
    tok_commands = tok.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_commands.add_parser("train", help="train a byte-level BPE tokenizer on a corpus")
    with_inputs(tok_train)
    tok_train.add_argument("--out", required=True, help="directory for tokenizer.json")
    tok_train.add_argument("--vocab-size", type=_VOCAB, required=True)
    tok_train.add_argument("--force", action="store_true",
                           help="replace a tokenizer already in --out")
    launch.add_parser(commands)

    runs = commands.add_parser("runs", help="list the runs in a directory")
    runs.add_argument("directory", help="a folder of run directories, e.g. runs/")
    plot = commands.add_parser("plot", help="draw loss, eval loss and LR of runs into a PNG")
    plot.add_argument("runs", nargs="+", help="run directories")
    plot.add_argument("--out", required=True, help="the PNG file to write")
    plot.add_argument("--smoothing", type=float, default=0.8,
                      help="EMA weight for the training loss, 0 (none) to <1 (default 0.8)")
    lineage = commands.add_parser("lineage", help="what produced a run or export, back to the start")
    lineage.add_argument("path", help="a run directory or a Hugging Face export")
    ev = commands.add_parser("eval", help="score a run, checkpoint or HF model on task files")
    ev.add_argument("target", help="a run directory, a checkpoint, or a Hugging Face directory")
    ev.add_argument("--task", action="append", required=True, metavar="TASK.jsonl",
                    help="a JSONL task file (multiple choice, generation or text); repeatable")
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--max-new-tokens", type=int, default=32, help="generation length limit")
    return parser


def _tracking_command(args: argparse.Namespace) -> None:
    if args.command == "runs":
        from kiln.tracking.runs import format_runs, list_runs

        rows = list_runs(args.directory)
        if not rows:
            raise KilnError(f"{args.directory} holds no run directories (config.yaml or metrics.jsonl)")
        print(format_runs(rows))
    elif args.command == "plot":
        from kiln.tracking.plot import plot_runs

        if not 0 <= args.smoothing < 1:
            raise KilnError(f"--smoothing {args.smoothing}: use a value from 0 to below 1")
        print(f"kiln: wrote {plot_runs(args.runs, args.out, args.smoothing)}")
    elif args.command == "lineage":
        from kiln.tracking.lineage import describe_chain

        print(describe_chain(args.path))
    else:
        from kiln.eval.run import evaluate

        results, loaded = evaluate(args.target, args.task, args.device, args.max_new_tokens)
        where = f" (step {loaded.step})" if loaded.step is not None else ""
        print(f"kiln: {args.target}{where}")
        for key, value in results.items():
            print(f"  {key:40s} {value:.4f}")


def _prepare_options(args: argparse.Namespace):
    from kiln.data.prepare import PrepareOptions

    import yaml

    storage = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise KilnError(f"--storage-option {item!r}: expected KEY=VALUE, e.g. endpoint_url=http://...")
        try:
            storage[key] = yaml.safe_load(value) if value else ""  # anon=true -> True
        except yaml.YAMLError:
            storage[key] = value  # not YAML: the string as typed
    return PrepareOptions(
        fmt=args.format, text_field=args.field, skip_bad_records=args.skip_bad_records,
        storage_options=storage, **{k: getattr(args, k) for k in
                                    ("score_field", "val_fraction", "shard_tokens", "workers")
                                    if hasattr(args, k)})


def _data_command(args: argparse.Namespace) -> None:
    import time

    from kiln.data.prepare import prepare, train_tokenizer
    from kiln.data.sources import ReadStats
    from kiln.data.tokenizer import load_tokenizer

    options = _prepare_options(args)
    if args.command == "tokenizer":
        stats = ReadStats()
        info = train_tokenizer(args.inputs, args.vocab_size, args.out, options, args.force, stats)
        print(f"kiln: trained a {info.vocab_size}-token BPE tokenizer into {args.out}")
        _report_reading(stats)
        return
    start = time.perf_counter()
    if args.chat_template and not args.sft:
        raise KilnError("--chat-template is for --sft (supervised fine-tuning examples)")
    if args.sft:
        from kiln.data.sft import prepare_sft

        template = None
        if args.chat_template:
            try:
                template = Path(args.chat_template).read_text()
            except OSError as e:
                raise KilnError(f"cannot read --chat-template {args.chat_template}: "
                                f"{e.strerror or e}") from None
        result = prepare_sft(args.inputs, load_tokenizer(args.tokenizer), args.out, options,
                             template)
    else:
        result = prepare(args.inputs, load_tokenizer(args.tokenizer), args.out, options)
    splits = result.manifest["splits"]
    if result.reused:
        print(f"kiln: {args.out} already holds these inputs, prepared; nothing to do")
    else:
        tokens = sum(s["tokens"] for s in splits.values())
        print(f"kiln: {result.stats.documents:,} {'examples' if args.sft else 'documents'}, {tokens:,} tokens "
              f"({tokens / (time.perf_counter() - start):,.0f} tokens/s), "
              f"{result.manifest['dtype']}, into {args.out}")
    for name, split in splits.items():
        if split["shards"]:
            print(f"  {name}: {split['tokens']:,} tokens, {split['documents']:,} documents, "
                  f"{len(split['shards'])} shards")
    if "sft" in result.manifest:
        sft = result.manifest["sft"]
        print(f"  sft: {sft['template']} chat template; {sft['assistant_tokens']:,} assistant "
              f"tokens ({sft['last_turn_tokens']:,} in last turns), {sft['prompt_tokens']:,} "
              "prompt/template tokens")
    _report_reading(result.stats)


def _report_reading(stats) -> None:
    if stats.bad_records:
        print(f"kiln: skipped {stats.bad_records} bad records, e.g. "
              + "; ".join(stats.bad_examples[:3]))
    if stats.invalid_utf8_bytes:
        files = stats.invalid_utf8_files
        print(f"kiln: note: {stats.invalid_utf8_bytes:,} invalid UTF-8 bytes (or JSON lone "
              f"surrogates) were replaced by U+FFFD, in {len(files)} "
              f"file{'s' if len(files) > 1 else ''}: "
              + ", ".join(files[:3]) + (", ..." if len(files) > 3 else ""))


def _hf_command(args: argparse.Namespace) -> None:
    from kiln.checkpoint import hf_export, hf_import
    from kiln.outputs import atomic_write, refuse_overwrite

    if args.command == "export-hf":
        out = hf_export.export_hf(args.source, args.out, args.dtype, args.endpoint_url,
                                  merge=args.merge)
        what = "a PEFT adapter" if (out / "adapter_config.json").is_file() else "a Hugging Face model"
        print(f"kiln: wrote {what} ({args.dtype}) to {out}")
        return
    if args.out:
        refuse_overwrite(args.out, args.force)
    text = hf_import.job_yaml(args.directory)
    if args.out:
        atomic_write(args.out, text)
        print(f"kiln: wrote {args.out}; train it with: kiln train {args.out}")
    else:
        print(text, end="")


def _run(args: argparse.Namespace, argv: list[str]) -> int | None:
    """Carry out a parsed command; an exit code where it is not 0 (a failed --nproc launch)."""
    if args.command in ("prepare", "tokenizer"):
        _data_command(args)
        return
    if args.command in ("export-hf", "import-hf"):
        _hf_command(args)
        return
    if args.command == "launch":
        launch.run(args)
        return
    if args.command in ("runs", "plot", "lineage", "eval"):
        _tracking_command(args)
        return
    if args.command == "adapters":
        from kiln.peft.adapter import adapters_table

        print(adapters_table(args.directory))
        return
    cfg = load_config(args.config, args.overrides)
    if args.command == "train" and cfg.task == "sft" and env_rank_world()[0] == 0:
        from kiln.tasks.sft import ensure_base

        ensure_base(cfg)  # e.g. the quickstart model the embedded sft job starts from
    if cfg.model.init_from:  # the shape comes from the directory's config.json
        from kiln.checkpoint.hf_import import resolve_init_from

        cfg = resolve_init_from(cfg)
    if args.command == "config":
        print(cfg.to_yaml(), end="")
    elif args.command == "data":
        from kiln.data.show import show_rows

        print(show_rows(cfg, args.n, color=sys.stdout.isatty()))
    elif args.command == "train":
        from kiln.launch.layout import check_layout

        world = env_rank_world()[1]
        if args.nproc and args.nproc > 1 and world == 1:
            from kiln.launch.torchrun import run_torchrun, strip_nproc

            check_layout(cfg, args.nproc)  # before starting any process
            return run_torchrun(args.nproc, strip_nproc(argv))
        # Before any process group, and without torch when train.device names the device.
        _, device_type = check_layout(cfg, world)
        from kiln.launch.process_group import process_group  # torch: only when needed
        from kiln.train.trainer import train

        with process_group(device_type):
            result = train(cfg, resume=args.resume)
        if env_rank_world()[0] != 0:  # only rank 0 prints
            return None
        first, last = result.val_losses[0][1], result.val_losses[-1][1]
        print(f"kiln: {result.steps} steps, {result.tokens:,} tokens; validation loss "
              f"{first:.3f} -> {last:.3f} ({100 * (1 - last / first):.0f}% lower); "
              f"weights in {cfg.run_dir / 'model.safetensors'}")
        if len(result.tokens_by_source) > 1:
            total = sum(result.tokens_by_source.values()) or 1
            print("kiln: tokens per source: " + ", ".join(
                f"{name} {n:,} ({100 * n / total:.1f}%)"
                for name, n in result.tokens_by_source.items()))
        if result.sample:
            print(f"--- sample ---\n{result.sample}\n--------------")


def _report_bug(error: BaseException) -> None:
    import platform
    import traceback
    from importlib.metadata import PackageNotFoundError, version

    try:
        kiln_version = version("kiln")
    except PackageNotFoundError:
        kiln_version = "unknown"
    trace = scrub_credentials("".join(traceback.format_exception(error)))
    print(f"kiln: internal error: this is a bug in kiln; please report it with the command you "
          f"ran, kiln {kiln_version}, Python {platform.python_version()} and the traceback "
          f"below.\n{trace}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """The one place errors become messages: a KilnError is one paragraph (exit 2), anything
    else is a bug in kiln and says so, with its traceback (exit 1)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parser().parse_args(argv)
    try:
        return _run(args, argv) or 0
    except KilnError as e:
        print(f"kiln: error{rank_label()}: {scrub_credentials(e)}", file=sys.stderr)
        return 2
    except Preempted as e:
        print(f"kiln: stopped: {e}", file=sys.stderr)
        return 75  # kiln.train.guards.EXIT_RESTART: "restart me"
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (the point: no exception leaves without a word)
        if (lost := lost_peer(e)) is not None:  # another process died: not a bug here
            print(f"kiln: error{rank_label()}: {lost}", file=sys.stderr)
            return 1
        _report_bug(e)
        return 1
