"""The pack job's configuration: command-line flags -> one frozen, validated `PackConfig`.

Every value that changes the output bytes goes into the dataset's manifest (`manifest_config`)
and into the job's plan, and a rerun into an existing output compares them exactly: the same
config resumes (or finds the dataset complete), a different one is refused unless
``--overwrite``. Flags that only change how the job runs (``--num-cpus``, ``--num-workers``,
storage options, progress) are not part of it, so a resumed job may use another cluster size.

The shape rule is the only one: ``seq_len % pad_multiple == 0``. ``--pad-multiple`` defaults to
what ``--cp-layout`` needs: ``cp`` for ``contiguous`` (the default: rows split evenly into cp
chunks), ``2 * cp`` for ``zigzag`` (each rank takes two mirrored chunks, as
``PackedShardStream(cp_layout="zigzag")`` does); an explicit ``--pad-multiple`` must be a multiple
of that.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from packshard import __version__
from packshard.packers import ALGORITHMS, OVERLONG_POLICIES, Algorithm, OverlongPolicy
from packshard.pipeline.options import ArgumentParser, add_storage_option_flag, parse_key_values
from packshard.pipeline.planning import (
    DEFAULT_CARRY_ROWS,
    DEFAULT_SHARD_TOKENS,
    DEFAULT_WINDOW_ROWS,
)
from packshard.pipeline.samples import KINDS, KNOWN_ROLES, Kind, parse_columns
from packshard.pipeline.tokenizer_loading import DEMO_TOKENIZER

DEMO_INPUT = "demo://"
INT32_MAX = 2**31 - 1
# chunks each row is split into, per cp rank (trainer_shim's cp_layout)
CP_LAYOUTS: dict[str, int] = {"contiguous": 1, "zigzag": 2}


@dataclass(frozen=True)
class PackConfig:
    """What to pack and how (validated on construction; `ValueError` names the flag)."""

    inputs: tuple[str, ...]
    output: str
    tokenizer: str | None
    seq_len: int
    cp: int
    pad_multiple: int
    pad_token_id: int | None = None
    cp_layout: str = "contiguous"
    algorithm: Algorithm = "bfd"
    window_rows: int = DEFAULT_WINDOW_ROWS
    carry_rows: int = DEFAULT_CARRY_ROWS
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    overlong: OverlongPolicy = "truncate"
    shuffle: bool = False
    seed: int = 0
    kind: Kind = "auto"
    columns: Mapping[str, str] = field(default_factory=dict)
    loss_roles: tuple[str, ...] = ("assistant",)
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    split: str = "train"
    skip_bad_records: bool = False
    trust_remote_code: bool = False
    tokenizer_revision: str | None = None
    # how to run (not part of the dataset's identity)
    overwrite: bool = False
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    num_cpus: int | None = None
    num_workers: int | None = None
    progress: bool = True
    demo: bool = False

    def __post_init__(self) -> None:
        def bad(flag: str, value: Any, valid: str) -> ValueError:
            return ValueError(f"{flag}={value!r} is not valid: {valid}")

        if not self.inputs:
            raise bad("--input", None, "give at least one input (or --demo)")
        for flag, value in (
            ("--seq-len", self.seq_len),
            ("--cp", self.cp),
            ("--pad-multiple", self.pad_multiple),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(flag, value, "a positive integer")
            if value > INT32_MAX:  # shards hold lengths and token ids as int32
                raise bad(flag, value, f"at most {INT32_MAX:,} (format v1 stores int32)")
        if self.cp_layout not in CP_LAYOUTS:
            raise bad("--cp-layout", self.cp_layout, f"one of {list(CP_LAYOUTS)}")
        need = 1 if self.cp == 1 else CP_LAYOUTS[self.cp_layout] * self.cp  # cp 1 splits nothing
        if self.pad_multiple % need:
            raise ValueError(
                f"--pad-multiple {self.pad_multiple} does not suit --cp {self.cp} --cp-layout "
                f"{self.cp_layout}, which splits every row into {need} equal chunks: give a multiple "
                f"of {need} (or leave --pad-multiple out)"
            )
        if self.seq_len % self.pad_multiple:
            raise ValueError(
                f"--seq-len {self.seq_len} is not a multiple of --pad-multiple {self.pad_multiple}: rows are "
                "padded to a multiple of pad_multiple and never exceed seq_len, so seq_len must be one "
                f"(e.g. --seq-len {self.seq_len - self.seq_len % self.pad_multiple or self.pad_multiple})"
            )
        if self.pad_token_id is not None and not 0 <= self.pad_token_id <= INT32_MAX:
            raise bad("--pad-token-id", self.pad_token_id, f"a token id in [0, {INT32_MAX:,}]")
        if self.algorithm not in ALGORITHMS:
            raise bad("--algorithm", self.algorithm, f"one of {sorted(ALGORITHMS)}")
        if self.overlong not in OVERLONG_POLICIES:
            raise bad("--overlong", self.overlong, f"one of {list(OVERLONG_POLICIES)}")
        if self.kind not in KINDS:
            raise bad("--kind", self.kind, f"one of {list(KINDS)}")
        for flag, value in (("--window", self.window_rows), ("--shard-tokens", self.shard_tokens)):
            if value < 1:
                raise bad(flag, value, "a positive integer")
        if self.carry_rows < 0:
            raise bad("--carry-rows", self.carry_rows, "0 or more")
        unknown = [r for r in self.loss_roles if r not in KNOWN_ROLES]
        if unknown or not self.loss_roles:
            raise bad(
                "--loss-roles",
                ",".join(self.loss_roles),
                f"a non-empty subset of {sorted(KNOWN_ROLES)}",
            )
        if self.tokenizer is None and self.pad_token_id is None:
            raise bad(
                "--tokenizer",
                None,
                "give --tokenizer (or, for pre-tokenized inputs only, --pad-token-id)",
            )
        for flag, count in (("--num-cpus", self.num_cpus), ("--num-workers", self.num_workers)):
            if count is not None and count < 1:
                raise bad(flag, count, "a positive integer")

    @property
    def window_tokens(self) -> int:
        return self.window_rows * self.seq_len

    def warnings(self) -> list[str]:
        """Settings that are valid but not what they seem to ask for (the job logs them)."""
        out = []
        # the default at a huge seq_len is a shard a window too, but nobody asked for it
        if self.shard_tokens != DEFAULT_SHARD_TOKENS and self.shard_tokens < self.window_tokens:
            out.append(
                f"--shard-tokens {self.shard_tokens:,} is below one packing window (--window "
                f"{self.window_rows} rows x --seq-len {self.seq_len:,} = {self.window_tokens:,} "
                "tokens): each shard holds one window, and no row is carried across shards, so "
                "every shard ends with a partly filled row"
            )
        return out

    def dataset_config(
        self,
        *,
        tokenizer: Mapping[str, Any] | None,
        pad_token_id: int,
        inputs: list[dict[str, Any]],
    ) -> dict[str, Any]:
        """The manifest's `config`: every setting that shapes the bytes (DESIGN.md keys first)."""
        return {
            "seq_len": self.seq_len,
            "cp": self.cp,
            "pad_multiple": self.pad_multiple,
            "pad_token_id": pad_token_id,
            "packing": {
                "algorithm": self.algorithm,
                "window": self.window_rows,
                "window_tokens": self.window_tokens,
                "carry_rows": self.carry_rows,
                "shard_tokens": self.shard_tokens,
            },
            "overlong": self.overlong,
            "seed": self.seed if self.shuffle else None,
            "shuffle": self.shuffle,
            "inputs": inputs,
            "tokenizer": dict(tokenizer) if tokenizer else None,
            "samples": {
                "kind": self.kind,
                "columns": dict(sorted(self.columns.items())),
                "loss_roles": sorted(self.loss_roles),
                "template_kwargs": dict(sorted(self.template_kwargs.items())),
                "skip_bad_records": self.skip_bad_records,
                "split": self.split,
            },
        }


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="packshard pack",
        description="Pack raw SFT / offline-RL samples into a packshard dataset with Ray "
        "(connects to the cluster under `ray job submit`, else starts a local Ray).",
    )
    p.add_argument("--version", action="version", version=f"packshard {__version__}")
    io = p.add_argument_group("inputs and output")
    io.add_argument(
        "--input",
        action="append",
        metavar="URL",
        help="input file, glob, directory, fsspec URL, save_to_disk dir or hub name (repeatable; order is kept)",
    )
    io.add_argument(
        "--output",
        required=True,
        metavar="URL",
        help="dataset URL (local dir, s3://..., any fsspec URL)",
    )
    io.add_argument(
        "--demo",
        action="store_true",
        help="pack the built-in generated dataset with the built-in tokenizer (replaces --input/--tokenizer; default --seq-len 32768 --cp 8)",
    )
    io.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing dataset (or unfinished job) made with a different config",
    )
    io.add_argument(
        "--split",
        default="train",
        help="split of a DatasetDict directory, a hub dataset, or a directory whose file names "
        "name splits (data/train-00000-of-00002.parquet; default train)",
    )
    add_storage_option_flag(io)
    tk = p.add_argument_group("samples and tokenization")
    tk.add_argument(
        "--tokenizer",
        metavar="NAME_OR_PATH",
        help="Hugging Face tokenizer: hub name or local directory",
    )
    tk.add_argument("--tokenizer-revision", default=None, help="hub revision of the tokenizer")
    tk.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow tokenizers that ship code (off by default)",
    )
    tk.add_argument(
        "--kind", default="auto", choices=KINDS, help="sample kind (default: detected per record)"
    )
    tk.add_argument(
        "--columns",
        action="append",
        metavar="FIELD=SOURCE,...",
        help="map packshard's field names to yours, e.g. prompt=question,completion=answer",
    )
    tk.add_argument(
        "--loss-roles",
        default="assistant",
        help="comma-separated chat roles that carry loss (default assistant)",
    )
    tk.add_argument(
        "--template-kwarg",
        action="append",
        metavar="KEY=VALUE",
        help="extra chat-template variable, e.g. enable_thinking=false (VALUE parsed as JSON when it can be)",
    )
    tk.add_argument(
        "--skip-bad-records",
        action="store_true",
        help="skip malformed records and count them by reason (default: fail naming the record)",
    )
    pk = p.add_argument_group("packing")
    pk.add_argument("--seq-len", type=int, help="row capacity in tokens")
    pk.add_argument("--cp", type=int, help="context-parallel degree")
    pk.add_argument(
        "--cp-layout",
        default="contiguous",
        choices=list(CP_LAYOUTS),
        help="how the trainer splits rows over cp ranks (PackedShardStream's cp_layout): "
        "contiguous pads rows to a multiple of cp, zigzag to 2*cp (default contiguous)",
    )
    pk.add_argument(
        "--pad-multiple",
        type=int,
        help="pad rows to a multiple of this (default: cp, or 2*cp with --cp-layout zigzag)",
    )
    pk.add_argument(
        "--pad-token-id", type=int, help="padding token (default: the tokenizer's pad, else EOS)"
    )
    pk.add_argument(
        "--overlong",
        default="truncate",
        choices=OVERLONG_POLICIES,
        help="samples longer than seq-len (default truncate)",
    )
    pk.add_argument(
        "--algorithm",
        default="bfd",
        choices=sorted(ALGORITHMS),
        help="bin packing algorithm (default bfd)",
    )
    pk.add_argument(
        "--window",
        type=int,
        default=DEFAULT_WINDOW_ROWS,
        metavar="ROWS",
        help=f"packing window: consecutive samples totalling ROWS x seq-len tokens (default {DEFAULT_WINDOW_ROWS})",
    )
    pk.add_argument("--carry-rows", type=int, default=DEFAULT_CARRY_ROWS, help=argparse.SUPPRESS)
    pk.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard file, about (default {DEFAULT_SHARD_TOKENS:,})",
    )
    pk.add_argument(
        "--shuffle",
        action="store_true",
        help="pack in a seeded random order (holds the tokenized data in Ray's object store)",
    )
    pk.add_argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    rn = p.add_argument_group("running")
    rn.add_argument(
        "--num-cpus",
        type=int,
        help="CPUs of the local Ray started when not under `ray job submit` (default: all)",
    )
    rn.add_argument(
        "--num-workers", type=int, help="concurrent tokenize tasks (default: the cluster's CPUs)"
    )
    rn.add_argument(
        "--no-progress", action="store_true", help="no progress bar (a log line every 30 s instead)"
    )
    return p


