"""The pack job's progress bar (driver side) and its end-of-job summary.

On a terminal the bar is a tqdm line: samples done / to do, tokens/s, rows and shards written,
ETA. Elsewhere (``ray job logs``, CI) it logs one line every 30 s instead, so logs stay short.
The summary names every number a user checks after a run: samples in / kept / dropped by
reason, truncations and splits, rows, shards, padding, and tokens/s.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from tqdm import tqdm

log = logging.getLogger("packshard.pipeline.pack")

LOG_EVERY_S = 30.0


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


class JobProgress:
    """Counts reported by the scheduler; a bar on a TTY, periodic log lines elsewhere."""

    def __init__(self, total_samples: int, *, enabled: bool = True, kept_shards: int = 0) -> None:
        self.total = total_samples
        self.samples = 0
        self.tokens = 0
        self.rows = 0
        self.shards_written = 0
        self.shards_planned = kept_shards
        self.kept_shards = kept_shards
        self.start = time.perf_counter()
        self._last_log = self.start
        self._bar = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm(
                total=total_samples, unit="sample", desc="pack", dynamic_ncols=True, smoothing=0.1
            )
        self._log = enabled and self._bar is None

    def tokenized(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(samples)

    def planned(self, shards: int) -> None:
        self.shards_planned = shards

    def written(self, result: Any) -> None:
        self.rows += result.record.rows
        self.shards_written += 1

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def refresh(self) -> None:
        rate = self.tokens / self.elapsed if self.elapsed > 0 else 0.0
        shards = f"{self.shards_written + self.kept_shards}/{self.shards_planned}"
        if self._bar is not None:
            self._bar.set_postfix_str(
                f"{_si(rate)} tok/s, {self.rows:,} rows, shards {shards}", refresh=False
            )
            self._bar.refresh()
        elif self._log and time.perf_counter() - self._last_log >= LOG_EVERY_S:
            self._last_log = time.perf_counter()
            frac = self.samples / self.total if self.total else 1.0
            eta = self.elapsed * (1 - frac) / frac if frac > 0 else float("nan")
            log.info(
                "pack: %.1f%% samples %s/%s | %s tok/s | rows %s | shards %s | ETA %s",
                100 * frac,
                f"{self.samples:,}",
                f"{self.total:,}",
                _si(rate),
                f"{self.rows:,}",
                shards,
                time.strftime("%H:%M:%S", time.gmtime(eta)) if eta == eta else "?",
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def format_summary(
    manifest: Mapping[str, Any],
    *,
    url: str,
    seconds: float,
    tokenized_tokens: int,
    workers: int,
    kept_shards: int,
) -> str:
    """The end-of-job summary (printed by pack.py)."""
    t = manifest["totals"]
    cfg = manifest["config"]
    dropped = ", ".join(f"{k} {v:,}" for k, v in t["dropped"].items()) or "none"
    n_dropped = sum(t["dropped"].values())
    lines = [
        f"packshard pack: committed {url} in {seconds:.1f} s",
        f"  samples   in {t['samples_in']:,}  kept {t['samples_kept']:,}  dropped {n_dropped:,} ({dropped})",
    ]
    policy = cfg["overlong"]
    if policy == "truncate":
        lines.append(
            f"  overlong  truncate: {t['truncated_samples']:,} samples cut, {t['truncated_tokens']:,} tokens lost"
        )
    elif policy == "split":
        lines.append(
            f"  overlong  split: {t['split_samples']:,} samples into {t['extra_pieces']:,} extra pieces"
        )
    else:
        lines.append(
            f"  overlong  drop: {t['dropped'].get('overlong', 0):,} samples, {t['dropped_tokens']:,} tokens"
        )
    mib = sum(s["bytes"] for s in manifest["shards"]) / 2**20
    lines += [
        f"  rows      {t['rows']:,} in {len(manifest['shards'])} shards ({mib:,.1f} MiB); padding {100 * t['padding_fraction']:.3f}% "
        f"(rows padded to a multiple of {cfg['pad_multiple']}, at most seq_len {cfg['seq_len']:,})",
        f"  tokens    {t['num_tokens']:,} true, {t['loss_tokens']:,} loss, {t['padded_tokens']:,} stored",
        f"  speed     {_si(tokenized_tokens / seconds if seconds > 0 else 0)} tokens/s over the whole job ({workers} workers)",
    ]
    if kept_shards:
        lines.append(
            f"  resumed   kept {kept_shards} verified shards of the interrupted run, wrote {len(manifest['shards']) - kept_shards}"
        )
    return "\n".join(lines)
