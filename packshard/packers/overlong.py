"""Padding rule and the overlong-sample policies.

A packed row holds at most `seq_len` tokens and is padded only up to the next multiple of
`pad_multiple` (cp, or 2·cp for zigzag context parallelism), so a row wastes fewer than
`pad_multiple` tokens instead of up to `seq_len - 1`.

A sample longer than the row capacity follows one policy, and the result reports exactly what
it cut, split or dropped, so the pipeline can count it in the manifest (nothing lost silently):

- ``truncate``: keep the first `capacity` tokens; the tail is cut and counted.
- ``split``: cut into consecutive pieces of `capacity` tokens (the last one shorter); each
  piece becomes its own document in the packing, and no token is lost.
- ``drop``: leave the sample out, counting it and its tokens.

Samples of length 0 are always dropped and counted under ``empty``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

OverlongPolicy = Literal["truncate", "split", "drop"]
OVERLONG_POLICIES: tuple[str, ...] = ("truncate", "split", "drop")


def padded_length(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= n (n itself when it already is one)."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return -(-n // multiple) * multiple


def padded_lengths(n: np.ndarray, multiple: int) -> np.ndarray:
    """Vectorised `padded_length`."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    n = np.asarray(n, dtype=np.int64)
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class OverlongResult:
    """Pieces to pack after the policy, and what the policy cost.

    `sample`, `start`, `length` describe each piece: tokens ``[start, start + length)`` of
    input sample `sample`. Pieces are in input order (a split sample's pieces consecutive).
    """

    sample: np.ndarray
    start: np.ndarray
    length: np.ndarray
    policy: str
    truncated_samples: int = 0
    truncated_tokens: int = 0
    split_samples: int = 0
    extra_pieces: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    dropped_tokens: int = 0

    @property
    def num_pieces(self) -> int:
        return int(self.sample.size)


def apply_overlong(
    lengths: np.ndarray | list[int], capacity: int, policy: OverlongPolicy = "truncate"
) -> OverlongResult:
    """Apply the overlong policy to sample lengths; see the module docstring."""
    if policy not in OVERLONG_POLICIES:
        raise ValueError(
            f"overlong={policy!r} is not known; choose one of {list(OVERLONG_POLICIES)}"
        )
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {lengths.shape}")
    if lengths.size and lengths.min() < 0:
        raise ValueError(f"lengths[{int(np.argmin(lengths))}] is negative")
    idx = np.arange(lengths.size, dtype=np.int64)
    empty = lengths == 0
    over = lengths > capacity
    dropped: dict[str, int] = {}
    if empty.any():
        dropped["empty"] = int(empty.sum())
    keep = ~empty
    if policy == "truncate":
        cut = np.where(over, lengths - capacity, 0)
        return OverlongResult(
            sample=idx[keep],
            start=np.zeros(int(keep.sum()), dtype=np.int64),
            length=np.minimum(lengths, capacity)[keep],
            policy=policy,
            truncated_samples=int(over.sum()),
            truncated_tokens=int(cut.sum()),
            dropped=dropped,
        )
    if policy == "drop":
        if over.any():
            dropped["overlong"] = int(over.sum())
        keep &= ~over
        return OverlongResult(
            sample=idx[keep],
            start=np.zeros(int(keep.sum()), dtype=np.int64),
            length=lengths[keep],
            policy=policy,
            dropped=dropped,
            dropped_tokens=int(lengths[over].sum()),
        )
    # split
    num_pieces = np.where(keep, -(-lengths // capacity), 0)
    sample = np.repeat(idx, num_pieces)
    first_piece = np.cumsum(num_pieces) - num_pieces
    piece_no = np.arange(sample.size, dtype=np.int64) - np.repeat(first_piece, num_pieces)
    start = piece_no * capacity
    length = np.minimum(lengths[sample] - start, capacity)
    return OverlongResult(
        sample=sample,
        start=start,
        length=length,
        policy=policy,
        split_samples=int(over.sum()),
        extra_pieces=int((num_pieces - 1).clip(min=0).sum()),
        dropped=dropped,
    )
