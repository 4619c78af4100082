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
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from packshard import __version__  # packshard itself imports nothing (see its docstring)

# The modules below (pyarrow, numpy, ...) are imported in `main`, inside its Ctrl-C handling:
# the console script imports this module before it calls `main`, so a Ctrl-C during a
# module-level import would print a traceback.
if TYPE_CHECKING:
    from packshard.packers import ShardDataset


def redact_text(text: str) -> str:
    from packshard.pipeline.inputs import redact_text

    return redact_text(text)


def redact_url(url: str) -> str:
    from packshard.pipeline.inputs import redact_url

    return redact_url(url)


def _storage_options(args: argparse.Namespace) -> dict[str, Any]:
    from packshard.pipeline.options import parse_key_values

    try:
        return parse_key_values(args.storage_option)
    except ValueError as e:
        raise SystemExit(f"packshard {args.command}: error: {e}") from None


def _open(args: argparse.Namespace) -> ShardDataset:
    """The dataset at args.url. Without one, the reader's DatasetNotFoundError says what is
    there (nothing, an empty directory, an unfinished pack job, other files); a failing store
    is its StorageError."""
    from packshard.packers import ShardDataset

    return ShardDataset.open(args.url, storage_options=_storage_options(args))


def _plot_types() -> set[str]:
    """The file types matplotlib writes; without matplotlib, MissingExtraError before any work
    (not after the stats are printed)."""
    from packshard._extras import require

    require("plot", "matplotlib", "packshard stats --plot")
    from matplotlib.figure import Figure

    return set(Figure().canvas.get_supported_filetypes())


def cmd_stats(args: argparse.Namespace) -> int:
    from packshard.pipeline.stats import dataset_stats, format_stats, plot_stats

    if args.plot:
        types = _plot_types()
        if args.plot.rpartition(".")[2].lower() not in types:
            print(
                f"packshard stats: error: --plot {args.plot}: give a file ending in one of "
                f"{', '.join('.' + t for t in sorted(types))}",
                file=sys.stderr,
            )
            return 2
    ds = _open(args)
    st = dataset_stats(ds)
    print(redact_text(json.dumps(st, indent=2) if args.json else format_stats(st)))
    if args.plot:
        plot_stats(ds, args.plot)
        if not args.json:
            print(f"plot written to {args.plot}")
    problems = ds.shard_file_problems()
    for p in problems:
        print(f"packshard stats: {redact_text(p)}", file=sys.stderr)
    if problems:
        print(
            f"packshard stats: {len(problems)} of {len(ds.shards)} shards damaged; the figures "
            f"above are the manifest's (`packshard verify {ds.url}` checks everything)",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from packshard.pipeline.verify import verify_dataset

    problems = verify_dataset(
        args.url,
        storage_options=_storage_options(args),
        progress=not args.quiet,
    )
    if problems:
        for p in problems:
            print(f"FAIL {redact_text(p)}", file=sys.stderr)
        print(f"verify: {len(problems)} problem(s) in {redact_url(args.url)}", file=sys.stderr)
        return 1
    ds = _open(args)
    print(
        f"verify: OK {redact_url(args.url)}: {len(ds.shards)} shards, {ds.num_rows:,} rows, checksums and row invariants hold"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from packshard.pipeline.options import ArgumentParser, add_storage_option_flag

    parser = ArgumentParser(prog="packshard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "pack",
        help="pack raw samples into a shard dataset (same flags as packshard.pipeline.pack)",
        add_help=False,
    )
    p = sub.add_parser(
        "stats", help="what a dataset holds (manifest and index; shard files listed, not read)"
    )
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


def _reader_left() -> int:
    """After a BrokenPipeError on stdout: nothing more to say, and nothing at exit's flush."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141  # 128 + SIGPIPE, as a shell tool killed by it


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else ""
    try:
        from packshard._extras import MissingExtraError
        from packshard.packers import FormatError
        from packshard.packers.urls import UrlError, add_redacting_filter

        if command == "pack":
            try:
                from packshard.pipeline.pack import main as pack_main
            except MissingExtraError as e:  # the core install: stats and verify only
                if {"-h", "--help"} & set(argv[1:]):  # the flags need none of the extra
                    from packshard.pipeline.config import build_parser as pack_parser

                    try:
                        pack_parser().print_help()
                        print(f"\nnote: {e}")
                    except BrokenPipeError:
                        return _reader_left()
                    return 0
                print(f"packshard pack: error: {e}", file=sys.stderr)
                return 1
    except KeyboardInterrupt:  # Ctrl-C while the libraries import (transformers, Ray: ~1-2 s)
        print(
            f"packshard{' ' + command if command else ''}: interrupted before anything started",
            file=sys.stderr,
        )
        return 130
    if command == "pack":
        return pack_main(argv[1:])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:  # libraries' lines may quote the URL too
        add_redacting_filter(handler, library_tracebacks=False)
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `packshard stats URL | head`: the reader has left
        return _reader_left()
    except (FormatError, FileNotFoundError, MissingExtraError, UrlError) as e:
        print(f"packshard {args.command}: {redact_text(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"packshard {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
