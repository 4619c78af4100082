"""The micro-batch contract: shifted labels that never cross documents, position ids,
cu_seqlens, ks/ke, and a packed row's loss equal to its documents' losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from packshard.trainer_shim.cp import cp_positions
from packshard.trainer_shim.microbatch import (
    IGNORE_INDEX,
    build_microbatch,
    filler_microbatch,
    key_ranges,
    labels_of,
    position_ids_of,
)


def test_hand_example():
    # docs [10 11 12] [20 21], 3 padding tokens (pad 0); loss on all but each doc's first token
    ids = np.array([10, 11, 12, 20, 21, 0, 0, 0], np.int32)
    mask = np.array([0, 1, 1, 0, 1, 0, 0, 0], bool)
    mb = build_microbatch(ids, mask, np.array([3, 2]), row=5)
    assert mb["labels"].tolist() == [11, 12, -100, 21, -100, -100, -100, -100]
    assert mb["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert mb["cu_seqlens"].tolist() == [0, 3, 5, 8] and mb["cu_seqlens"].dtype == np.int32
    assert mb["ks"].tolist() == [0, 0, 0, 3, 3, 5, 6, 7]
    assert mb["ke"].tolist() == [1, 2, 3, 4, 5, 5, 6, 7]
    assert (
        mb["num_tokens"],
        mb["num_loss_tokens"],
        mb["padded_len"],
        mb["attn_cost"],
        mb["row"],
    ) == (5, 3, 8, 13, 5)
    # a loss-masked first token is never a target: loss_mask all on still gives 3 targets
    assert build_microbatch(ids, ids > 0, np.array([3, 2]))["num_loss_tokens"] == 3


def test_documents_longer_than_the_row_raise():
    ids = np.zeros(8, np.int32)
    with pytest.raises(ValueError, match="documents hold 9 tokens, more than the row's 8"):
        build_microbatch(ids, ids > 0, np.array([5, 4], np.int32))
    # a row exactly full has no padding segment; int64 and int32 document lengths agree
    for dtype in (np.int32, np.int64):
        mb = build_microbatch(ids, ids > 0, np.array([5, 3], dtype))
        assert mb["cu_seqlens"].tolist() == [0, 5, 8] and mb["attn_cost"] == 34


def test_cp_chunk_of_hand_example():
    ids = np.array([10, 11, 12, 20, 21, 0, 0, 0], np.int32)
    mask = np.array([0, 1, 1, 0, 1, 0, 0, 0], bool)
    mb = build_microbatch(ids, mask, np.array([3, 2]), cp_size=2, cp_rank=1, cp_layout="zigzag")
    # zigzag cp=2 on 8 tokens: rank 1 holds positions 2, 3, 4, 5
    assert mb["input_ids"].tolist() == [12, 20, 21, 0]
    assert mb["labels"].tolist() == [-100, 21, -100, -100]
    assert mb["ks"].tolist() == [0, 3, 3, 5] and mb["ke"].tolist() == [3, 4, 5, 5]
    assert mb["cu_seqlens"].tolist() == [0, 3, 5, 8]  # always the whole row
    assert mb["num_loss_tokens"] == 3  # the whole row's


def test_filler():
    mb = filler_microbatch(8, 7, cp_size=2, cp_rank=0)
    assert mb["input_ids"].tolist() == [7] * 4
    assert (mb["labels"] == IGNORE_INDEX).all()
    assert (mb["num_tokens"], mb["num_loss_tokens"], mb["row"]) == (0, 0, -1)
    assert (mb["ks"] == mb["ke"]).all()


rows = st.lists(st.integers(1, 40), min_size=1, max_size=6).flatmap(
    lambda docs: st.tuples(st.just(docs), st.integers(0, 7), st.integers(0, 2**31 - 1))
)


@settings(max_examples=150, deadline=None)
@given(row=rows, cp=st.sampled_from([1, 2, 4]), layout=st.sampled_from(["contiguous", "zigzag"]))
def test_labels_never_cross_documents(row, cp, layout):
    docs, pad_extra, seed = row
    rng = np.random.default_rng(seed)
    div = cp * (2 if layout == "zigzag" else 1)
    n = sum(docs)
    length = -(-(n + pad_extra) // div) * div
    ids = np.zeros(length, np.int32)
    ids[:n] = rng.integers(1, 50, n)
    mask = np.zeros(length, bool)
    mask[:n] = rng.random(n) < 0.7
    doc_of = np.full(length, -1)
    doc_of[:n] = np.repeat(np.arange(len(docs)), docs)
    start_of = np.concatenate(([0], np.cumsum(docs)))[:-1]
    whole = build_microbatch(ids, mask, np.array(docs))
    # the plain helpers compute the same thing one concept at a time
    assert np.array_equal(labels_of(ids, mask, np.array(docs)), whole["labels"])
    assert np.array_equal(position_ids_of(whole["cu_seqlens"]), whole["position_ids"])
    ks, ke = key_ranges(whole["cu_seqlens"], n, np.arange(length))
    assert np.array_equal(ks, whole["ks"]) and np.array_equal(ke, whole["ke"])
    for t in range(length):
        ok = t + 1 < n and doc_of[t + 1] == doc_of[t] and mask[t + 1]
        assert whole["labels"][t] == (ids[t + 1] if ok else IGNORE_INDEX)
        if t < n:
            assert whole["position_ids"][t] == t - start_of[doc_of[t]]
            assert (whole["ks"][t], whole["ke"][t]) == (start_of[doc_of[t]], t + 1)
        else:
            assert whole["ks"][t] == whole["ke"][t] == t
    for r in range(cp):
        mb = build_microbatch(ids, mask, np.array(docs), cp_size=cp, cp_rank=r, cp_layout=layout)
        pos = cp_positions(length, cp, r, layout)
        for key in ("input_ids", "labels", "position_ids", "ks", "ke"):
            assert np.array_equal(mb[key], whole[key][pos] if key != "input_ids" else ids[pos])
        assert (
            mb["num_loss_tokens"]
            == whole["num_loss_tokens"]
            == int((whole["labels"] != IGNORE_INDEX).sum())
        )


@settings(max_examples=50, deadline=None)
@given(row=rows)
def test_packed_loss_equals_per_document_losses(row):
    """With per-position logits, sum CE(logits[t], labels[t]) over the packed row equals the
    sum over documents of the usual HF loss (labels = ids where mask, shifted in the model)."""
    docs, pad_extra, seed = row
    rng = np.random.default_rng(seed)
    n = sum(docs)
    length = n + pad_extra
    ids = np.zeros(length, np.int32)
    ids[:n] = rng.integers(1, 50, n)
    mask = np.zeros(length, bool)
    mask[:n] = rng.random(n) < 0.8
    logits = torch.from_numpy(rng.normal(size=(length, 50)))
    mb = build_microbatch(ids, mask, np.array(docs))
    packed = F.cross_entropy(
        logits, torch.from_numpy(mb["labels"]), ignore_index=-100, reduction="sum"
    )
    ref, count, start = torch.zeros((), dtype=torch.float64), 0, 0
    for d in docs:
        doc_ids = torch.from_numpy(ids[start : start + d].astype(np.int64))
        labels = torch.where(torch.from_numpy(mask[start : start + d]), doc_ids, -100)
        ref += F.cross_entropy(
            logits[start : start + d][:-1], labels[1:], ignore_index=-100, reduction="sum"
        )
        count += int((labels[1:] != -100).sum())
        start += d
    assert count == mb["num_loss_tokens"]
    torch.testing.assert_close(packed, ref)
