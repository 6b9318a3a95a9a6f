"""The `kiln` command: parse, call, print. User errors are one paragraph, never a traceback."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.config import load_config
from kiln.errors import KilnError


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
    export = commands.add_parser("export-hf", help="write a Hugging Face model directory")
    export.add_argument("source", help="a run directory, a checkpoint root, or a step-NNNNNN checkpoint")
    export.add_argument("out", help="the directory to create")
    export.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    export.add_argument("--endpoint-url", help="an S3-compatible endpoint for s3:// sources")
    imp = commands.add_parser("import-hf", help="a job config that trains from a Hugging Face model")
    imp.add_argument("directory", help="a directory with config.json and safetensors weights")
    imp.add_argument("--out", help="write the job YAML here instead of printing it")
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
    prep.add_argument("--val-fraction", type=float, default=0.0,
                      help="share of documents held out as the 'val' split")
    prep.add_argument("--shard-tokens", type=int, default=100_000_000)
    prep.add_argument("--workers", type=int, help="tokenizer processes (default: one per core)")
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
    show.add_argument("--n", type=int, default=2, help="rows to print (default 2)")
    tok = commands.add_parser("tokenizer", help="tokenizers")
    tok_commands = tok.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_commands.add_parser("train", help="train a byte-level BPE tokenizer on a corpus")
    with_inputs(tok_train)
    tok_train.add_argument("--out", required=True, help="directory for tokenizer.json")
    tok_train.add_argument("--vocab-size", type=int, required=True)
    return parser


def _prepare_options(args: argparse.Namespace):
    from kiln.data.prepare import PrepareOptions

    import yaml

    storage = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise KilnError(f"--storage-option {item!r}: expected KEY=VALUE, e.g. endpoint_url=http://...")
        storage[key] = yaml.safe_load(value) if value else ""  # anon=true -> True
    return PrepareOptions(
        fmt=args.format, text_field=args.field, skip_bad_records=args.skip_bad_records,
        storage_options=storage, **{k: getattr(args, k) for k in
                                    ("score_field", "val_fraction", "shard_tokens", "workers")
                                    if hasattr(args, k)})


def _data_command(args: argparse.Namespace) -> None:
    import time

    from kiln.data.prepare import prepare, train_tokenizer
    from kiln.data.tokenizer import load_tokenizer

    options = _prepare_options(args)
    if args.command == "tokenizer":
        info = train_tokenizer(args.inputs, args.vocab_size, args.out, options)
        print(f"kiln: trained a {info.vocab_size}-token BPE tokenizer into {args.out}")
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
    if result.stats.bad_records:
        print(f"kiln: skipped {result.stats.bad_records} bad records, e.g. "
              + "; ".join(result.stats.bad_examples[:3]))


def _hf_command(args: argparse.Namespace) -> None:
    from kiln.checkpoint import hf_export, hf_import

    if args.command == "export-hf":
        out = hf_export.export_hf(args.source, args.out, args.dtype, args.endpoint_url)
        print(f"kiln: wrote a Hugging Face model ({args.dtype}) to {out}")
        return
    text = hf_import.job_yaml(args.directory)
    if args.out:
        Path(args.out).write_text(text)
        print(f"kiln: wrote {args.out}; train it with: kiln train {args.out}")
    else:
        print(text, end="")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command in ("prepare", "tokenizer"):
            _data_command(args)
            return 0
        if args.command in ("export-hf", "import-hf"):
            _hf_command(args)
            return 0
        cfg = load_config(args.config, args.overrides)
        if args.command == "train" and cfg.task == "sft":
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
            from kiln.train.trainer import train  # torch is slow to import; only when needed

            result = train(cfg, resume=args.resume)
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
    except KilnError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
    return 0
