"""The packshard side of bench_stream.py: one shuffled epoch of one rank in a fresh process,
printing one JSON line (the twin of `_mosaic_runner.py read`).

    python benchmarks/_ours_runner.py URL [--storage-options JSON] [--kw JSON]

The timed window opens before the `PackedShardStream` constructor (which reads manifest.json
and index.arrow, from the object store for an s3:// URL, and creates the S3 client: pyarrow's,
or s3fs' with ``PACKSHARD_S3_CLIENT=s3fs``, see packers/s3_reading.py) and closes after the
epoch's last micro-batch. Modules are imported before it opens (packshard, torch, and s3fs and
pyarrow.fs for an s3:// URL), as the Mosaic runner imports streaming and boto3 first, and
both run a full garbage collection then: the first full collection after importing torch walks
~240K objects (~150 ms here) and would otherwise land in whichever window happens to trigger it.
`--kw` passes stream keyword arguments (`cache_dir`, `read_threads`, `prefetch`, ...).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packshard.trainer_shim import PackedShardStream


def read(url: str, storage_options: dict | None, kw: dict) -> dict:
    if url.startswith("s3://"):
        import pyarrow.fs  # noqa: F401  (outside the window: see the module docstring)
        import s3fs  # noqa: F401
    gc.collect()  # the imports' deferred full collection, outside the window on both sides
    t0 = time.perf_counter()
    stream = PackedShardStream(
        url,
        dp_rank=0,
        dp_size=1,
        rows_per_step=8,
        seed=0,
        storage_options=storage_options,
        **kw,
    )
    rows = tokens = loss = 0
    for mb in stream:
        if mb["row"] >= 0:
            rows += 1
            tokens += mb["num_tokens"]
            loss += mb["num_loss_tokens"]
    seconds = time.perf_counter() - t0
    stream.close()
    return {
        "rows": rows,
        "tokens": tokens,
        "loss_tokens": loss,
        "seconds": seconds,
        "load": os.getloadavg()[0],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--storage-options", default="null")
    p.add_argument("--kw", default="{}", help="PackedShardStream keyword arguments, JSON")
    args = p.parse_args()
    print(json.dumps(read(args.url, json.loads(args.storage_options), json.loads(args.kw))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
