"""`packshard stats URL`: what a dataset holds, from manifest.json and index.arrow only.

No token data is read, so stats on a remote dataset of any size costs two small reads, and the
CLI adds one listing of the shard files (`ShardDataset.shard_file_problems`: a missing or
resized shard fails the command). Besides
the totals it reports what padding every row to seq_len would have cost on the same rows (the
number packshard exists to remove), and the first skipped records with their file:line.

The JSON form (`dataset_stats`) holds the numbers the text form (`format_stats`) prints, rounded
once, in `dataset_stats`, to the digits the text shows: the padding fraction to 5 decimals
(printed as a percentage with 3), the fill fractions to 4 (2), means to 2, medians exactly (a
median of integers is an integer or ends in .5). The text prints each JSON value with exactly
those digits, so the two never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from packshard.packers import ShardDataset
from packshard.packers.manifest import OVERLONG_COUNTS

SHOWN_EXAMPLES = 5  # skipped records printed by stats and the job's summary
MAX_EXAMPLES = 20  # skipped records the manifest keeps (scheduler.merge_counters)


def dataset_stats(ds: ShardDataset) -> dict[str, Any]:
    """A JSON-serialisable summary of the dataset (see `format_stats` for the text form)."""
    cfg, totals = ds.config, ds.manifest["totals"]
    seq_len = int(cfg["seq_len"])
    num_tokens = ds.index_column("num_tokens").astype(np.int64)
    padded = ds.index_column("padded_len").astype(np.int64)
    docs = ds.index_column("num_docs").astype(np.int64)
    rows = int(num_tokens.size)
    true_tokens, padded_tokens = int(num_tokens.sum()), int(padded.sum())
    seq_tokens = rows * seq_len
    edges = np.asarray(
        ds.manifest.get("histogram", {}).get("edges") or np.linspace(0, seq_len, 33).round(),
        dtype=np.int64,
    )
    counts, _ = np.histogram(num_tokens, bins=edges)
    return {
        "url": ds.url,
        "seq_len": seq_len,
        "cp": cfg.get("cp"),
        "pad_multiple": int(cfg["pad_multiple"]),
        "tokenizer": (cfg.get("tokenizer") or {}).get("name"),
        "packing": cfg.get("packing"),
        "shards": len(ds.shards),
        "rows": rows,
        "samples_in": totals.get("samples_in"),
        "samples_kept": totals.get("samples_kept"),
        "dropped": totals.get("dropped", {}),
        "overlong": {
            "policy": cfg.get("overlong"),
            **{k: totals.get(k, 0) for k in OVERLONG_COUNTS},
        },
        "documents": int(docs.sum()),
        "num_tokens": true_tokens,
        "padded_tokens": padded_tokens,
        "loss_tokens": int(ds.index_column("num_loss_tokens").astype(np.int64).sum()),
        "padding_fraction": _fraction(padded_tokens - true_tokens, padded_tokens, 5),
        "fill_vs_seq_len": _fraction(true_tokens, seq_tokens, 4),
        "pad_to_seq_len_fraction": _fraction(seq_tokens - true_tokens, seq_tokens, 4),
        "docs_per_row": {
            "mean": round(float(docs.mean()), 2) if rows else 0.0,
            "median": _median(docs),
            "max": int(docs.max()) if rows else 0,
        },
        "row_tokens": {
            "min": int(num_tokens.min()) if rows else 0,
            "median": _median(num_tokens),
            "max": int(num_tokens.max()) if rows else 0,
        },
        "histogram": {"edges": edges.tolist(), "counts": counts.tolist()},
        "bytes": sum(s.bytes for s in ds.shards),
        "skipped_examples": [list(e) for e in ds.manifest.get("skipped_examples") or []],
    }


def _fraction(part: int, whole: int, decimals: int) -> float:
    """part / whole rounded to the digits the text shows (as a percentage, 2 fewer decimals)."""
    return round(part / whole, decimals) if whole else 0.0


def _median(values: np.ndarray) -> int | float:
    """The median of integers: an int, or a float ending in .5 (exact either way)."""
    if not values.size:
        return 0
    m = float(np.median(values))
    return int(m) if m.is_integer() else m


def _num(x: int | float) -> str:
    """A count or median as the JSON holds it: 575 -> "575", 575.5 -> "575.5", thousands split."""
    return f"{x:,}" if isinstance(x, int) or not float(x).is_integer() else f"{int(x):,}"


def skipped_lines(
    examples: Sequence[Sequence[Any]], dropped: Mapping[str, int], label: str = "skipped      "
) -> list[str]:
    """The first skipped records (bad ones, and those `--overlong truncate` left without a loss
    token) as ``file:line: reason: detail`` lines (stats; the job's summary passes its own
    `label` column)."""
    shown = [e for e in examples if len(e) >= 4][:SHOWN_EXAMPLES]
    if not shown:
        return []
    listed = sum(n for reason, n in dropped.items() if reason != "overlong")
    lines = [
        f"{label}the first {len(shown)} of {listed:,} skipped records"
        + (
            f" (manifest.json's skipped_examples lists up to {MAX_EXAMPLES})"
            if listed > len(shown)
            else ""
        )
        + ":"
    ]
    for e in shown:
        text = f"{e[1]}: {e[2]}: {e[3]}"
        lines.append(
            f"{' ' * (len(label) - len(label.lstrip()) + 2)}{text[:240]}{'...' if len(text) > 240 else ''}"
        )
    return lines


def format_stats(st: Mapping[str, Any]) -> str:
    """Human-readable report of `dataset_stats`."""
    dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(st["dropped"].items())) or "none"
    lines = [
        f"dataset      {st['url']}",
        f"config       seq_len {st['seq_len']:,}  cp {st['cp']}  pad_multiple {st['pad_multiple']}  tokenizer {st['tokenizer']}",
        f"shards       {st['shards']:,} ({st['bytes'] / 2**20:,.1f} MiB)",
        f"samples      in {_n(st['samples_in'])}  kept {_n(st['samples_kept'])}  dropped: {dropped}",
        *_overlong_lines(st),
        f"rows         {st['rows']:,}  documents {st['documents']:,}  "
        f"docs/row mean {st['docs_per_row']['mean']:.2f} median {_num(st['docs_per_row']['median'])} max {st['docs_per_row']['max']}",
        f"tokens       true {st['num_tokens']:,}  padded {st['padded_tokens']:,}  loss {st['loss_tokens']:,}",
        f"padding      {100 * st['padding_fraction']:.3f}% of padded tokens (rows padded to a multiple of {st['pad_multiple']})",
        f"fill         {100 * st['fill_vs_seq_len']:.2f}% of rows x seq_len; padding every row to seq_len "
        f"would waste {100 * st['pad_to_seq_len_fraction']:.2f}%",
        f"row tokens   min {st['row_tokens']['min']:,}  median {_num(st['row_tokens']['median'])}  max {st['row_tokens']['max']:,}",
        *skipped_lines(st.get("skipped_examples") or [], st["dropped"]),
        "row-length histogram (true tokens per row):",
    ]
    edges, counts = st["histogram"]["edges"], st["histogram"]["counts"]
    peak = max(counts) if counts else 0
    for i, (lo, hi, c) in enumerate(zip(edges[:-1], edges[1:], counts, strict=False)):
        if c:
            bar = "#" * max(1, round(40 * c / peak))
            close = "]" if i == len(counts) - 1 else ")"  # numpy's last bin includes its right edge
            lines.append(f"  [{lo:>8,}, {hi:>8,}{close}  {c:>8,}  {bar}")
    return "\n".join(lines)


def _overlong_lines(st: Mapping[str, Any]) -> list[str]:
    """The overlong policy's line, when it cut, split or dropped anything."""
    o = st.get("overlong") or {}
    if not any(o.get(k) for k in OVERLONG_COUNTS):
        return []
    return [f"overlong     {overlong_text(o.get('policy'), {**o, 'dropped': st['dropped']})}"]


