"""With a CUDA device: micro-batches arrive on the GPU, copied from pinned host memory with
non_blocking copies, and equal to the CPU stream's (skipped without a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from packshard.trainer_shim import PackedShardStream
from packshard.trainer_shim.microbatch import TENSOR_KEYS

pytestmark = pytest.mark.gpu


def test_cuda_stream_matches_cpu(small_dataset: Path, monkeypatch: pytest.MonkeyPatch):
    kw = {
        "dp_rank": 1,
        "dp_size": 2,
        "cp_rank": 0,
        "cp_size": 2,
        "rows_per_step": 4,
        "cp_layout": "zigzag",
    }
    cpu = list(PackedShardStream(str(small_dataset), **kw))
    copies: list[tuple[bool, bool]] = []
    real_to = torch.Tensor.to

    def spy(self: torch.Tensor, *args, **kwargs):
        copies.append((self.is_pinned(), bool(kwargs.get("non_blocking"))))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    gpu = list(PackedShardStream(str(small_dataset), device="cuda", **kw))
    monkeypatch.undo()
    torch.cuda.synchronize()
    assert len(gpu) == len(cpu) > 0
    assert copies and all(pinned and nb for pinned, nb in copies)
    for a, b in zip(cpu, gpu, strict=True):
        for k in TENSOR_KEYS:
            assert b[k].is_cuda and torch.equal(a[k], b[k].cpu()), k
        for k in ("ks", "ke"):  # the host copies stay on the host, pinned
            host = b[f"{k}_host"]
            assert not host.is_cuda and host.is_pinned() and torch.equal(host, a[k])
            assert a[f"{k}_host"] is a[k]
