"""Where the top-k select's time goes (issue 5 diagnostic; GPU only).

    PYTHONPATH=. python3 benchmarks/select_probe.py --out $OUT/probe

The H200 run of 2026-12-03 measured the one-warp select at 9.9 ms for S = 64K, H = 64 (64K rows,
2.1e9 in-range scores: ~0.87 TB/s of the card's ~4.8), and none of three compaction changes
(float threshold test, unmasked interior blocks, prefetched blocks) moved it. This probe splits
the time without guessing:

1. a per-row cost model: R rows that all hold n in-range scores (random normal fp32), n in
   {8K, 16K, 32K, 64K}: select ms = R * (fixed + per_score * n) / concurrency, so the
   intercept of ms against n is the per-row fixed part (threshold select, exact select,
   staging write) and the slope is the compaction pass;
2. the same at topk 256 (candidate buffer 512 instead of 4096: a cheap exact select);
3. each variant's compiled kernel: registers, spills, shared memory, programs an SM, and SASS
   instruction counts (total, shuffles, global loads / stores, barriers) when cuobjdump runs;
4. the order step on the fixed select's staging rows (n = 64K): the stable torch sort + gather
   and the radix order variants (`ORDERS`, each checked against the sort), and torch.topk for
   scale.

Writes select_probe.json and select_probe.md under --out; nothing is appended to RESULTS.md
by the device run (`--append-results DIR` appends the markdown here afterwards).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import re
import statistics
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
from benchmarks.bench_indexer import event_ms
from packshard.kernels.order import finish_topk, order_topk
from packshard.kernels.topk import (
    FIXED_TOPK_CONFIG,
    SCAN_TOPK_CONFIG,
    TopkConfig,
    TopkWorkspace,
    _select_kernel,
    launch_select,
)

TITLE = "fp8 indexer (issue 5): where the top-k select's time goes"
ROWS = 16384
LENGTHS = (8192, 16384, 32768, 65536)
_FIXED = FIXED_TOPK_CONFIG
# The ballot study (2026-12-03, afternoon): the split select's compaction with warp-ballot
# positions (now the fixed top-k) against the block prefix sum it replaced; sm_90 SASS of the
# compaction loop (Triton 3.9, compiled on CPU): scan 737 instructions a 512-score block,
# ballot 449, ballot + float test 361, and 160 a 256-score block. The first variant is the
# reference of the "staging == fixed" column. The morning's variants are in RESULTS.md.
VARIANTS: dict[str, TopkConfig] = {
    "fixed (split 96, ballot 512 prefetch, early exit)": _FIXED,
    "scan (the morning's fixed)": SCAN_TOPK_CONFIG,
}
# the afternoon's probes also ran the select without early exit or prefetch, with the float
# threshold test, at blocks 128 and 256 and at 64 registers (RESULTS.md): none beat the fixed
# select at 32K scores a row or more. The order step's candidates (on the fixed select's
# staging rows, each checked against the stable torch sort):
ORDERS: dict[str, TopkConfig] = {
    "radix order (ballot peers, fixed)": _FIXED,
    "radix order (match.any peers)": dataclasses.replace(_FIXED, order_peers="match"),
}
TOPKS = (2048,)  # the morning's runs also timed topk 256 (a cheap exact select)


def compiled_select_kernels() -> dict:
    """{cache key: CompiledKernel} of `_select_kernel` on the current device."""
    found = {}
    for cache in _select_kernel.device_caches.values():
        found.update(cache[0])
    return found


def kernel_facts(ck) -> dict:
    facts: dict = {}
    for name in ("n_regs", "n_spills"):
        facts[name] = getattr(ck, name, None)
    md = ck.metadata
    facts["shared"] = getattr(md, "shared", None)
    facts["num_warps"] = getattr(md, "num_warps", None)
    try:
        sass = ck.asm["sass"]
        ops = []
        for ln in sass.splitlines():
            m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", ln)
            if m:
                ops.append(m.group(2))
        base = [op.split(".")[0] for op in ops]
        facts["sass_instructions"] = len(ops)
        for op in ("SHFL", "LDG", "STG", "BAR", "BRA", "ISETP", "FSETP", "IADD3", "LOP3", "SEL"):
            facts[f"sass_{op}"] = base.count(op)
    except Exception as exc:  # cuobjdump missing: the counts stay out
        facts["sass_error"] = repr(exc)[:200]
    return facts


def probe(out: Path | None) -> dict:
    dev = torch.device("cuda")
    width = max(LENGTHS)
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn((ROWS, width), device=dev, generator=g)
    ks = torch.zeros(ROWS, dtype=torch.int32, device=dev)
    res: dict = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "command": command_line(),
        "rows": ROWS,
        "timings": [],
        "kernels": {},
        "order": {},
        "order_same": {},  # radix orders: indices equal to the stable sort's
    }
    fixed_staging: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for name, cfg in VARIANTS.items():
        for topk in TOPKS:
            ws = TopkWorkspace.allocate(ROWS, topk, cfg, dev)
            before = set(compiled_select_kernels())
            for n in LENGTHS:
                ke = torch.full((ROWS,), n, dtype=torch.int32, device=dev)
                ms = event_ms(
                    lambda ke=ke, ws=ws, topk=topk, cfg=cfg: launch_select(
                        logits, 0, ks, ke, ws, topk=topk, row0=0, n_rows=ROWS, sentinel=width,
                        config=cfg,
                    ),
                    reps=5,
                )  # fmt: skip
                flagged = int(ws.status[:ROWS].sum())
                # the staging rows (winners in index order) must equal the fixed config's
                staging = (ws.skey[:ROWS].clone(), ws.sidx[:ROWS].clone())
                if name == next(iter(VARIANTS)):
                    fixed_staging[(topk, n)] = staging
                ref = fixed_staging.get((topk, n))
                same = ref is not None and all(
                    torch.equal(a, b) for a, b in zip(staging, ref, strict=True)
                )
                res["timings"].append(
                    {"variant": name, "topk": topk, "n": n, "ms": ms, "flagged": flagged,
                     "same_as_fixed": same}
                )  # fmt: skip
                print(json.dumps(res["timings"][-1]), flush=True)
            new = [k for k in compiled_select_kernels() if k not in before]
            for i, key in enumerate(new if topk == 2048 else []):
                label = name if len(new) == 1 else f"{name} (launch {i + 1})"
                ck = compiled_select_kernels()[key]
                res["kernels"][label] = kernel_facts(ck)
                print(label, json.dumps(res["kernels"][label]), flush=True)
                if out is not None and name.startswith("fixed"):
                    out.mkdir(parents=True, exist_ok=True)
                    (out / "fixed_select.sass").write_text(str(ck.asm.get("sass", "")))
            if name.startswith("fixed") and topk == 2048:
                res["order"]["stable sort + gather"] = event_ms(
                    lambda ws=ws: finish_topk(ws, ROWS, 2048), reps=5
                )
                want = finish_topk(ws, ROWS, 2048)
                got = torch.empty_like(want)
                for label, ocfg in ORDERS.items():
                    res["order"][label] = event_ms(
                        lambda ws=ws, o=got, c=ocfg: order_topk(ws, o, ROWS, 2048, c), reps=5
                    )
                    res["order_same"][label] = torch.equal(got, want)
            del ws
    for n in (8192, 65536):
        res["order"][f"torch.topk over [{ROWS}, {n}]"] = event_ms(
            lambda n=n: torch.topk(logits[:, :n], 2048, dim=1), reps=5
        )
    res["fit"] = fit(res["timings"])
    res["markdown"] = markdown(res)
    return save_probe(out, "select_probe", res)


def fit(timings: list[dict]) -> list[dict]:
    """Least-squares ms = a + b * n per (variant, topk): a = the per-row fixed part over all rows."""
    rows = []
    keys = sorted({(t["variant"], t["topk"]) for t in timings}, key=str)
    for var, topk in keys:
        pts = [(t["n"], t["ms"]) for t in timings if t["variant"] == var and t["topk"] == topk]
        mx = statistics.fmean(n for n, _ in pts)
        my = statistics.fmean(m for _, m in pts)
        b = sum((n - mx) * (m - my) for n, m in pts) / sum((n - mx) ** 2 for n, _ in pts)
        rows.append(
            {"variant": var, "topk": topk, "fixed_ms": my - b * mx, "ms_per_1k_scores": b * 1024}
        )
    return rows


def markdown(res: dict) -> str:
    lines = [
        f"Measured {res['date']}. {res['rows']} rows of n in-range scores each (random normal fp32), one select launch; "
        "CUDA-event medians (>= 5 repetitions and >= 40 ms of timed work; the runs of "
        "2026-12-03: 5).\n",
    ]
    by = {(t["variant"], t["topk"], t["n"]): t for t in res["timings"]}
    head = [
        "variant",
        "topk",
        *(f"n={n // 1024}K ms" for n in LENGTHS),
        "fixed part ms",
        "ms per 1K scores/row",
        "flagged rows (64K)",
        "staging == fixed",
    ]
    body = []
    for f in res["fit"]:
        v, k = f["variant"], f["topk"]
        body.append(
            [v, k, *(f"{by[(v, k, n)]['ms']:.2f}" for n in LENGTHS), f"{f['fixed_ms']:.2f}",
             f"{f['ms_per_1k_scores']:.3f}", by[(v, k, max(LENGTHS))]["flagged"],
             "yes" if all(by[(v, k, n)].get("same_as_fixed") for n in LENGTHS) else "NO"]
        )  # fmt: skip
    lines.append(markdown_table(head, body))
    if res["kernels"]:
        names = sorted({k for facts in res["kernels"].values() for k in facts})
        lines.append("\nCompiled select kernels (topk 2048):\n")
        lines.append(
            markdown_table(
                ["variant", *names],
                [[v, *(facts.get(k, "") for k in names)] for v, facts in res["kernels"].items()],
            )
        )
    lines.append("\nOrder step and torch.topk on the same rows:\n")
    same = res.get("order_same", {})
    lines.append(
        markdown_table(
            ["what", "ms", "same indices as the stable sort"],
            [[k, f"{v:.2f}", same.get(k, "")] for k, v in res["order"].items()],
        )
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    probe_main(__doc__, TITLE, "select_probe.py", "select_probe.json", probe)


if __name__ == "__main__":
    main()
