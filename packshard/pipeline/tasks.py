"""The work the pack job runs on Ray workers: count, tokenize, pack + write + verify, check.

Each task is a plain function (testable in-process) wrapped by a Ray remote with retries; all
of them are idempotent, so a retry after a worker death redoes the same work:

- `warm_up`: imports what tokenizing needs in a fresh worker process (~0.3-0.6 s: pyarrow,
  the packers, jinja2, the Rust tokenizers), run while the driver still loads the tokenizer.
- `count_input`: one input file's record count (and seek checkpoints).
- `tokenize_block`: records [start, stop) of one file -> (`BlockMeta`, `BlockData`). The meta
  (lengths, per-record status, examples of bad records) goes to the driver; the token data stays
  in the object store until the shards that need it are written. Pre-tokenized samples in a
  parquet / Arrow file are read as arrays when the block is clean (2.78M ids and masks in
  ~0.1 s, ~3 s as Python lists: the per-token Python work dominated such jobs); a block with a
  bad record goes through the per-record path, which names the record and its reason.
- `pack_shard`: gathers one shard's samples from the blocks that hold them, plans its rows
  (`planning.plan_shard_rows`), builds them (`packers.build_rows`), writes the shard
  (`packers.write_shard`: temporary name, then moved), re-reads and verifies it (checksum and
  every row invariant), and only then writes its marker (`jobstate`).
- `check_shard`: on resume, re-hashes a shard against its marker and rebuilds its index columns.

Workers never load tokenizer files: the driver ships its tokenizer as a `TokenizerPayload`
(through the object store, once), and each worker process builds its encoder from it once
(`encoder_for` caches it by fingerprint), never per task, and encode on one thread
(``TOKENIZERS_PARALLELISM=false`` unless set: one task a CPU).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from packshard.packers import (
    Algorithm,
    OverlongPolicy,
    build_rows,
    row_index_stats,
    row_problems,
    url_to_fs,
    write_shard,
)
from packshard.packers.arrays import column_numpy
from packshard.packers.format import checksum_stream, shard_name, split_checksum
from packshard.packers.writer import ShardRecord, index_columns, write_json_atomic
from packshard.pipeline.inputs import InputFile
from packshard.pipeline.jobstate import marker_path
from packshard.pipeline.planning import ShardPlan, plan_shard_rows, window_sizes_for
from packshard.pipeline.readers import TABLE_FORMATS, read_records, read_tables
from packshard.pipeline.samples import (
    POLICY_DROPS,
    REASONS,
    BadRecord,
    Kind,
    Tokens,
    source_fields,
    to_sample,
)
from packshard.pipeline.tokenization import Encoded, SampleEncoder, TokenizerPayload, checked_ids

log = logging.getLogger(__name__)

MAX_EXAMPLES = 20
ROWS_PER_BUILD = 4096


@dataclass(frozen=True)
class WorkSpec:
    """Everything a task needs, small and picklable (no credentials beyond storage options)."""

    output: str
    storage_options: Mapping[str, Any]
    tokenizer: Any  # TokenizerPayload, a Ray ObjectRef to one, or None (pre-tokenized inputs only)
    tokenizer_fingerprint: str | None
    kind: Kind
    columns: Mapping[str, str]
    loss_roles: tuple[str, ...]
    template_kwargs: Mapping[str, Any]
    skip_bad_records: bool
    seq_len: int
    pad_multiple: int
    pad_token_id: int
    algorithm: Algorithm
    overlong: OverlongPolicy
    carry_rows: int
    rows_per_batch: int
    config_digest: str


@dataclass
class BlockData:
    """Tokenized records of one block (ids first_id .. first_id + n - 1); bad records have
    length 0 and a non-zero status (index + 1 into samples.REASONS)."""

    first_id: int
    offsets: np.ndarray  # int64 [n + 1]
    tokens: np.ndarray  # int32
    mask: np.ndarray  # bool
    status: np.ndarray  # int8 [n]
    examples: list[tuple[int, str, str, str]] = field(
        default_factory=list
    )  # (id, location, reason, detail)
    # tokens of the samples the overlong policy dropped whole (samples.POLICY_DROPS), else 0
    policy_tokens: np.ndarray | None = None  # int64 [n]


@dataclass
class BlockMeta:
    """What the driver learns from a tokenized block (the token data stays in the store)."""

    first_id: int
    lengths: np.ndarray  # int64 [n]; 0 for bad records
    status: np.ndarray  # int8 [n]
    tokens: int
    loss_tokens: int
    seconds: float
    examples: list[tuple[int, str, str, str]]
    node: str = ""  # the Ray node that tokenized it ("" outside Ray)


@dataclass
class ShardResult:
    """A written (or kept) shard: plan, manifest record with index columns, and counters."""

    plan: ShardPlan
    record: ShardRecord
    counters: dict[str, Any]
    kept: bool = False
    node: str = ""  # the Ray node that wrote (or checked) it ("" outside Ray)


def current_node() -> str:
    """The id of the Ray node this process runs on ("" when Ray is not initialized here)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