def config_from_args(argv: Sequence[str]) -> PackConfig:
    """Parse and validate; argparse exits 2 on unknown flags, ValueError on bad values."""
    parser = build_parser()
    args = parser.parse_args(list(argv))
    inputs = list(args.input or [])
    tokenizer = args.tokenizer
    seq_len, cp = args.seq_len, args.cp
    if args.demo:
        from packshard.pipeline.demo import DEMO_CP, DEMO_SEQ_LEN

        if inputs or tokenizer:
            parser.error("--demo replaces --input and --tokenizer; give neither")
        inputs, tokenizer = [DEMO_INPUT], DEMO_TOKENIZER
        seq_len = DEMO_SEQ_LEN if seq_len is None else seq_len
        cp = DEMO_CP if cp is None else cp
    missing = [
        f
        for f, v in (("--input", inputs or None), ("--seq-len", seq_len), ("--cp", cp))
        if v is None
    ]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)} (or use --demo)")
    return PackConfig(
        inputs=tuple(inputs),
        output=args.output,
        tokenizer=tokenizer,
        seq_len=seq_len,
        cp=cp,
        pad_multiple=(
            CP_LAYOUTS.get(args.cp_layout, 1) * cp
            if args.pad_multiple is None
            else args.pad_multiple
        ),
        cp_layout=args.cp_layout,
        pad_token_id=args.pad_token_id,
        algorithm=args.algorithm,
        window_rows=args.window,
        carry_rows=args.carry_rows,
        shard_tokens=args.shard_tokens,
        overlong=args.overlong,
        shuffle=args.shuffle,
        seed=args.seed,
        kind=args.kind,
        columns=parse_columns(args.columns),
        loss_roles=tuple(r.strip() for r in args.loss_roles.split(",") if r.strip()),
        template_kwargs=parse_key_values(args.template_kwarg, flag="--template-kwarg"),
        split=args.split,
        skip_bad_records=args.skip_bad_records,
        trust_remote_code=args.trust_remote_code,
        tokenizer_revision=args.tokenizer_revision,
        overwrite=args.overwrite,
        storage_options=parse_key_values(args.storage_option),
        num_cpus=args.num_cpus,
        num_workers=args.num_workers,
        progress=not args.no_progress and os.environ.get("PACKSHARD_NO_PROGRESS") is None,
        demo=args.demo,
    )
