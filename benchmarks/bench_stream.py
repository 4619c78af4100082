"""Streaming rows into a rank: packshard's PackedShardStream vs MosaicML streaming, and the
quality of the DP balance (cost vs count).

    python benchmarks/bench_stream.py [--rows 1500] [--seq-len 8192] [--repeats 3]

1. Throughput. The same packed token rows (a chat + long-trajectory length mix, random token
   ids) are written twice: as a packshard dataset (the foundation's writer, default record
   batches) and as MDS shards (Mosaic's own `MDSWriter`). One rank (world size 1) reads one
   shuffled epoch; rows/s and true tokens/s are reported per rank, from local disk and from a
   moto S3 server that the script starts on 127.0.0.1 (and stops). From S3 both sides start
   with an empty local cache, so the time includes downloading the shards (Mosaic always
   downloads whole shards; ours with `cache_dir`). Ours without a cache (range reads) is shown
   too. Ours delivers full micro-batches (labels, position ids, cu_seqlens, ks/ke as torch
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
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks._results import append_result, markdown_table  # noqa: E402
from packshard.packers import CostModel, DatasetWriter, apply_overlong, pack_table, plan_bins  # noqa: E402
from packshard.packers.rows import list_parts  # noqa: E402
from packshard.trainer_shim import PackedShardStream  # noqa: E402
from packshard.trainer_shim.planning import StepPlanner, step_imbalance  # noqa: E402
from packshard.trainer_shim.synthetic import synthetic_table  # noqa: E402

BENCH = REPO / ".bench"
MOSAIC_VENV = BENCH / "mosaic-venv"
RUNNER = REPO / "benchmarks" / "_mosaic_runner.py"
SHARED = REPO.parent / "shared" / "data"

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
    w = DatasetWriter(str(ours), config)
    w.write(batch)
    manifest = w.close({"samples_in": 0, "samples_kept": 0, "dropped": {}})
    ids_off, ids = list_parts(batch.column("input_ids"), np.int32)
    _, mask = list_parts(batch.column("loss_mask"), np.uint8)
    doc_off, docs = list_parts(batch.column("doc_lens"), np.int32)
    raw = work / "rows.npz"
    np.savez(
        raw, input_ids=ids, loss_mask=mask, row_offsets=ids_off, doc_lens=docs, doc_offsets=doc_off
    )
    return ours, raw, manifest


def ensure_mosaic_venv() -> Path:
    py = MOSAIC_VENV / "bin" / "python"
    if py.exists():
        return py
    uv = (
        [str(REPO / ".venv" / "bin" / "uv")]
        if (REPO / ".venv" / "bin" / "uv").exists()
        else [sys.executable, "-m", "uv"]
    )
    links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    import torch

    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    print(
        f"creating {MOSAIC_VENV} (mosaicml-streaming 0.13, {torch_pin}, transformers<5) ...",
        flush=True,
    )
    subprocess.run([*uv, "venv", "-q", str(MOSAIC_VENV), "--python", sys.executable], check=True)
    pip = [*uv, "pip", "install", "-q", "--python", str(py), *links]
    subprocess.run(
        [
            *pip,
            torch_pin,
            "transformers<5",
            "numpy<2.2",
            "boto3",
            "xxhash",
            "zstd",
            "Brotli",
            "python-snappy",
            "tqdm",
            "catalogue",
            "matplotlib<4",
        ],
        check=True,
    )
    subprocess.run([*pip, "--no-deps", "mosaicml-streaming==0.13.0"], check=True)
    return py


def mosaic(py: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run(
        [str(py), str(RUNNER), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=1800,
    )
    if out.returncode:
        raise RuntimeError(f"Mosaic runner failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_ours(url: str, *, limit: int | None = None, **kw) -> dict:
    t0 = time.perf_counter()
    stream = PackedShardStream(url, dp_rank=0, dp_size=1, rows_per_step=8, seed=0, **kw)
    rows = tokens = 0
    for mb in stream:
        rows += mb["row"] >= 0
        tokens += mb["num_tokens"]
        if limit is not None and rows >= limit:
            break
    dt = time.perf_counter() - t0
    stream.close()
    return {"rows": rows, "tokens": tokens, "seconds": dt}


def upload(client, bucket: str, prefix: str, root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root).as_posix()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1500, help="packed rows in the throughput dataset")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-s3", action="store_true")
    p.add_argument(
        "--no-append", action="store_true", help="print only; do not append to RESULTS.md"
    )
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's request log

    lengths, source = mix_lengths()
    bal_rows, bal = balance_table(lengths)
    bal_headers = [
        "rows_per_step (dp=4)",
        "cost mean",
        "cost p95",
        "cost max",
        "count mean",
        "count p95",
        "count max",
        "optimum mean",
    ]
    print(markdown_table(bal_headers, bal_rows))

    work = BENCH / "stream"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ours, raw, manifest = build_datasets(lengths, args.seq_len, args.rows, work)
    n_rows, n_tokens = manifest["totals"]["rows"], manifest["totals"]["num_tokens"]
    py = ensure_mosaic_venv()
    mds = work / "mds"
    mosaic(py, "write", str(raw), str(mds))

    server = None
    results: dict[str, list[dict]] = {}
    try:
        s3: dict[str, str] = {}
        opts: dict[str, str] = {}
        if not args.no_s3:
            import boto3
            from moto.server import ThreadedMotoServer

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
            server.start()
            endpoint = f"http://127.0.0.1:{port}"
            os.environ.update(
                AWS_ACCESS_KEY_ID="testing",
                AWS_SECRET_ACCESS_KEY="testing",
                AWS_DEFAULT_REGION="us-east-1",
            )
            client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
            client.create_bucket(Bucket="bench")
            upload(client, "bench", "ours", ours)
            upload(client, "bench", "mds", mds)
            opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
            s3 = {"S3_ENDPOINT_URL": endpoint}
        # warm-up: imports (s3fs, pyarrow's pandas shim) out of the timed runs, as Mosaic's are
        read_ours(str(ours), limit=16)
        if s3:
            read_ours("s3://bench/ours", storage_options=opts, limit=16)
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}", flush=True)
            results.setdefault("ours local", []).append(read_ours(str(ours)))
            results.setdefault("Mosaic local", []).append(
                mosaic(py, "read", "--local", str(mds), "--shuffle")
            )
            if s3:
                cache = work / f"cache-{rep}"
                results.setdefault("ours S3, cache_dir (cold)", []).append(
                    read_ours("s3://bench/ours", storage_options=opts, cache_dir=cache)
                )
                mlocal = work / f"mds-cache-{rep}"
                results.setdefault("Mosaic S3 (cold local cache)", []).append(
                    mosaic(
                        py,
                        "read",
                        "--local",
                        str(mlocal),
                        "--remote",
                        "s3://bench/mds",
                        "--shuffle",
                        env=s3,
                    )
                )
                results.setdefault("ours S3, range reads, no cache (first 200 rows)", []).append(
                    read_ours("s3://bench/ours", storage_options=opts, limit=200)
                )
                shutil.rmtree(cache, ignore_errors=True)
                shutil.rmtree(mlocal, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] / r["seconds"] for r in results[name])

    for name, runs in results.items():
        full = "first" not in name
        for r in runs:
            if full and r["rows"] != n_rows:  # real rows, fillers excluded
                raise RuntimeError(f"{name} read {r['rows']} rows, the dataset has {n_rows}")
    rows_out = []
    for name in results:
        peer = "Mosaic local" if "local" in name else "Mosaic S3 (cold local cache)"
        ratio = (
            med(name, "rows") / med(peer, "rows")
            if not name.startswith("Mosaic") and peer in results
            else None
        )
        rows_out.append(
            [
                name,
                f"{med(name, 'rows'):,.0f}",
                f"{med(name, 'tokens') / 1e6:,.2f}",
                f"{ratio:.2f}x" if ratio else "-",
            ]
        )
    headers = ["reader (1 rank, shuffled epoch)", "rows/s", "M tokens/s", "vs Mosaic rows/s"]
    table = markdown_table(headers, rows_out)
    print(table)
    load_after = os.getloadavg()
    body = (
        f"Throughput: {n_rows} rows of seq_len {args.seq_len} ({n_tokens / 1e6:.1f}M true tokens, "
        f"{len(manifest['shards'])} packshard shards of record batches of {manifest['shards'][0]['rows_per_batch']} rows; "
        f"MDS shards of 32 MiB), median of {args.repeats} interleaved runs. Ours yields finished micro-batches "
        "(labels, position ids, cu_seqlens, ks/ke, torch tensors), Mosaic raw numpy samples.\n\n"
        f"{table}\n\nBalance: {source}; {bal['rows']} rows packed at seq_len 32768 by BFD "
        f"(row cost max/mean {bal['cost_spread']:.2f}); max/mean rank cost per full step, dp=4, 3 epochs.\n\n"
        f"{markdown_table(bal_headers, bal_rows)}\n\n"
        f"Load average (1/5/15 min) before: {load_before[0]:.2f}/{load_before[1]:.2f}/{load_before[2]:.2f}, "
        f"after: {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} (2 cores shared with other work)."
    )
    if not args.no_append:
        append_result("bench_stream: PackedShardStream vs MosaicML streaming; DP balance", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