class ShardVerifyError(OSError):
    """A shard read back from storage differs from what was written (retried by Ray)."""


# ---- tokenize ----------------------------------------------------------------------------


def warm_up() -> str:
    """Import what `tokenize_block` needs, in this worker process (Ray imports this module to
    run the task, which brings in the packers, pyarrow and jinja2; the Rust tokenizers are
    imported here); returns the node id. Only a head start: a worker that missed it imports the
    same on its first block."""
    import tokenizers  # noqa: F401 (imported for its side effect: the module is loaded)

    return current_node()


_ENCODERS: dict[str, SampleEncoder | None] = {}


def encoder_for(spec: WorkSpec) -> SampleEncoder | None:
    """This process's encoder for the spec (built once per worker from the driver's payload)."""
    if spec.tokenizer is None:
        return None
    key = json.dumps(
        [spec.tokenizer_fingerprint, spec.loss_roles, spec.template_kwargs],
        sort_keys=True,
        default=str,
    )
    if key not in _ENCODERS:
        # One task a CPU: the Rust tokenizer's own thread pool would put ~1.6 cores' worth of
        # threads on each (Ray pins OpenMP threads to a task's CPUs the same way); a user's
        # TOKENIZERS_PARALLELISM (through the job's runtime env) wins.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        payload = spec.tokenizer
        if not isinstance(payload, TokenizerPayload):
            import ray

            payload = ray.get(payload)
        _ENCODERS[key] = SampleEncoder(
            payload, loss_roles=spec.loss_roles, template_kwargs=spec.template_kwargs
        )
    return _ENCODERS[key]


def _encode_without_tokenizer(sample: Any) -> Encoded | BadRecord:
    if isinstance(sample, BadRecord):
        return sample
    if isinstance(sample, Tokens):
        try:  # stored as int32, and ids are embedding rows: [0, 2^31)
            ids = checked_ids(sample.input_ids, 2**31, "int32's")
        except BadRecord as e:
            return e
        mask = (
            np.ones(ids.size, np.bool_)
            if sample.loss_mask is None
            else np.asarray(sample.loss_mask, np.bool_)
        )
        if not mask.any():
            return BadRecord("no_loss_tokens", "the sample has no loss tokens")
        return Encoded(ids, mask)
    return BadRecord("no_tokenizer", f"a {type(sample).__name__} sample needs --tokenizer")


_CHAT_FIELDS = ("messages", "prompt", "completion")


