"""ks/ke on the host or on the GPU: an indexer call behind queued GPU work (issue 5; GPU only).

    PYTHONPATH=. python3 benchmarks/indexer_sync.py --out $OUT/sync

In a model the indexer is called while the GPU still works through what the host queued before
it (the layers before). `fp8_indexer_topk` plans its chunks on the host from ks / ke: ranges on
the GPU must first be copied back, so the call waits for all of that queued work and the GPU
then idles while the host checks, plans and queues the first launches. Ranges on the CPU (as
`trainer_shim` hands them out) need no such wait.

At each shape: `torch.cuda._sleep` queues ~QUEUED_MS of GPU work, then one indexer call, then a
sync; the wall time of the whole, interleaved between ranges on the GPU (the peer: what a caller
that moved its batch to the GPU gets) and on the CPU (pinned, as `trainer_shim` hands them
out), ROUNDS rounds, medians. The same without
the queued work, and the queued work alone, for reference. The indices of both are compared
bitwise. Writes indexer_sync.json and .md under --out; `--append-results FILE` appends the
markdown to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import datetime as _dt
import json
import statistics
import sys
import time
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
from benchmarks.bench_indexer import TOPK, random_row, row_ranges
from benchmarks.indexer_final import shape_name
from packshard.kernels import fp8_indexer_topk

TITLE = "fp8 indexer (issue 5): ranges from the host against ranges on the GPU"
SHAPES = ((64, 4096, False), (64, 4096, True), (64, 16384, False), (64, 65536, False))
QUEUED_MS = 5.0
ROUNDS = 15


def _sleep_cycles(ms: float) -> int:
    """Cycles of `torch.cuda._sleep` that take ~ms on this GPU (measured once)."""
    n = 1_000_000
    torch.cuda._sleep(n)  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(n)
    torch.cuda.synchronize()
    return int(n * ms / ((time.perf_counter() - t0) * 1e3))


def _wall_ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def run(out: Path | None) -> dict:
    cycles = _sleep_cycles(QUEUED_MS)
    res: dict = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "command": command_line(),
        "queued_ms": statistics.median(
            _wall_ms(lambda: torch.cuda._sleep(cycles)) for _ in range(5)
        ),
        "shapes": [],
    }
    for h, s, packed in SHAPES:
        res["shapes"].append(_shape(h, s, packed, cycles))
        torch.cuda.empty_cache()
    res["markdown"] = markdown(res)
    return save_probe(out, "indexer_sync", res)


def _shape(h: int, s: int, packed: bool, cycles: int) -> dict:
    """One shape: both range placements, behind queued work and alone, interleaved."""
    ks, ke = row_ranges(s, packed)
    q, k, w = random_row(s, h, seed=s + h + packed)
    # on the CPU pinned, as trainer_shim hands them out (PackedShardStream's ks_host / ke_host)
    ranges = {"GPU": (ks.cuda(), ke.cuda()), "CPU": (ks.pin_memory(), ke.pin_memory())}
    got = {m: fp8_indexer_topk(q, k, w, *r, TOPK) for m, r in ranges.items()}  # and warm

    def behind(r) -> None:
        torch.cuda._sleep(cycles)
        fp8_indexer_topk(q, k, w, *r, TOPK)

    times: dict[str, list[float]] = {}
    for i in range(ROUNDS):
        for m in list(ranges) if i % 2 == 0 else list(reversed(ranges)):
            r = ranges[m]
            times.setdefault(f"{m}, behind queued work", []).append(_wall_ms(lambda r=r: behind(r)))
            times.setdefault(f"{m}, alone", []).append(
                _wall_ms(lambda r=r: fp8_indexer_topk(q, k, w, *r, TOPK))
            )
    ms = {n: statistics.median(v) for n, v in times.items()}
    shape = shape_name(h, s, packed)
    same = bool(torch.equal(got["GPU"], got["CPU"]))
    print(shape, json.dumps({n: round(v, 3) for n, v in ms.items()}), same, flush=True)
    return {"shape": shape, "ms": ms, "same_indices": same}


def markdown(res: dict) -> str:
    head = [
        "shape",
        "ranges on the GPU: behind queued work / alone, ms",
        "ranges on the CPU: behind queued work / alone, ms",
        "saved behind queued work, ms",
        "same indices",
    ]
    body = []
    for r in res["shapes"]:
        ms = r["ms"]
        body.append(
            [
                r["shape"],
                f"{ms['GPU, behind queued work']:.2f} / {ms['GPU, alone']:.2f}",
                f"{ms['CPU, behind queued work']:.2f} / {ms['CPU, alone']:.2f}",
                f"{ms['GPU, behind queued work'] - ms['CPU, behind queued work']:.2f}",
                r["same_indices"],
            ]
        )
    return (
        f"Measured {res['date']}. Wall time of `fp8_indexer_topk` (topk {TOPK}) with "
        f"{res['queued_ms']:.2f} ms of GPU work queued before it (`torch.cuda._sleep`, then the "
        f"call, then a sync) and alone; ranges on the GPU or on the CPU (pinned) interleaved, "
        f"{ROUNDS} rounds, medians.\n\n" + markdown_table(head, body) + "\n"
    )


def main() -> None:
    probe_main(__doc__, TITLE, "indexer_sync.py", "indexer_sync.json", run)


if __name__ == "__main__":
    main()
