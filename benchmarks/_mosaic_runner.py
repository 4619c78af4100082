"""The MosaicML-streaming side of bench_stream.py, run with the Mosaic venv's Python
(mosaicml-streaming 0.13 pins transformers<5, so it cannot share our venv). Imports nothing of
packshard. Two commands, each printing one JSON line:

    write RAW.npz OUT_DIR        rows (input_ids, loss_mask, doc_lens) -> MDS shards (MDSWriter)
    read --local DIR [--remote URL] [--shuffle]   one epoch through StreamingDataset, world size 1

`read` times from the StreamingDataset constructor to the end of the epoch (downloads included
when `--remote` is given: the cold-cache case), like the packshard side times its stream.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types


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


def write(raw: str, out: str) -> dict:
    import numpy as np
    from streaming import MDSWriter

    data = np.load(raw)
    ids, mask, row_off = data["input_ids"], data["loss_mask"], data["row_offsets"]
    docs, doc_off = data["doc_lens"], data["doc_offsets"]
    columns = {
        "input_ids": "ndarray:int32",
        "loss_mask": "ndarray:uint8",
        "doc_lens": "ndarray:int32",
    }
    t0 = time.perf_counter()
    with MDSWriter(out=out, columns=columns, size_limit=1 << 25) as w:
        for i in range(row_off.size - 1):
            w.write(
                {
                    "input_ids": ids[row_off[i] : row_off[i + 1]],
                    "loss_mask": mask[row_off[i] : row_off[i + 1]],
                    "doc_lens": docs[doc_off[i] : doc_off[i + 1]],
                }
            )
    return {"rows": int(row_off.size - 1), "seconds": time.perf_counter() - t0}


def read(local: str, remote: str | None, shuffle: bool) -> dict:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    t0 = time.perf_counter()
    ds = StreamingDataset(local=local, remote=remote, shuffle=shuffle, batch_size=1, shuffle_seed=0)
    rows = tokens = 0
    for sample in ds:
        rows += 1
        tokens += int(sample["doc_lens"].sum())
    return {"rows": rows, "tokens": tokens, "seconds": time.perf_counter() - t0}


def main() -> int:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("raw")
    w.add_argument("out")
    r = sub.add_parser("read")
    r.add_argument("--local", required=True)
    r.add_argument("--remote")
    r.add_argument("--shuffle", action="store_true")
    args = p.parse_args()
    _stub_torchvision()
    result = (
        write(args.raw, args.out)
        if args.cmd == "write"
        else read(args.local, args.remote, args.shuffle)
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
