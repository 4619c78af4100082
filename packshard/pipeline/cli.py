"""The `packshard` console script: `pack`, `stats`, `verify`.

`packshard pack ...` is `python -m packshard.pipeline.pack ...` (the Ray job). `stats` and `verify` read
a dataset at any fsspec URL; `--storage-option KEY=VALUE` (repeatable, VALUE parsed as JSON
when it can be) passes filesystem options such as an S3 endpoint, and fsspec's own
``FSSPEC_<PROTOCOL>_<OPTION>`` environment variables work too.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from packshard.packers import FormatError, ShardDataset


def parse_storage_options(
    pairs: Sequence[str] | None, flag: str = "--storage-option"
) -> dict[str, Any]:
    """['key=value', ...] -> {key: json-or-string value} (`flag` names the option in errors)."""
    options: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"{flag} expects KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def add_storage_option_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-option",
        action="append",
        metavar="KEY=VALUE",
        help="fsspec filesystem option, e.g. endpoint_url=http://127.0.0.1:5000 (repeatable)",
    )


def cmd_stats(args: argparse.Namespace) -> int:
    from packshard.pipeline.stats import dataset_stats, format_stats, plot_stats

    ds = ShardDataset.open(args.url, storage_options=parse_storage_options(args.storage_option))
    st = dataset_stats(ds)
    print(json.dumps(st, indent=2) if args.json else format_stats(st))
    if args.plot:
        plot_stats(ds, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from packshard.pipeline.verify import verify_dataset

    problems = verify_dataset(
        args.url,
        storage_options=parse_storage_options(args.storage_option),
        progress=not args.quiet,
    )
    if problems:
        for p in problems:
            print(f"FAIL {p}", file=sys.stderr)
        print(f"verify: {len(problems)} problem(s) in {args.url}", file=sys.stderr)
        return 1
    ds = ShardDataset.open(args.url, storage_options=parse_storage_options(args.storage_option))
    print(
        f"verify: OK {args.url}: {len(ds.shards)} shards, {ds.num_rows:,} rows, checksums and row invariants hold"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="packshard", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "pack",
        help="pack raw samples into a shard dataset (same flags as packshard.pipeline.pack)",
        add_help=False,
    )
    p = sub.add_parser("stats", help="what a dataset holds (manifest and index only)")
    p.add_argument("url")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--plot", metavar="FILE.png", help="also write a PNG of row lengths and padding")
    add_storage_option_flag(p)
    p.set_defaults(func=cmd_stats)
    p = sub.add_parser(
        "verify", help="re-read every shard; exit 1 on any broken checksum or invariant"
    )
    p.add_argument("url")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_storage_option_flag(p)
    p.set_defaults(func=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if argv and argv[0] == "pack":
        from packshard.pipeline.pack import main as pack_main

        return pack_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FormatError as e:
        print(f"packshard {args.command}: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"packshard {args.command}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
