"""`packed_collator` against a real Hugging Face model: a tiny random-init Qwen3 (fp32, CPU) with
the shared Qwen3 vocabulary, on rows packed from real chats.

- The loss of a packed row (one or two rows flattened into one batch) equals the token-weighted
  loss of its documents run one by one, to 1e-5 relative, with sdpa and eager attention; the same
  forward with documents attending to each other does not (the test can fail).
- The masks transformers builds from the collator's position ids are document-causal for sdpa,
  eager and flex_attention; the flash-attention varlen arguments are the document boundaries
  (flash_attention_2 itself needs a GPU and the flash-attn package: not run here).
- flex_attention's forward (its backward is GPU-only in torch) gives the same loss (slow: it
  compiles).
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.trainer_shim._hf_fixtures import doc_spans, tiny_qwen3, write_packed_chats

pytest.importorskip("transformers")
from packshard.trainer_shim.hf import PackedShardDataset, packed_collator

pytestmark = pytest.mark.shared


@pytest.fixture(scope="module")
def rows(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list:
    out = tmp_path_factory.mktemp("hf") / "chats"
    write_packed_chats(shared_data, out, per_file=12, seq_len=512)
    ds = PackedShardDataset(str(out), shuffle=False)
    items = list(ds)
    ds.close()
    multi = [it for it in items if len(doc_spans(it["cu_seqlens"].numpy(), it["num_tokens"])) >= 3]
    multi.sort(key=lambda it: it["num_tokens"] - it["padded_len"])  # padded rows first
    assert len(multi) >= 2 and multi[0]["padded_len"] > multi[0]["num_tokens"]
    return multi[:2]


def docs_loss(model: torch.nn.Module, items: list) -> float:
    """Token-weighted mean of the model's own loss over every document, run alone."""
    total, count = 0.0, 0
    for it in items:
        ids, shifted = it["input_ids"], it["labels"]
        for a, b in doc_spans(it["cu_seqlens"].numpy(), it["num_tokens"]):
            labels = torch.full((b - a,), -100)
            labels[1:] = shifted[
                a : b - 1
            ]  # labels as a user writes them: the token where loss is on
            n = int((labels[1:] != -100).sum())
            if n:
                out = model(input_ids=ids[a:b][None], labels=labels[None], use_cache=False)
                total += out.loss.item() * n
                count += n
    return total / count


@pytest.mark.parametrize(("attn", "num_rows"), [("sdpa", 2), ("eager", 1)])
def test_packed_loss_equals_documents_one_by_one(rows: list, attn: str, num_rows: int):
    model = tiny_qwen3(attn)
    items = rows[:num_rows]
    with torch.no_grad():
        packed = model(**packed_collator(items)).loss.item()
        reference = docs_loss(model, items)
        # the same forward with the documents of a row attending to each other must differ
        batch = packed_collator(items)
        leaky = model(
            input_ids=batch["input_ids"], labels=batch["labels"], use_cache=False
        ).loss.item()
    assert abs(packed - reference) <= 1e-5 * abs(reference), (packed, reference)
    assert abs(leaky - reference) > 10 * 1e-5 * abs(reference), (leaky, reference)


def test_use_cache_false_keeps_documents_apart(rows: list):
    """A model whose config has use_cache=True builds a cache in its forward, and transformers
    then skips the packed-sequence mask: the collator's use_cache=False is what prevents it."""
    model = tiny_qwen3("sdpa")
    assert model.config.use_cache
    batch = packed_collator(rows[:1])
    with torch.no_grad():
        good = model(**batch).loss.item()
        del batch["use_cache"]
        bad = model(**batch).loss.item()
        reference = docs_loss(model, rows[:1])
    assert (
        abs(good - reference) <= 1e-5 * reference and abs(bad - reference) > 10 * 1e-5 * reference
    )


def test_labels_and_shift_labels_give_the_same_loss(rows: list):
    model = tiny_qwen3("sdpa")
    plain = packed_collator(rows)
    shifted = functools.partial(packed_collator, shift_labels=True)(rows)
    assert torch.equal(shifted["shift_labels"][0], torch.cat([r["labels"] for r in rows]))
    # unshifted labels: the token itself where it is a target, never at a document start
    lab, ids = plain["labels"][0], plain["input_ids"][0]
    on = lab != -100
    assert torch.equal(lab[on], ids[on]) and not on[plain["position_ids"][0] == 0].any()
    with torch.no_grad():
        a = model(**plain).loss.item()
        # with shift_labels the model's loss reads them, not labels (present, all ignored here)
        b = model(**{**shifted, "labels": torch.full_like(lab, -100)[None]}).loss.item()
    assert abs(a - b) <= 1e-6 * a