def overlong_text(policy: str | None, t: Mapping[str, Any]) -> str:
    """What the overlong policy did, from totals-like counters (`OVERLONG_COUNTS` and
    `dropped`): one sentence for `stats` and the job's summary."""
    if policy == "truncate":
        text = f"truncate: {t['truncated_samples']:,} samples cut, {t['truncated_tokens']:,} tokens lost"
        if emptied := t["dropped"].get("no_loss_after_truncate", 0):
            text += f"; {emptied:,} more dropped ({t['dropped_tokens']:,} tokens), their loss tokens all past seq_len"
        return text
    if policy == "split":
        text = f"split: {t['split_samples']:,} samples into {t['extra_pieces']:,} extra pieces"
        if t.get("lossless_pieces"):
            text += (
                f"; {t['lossless_pieces']:,} pieces ({t['lossless_piece_tokens']:,} tokens) carry no "
                "loss token and train nothing"
            )
        return text
    return f"drop: {t['dropped'].get('overlong', 0):,} samples, {t['dropped_tokens']:,} tokens"


def _n(x: Any) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def plot_stats(ds: ShardDataset, path: str) -> None:
    """PNG with the row-length distribution and where the tokens go (true / padding)."""
    from packshard._extras import require

    matplotlib = require("plot", "matplotlib", "packshard stats --plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = dataset_stats(ds)
    num_tokens = ds.index_column("num_tokens")
    padded = ds.index_column("padded_len")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.hist(num_tokens, bins=st["histogram"]["edges"], color="#3b75af")
    ax1.axvline(st["seq_len"], color="k", ls="--", lw=1, label=f"seq_len {st['seq_len']:,}")
    ax1.set_xlabel("true tokens per row")
    ax1.set_ylabel("rows")
    ax1.set_title(f"{st['rows']:,} rows, {st['documents']:,} documents")
    ax1.legend()
    seq_total = st["rows"] * st["seq_len"]
    labels = [f"packshard (pad to {st['pad_multiple']})", "pad to seq_len"]
    true = [st["num_tokens"], st["num_tokens"]]
    pad = [int((padded - num_tokens).sum()), seq_total - st["num_tokens"]]
    ax2.bar(labels, true, color="#3b75af", label="true tokens")
    ax2.bar(labels, pad, bottom=true, color="#d9534f", label="padding")
    for i, (t, p) in enumerate(zip(true, pad, strict=False)):
        ax2.text(i, t + p, f"{100 * p / (t + p):.2f}% pad", ha="center", va="bottom")
    ax2.set_ylabel("tokens")
    ax2.set_title("where the compute goes")
    ax2.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def stats_json(ds: ShardDataset) -> str:
    return json.dumps(dataset_stats(ds), indent=2)
