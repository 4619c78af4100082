"""Does the count of query chunks cost logits time? (issue 5; GPU only)

    PYTHONPATH=. python3 benchmarks/chunk_probe.py --out $OUT/chunks

`fp8_indexer_topk` computes a row's logits one query chunk at a time (`plan_chunks`, under
`IndexerConfig.max_chunk_bytes`, 8 GiB), each a launch whose last wave leaves SMs idle. At each
shape this times the fixed logits config over the chunks `plan_chunks` makes under the default
bound and larger ones (fewer, bigger launches, one shared buffer), interleaved
(`time_interleaved`, medians). Its run of 2026-12-04 13:36 (RESULTS.md) planned every chunk as
rows of all keys (10 chunks at 128K under 8 GiB); chunks are now sized by their key windows.
Writes chunk_probe.json and .md under --out; `--append-results FILE` appends the markdown to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import datetime as _dt
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._results import (
    command_line,
    machine_description,
    markdown_table,
    probe_main,
    save_probe,
)
from benchmarks.bench_indexer import TOPK, D, count_pairs, logits_runner, random_row, row_ranges
from benchmarks.indexer_final import shape_name, time_interleaved
from packshard.kernels.fp8_indexer import FIXED_CONFIG, plan_chunks, prepare_inputs
from packshard.kernels.logits import FIXED_LOGITS_CONFIG
from packshard.kernels.topk import TopkWorkspace

TITLE = "fp8 indexer (issue 5): logits time against the count of query chunks"
BOUNDS_GIB = (8, 16, 32, 96)  # the fixed bound first; 96 GiB: one chunk up to 128K x 128K
SHAPES = (
    (64, 65536, False),
    (64, 65536, True),
    (64, 131072, False),
    (64, 131072, True),
    (32, 131072, True),
)
ROUNDS = 7


def plans(p, bounds_gib=BOUNDS_GIB) -> dict[str, list[tuple[int, int, int, int]]]:
    """The fixed config's chunk plan under each bound, named by the bound and chunk count."""
    extra = TopkWorkspace.bytes_per_row(TOPK, FIXED_CONFIG.topk)
    out = {}
    for gib in bounds_gib:
        chunks = plan_chunks(p.ks_host, p.ke_host, p.k8.shape[0], extra, gib << 30)
        if chunks not in out.values():  # a larger bound with the same plan adds nothing
            out[f"{gib} GiB ({len(chunks)} chunks)"] = chunks
    return out


def probe(out: Path | None) -> dict:
    res: dict = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "command": command_line(),
        "config": FIXED_LOGITS_CONFIG.label,
        "shapes": [],
    }
    for h, s, packed in SHAPES:
        ks, ke = row_ranges(s, packed)
        q, k, w = random_row(s, h, seed=s + h + packed)
        p = prepare_inputs(q, k, w, ks.cuda(), ke.cuda())
        ps = plans(p)
        size = max((r1 - r0) * wd for c in ps.values() for r0, r1, _, wd in c)
        buf = torch.empty(size, dtype=torch.float32, device="cuda")
        runners = {n: logits_runner(p, FIXED_LOGITS_CONFIG, buf, c) for n, c in ps.items()}
        ms = time_interleaved(runners, ROUNDS, seed=s + h)
        flops = 2 * h * D * count_pairs(ks, ke)
        r = {"shape": shape_name(h, s, packed), "ms": ms}
        r["tflops"] = {n: flops / (v * 1e9) for n, v in ms.items()}
        res["shapes"].append(r)
        print(r, flush=True)
        del p, q, k, w, buf, runners
        torch.cuda.empty_cache()
    res["markdown"] = markdown(res)
    return save_probe(out, "chunk_probe", res)


def markdown(res: dict) -> str:
    body = []
    for r in res["shapes"]:
        base = next(iter(r["ms"].values()))  # the fixed bound
        cells = [f"{n}: {v:.3f} ({v / base:.3f}), {r['tflops'][n]:.0f}" for n, v in r["ms"].items()]
        body.append([r["shape"], *cells])
    head = ["shape", *(f"bound {i + 1}" for i in range(len(BOUNDS_GIB)))]
    return (
        f"Measured {res['date']}. Logits ms of {res['config']} (ratio to the 8 GiB plan), "
        f"TFLOP/s, all chunks of a topk call under each bound, interleaved, {ROUNDS} rounds, "
        "medians.\n\n" + markdown_table(head, body) + "\n"
    )


if __name__ == "__main__":
    probe_main(__doc__, TITLE, "chunk_probe.py", "chunk_probe.json", probe)