def reference_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """[L, L] bool: query q may see key k iff same segment (position ids restart) and k <= q."""
    seg = torch.cumsum(position_ids == 0, 0)
    q = torch.arange(position_ids.numel())
    return (seg[:, None] == seg[None, :]) & (q[None, :] <= q[:, None])


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
def test_transformers_builds_a_document_causal_mask(rows: list, attn: str):
    from transformers.masking_utils import create_causal_mask

    model = tiny_qwen3(attn)
    batch = packed_collator(rows)
    pos = batch["position_ids"]
    embeds = torch.zeros(1, pos.shape[1], model.config.hidden_size)
    # create_causal_mask takes ``past_key_values`` in 5.17 and ``cache`` in 5.25: None under either
    cache_kw = (
        "cache"
        if "cache" in inspect.signature(create_causal_mask).parameters
        else "past_key_values"
    )
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=embeds,
        attention_mask=None,
        position_ids=pos,
        **{cache_kw: None},
    )
    want = reference_mask(pos[0])
    if attn == "flex_attention":
        n = pos.shape[1]
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        got = mask.mask_mod(torch.tensor(0), torch.tensor(0), q, k)
    elif mask.dtype == torch.bool:
        got = mask[0, 0]
    else:  # eager: additive float mask
        got = mask[0, 0] == 0
    assert torch.equal(got, want)


def test_varlen_kwargs_are_the_document_boundaries(rows: list):
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    batch = functools.partial(packed_collator, varlen=True)(rows)
    (cu_q, _cu_k), (max_q, _max_k) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    assert torch.equal(batch["cu_seq_lens_q"], cu_q.to(torch.int32))
    assert batch["cu_seq_lens_q"] is batch["cu_seq_lens_k"]
    assert batch["max_length_q"] == batch["max_length_k"] == int(max_q)
    starts = []
    offset = 0
    for r in rows:  # every document (and each row's padding) starts a segment
        starts += [offset + int(c) for c in r["cu_seqlens"][:-1]]
        offset += int(r["padded_len"])
    assert batch["cu_seq_lens_q"].tolist() == [*starts, offset]


@pytest.mark.slow
def test_flex_attention_forward_loss_equals_documents(rows: list):
    model = tiny_qwen3("flex_attention")
    item = dict(rows[0])
    cut = int(item["cu_seqlens"][3])  # the first three documents: a shorter compile
    sub = {
        "input_ids": item["input_ids"][:cut], "labels": item["labels"][:cut].clone(),
        "position_ids": item["position_ids"][:cut], "cu_seqlens": item["cu_seqlens"][:4],
        "num_tokens": cut,
    }  # fmt: skip
    sub["labels"][-1] = -100
    with torch.no_grad():
        packed = model(**packed_collator([sub])).loss.item()
        reference = docs_loss(tiny_qwen3("sdpa"), [sub])
    assert np.isclose(packed, reference, rtol=1e-5, atol=0)


def test_what_the_collator_and_the_meter_cannot_take_is_named(rows: list):
    from packshard.trainer_shim import TrainedTokenMeter

    with pytest.raises(TypeError, match="got one item: use a batch_size of 1 or more"):
        packed_collator(rows[0])  # DataLoader(batch_size=None) hands items one by one
    with pytest.raises(ValueError, match="cannot collate an empty batch"):
        packed_collator([])
    two_d = {**rows[0], "input_ids": rows[0]["input_ids"][None]}
    with pytest.raises(ValueError, match=r"row 0: input_ids \(1, \d+\).*fields are 1-D"):
        packed_collator([two_d])
    half = {k: rows[0][k] for k in ("labels", "position_ids", "cu_seqlens")}
    n = rows[0]["input_ids"].numel() // 2
    chunk = {**{k: v[:n] for k, v in half.items() if k != "cu_seqlens"}, "cu_seqlens": half["cu_seqlens"], "input_ids": rows[0]["input_ids"][:n]}  # fmt: skip
    with pytest.raises(ValueError, match=f"cu_seqlens ends at {rows[0]['input_ids'].numel()}, input_ids has {n}"):  # fmt: skip
        packed_collator([chunk])
    with pytest.raises(KeyError, match=r"lacks .*'num_tokens'.*update with each of its items"):
        TrainedTokenMeter().update(packed_collator(rows))
