"""The pack job's progress bar (driver side) and its end-of-job summary.

On a terminal the bar is a tqdm line: samples tokenized of the total, percentage, tokens/s, rows
and shards written, elapsed time and ETA. Elsewhere (``ray job logs``, CI) it logs the same as
one line after 10 s and then every 30 s, so logs stay short. The ETA extrapolates the samples
tokenized so far (tokenizing is ~95% of the job's work). The summary names every number a user
checks after a run: samples in / kept / dropped by reason (with the first skipped records'
file:line), truncations and splits, rows, shards, padding, and tokens/s.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from packshard.pipeline.samples import REASONS
from packshard.pipeline.stats import SHOWN_EXAMPLES, overlong_text, skipped_lines

log = logging.getLogger("packshard.pipeline.pack")

LOG_FIRST_S = 10.0
LOG_EVERY_S = 30.0


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _clock(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class JobProgress:
    """Counts reported by the scheduler; a bar on a TTY, periodic log lines elsewhere."""

    def __init__(self, total_samples: int, *, enabled: bool = True, kept_shards: int = 0) -> None:
        self._total = total_samples
        self.samples = 0
        self.tokens = 0
        self.rows = 0
        self.shards_written = 0
        self.kept_shards = kept_shards
        self.bad: dict[str, int] = {}
        self.bad_examples: list[tuple[Any, ...]] = []
        self.start = time.perf_counter()
        self._next_log = self.start + LOG_FIRST_S
        self._bar = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm(
                total=total_samples, unit="sample", desc="pack", dynamic_ncols=True, smoothing=0.1
            )
        self._log = enabled and self._bar is None

    @property
    def total(self) -> int:
        """Samples to tokenize in this run (kept shards' samples excluded)."""
        return self._total

    @total.setter
    def total(self, n: int) -> None:
        self._total = n
        if self._bar is not None:
            self._bar.total = n
            self._bar.refresh()

    def tokenized(self, samples: int, tokens: int) -> None:
        self.samples += samples
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(samples)

    def skipped(self, status: Any, examples: Sequence[Sequence[Any]]) -> None:
        """A tokenized block's bad records: per-record status codes (0: good, k: REASONS[k - 1])
        and the block's first examples (sample id, location, reason, detail)."""
        for code, n in zip(*np.unique(np.asarray(status), return_counts=True), strict=True):
            if code:
                reason = REASONS[int(code) - 1]
                self.bad[reason] = self.bad.get(reason, 0) + int(n)
        self.bad_examples = sorted([*self.bad_examples, *map(tuple, examples)])[:SHOWN_EXAMPLES]

    def drop_reasons(self, overlong: str) -> str:
        """Why samples were dropped so far: counts by reason and the first records, for the
        error that says nothing is left to pack."""
        counts = ", ".join(f"{r} {n:,}" for r, n in sorted(self.bad.items()))
        parts = [counts or "no bad records"]
        if overlong == "drop":
            parts.append("the others are longer than --seq-len (--overlong drop)")
        text = "; ".join(parts)
        for e in self.bad_examples:
            text += f"\n  {e[1]}: {e[2]}: {e[3]}"
        return text

    def written(self, result: Any) -> None:
        self.rows += result.record.rows
        self.shards_written += 1

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def fraction(self) -> float:
        return min(1.0, self.samples / self._total) if self._total else 1.0

    @property
    def eta(self) -> float:
        """Seconds left, extrapolated from the samples tokenized so far (nan before any)."""
        frac = self.fraction
        return self.elapsed * (1 - frac) / frac if frac > 0 else float("nan")

    def line(self) -> str:
        """One progress line: percentage, samples of the total, speed, rows, shards, times."""
        rate = self.tokens / self.elapsed if self.elapsed > 0 else 0.0
        return (
            f"pack: {100 * self.fraction:5.1f}% | samples {self.samples:,}/{self._total:,} | "
            f"{_si(rate)} tok/s | rows {self.rows:,} | shards {self._shards()} | "
            f"elapsed {_clock(self.elapsed)} | ETA {_clock(self.eta)}"
        )

    def _shards(self) -> str:
        """Shards done (kept from an interrupted run, or written): how many the job makes is
        known only once every window is planned, so no "of N" that would move."""
        done = self.shards_written + self.kept_shards
        return f"{done:,}" + (f" ({self.kept_shards:,} kept)" if self.kept_shards else "")

    def refresh(self) -> None:
        if self._bar is not None:
            rate = self.tokens / self.elapsed if self.elapsed > 0 else 0.0
            self._bar.set_postfix_str(
                f"{_si(rate)} tok/s, {self.rows:,} rows, shards {self._shards()}", refresh=False
            )
            self._bar.refresh()
        elif self._log and time.perf_counter() >= self._next_log:
            self._next_log = time.perf_counter() + LOG_EVERY_S
            log.info("%s", self.line())

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
    lines.append(f"  overlong  {overlong_text(cfg['overlong'], t)}")
    mib = sum(s["bytes"] for s in manifest["shards"]) / 2**20
    lines += [
        f"  rows      {t['rows']:,} in {len(manifest['shards'])} shards ({mib:,.1f} MiB); padding {100 * t['padding_fraction']:.3f}% "
        f"(rows padded to a multiple of {cfg['pad_multiple']}, at most seq_len {cfg['seq_len']:,})",
        f"  tokens    {t['num_tokens']:,} true, {t['loss_tokens']:,} loss, {t['padded_tokens']:,} stored",
        f"  speed     {_si(tokenized_tokens / seconds if seconds > 0 else 0)} tokens/s over the whole job ({workers} worker{'s' if workers != 1 else ''})",
    ]
    if kept_shards:
        lines.append(
            f"  resumed   kept {kept_shards} verified shards of the interrupted run, wrote {len(manifest['shards']) - kept_shards}"
        )
    lines += skipped_lines(manifest.get("skipped_examples") or [], t["dropped"], "  skipped   ")
    return "\n".join(lines)
