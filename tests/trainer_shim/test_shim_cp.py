"""CP chunking: every position held by exactly one rank, the zigzag pairing, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from packshard.trainer_shim.cp import check_layout, cp_positions, cp_slices, reassemble, row_divisor


@settings(max_examples=100, deadline=None)
@given(
    cp=st.integers(1, 8), chunks=st.integers(0, 6), layout=st.sampled_from(["contiguous", "zigzag"])
)
def test_chunks_partition_the_row(cp, chunks, layout):
    length = chunks * row_divisor(cp, layout)
    parts = [cp_positions(length, cp, r, layout) for r in range(cp)]
    assert all(p.size == length // cp for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(length))
    row = np.arange(length) * 7
    assert np.array_equal(reassemble([row[p] for p in parts], length, layout), row)
    for r in range(cp):
        assert np.array_equal(
            np.concatenate([np.arange(length)[s] for s in cp_slices(length, cp, r, layout)]),
            parts[r],
        )


def test_one_cp_rank_holds_any_row_whole_in_either_layout():
    """Without CP nothing is split: a zigzag config kept with cp_size=1 takes odd lengths."""
    assert row_divisor(1, "zigzag") == row_divisor(1, "contiguous") == 1
    for layout in ("zigzag", "contiguous"):
        assert cp_positions(7, 1, 0, layout).tolist() == list(range(7))  # type: ignore[arg-type]
        assert cp_slices(7, 1, 0, layout) == [slice(0, 7)]  # type: ignore[arg-type]


def test_zigzag_takes_chunks_r_and_mirror():
    # 16 tokens, cp=2 -> 4 chunks of 4: rank 0 holds chunks 0 and 3, rank 1 holds 1 and 2
    assert cp_positions(16, 2, 0, "zigzag").tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_positions(16, 2, 1, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_positions(16, 2, 1, "contiguous").tolist() == list(range(8, 16))


def test_zigzag_balances_causal_work():
    length, cp = 1024, 4
    work = lambda pos: int((pos + 1).sum())  # noqa: E731 - keys each causal query sees
    zig = [work(cp_positions(length, cp, r, "zigzag")) for r in range(cp)]
    con = [work(cp_positions(length, cp, r, "contiguous")) for r in range(cp)]
    assert max(zig) == min(zig)
    assert max(con) / min(con) > 6


def test_indivisible_row_says_how_to_repack():
    with pytest.raises(
        ValueError, match=r"row 17 has 12 tokens, not a multiple of 8.*--pad-multiple 8"
    ):
        cp_positions(12, 4, 0, "zigzag", row=17)
    with pytest.raises(ValueError, match=r"--pad-multiple 4"):
        check_layout(2, 2, "zigzag")
    check_layout(4, 2, "zigzag")
    check_layout(3, 1, "zigzag")  # no CP: anything goes
    with pytest.raises(ValueError, match="cp_layout='ring' is not known"):
        cp_positions(8, 2, 0, "ring")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cp_rank must be in"):
        cp_positions(8, 2, 2)
