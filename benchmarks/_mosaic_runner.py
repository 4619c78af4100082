"""The MosaicML-streaming side of bench_stream.py, run with the Mosaic venv's Python
(mosaicml-streaming 0.13 pins transformers<5, so it cannot share our venv). Imports nothing of
packshard. Two commands, each printing one JSON line:

    write RAW.npz OUT_DIR [--size-limit BYTES]   rows -> MDS shards (Mosaic's own MDSWriter)
    read --local DIR [--remote URL] [--config JSON]   one epoch through StreamingDataset

The MDS columns hold the same bytes as a packshard shard: input_ids int32, loss_mask packed to
bits (numpy packbits, little bit order: what Arrow stores for list<bool>), doc_lens int32,
sample_ids int64. Each sample read is made usable as a consumer would use it: the mask unpacked
to one bool per token and the true tokens counted from doc_lens. With `--build` the sample is
also turned into the trainer's micro-batch the packshard stream yields (labels, position ids,
cu_seqlens, ks/ke as torch tensors) by packshard's own `build_microbatch`, loaded from the
checkout by path (its module needs numpy only; this venv has no pyarrow for the package's
other modules): the same work per row on both sides.

`read` takes StreamingDataset's tuning knobs as JSON (`predownload`, `batch_size`,
`cache_limit`, `shuffle_algo`, `num_canonical_nodes`, `shuffle_block_size`) and
`num_workers`: 0 iterates the dataset in this process; N > 0 runs it through a
`StreamingDataLoader` with N worker processes and `batch_size` samples per batch (a list, since
rows differ in length). The timed window opens before the StreamingDataset constructor (which
reads index.json, from the remote when given) and closes after the epoch's last sample:
downloads and the S3 client's creation are inside it. Modules are imported before it opens
(streaming, numpy, torch, and boto3 when a remote is given), as the packshard runner imports
s3fs before its window, and both run a full garbage collection before it (the import garbage's).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import types
from typing import Any


def _stub_torchvision() -> None:
    """streaming.vision imports torchvision at import time; PyPI's torchvision wheel does not
    load against the CPU torch build that this venv gets, and nothing here uses vision, so a
    stub with the three names streaming imports stands in when the real one fails."""
    try:
        import torchvision  # noqa: F401

        return
    except (ImportError, RuntimeError):
        pass
    import transformers.feature_extraction_utils  # noqa: F401  (decides "no torchvision" before the stub exists)

    tv = types.ModuleType("torchvision")
    datasets = types.ModuleType("torchvision.datasets")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")
    datasets.VisionDataset = type("VisionDataset", (), {})
    datasets.CIFAR10 = type("CIFAR10", (), {})
    functional.to_tensor = lambda x: x
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional
    sys.modules.update(
        {
            "torchvision": tv,
            "torchvision.datasets": datasets,
            "torchvision.transforms": transforms,
            "torchvision.transforms.functional": functional,
        }
    )


def write(raw: str, out: str, size_limit: int) -> dict:
    import numpy as np
    from streaming import MDSWriter

    data = np.load(raw)
    ids, mask, row_off = data["input_ids"], data["loss_mask"], data["row_offsets"]
    docs, doc_off = data["doc_lens"], data["doc_offsets"]
    sids = data["sample_ids"]
    columns = {
        "input_ids": "ndarray:int32",
        "loss_mask": "ndarray:uint8",
        "doc_lens": "ndarray:int32",
        "sample_ids": "ndarray:int64",
    }
    t0 = time.perf_counter()
    with MDSWriter(out=out, columns=columns, size_limit=size_limit) as w:
        for i in range(row_off.size - 1):
            bits = np.packbits(mask[row_off[i] : row_off[i + 1]], bitorder="little")
            w.write(
                {
                    "input_ids": ids[row_off[i] : row_off[i + 1]],
                    "loss_mask": bits,
                    "doc_lens": docs[doc_off[i] : doc_off[i + 1]],
                    "sample_ids": sids[doc_off[i] : doc_off[i + 1]],
                }
            )
    shard_bytes = sum(
        os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".mds")
    )
    return {
        "rows": int(row_off.size - 1),
        "seconds": time.perf_counter() - t0,
        "bytes": shard_bytes,
    }


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TENSOR_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "ks", "ke")


def _load_build_microbatch() -> Any:
    """packshard.trainer_shim.microbatch.build_microbatch without importing the package (its
    __init__ needs pyarrow): the two numpy-only modules are loaded from their files."""
    import importlib.util

    for name in ("packshard", "packshard.trainer_shim"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules.setdefault(name, package)
    for name in ("cp", "microbatch"):
        full = f"packshard.trainer_shim.{name}"
        spec = importlib.util.spec_from_file_location(
            full, os.path.join(REPO, "packshard", "trainer_shim", f"{name}.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)
    return sys.modules["packshard.trainer_shim.microbatch"].build_microbatch


def _as_list(batch: list) -> list:
    return batch


def _samples(ds: Any, num_workers: int, batch_size: int | None) -> Any:
    if num_workers == 0:
        yield from ds
        return
    from streaming import StreamingDataLoader

    loader = StreamingDataLoader(
        ds, batch_size=batch_size or 1, num_workers=num_workers, collate_fn=_as_list
    )
    for batch in loader:
        yield from batch


def read(local: str, remote: str | None, config: dict[str, Any], build: bool) -> dict:
    import numpy as np
    import torch

    build_microbatch = _load_build_microbatch() if build else None
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    if remote is not None:
        import boto3
        import boto3.s3.transfer  # noqa: F401
    config = dict(config)
    num_workers = int(config.pop("num_workers", 0))
    clean_stale_shared_memory()
    gc.collect()  # the imports' deferred full collection, outside the window on both sides
    t0 = time.perf_counter()
    ds = StreamingDataset(local=local, remote=remote, shuffle=True, shuffle_seed=0, **config)
    rows = tokens = loss = 0
    for sample in _samples(ds, num_workers, config.get("batch_size")):
        n = sample["input_ids"].size
        mask = np.unpackbits(sample["loss_mask"], count=n, bitorder="little").view(np.bool_)
        rows += 1
        if build_microbatch is None:
            tokens += int(sample["doc_lens"].sum())
            loss += int(np.count_nonzero(mask))
            continue
        mb = build_microbatch(sample["input_ids"], mask, sample["doc_lens"])
        for k in TENSOR_KEYS:
            mb[k] = torch.from_numpy(mb[k])
        tokens += mb["num_tokens"]
        loss += mb["num_loss_tokens"]
    seconds = time.perf_counter() - t0
    return {
        "rows": rows,
        "tokens": tokens,
        "loss_tokens": loss,
        "seconds": seconds,
        "load": os.getloadavg()[0],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("raw")
    w.add_argument("out")
    w.add_argument("--size-limit", type=int, default=1 << 26)
    r = sub.add_parser("read")
    r.add_argument("--local", required=True)
    r.add_argument("--remote")
    r.add_argument("--config", default="{}", help="StreamingDataset knobs and num_workers, JSON")
    r.add_argument("--build", action="store_true", help="build each sample's micro-batch")
    args = p.parse_args()
    _stub_torchvision()
    result = (
        write(args.raw, args.out, args.size_limit)
        if args.cmd == "write"
        else read(args.local, args.remote, json.loads(args.config), args.build)
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