def _clean_ids(
    table: pa.Table, ids_name: str, mask_name: str, bounds: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(lengths, ids, mask) of a table piece of pre-tokenized samples when every one of them is
    a clean sample (integer ids in `bounds`, not empty; a loss mask of the same length with a
    loss token, or none), else None."""
    if ids_name not in table.column_names:
        return None
    ids = table.column(ids_name).combine_chunks()
    if not _is_list_of(ids.type, pa.types.is_integer) or ids.null_count:
        return None
    lengths = column_numpy(pc.list_value_length(ids)).astype(np.int64)
    values = pc.list_flatten(ids)
    if values.null_count or (lengths.size and lengths.min() < 1):
        return None
    tokens = column_numpy(values)
    if tokens.size and (tokens.min() < bounds[0] or tokens.max() >= bounds[1]):
        return None
    if mask_name not in table.column_names:
        return lengths, tokens.astype(np.int32), np.ones(tokens.size, np.bool_)
    mask_col = table.column(mask_name).combine_chunks()
    if mask_col.null_count or not _is_list_of(
        mask_col.type, lambda t: pa.types.is_boolean(t) or pa.types.is_integer(t)
    ):
        return None
    mask_values = pc.list_flatten(mask_col)
    if mask_values.null_count or not np.array_equal(
        column_numpy(pc.list_value_length(mask_col)), lengths
    ):
        return None
    mask = column_numpy(mask_values).astype(np.bool_)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    if lengths.size and not np.logical_or.reduceat(mask, starts).all():
        return None
    return lengths, tokens.astype(np.int32), mask


def _is_list_of(t: pa.DataType, value_test: Any) -> bool:
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and value_test(t.value_type)


def columnar_block(
    spec: WorkSpec, file: InputFile, start: int, stop: int, vocab_size: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(lengths, ids, mask) of records [start, stop) of a parquet / Arrow file of pre-tokenized
    samples, read as arrays (2.8M ids + masks: ~0.1 s, against ~3 s as Python lists), or None
    when the block needs the per-record path: another kind of sample may be there, or a record
    is bad (that path names it and its reason)."""
    if file.format not in TABLE_FORMATS or spec.kind not in ("auto", "input_ids"):
        return None
    name = {f: spec.columns.get(f, f) for f in ("input_ids", "loss_mask", *_CHAT_FIELDS)}
    chat = [name[f] for f in _CHAT_FIELDS] if spec.kind == "auto" else []
    fields = [name["input_ids"], name["loss_mask"], *chat]
    # with a tokenizer ids must be in its vocabulary, without one in int32's non-negative range
    bounds = (0, vocab_size) if vocab_size is not None else (0, 2**31)
    pieces = []
    for _, table in read_tables(
        file, start, stop, storage_options=spec.storage_options, fields=fields
    ):
        if any(c in table.column_names for c in chat):  # auto may find chats: per record
            return None
        piece = _clean_ids(table, name["input_ids"], name["loss_mask"], bounds)
        if piece is None:
            return None
        pieces.append(piece)
    if not pieces:
        return None
    return tuple(np.concatenate(parts) for parts in zip(*pieces, strict=True))  # type: ignore[return-value]


def tokenize_block(
    spec: WorkSpec, file: InputFile, start: int, stop: int, first_id: int
) -> tuple[BlockMeta, BlockData]:
    """Read, validate and tokenize records [start, stop) of `file` (ids from `first_id`)."""
    t0 = time.perf_counter()
    encoder = encoder_for(spec)
    clean = columnar_block(
        spec, file, start, stop, encoder.vocab_size if encoder is not None else None
    )
    if clean is not None:
        lengths, tokens, mask = clean
        away = _loss_truncated(spec, lengths, mask)
        if not away.any():
            return _block(first_id, lengths, np.zeros(lengths.size, np.int8), tokens, mask, [], t0)
        return _columnar_without(spec, file, start, first_id, lengths, tokens, mask, away, t0)
    has_template = bool(encoder and encoder.has_chat_template)
    fields = source_fields(spec.columns) if spec.kind == "auto" or spec.columns else None
    locations: list[str] = []
    samples: list[Any] = []
    for location, record in read_records(
        file,
        start,
        stop,
        storage_options=spec.storage_options,
        fields=fields,
        sample_fields=source_fields(spec.columns),
    ):
        locations.append(location)
        if isinstance(record, BadRecord):
            samples.append(record)
            continue
        try:
            samples.append(
                to_sample(
                    record, kind=spec.kind, columns=spec.columns, has_chat_template=has_template
                )
            )
        except BadRecord as e:
            samples.append(e)
    encoded = (
        encoder.encode(samples)
        if encoder is not None
        else [_encode_without_tokenizer(s) for s in samples]
    )
    n = len(encoded)
    lengths = np.zeros(n, np.int64)
    status = np.zeros(n, np.int8)
    ids: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    examples: list[tuple[int, str, str, str]] = []
    policy_examples: list[tuple[int, str, str, str]] = []
    policy_tokens = np.zeros(n, np.int64)
    for i, enc in enumerate(encoded):
        if (
            not isinstance(enc, BadRecord)
            and spec.overlong == "truncate"
            and enc.ids.size > spec.seq_len
            and not enc.mask[: spec.seq_len].any()
        ):
            policy_tokens[i] = enc.ids.size
            enc = _truncated_away(spec, enc.ids.size, int(np.argmax(enc.mask)))
        if isinstance(enc, BadRecord):
            status[i] = REASONS.index(enc.reason) + 1
            # bad records are listed first: the scheduler fails a job on the first of them
            listed = policy_examples if enc.reason in POLICY_DROPS else examples
            if len(listed) < MAX_EXAMPLES:
                listed.append((first_id + i, locations[i], enc.reason, enc.detail))
        else:
            lengths[i] = enc.ids.size
            ids.append(enc.ids)
            masks.append(enc.mask)
    tokens = np.concatenate(ids) if ids else np.zeros(0, np.int32)
    mask = np.concatenate(masks) if masks else np.zeros(0, np.bool_)
    return _block(
        first_id, lengths, status, tokens, mask, examples + policy_examples, t0, policy_tokens
    )


def _columnar_without(
    spec: WorkSpec,
    file: InputFile,
    start: int,
    first_id: int,
    lengths: np.ndarray,
    tokens: np.ndarray,
    mask: np.ndarray,
    away: np.ndarray,
    t0: float,
) -> tuple[BlockMeta, BlockData]:
    """A clean columnar block with the samples `--overlong truncate` would leave without a
    loss token dropped, as the per-record path drops them (same status, detail, location)."""
    starts = np.cumsum(lengths) - lengths
    status = np.where(away, REASONS.index("no_loss_after_truncate") + 1, 0).astype(np.int8)
    examples = []
    for i in np.flatnonzero(away)[:MAX_EXAMPLES].tolist():
        first_loss = int(np.argmax(mask[starts[i] : starts[i] + lengths[i]]))
        bad = _truncated_away(spec, int(lengths[i]), first_loss)
        examples.append(
            (first_id + i, f"{file.display}:row {start + i + 1}", bad.reason, bad.detail)
        )
    keep = np.repeat(~away, lengths)
    policy_tokens = np.where(away, lengths, 0)
    return _block(
        first_id,
        np.where(away, 0, lengths),
        status,
        tokens[keep],
        mask[keep],
        examples,
        t0,
        policy_tokens,
    )


def _truncated_away(spec: WorkSpec, length: int, first_loss: int) -> BadRecord:
    """The drop of a sample whose loss tokens all lie past seq_len (`_loss_truncated`)."""
    return BadRecord(
        "no_loss_after_truncate",
        f"--overlong truncate keeps its first {spec.seq_len:,} of {length:,} tokens, and its "
        f"first loss token is at {first_loss:,}",
    )


def _loss_truncated(spec: WorkSpec, lengths: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Which of these samples `--overlong truncate` would keep without a single loss token.
    Rows would carry them for nothing, so tokenize_block drops them (`no_loss_after_truncate`,
    counted and listed, never failing the job: the policy chose it)."""
    out = np.zeros(lengths.size, np.bool_)
    if spec.overlong != "truncate":
        return out
    starts = np.cumsum(lengths) - lengths
    for i in np.flatnonzero(lengths > spec.seq_len).tolist():
        s = int(starts[i])
        out[i] = not mask[s : s + spec.seq_len].any()
    return out


def _block(
    first_id: int,
    lengths: np.ndarray,
    status: np.ndarray,
    tokens: np.ndarray,
    mask: np.ndarray,
    examples: list[tuple[int, str, str, str]],
    t0: float,
    policy_tokens: np.ndarray | None = None,
) -> tuple[BlockMeta, BlockData]:
    data = BlockData(
        first_id,
        np.concatenate(([0], np.cumsum(lengths))),
        tokens,
        mask,
        status,
        examples,
        policy_tokens if policy_tokens is not None and policy_tokens.any() else None,
    )
    meta = BlockMeta(
        first_id,
        lengths,
        status,
        int(tokens.size),
        int(mask.sum()),
        time.perf_counter() - t0,
        examples,
        current_node(),
    )
    return meta, data


# ---- pack ----------------------------------------------------------------------------------


def _gather(
    blocks: tuple[BlockData, ...], which: np.ndarray, src: np.ndarray, lengths: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate samples' tokens and masks (in the given order), copying contiguous runs at once."""
    total = int(lengths.sum())
    tokens = np.empty(total, np.int32)
    mask = np.empty(total, np.bool_)
    if not lengths.size:
        return tokens, mask
    run_start = np.flatnonzero(
        np.concatenate(([True], (which[1:] != which[:-1]) | (src[1:] != src[:-1] + lengths[:-1])))
    )
    run_end = np.concatenate((run_start[1:], [lengths.size]))
    dst_of = np.concatenate(([0], np.cumsum(lengths)))
    for a, b in zip(run_start.tolist(), run_end.tolist(), strict=True):
        blk = blocks[int(which[a])]
        s, e = int(src[a]), int(src[b - 1] + lengths[b - 1])
        d = int(dst_of[a])
        tokens[d : d + e - s] = blk.tokens[s:e]
        mask[d : d + e - s] = blk.mask[s:e]
    return tokens, mask


def pack_shard(
    spec: WorkSpec,
    plan: ShardPlan,
    ids: np.ndarray | None,
    block_firsts: list[int],
    *blocks: BlockData,
) -> ShardResult:
    """Build, write and verify shard `plan.number` from the samples at its positions (`ids`:
    their sample ids, None for the identity order), then write its marker."""
    ids = (
        np.arange(plan.start, plan.stop, dtype=np.int64)
        if ids is None
        else np.asarray(ids, np.int64)
    )
    firsts = np.asarray(block_firsts, np.int64)
    which = np.searchsorted(firsts, ids, side="right") - 1
    local = ids - firsts[which]
    n = ids.size
    status = np.zeros(n, np.int8)
    src = np.zeros(n, np.int64)
    lengths = np.zeros(n, np.int64)
    policy_tokens = 0
    for b in np.unique(which).tolist():
        sel = np.flatnonzero(which == b)
        blk, loc = blocks[b], local[sel]
        if loc.size and int(loc.max()) >= blk.status.size:
            raise AssertionError(
                f"block {b} (ids from {blk.first_id}) lacks sample {int(ids[sel][loc.argmax()])}"
            )
        status[sel] = blk.status[loc]
        if blk.policy_tokens is not None:
            policy_tokens += int(blk.policy_tokens[loc].sum())
        src[sel] = blk.offsets[loc]
        lengths[sel] = blk.offsets[loc + 1] - blk.offsets[loc]
    kept = np.flatnonzero(status == 0)
    tokens, mask = _gather(blocks, which[kept], src[kept], lengths[kept])
    kept_lengths = lengths[kept]
    packed = plan_shard_rows(
        kept_lengths,
        window_sizes_for(plan.window_ends, plan.start, kept + plan.start),
        seq_len=spec.seq_len,
        overlong=spec.overlong,
        algorithm=spec.algorithm,
        carry_rows=spec.carry_rows,
    )
    pieces = packed.pieces
    piece_start = (np.cumsum(kept_lengths) - kept_lengths)[pieces.sample] + pieces.start
    piece_sample_id = ids[kept][pieces.sample]
    # pieces of split samples that carry no loss token train nothing: counted, and said
    lossless = np.zeros(pieces.num_pieces, np.bool_)
    if pieces.extra_pieces:  # only a split makes pieces shorter than their sample
        loss_before = np.concatenate(([0], np.cumsum(mask, dtype=np.int64)))
        piece_loss = loss_before[piece_start + pieces.length] - loss_before[piece_start]
        lossless = (piece_loss == 0) & (pieces.length < lengths[kept][pieces.sample])
    batches = (
        build_rows(
            tokens,
            mask,
            piece_start,
            pieces.length,
            piece_sample_id,
            packed.rows[i : i + ROWS_PER_BUILD],
            pad_multiple=spec.pad_multiple,
            pad_token_id=spec.pad_token_id,
        )
        for i in range(0, len(packed.rows), ROWS_PER_BUILD)
    )
    fs, root = url_to_fs(spec.output, spec.storage_options)
    record = write_shard(fs, root, plan.number, batches, rows_per_batch=spec.rows_per_batch)
    verify_written(fs, root, record, spec)
    dropped: dict[str, int] = {}
    for code, count in zip(*np.unique(status[status > 0], return_counts=True), strict=True):
        dropped[REASONS[int(code) - 1]] = int(count)
    for reason, count in pieces.dropped.items():
        dropped[reason] = dropped.get(reason, 0) + count
    counters = {
        "samples_in": int(n),
        "samples_kept": int(np.unique(pieces.sample).size),
        "dropped": dropped,
        "truncated_samples": pieces.truncated_samples,
        "truncated_tokens": pieces.truncated_tokens,
        "split_samples": pieces.split_samples,
        "extra_pieces": pieces.extra_pieces,
        "dropped_tokens": pieces.dropped_tokens + policy_tokens,
        "lossless_pieces": int(lossless.sum()),
        "lossless_piece_tokens": int(pieces.length[lossless].sum()),
        "examples": _examples_in(blocks, ids),
    }
    fs.makedirs(marker_path(root, plan.number).rsplit("/", 1)[0], exist_ok=True)
    write_json_atomic(
        fs,
        marker_path(root, plan.number),
        {
            "plan": asdict(plan),
            "record": record.manifest_entry(),
            "counters": counters,
            "config_digest": spec.config_digest,
        },
    )
    return ShardResult(plan, record, counters, node=current_node())


def _examples_in(blocks: tuple[BlockData, ...], ids: np.ndarray) -> list[list[Any]]:
    """The bad-record examples of these blocks whose samples belong to this shard."""
    examples = [e for blk in blocks for e in blk.examples]
    if not examples:
        return []
    inside = np.isin(np.asarray([e[0] for e in examples], np.int64), ids)
    return [list(e) for e, ok in zip(examples, inside.tolist(), strict=True) if ok][:MAX_EXAMPLES]


def verify_written(fs: Any, root: str, record: ShardRecord, spec: WorkSpec) -> None:
    """Re-read the shard from storage: bytes, checksum, schema, row count, row invariants."""
    path = f"{root}/{record.path}"
    with fs.open(path, "rb") as f:
        data = f.read()
    algorithm, _ = split_checksum(record.checksum, path)
    got = checksum_stream(pa.BufferReader(data).read, algorithm)
    if len(data) != record.bytes or got != record.checksum:
        raise ShardVerifyError(
            f"{path}: read back {len(data)} bytes with checksum {got}, wrote {record.bytes} with {record.checksum}"
        )
    reader = pa.ipc.open_file(pa.BufferReader(data))
    rows = 0
    for b in range(reader.num_record_batches):
        batch = reader.get_batch(b)
        problems = row_problems(
            batch,
            seq_len=spec.seq_len,
            pad_multiple=spec.pad_multiple,
            pad_token_id=spec.pad_token_id,
            first_row=rows,
        )
        if problems:
            raise AssertionError(f"{path}: packed rows break the format: {problems[:3]}")
        rows += batch.num_rows
    if rows != record.rows:
        raise ShardVerifyError(f"{path}: holds {rows} rows, {record.rows} were written")


def check_shard(spec: WorkSpec, marker: Mapping[str, Any]) -> ShardResult | str:
    """A kept shard's result rebuilt from its marker and its file, or why it cannot be kept."""
    plan = ShardPlan(**{**marker["plan"], "window_ends": tuple(marker["plan"]["window_ends"])})
    entry = marker["record"]
    if marker.get("config_digest") != spec.config_digest:
        return "its marker belongs to another config"
    if entry.get("path") != shard_name(plan.number):
        return f"its marker names {entry.get('path')!r}"
    fs, root = url_to_fs(spec.output, spec.storage_options)
    path = f"{root}/{entry['path']}"
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return "the shard file is missing"
    algorithm, _ = split_checksum(entry["checksum"], path)
    if (
        len(data) != entry["bytes"]
        or checksum_stream(pa.BufferReader(data).read, algorithm) != entry["checksum"]
    ):
        return "the shard file does not match its marker's checksum"
    reader = pa.ipc.open_file(pa.BufferReader(data))
    stats = [row_index_stats(reader.get_batch(i)) for i in range(reader.num_record_batches)]
    record = ShardRecord.from_entry(entry, index_columns(stats))
    return ShardResult(plan, record, dict(marker["counters"]), kept=True, node=current_node())
