"""The long-trajectory mix at CPU scale, packed twice (pad8 / padseq) like the GPU data.

The GPU run reads `.bench/multigpu_data/long_greedy/{pad8,padseq}`: the e2e ablation's
long-trajectory mix (real SWE-agent trajectories + synthetic ones, Qwen2.5 tokens) packed at
32K by `packshard.pipeline.pack --algorithm greedy` (in order, as a sequential loader packs), made by
`benchmarks.e2e_ablation.data.prepare(..., rows=160, workloads=("long_greedy",))` (~21% of
the padded-to-seq_len positions are padding). A CPU cannot run 32K rows through even a tiny
DSA model in useful time, so the CPU proxy uses the same *shape* of mix at `seq_len` tokens:

- document lengths as the e2e synthesis draws them, scaled by seq_len / 32768: 85% from a
  log-normal with median 0.55 x seq_len, sigma 0.4, clipped to [0.12, 0.95] x
  seq_len; 15% uniform in [0.06, 0.47] x seq_len (the real trajectories' 1.9K-15.3K);
- random token ids below the tiny model's vocabulary, loss on the last 70% of each document;
- packed in order with greedy next-fit by `packers.pack_table` (the function packshard.pipeline.pack's
  pack tasks call), to a multiple of `pad_multiple` (`pad8/`) and to seq_len with token 0
  (`padseq/`): the same rows in the same order, as in the GPU data.

The length quantiles (5/10/25/50/75/90%: 0.19/0.26/0.37/0.50/0.68/0.88 x seq_len) match those of
the GPU mix's documents (0.19/0.25/0.34/0.53/0.70/0.89 of 32K) within 0.04. Greedy packing of
64 rows leaves 24.4% padding in padseq (the GPU data: 21.6%; the seed observation: 19.7%).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from packshard.packers import DatasetWriter, pack_table, plan_bins
from packshard.trainer_shim.synthetic import synthetic_table

GPU_DATA = Path(__file__).resolve().parents[2] / ".bench" / "multigpu_data" / "long_greedy"


def long_mix_lengths(n: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """`n` document lengths of the long-trajectory mix at this seq_len (module docstring)."""
    rng = np.random.default_rng(seed)
    syn = np.exp(rng.normal(np.log(0.55 * seq_len), 0.4, n))
    syn = np.clip(syn, 0.12 * seq_len, 0.95 * seq_len)
    real = rng.uniform(0.06 * seq_len, 0.47 * seq_len, n)
    lengths = np.where(rng.random(n) < 0.85, syn, real)
    return np.maximum(2, lengths.astype(np.int64))


def prepare_cpu_mix(
    root: Path, *, seq_len: int, rows: int, vocab_size: int, pad_multiple: int = 8, seed: int = 0
) -> dict[str, Any]:
    """Write `root/pad8` and `root/padseq` holding at least `rows` rows each; returns their totals."""
    n = max(4, 2 * rows)
    lengths = long_mix_lengths(n, seq_len, seed)
    while len(plan_bins(lengths, seq_len, "greedy")) < rows:
        n *= 2
        lengths = long_mix_lengths(n, seq_len, seed)
    k = 1
    while len(plan_bins(lengths[:k], seq_len, "greedy")) < rows:
        k += 1
    lengths = lengths[:k]
    table = synthetic_table(lengths, vocab_size=vocab_size, seed=seed, prompt_fraction=0.3)
    info: dict[str, Any] = {
        "samples": int(k),
        "seq_len": seq_len,
        "source": "cpu long mix (data.py)",
    }
    for sub, pm, pad_id in (("pad8", pad_multiple, 1), ("padseq", seq_len, 0)):
        batch, _ = pack_table(
            table, seq_len=seq_len, pad_multiple=pm, pad_token_id=pad_id, algorithm="greedy"
        )
        config = {
            "seq_len": seq_len, "cp": pad_multiple, "pad_multiple": pm, "pad_token_id": pad_id,
            "packing": {"algorithm": "greedy", "window": int(k)}, "overlong": "truncate", "seed": seed,
            "inputs": ["multigpu cpu long mix"], "tokenizer": {"name": "synthetic", "fingerprint": f"vocab{vocab_size}"},
        }  # fmt: skip
        writer = DatasetWriter(str(root / sub), config, max_rows=32)
        writer.write(batch)
        manifest = writer.close({"samples_in": int(k), "samples_kept": int(k), "dropped": {}})
        info[sub] = manifest["totals"]
    (root / "data_info.json").write_text(json.dumps(info, indent=1) + "\n")
    return info
