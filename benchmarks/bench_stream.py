"""Streaming rows into a rank: packshard's PackedShardStream vs MosaicML streaming, and the
quality of the DP balance (cost vs count).

    python benchmarks/bench_stream.py [--rows 4800] [--seq-len 8192] [--repeats 3]

1. Throughput. The same packed token rows (a chat + long-trajectory length mix, random token
   ids) are written twice: as a packshard dataset (the foundation's writer, default record
   batches) and as MDS shards (Mosaic's own `MDSWriter`). One rank (world size 1) reads one
   shuffled epoch; rows/s and true tokens/s are reported per rank, from local disk and from a
   moto S3 server that the script starts on 127.0.0.1 (and stops). From S3 both sides start
   with an empty local cache, so the time includes downloading the shards (Mosaic always
   downloads whole shards; ours with `cache_dir`). Ours without a cache (range reads) is shown
   too, through pyarrow's S3 client (its default where it applies: packers/s3_reading.py) and
   through s3fs (``PACKSHARD_S3_CLIENT=s3fs``). Ours delivers full micro-batches (labels, position ids, cu_seqlens, ks/ke as torch
   tensors); Mosaic delivers raw numpy samples, the most favourable reading for it.
   Runs are interleaved (ours, Mosaic, ours, ...) and the table holds medians.
2. Balance. A long-trajectory mix (SWE-agent trajectories, Wikipedia articles, books split at
   seq_len, with OASST/Glaive/Alpaca/GSM8K chat; token counts from the Qwen2.5 tokenizer in
   ../shared/data when present, else a synthetic mix of the same shape) is packed at seq_len
   32768 by BFD; dp=4 ranks take steps of `rows_per_step` rows: max/mean rank cost per step,
   for balance="cost" and "count".

Mosaic runs in its own venv (.bench/mosaic-venv, made on first use: mosaicml-streaming 0.13
pins transformers<5) through benchmarks/_mosaic_runner.py.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._results import markdown_table, record_result  # noqa: E402
from benchmarks._stream_sides import (  # noqa: E402
    BENCH,
    MDS_SIZES,
    MotoServer,
    describe,
    ensure_mosaic_venv,
    mosaic_read,
    mosaic_sweep,
    mosaic_write,
    ours_read,
)
from packshard.packers import CostModel, DatasetWriter, apply_overlong, pack_table, plan_bins  # noqa: E402
from packshard.packers.rows import list_parts  # noqa: E402
from packshard.trainer_shim.planning import StepPlanner, step_imbalance  # noqa: E402
from packshard.trainer_shim.synthetic import synthetic_table  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
SWEEP_TIMEOUT = 120  # seconds for one Mosaic configuration's epoch in the sweep

# ---- the length mix -------------------------------------------------------------------------


def _chat_lengths(tok, path: Path, limit: int | None = None) -> list[int]:
    out = []
    with path.open() as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            rec = json.loads(line)
            msgs = [{"role": m["role"], "content": m.get("content") or ""} for m in rec["messages"]]
            out.append(len(tok.apply_chat_template(msgs, tokenize=True, return_dict=False)))
    return out


MIX_SHARES = {"trajectories": 0.35, "wiki": 0.15, "books": 0.10, "chat": 0.20, "gsm8k": 0.20}
MIX_TOKENS = 40_000_000


def _pools() -> tuple[dict[str, list[int]], str]:
    """Token counts per source (Qwen2.5 tokenizer on ../shared/data, else synthetic)."""
    if not SHARED.is_dir():
        rng = np.random.default_rng(0)
        pools = {
            "trajectories": rng.integers(2_000, 15_000, 22), "wiki": rng.integers(250, 27_000, 30),
            "books": rng.integers(34_000, 98_000, 7), "chat": rng.integers(45, 2_400, 1700), "gsm8k": rng.integers(95, 570, 3000),
        }  # fmt: skip
        return {
            k: v.tolist() for k, v in pools.items()
        }, "synthetic lengths shaped like ../shared/data (absent here)"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SHARED / "tokenizers" / "qwen2.5-instruct"))
    lc = SHARED / "long_context"
    chat = []
    for name in (
        "oasst_en_100_threads.messages.jsonl",
        "glaive_toolcall_en_demo.messages.jsonl",
        "alpaca_en_demo.messages.jsonl",
    ):
        chat += _chat_lengths(tok, SHARED / "chat" / name)
    gsm = []
    with (SHARED / "gsm8k" / "train.jsonl").open() as f:
        for i, line in enumerate(f):
            if i >= 3000:
                break
            rec = json.loads(line)
            msgs = [
                {"role": "user", "content": rec["question"]},
                {"role": "assistant", "content": rec["answer"]},
            ]
            gsm.append(len(tok.apply_chat_template(msgs, tokenize=True, return_dict=False)))
    pools = {
        "trajectories": _chat_lengths(
            tok, lc / "agent_trajectories" / "swe_agent_trajectories.messages.jsonl"
        ),
        "wiki": [
            len(tok(line)["input_ids"])
            for line in (lc / "wikipedia" / "wiki_demo.txt").read_text().splitlines()
            if line
        ],
        "books": [
            int(json.loads(line)["n_tokens_qwen2.5"])
            for line in (lc / "gutenberg" / "long_docs.jsonl").open()
        ],
        "chat": chat,
        "gsm8k": gsm,
    }
    return (
        pools,
        "Qwen2.5 token counts of ../shared/data: SWE-agent trajectories, Wikipedia, Gutenberg books, OASST/Glaive/Alpaca chat, GSM8K",
    )


def mix_lengths() -> tuple[np.ndarray, str]:
    """A seeded draw (with replacement) of MIX_TOKENS tokens from the pools in MIX_SHARES
    (token shares), shuffled; cached in .bench/."""
    cache = BENCH / "mix_lengths_v2.npz"
    if cache.exists():
        data = np.load(cache)
        return data["lengths"], str(data["source"])
    pools, source = _pools()
    rng = np.random.default_rng(0)
    parts = []
    for name, share in MIX_SHARES.items():
        pool = np.asarray(pools[name], dtype=np.int64)
        n = max(1, round(share * MIX_TOKENS / pool.mean()))
        parts.append(rng.choice(pool, n))
    lengths = rng.permutation(np.concatenate(parts))
    source += (
        " (token shares "
        + ", ".join(f"{k} {v:.0%}" for k, v in MIX_SHARES.items())
        + f"; {lengths.sum() / 1e6:.0f}M tokens)"
    )
    BENCH.mkdir(exist_ok=True)
    np.savez(cache, lengths=lengths, source=source)
    return lengths, source


# ---- balance --------------------------------------------------------------------------------


def balance_table(
    lengths: np.ndarray, seq_len: int = 32768, dp: int = 4
) -> tuple[list[list[object]], dict[str, float]]:
    res = apply_overlong(lengths, seq_len, "split")
    bins = plan_bins(res.length, seq_len)
    tokens = np.array([res.length[b].sum() for b in bins])
    attn = np.array([(res.length[b].astype(np.int64) ** 2).sum() for b in bins])
    costs = CostModel().row_costs(tokens, attn)
    rows, summary = [], {}
    for rps in (8, 16, 32, 64):
        line: list[object] = [f"{rps} ({rps // dp}/rank)"]
        for balance in ("cost", "count"):
            planner = StepPlanner(
                costs, dp_size=dp, rows_per_step=rps, seed=0, balance=balance, epochs=3
            )
            steps = [p for p in planner.steps() if p.num_real == rps]
            imb = np.array([step_imbalance(p, costs) for p in steps])
            line += [f"{imb.mean():.4f}", f"{np.percentile(imb, 95):.4f}", f"{imb.max():.4f}"]
            summary[f"{balance}@{rps}"] = float(imb.mean())
        if rps == 2 * dp:  # two rows per rank: pairing sorted rows largest with smallest is optimal
            opt = []
            for p in steps:
                c = np.sort(costs[p.rows.ravel()])
                pair = c[: rps // 2] + c[::-1][: rps // 2]
                opt.append(pair.max() / pair.mean())
            line.append(f"{np.mean(opt):.4f}")
        else:
            line.append("-")
        rows.append(line)
    return rows, {**summary, "rows": len(bins), "cost_spread": float(costs.max() / costs.mean())}


# ---- datasets -------------------------------------------------------------------------------


def build_datasets(
    lengths: np.ndarray, seq_len: int, max_rows: int, work: Path
) -> tuple[Path, Path, dict]:
    """Our dataset and the same rows as a raw .npz for the MDS writer."""
    res = apply_overlong(lengths, seq_len, "split")
    take = (
        int(np.searchsorted(np.cumsum(res.length), max_rows * seq_len)) + 1
    )  # about enough for max_rows rows
    table = synthetic_table(res.length[:take], vocab_size=150_000, seed=1)
    batch, _ = pack_table(table, seq_len=seq_len, pad_multiple=8, pad_token_id=0)
    batch = batch.slice(0, min(max_rows, batch.num_rows))
    ours = work / "ours"
    config = {"seq_len": seq_len, "cp": 8, "pad_multiple": 8, "pad_token_id": 0, "packing": {"algorithm": "bfd"}, "overlong": "split",
              "seed": 0, "inputs": ["bench-mix"], "tokenizer": {"name": "synthetic", "fingerprint": "-"}}  # fmt: skip
    ids_off, ids = list_parts(batch.column("input_ids"), np.int32)
    _, mask = list_parts(batch.column("loss_mask"), np.uint8)
    doc_off, docs = list_parts(batch.column("doc_lens"), np.int32)
    _, sids = list_parts(batch.column("sample_ids"), np.int64)
    w = DatasetWriter(str(ours), config)
    w.write(batch)
    kept = int(np.unique(sids).size)  # the samples the rows hold (split ones count once)
    manifest = w.close({"samples_in": kept, "samples_kept": kept, "dropped": {}})
    raw = work / "rows.npz"
    np.savez(
        raw,
        input_ids=ids,
        loss_mask=mask,
        row_offsets=ids_off,
        doc_lens=docs,
        doc_offsets=doc_off,
        sample_ids=sids,
    )
    return ours, raw, manifest


# ---- the head-to-head -----------------------------------------------------------------------


def _rate(runs: list[dict], key: str = "rows") -> float:
    return statistics.median(r[key] / r["seconds"] for r in runs)


def _interleaved(
    jobs: dict[str, Callable[[int], dict]], repeats: int, rows: int, *, strict: bool = True
) -> dict[str, list[dict]]:
    """Run every job `repeats` times, round-robin (job order rotates each round, so no side
    always runs first after a pause); check each read the whole epoch, exactly: a job that
    does not raises (`strict`) or is dropped from further rounds with its runs marked."""
    results: dict[str, list[dict]] = {name: [] for name in jobs}
    names = list(jobs)
    for rep in range(repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            if results[name] and "wrong_rows" in results[name][-1]:
                continue
            os.sync()  # what earlier runs wrote is on disk before this run's window opens
            r = jobs[name](rep)
            if r["rows"] != rows:
                if strict:
                    raise RuntimeError(f"{name} read {r['rows']} rows, the dataset has {rows}")
                r["wrong_rows"] = True
            results[name].append(r)
        print(f"  round {rep + 1}/{repeats}: " + ", ".join(
            f"{n} {results[n][-1]['rows'] / results[n][-1]['seconds']:,.0f}" for n in names), flush=True)  # fmt: skip
    return results


def cache_root(work: Path, need: int) -> Path:
    """Where the S3 runs' cold caches go (both sides): tmpfs (/dev/shm) when it has room, else
    `work`. This machine's ext4 disk is mounted with online discard: for seconds after a large
    file is deleted (each cold run's cache is), a 32 MiB write there takes 0.06-0.1 s instead of
    0.005 s, at random, which timed the disk rather than either reader."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > need:
        return Path(tempfile.mkdtemp(prefix="packshard-bench-", dir=shm))
    return work


def cold(caches: Path, read: Callable[[Path], dict]) -> Callable[[int], dict]:
    """A cold-cache run (both sides, sweep and head to head): an empty cache directory of its
    own, deleted after it, so the shards a run downloads (155 MiB) are not left for the page
    cache to write back during the next runs' windows."""

    def run(rep: int) -> dict:
        path = caches / "cold-cache"
        shutil.rmtree(path, ignore_errors=True)
        try:
            return read(path)
        finally:
            shutil.rmtree(path, ignore_errors=True)

    return run


def sweep_mosaic(
    py: Path, mds: dict[str, Path], rows: int, repeats: int, server: MotoServer | None, caches: Path
) -> tuple[dict, dict, list[list[object]]]:
    """Mosaic's sweep; returns (best local config, best S3 config or {}, table rows)."""
    table: list[list[object]] = []
    best: dict[str, dict] = {}
    for where in ("local", "S3") if server else ("local",):
        configs = mosaic_sweep(rows, where == "S3")

        def job(c: dict, where: str = where) -> Callable[[int], dict]:
            if where == "local":
                return lambda rep: mosaic_read(py, mds[c["mds"]], c, timeout=SWEEP_TIMEOUT)
            return cold(caches, lambda cache: mosaic_read(
                py, cache, c, remote=f"s3://bench/mds-{c['mds']}", endpoint=server.endpoint,
                timeout=SWEEP_TIMEOUT,
            ))  # fmt: skip

        print(f"Mosaic sweep, {where}: {len(configs)} configurations x {repeats}", flush=True)
        res = _interleaved({describe(c): job(c) for c in configs}, repeats, rows, strict=False)
        fair = [c for c in configs if "wrong_rows" not in res[describe(c)][-1]]
        rates = {describe(c): _rate(res[describe(c)]) for c in fair}
        best[where] = max(fair, key=lambda c: rates[describe(c)])
        for c in configs:
            name = describe(c)
            if name not in rates:
                last = res[name][-1]
                why = (
                    f"timed out ({SWEEP_TIMEOUT} s)"
                    if last.get("timed_out")
                    else f"reads {last['rows']} rows, not {rows}"
                )
                table.append([where, name, f"excluded: {why}", ""])
            else:
                table.append(
                    [where, name, f"{rates[name]:,.0f}", "best" if c is best[where] else ""]
                )
    return best["local"], best.get("S3", {}), table


def head_to_head(
    py: Path, ours: Path, mds: dict[str, Path], best_local: dict, best_s3: dict,
    rows: int, repeats: int, server: MotoServer | None, caches: Path,
) -> dict[str, list[dict]]:  # fmt: skip
    jobs: dict[str, Callable[[int], dict]] = {
        "ours local": lambda rep: ours_read(str(ours)),
        "ours local, prefetch thread": lambda rep: ours_read(str(ours), prefetch_thread=True),
        "Mosaic local + build": lambda rep: mosaic_read(py, mds[best_local["mds"]], best_local, build=True),
        "Mosaic local": lambda rep: mosaic_read(py, mds[best_local["mds"]], best_local),
    }  # fmt: skip
    if server is not None:
        opts = server.storage_options

        remote = f"s3://bench/mds-{best_s3['mds']}"
        jobs |= {
            "ours S3, cache_dir": cold(caches, lambda c: ours_read("s3://bench/ours", storage_options=opts, cache_dir=c)),
            "ours S3, no cache": lambda rep: ours_read("s3://bench/ours", storage_options=opts),
            "ours S3, no cache, s3fs": lambda rep: ours_read("s3://bench/ours", storage_options=opts, s3_client="s3fs"),
            "Mosaic S3 + build": cold(caches, lambda c: mosaic_read(py, c, best_s3, remote=remote, build=True, endpoint=server.endpoint)),
            "Mosaic S3": cold(caches, lambda c: mosaic_read(py, c, best_s3, remote=remote, endpoint=server.endpoint)),
        }  # fmt: skip
    print(f"head to head: {len(jobs)} readers x {repeats}", flush=True)
    return _interleaved(jobs, repeats, rows)


def result_table(results: dict[str, list[dict]]) -> list[list[object]]:
    """One line per packshard reading, against Mosaic doing the same work and Mosaic raw."""
    out = []
    for ours_name, peer in (
        ("ours local", "Mosaic local"),
        ("ours local, prefetch thread", "Mosaic local"),
        ("ours S3, cache_dir", "Mosaic S3"),
        ("ours S3, no cache", "Mosaic S3"),
        ("ours S3, no cache, s3fs", "Mosaic S3"),
    ):
        if ours_name not in results:
            continue
        mine, same, raw = (
            _rate(results[ours_name]),
            _rate(results[f"{peer} + build"]),
            _rate(results[peer]),
        )
        loads = [r["load"] for name in (ours_name, peer, f"{peer} + build") for r in results[name]]
        out.append([
            ours_name, f"{mine:,.0f}", f"{_rate(results[ours_name], 'tokens') / 1e6:.1f}",
            f"{same:,.0f}", f"**{mine / same:.2f}x**", f"{raw:,.0f}", f"{mine / raw:.2f}x",
            f"{statistics.median(loads):.2f}",
        ])  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # 4800 rows of 8K (157 MiB, the most the length mix fills) is three of a remote reader's
    # 64 MiB windows, so an epoch shows how windows share a shard's bytes; 1500 rows (48 MiB)
    # fit in one window, which hides that.
    p.add_argument("--rows", type=int, default=4800, help="packed rows in the throughput dataset")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5, help="head-to-head rounds (medians)")
    p.add_argument("--sweep-repeats", type=int, default=2, help="runs per Mosaic configuration")
    p.add_argument("--no-s3", action="store_true")
    p.add_argument("--append-results", action="store_true", help="record the run in RESULTS.md")
    args = p.parse_args(argv)
    load_before = os.getloadavg()

    lengths, source = mix_lengths()
    bal_rows, bal = balance_table(lengths)
    bal_headers = ["rows_per_step (dp=4)", "cost mean", "cost p95", "cost max", "count mean", "count p95", "count max", "optimum mean"]  # fmt: skip
    print(markdown_table(bal_headers, bal_rows))

    work = BENCH / "stream"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ours, raw, manifest = build_datasets(lengths, args.seq_len, args.rows, work)
    n_rows, n_tokens = manifest["totals"]["rows"], manifest["totals"]["num_tokens"]
    py = ensure_mosaic_venv()
    mds = {name: work / f"mds-{name}" for name in MDS_SIZES}
    mds_bytes = {name: mosaic_write(py, raw, mds[name], size)["bytes"] for name, size in MDS_SIZES.items()}  # fmt: skip
    server = None if args.no_s3 else MotoServer()
    caches = cache_root(work, 4 * sum(mds_bytes.values()))
    try:
        if server is not None:
            client = server.client()
            client.create_bucket(Bucket="bench")
            server.upload("bench", "ours", ours)
            for name, path in mds.items():
                server.upload("bench", f"mds-{name}", path)
        best_local, best_s3, sweep = sweep_mosaic(
            py, mds, n_rows, args.sweep_repeats, server, caches
        )
        results = head_to_head(
            py, ours, mds, best_local, best_s3, n_rows, args.repeats, server, caches
        )
    finally:
        if server is not None:
            server.stop()
        if caches != work:
            shutil.rmtree(caches, ignore_errors=True)
    headers = [
        "packshard reading (1 rank, shuffled epoch)", "rows/s", "M tokens/s",
        "Mosaic + same build, rows/s", "ratio", "Mosaic raw samples, rows/s", "ratio", "load (1 min)",
    ]  # fmt: skip
    table = markdown_table(headers, result_table(results))
    sweep_table = markdown_table(["where", "Mosaic configuration", "rows/s (median)", ""], sweep)
    print(table)
    print(sweep_table)
    load_after = os.getloadavg()
    ours_bytes = sum(s["bytes"] for s in manifest["shards"])
    body = (
        f"Throughput: {n_rows} rows of seq_len {args.seq_len} ({n_tokens / 1e6:.1f}M true tokens) as "
        f"{len(manifest['shards'])} packshard shard(s) of record batches of {manifest['shards'][0]['rows_per_batch']} rows "
        f"({ours_bytes / 2**20:.1f} MiB) and as MDS shards with the same bytes per row (loss_mask as bits on both sides, "
        f"{mds_bytes['64MiB'] / 2**20:.1f} MiB). One rank, one shuffled epoch, each run a fresh process, timed from the "
        "reader's constructor (manifest/index reads, S3 client creation, downloads) to the epoch's last row; library "
        f"imports (packshard, torch, s3fs, pyarrow.fs / streaming, torch, boto3) before the window on both sides; ours reads S3 through pyarrow's S3 client (packers/s3_reading.py), Mosaic through boto3. Medians of {args.repeats} "
        "interleaved rounds; moto's S3 server runs in its own process; every cold-cache run (both sides) starts from an empty cache directory, deleted after it, on tmpfs (/dev/shm) where it has room (this disk, mounted with online discard, slows writes at random after a deletion), and the disk is synced before every run. Ours yields training-ready micro-batches (labels, "
        "position ids, cu_seqlens, ks/ke as torch tensors; every row checked against its checksum); a local dataset is read by the "
        "iterating thread (the stream's default there), \"prefetch thread\" reads it on the background thread instead (prefetch_thread=True, "
        "the default for S3); \"Mosaic + same build\" "
        "turns each Mosaic sample into the same micro-batch with packshard's build_microbatch (the same work, the ratio "
        "in bold); \"Mosaic raw\" only unpacks the mask (its most favourable reading). Mosaic has no cache-less mode (it "
        "always downloads whole shards), so both S3 rows compare with its cold-cache S3 run. Mosaic's best configuration "
        f"from the sweep below: local {describe(best_local)}" + (f"; S3 {describe(best_s3)}" if best_s3 else "") + ".\n\n"
        f"{table}\n\nMosaic sweep (median of {args.sweep_repeats} runs each; configurations in benchmarks/_stream_sides.py):\n\n"
        f"{sweep_table}\n\nBalance: {source}; {bal['rows']} rows packed at seq_len 32768 by BFD "
        f"(row cost max/mean {bal['cost_spread']:.2f}); max/mean rank cost per full step, dp=4, 3 epochs.\n\n"
        f"{markdown_table(bal_headers, bal_rows)}\n\n"
        f"Load average (1/5/15 min) before: {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after: {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} ({os.cpu_count()} cores)."
    )  # fmt: skip
    if args.append_results:
        record_result(
            "bench_stream", "bench_stream: PackedShardStream vs MosaicML streaming; DP balance", body,
            data={"runs": results, "sweep": sweep, "best_local": best_local, "best_s3": best_s3,
                  "load_before": load_before, "load_after": load_after},
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
