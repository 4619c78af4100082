"""Route the DSA lightning indexer of Hugging Face transformers' models to `fp8_indexer_topk`.

    handle = use_packshard_indexer(model)   # every DSA indexer module of the model
    model(input_ids=ids, position_ids=pos, labels=labels)   # a packed row, positions restarting
    handle.restore()                        # or: with use_packshard_indexer(model): ...

**Models.** `glm_moe_dsa` (GLM-5: `GlmMoeDsaIndexer`, interleaved RoPE on the indexer's first
`qk_rope_head_dim` dimensions) and `deepseek_v32` (DeepSeek-V3.2: `DeepseekV32Indexer`,
half-split RoPE), in transformers 5.17 to 5.25 (the two differ only in the cache argument's name,
`past_key_values` then `cache`; both are accepted). GLM's "shared" layers have no indexer and
reuse the previous layer's indices, so they follow. `deepseek_v4` is refused: its indexer scores
compressed keys, one per 4-token window of the whole row (windows straddle documents, the
causal threshold is read off position ids that restart), so its candidates are not tokens with
per-document ranges; packing would first need a per-document compressor.

**What is replaced.** Each indexer module's `forward`, as an instance attribute (the class is
untouched; `restore()` deletes the attribute; `use_packshard_indexer` on a routed model returns
the same handle). The replacement computes q [B, S, H, D], k [B, T, D] and the head weights with
the module's own layers and RoPE function (and appends k to the model's indexer cache as the
original does; a static cache's buffer is cut to the tokens cached so far), then one
`fp8_indexer_topk` call for the whole batch (batch rows laid end to end,
key b*T + s for row b). It returns what the model's attention consumes: int32 [B, S, topk] with
topk = min(config.index_topk, T), indices in the row's key coordinates. The model's own indexer
fills the slots of a query with fewer than topk candidates with masked (future) keys, which the
attention mask then hides; ours returns the kernel's sentinel there, replaced by the query's own
key (always among its selected keys when a slot is unused; the eager / SDPA paths scatter the
indices into a [B, S, T] mask, which accepts only indices in [0, T)), or by -1 with
`unused_slots="minus_one"` (FlashMLA's sparse kernels read -1 as "no key").

**Scoring.** The model: score[t, s] = sum_h weights[t, h] * n_heads^-0.5 * relu(softmax_scale *
q[t, h] . k[s]), where weights = weights_proj(hidden), softmax_scale = head_dim^-0.5, in fp32 on
the bf16 q and k; then the attention mask, then `torch.topk` over the dense [B, S, T] scores
(32 GiB of fp32 at S = T = 16K with GLM-5's 32 heads, before the relu's copy). Since
relu(c x) = c relu(x) for c > 0, this is the kernel's score with w = weights * n_heads^-0.5 *
softmax_scale: the same function, computed on fp8 q and k.

**Packed rows.** A query's candidate keys are its own document's, causally: with position id p
at key coordinate a = past + t (past: tokens already in the indexer cache), ks = a - p and
ke = a + 1. Position ids must restart at 0 at every document and rise by 1 within it, as
`packshard.trainer_shim` and Hugging Face's padding-free collators make them (the model's
default, past + arange(S), is one document; the shim's padding at a row's end is one more).
Documents are isolated even where the model's mask does not isolate them (with a cache, or a
2D attention mask, transformers builds a plain causal mask over the packed row): the attention
sees only selected keys. Other position ids
raise ValueError naming the first bad token, and so does an attention mask hiding any key of a
document from a query of it that sees itself (left padding: put position 0 on the first real
token; a mask with holes inside a document cannot be followed, as selection works on whole
ranges). Right padding needs nothing in a forward over the padded batch: padding comes after
the real tokens, so no real query sees it; decoding after a right-padded prefill puts the
padding inside the document, which the check refuses (generation pads on the left). The
ranges are computed once per forward, not per layer (every layer gets the same position ids
and mask objects): the position ids' host copy and the mask check (over the keys of each
query's document up to it, in steps: `_check_mask`) are two syncs a forward. Under
`torch.inference_mode` the tensors have no version counter to show that a reused buffer
changed, so their ranges are kept only while a call of the module given to
`use_packshard_indexer` runs (hooks around its `__call__`; a bare indexer module's calls are
one layer each). Reaching the indexers another way (`model.forward(...)`, the inner
`model.model(...)`, a wrapper calling `.forward`) computes them per layer under
inference_mode.
The replacement is not traceable by torch.compile (host-side ranges, syncs): dynamo breaks the
graph around it. Its selections are bitwise deterministic, so a layer recomputed under
gradient checkpointing selects the same keys.

**Copies of the model.** A routed model pickles (`torch.save(model)`) and deep-copies (TRL's
reference model) with its routing: the copy gets its own handle, which routes and restores the
copy. `nn.DataParallel`'s replicas copy each module's attributes shallowly, so a replica's
routed forward would run on the original module's weights (on another GPU than its inputs):
train on several GPUs with one process each (torchrun / accelerate: DDP, FSDP), where every
process routes its own model.

**fp8 tolerance rule.** Ours selects the exact top-k of s8[t, s], the score above on q and k
rounded per vector to e4m3 at a power-of-two scale c (an element's error is at most
max(2^-4 |x|, 2^-10 c), c <= max(amax, 1e-4) / 224);
the model's own the top-k of s[t, s], on bf16 q and k. For a query t the two sets are equal
whenever the gap between its k-th and (k+1)-th largest s exceeds 2 * max_s |s8 - s| (no key can
cross), up to the choice among keys tied at the k-th score (ours takes lower key indices first,
`torch.topk`'s choice is unspecified). In particular they are equal when every element of q
and k is an e4m3 value times its vector's power-of-two scale (e.g. integers of magnitude <= 16):
then s8 = s up to fp32 summation order. tests/kernels/test_hf_dsa.py checks this on tiny models,
benchmarks/bench_hf_indexer.py at GLM-5's shapes on 16K-32K rows, where it also reports the
overlap of the two selections on random inputs.

**Hadamard rotation** (``hadamard=True``; off by default). DeepSeek's reference indexer, and
the inference engines that follow it, rotate q and k by the normalised Hadamard matrix H
before quantising them to fp8; transformers' bf16 indexer skips it, as Hq . Hk = q . k exactly.
In fp8 it matters: a channel much larger than the others in both q and k (the "massive
activations" of trained models) dominates each score, and its fp8 rounding error swamps the
other channels' differences; H spreads every channel over all of them first. With two such
channels at 20x in the tiny test models, the share of the model's own fp32 selection that ours
keeps rises from 0.93-0.98 to 0.98-0.99 (tests/kernels/test_hf_dsa.py); on Gaussian q and k
without outliers it is unchanged, and with outlier channels in k alone it does not help
(0.94-0.96 of the selection kept without it, 0.92-0.95 with it). Turn it on to match an engine
that rotates (e.g. the sampler of an RL run); the exactness rule above then no longer applies
(the rotated vectors of integer q and k are not e4m3 values). The indexer cache keeps the
model's own, unrotated keys.
"""

from __future__ import annotations

import copy
import functools
import math
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from packshard.kernels import FIXED_CONFIG, IndexerConfig, fp8_indexer_topk
from packshard.kernels.prepare import _next_pow2


@dataclass(frozen=True)
class DsaFamily:
    """One transformers model family whose indexer packshard routes."""

    model_type: str
    indexer_class: str
    rope_function: str  # the modeling module's function that the indexer's forward calls


FAMILIES: dict[str, DsaFamily] = {
    f.indexer_class: f
    for f in (
        DsaFamily("glm_moe_dsa", "GlmMoeDsaIndexer", "apply_rotary_pos_emb_interleave"),
        DsaFamily("deepseek_v32", "DeepseekV32Indexer", "apply_rotary_pos_emb"),
    )
}
UNSUPPORTED: dict[str, str] = {
    "DeepseekV4Indexer": (
        "deepseek_v4's indexer scores compressed keys (one per 4-token window of the whole row, "
        "windows straddling documents) and selects windows, not tokens with per-document ranges"
    ),
}
_ATTRIBUTES = (
    "wq_b", "wk", "k_norm", "weights_proj", "n_heads", "head_dim", "qk_rope_head_dim",
    "index_topk", "softmax_scale", "layer_idx",
)  # fmt: skip
UnusedSlots = Literal["query", "minus_one"]
MASK_ATTENTIONS = ("eager", "sdpa")  # transformers' DSA attention scatters the indices for these


def _family_of(module: nn.Module) -> tuple[str, DsaFamily | None]:
    """(class name, family) for a transformers DSA indexer module, ("", None) for anything else."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("transformers.models."):
            continue
        if cls.__name__ in FAMILIES:
            return cls.__name__, FAMILIES[cls.__name__]
        if cls.__name__ in UNSUPPORTED:
            return cls.__name__, None
    return "", None


def _rope_of(module: nn.Module) -> Any:
    """The RoPE function the module's transformers forward calls, from the modeling module of
    the transformers class it is or derives from (a user's subclass, FSDP2's wrapper class:
    their own modules do not hold it)."""
    for cls in type(module).__mro__:
        if cls.__module__.startswith("transformers.models.") and cls.__name__ in FAMILIES:
            return getattr(sys.modules[cls.__module__], FAMILIES[cls.__name__].rope_function)
    raise ValueError(f"{type(module).__name__} is not an indexer packshard routes")


def document_ranges(position_ids: np.ndarray, past: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """ks, ke int64 [B, S] in key coordinates (past + t) from position ids restarting per document.

    Raises ValueError naming the first token whose position id is neither 0 nor its
    predecessor's plus one, or is larger than the token's key coordinate (the document would
    start before the row).
    """
    pos = np.asarray(position_ids, dtype=np.int64)
    if pos.ndim != 2:
        raise ValueError(f"position_ids must be [batch, tokens], got shape {pos.shape}")
    b, s = pos.shape
    key = past + np.arange(s, dtype=np.int64)
    ks = key[None, :] - pos
    steps = (pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)
    bad = np.argwhere(~steps)
    if bad.size:
        r, t = (int(x) for x in bad[0])
        raise ValueError(
            f"position_ids[{r}, {t + 1}] = {pos[r, t + 1]} after {pos[r, t]}: packshard's indexer "
            "takes documents from position ids that restart at 0 at each document and rise by 1 "
            "within it (left padding: give the pad tokens position 0 as generate() does, and "
            "the first real token 0; `cumsum - 1` with the pads filled with 1 does not)"
        )
    bad = np.argwhere((ks < 0) | (pos < 0))
    if bad.size:
        r, t = (int(x) for x in bad[0])
        raise ValueError(
            f"position_ids[{r}, {t}] = {pos[r, t]} at key {key[t]} (past={past}): a document "
            "cannot start before the row; position ids must restart at 0 at each document"
        )
    return ks, np.broadcast_to(key + 1, (b, s)).copy()


def _allowed(mask: torch.Tensor) -> torch.Tensor:
    """Which entries of a bool (True = visible) or additive float mask let a key through."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


MASK_CHECK_ELEMENTS = 1 << 27  # mask entries looked at per step of `_check_mask` (bounds memory)


def _query_chunks(lo: np.ndarray, past: int, batch: int, budget: int) -> list[tuple[int, int, int]]:
    """(q0, q1, k0) steps over the queries: queries [q0, q1) look at keys [k0, past + q1), the
    window holding every key of their documents up to themselves (lo: the smallest ks of each
    query over the batch).

    A step holds at most `budget` mask entries (one query at least). Past budget / 32 entries
    it also ends before the first query where less than half of its window is inside the
    queries' documents, i.e. where a new document starts far from the window's first key: so
    the steps follow documents longer than a step (GLM-5's 6-document bench row at 16K: 0.17
    of S x T) while short documents share steps of budget / 32 entries (16-token documents at
    32K: 0.06 of S x T) instead of a launch each. The host work is O(S) a step at most, as
    the budget bounds how far a step can reach.
    """
    s = lo.shape[0]
    chunks = []
    q0 = 0
    while q0 < s:
        # a step of n queries holds at least batch * n * (w0 + n - 1) entries (w0: the first
        # query's window), so the budget ends it within `cap` queries: look no further
        w0 = past + q0 + 1 - int(lo[q0])
        cap = min(budget // batch, budget // (batch * w0) + 1, math.isqrt(budget // batch) + 2)
        ahead = lo[q0 : q0 + max(1, cap)]
        k0 = np.minimum.accumulate(ahead)
        n = np.arange(1, ahead.shape[0] + 1)
        own = past + q0 + n - 1
        entries = batch * n * (own + 1 - k0)
        useful = batch * np.cumsum(own + 1 - ahead)
        stop = (entries > budget) | ((entries > budget >> 5) & (2 * useful < entries))
        q1 = q0 + max(1, int(np.argmax(stop)) if stop.any() else ahead.shape[0])
        chunks.append((q0, q1, int(k0[q1 - q0 - 1])))
        q0 = q1
    return chunks


def _check_mask(mask: torch.Tensor, ks: np.ndarray, past: int) -> None:
    """Raise if the model's mask hides, from a query that sees itself, any key of its document
    up to the query (keys [ks, itself] by the position ids).

    mask [B or 1, S, T]; ks int64 [B, S] on the host. The ranges are all packshard's indexer
    selects from, so a mask that hides part of one (left padding, a prefix mask, holes inside a
    document) means the selection would spend top-k slots on keys the attention then drops.
    Each step of queries reads only the mask's window of keys their documents span up to the
    last of them (`_query_chunks`: 0.17 of S x T for GLM-5's 6-document bench row at 16K; for
    one causal document, from 0.8 of it at 16K to about half from 128K), and there is one
    sync.
    """
    b, s = ks.shape
    m = mask.expand(b, -1, -1)
    dev = mask.device
    ks_dev = torch.from_numpy(np.ascontiguousarray(ks)).to(dev)
    bad = torch.zeros((b, s), dtype=torch.bool, device=dev)
    for q0, q1, k0 in _query_chunks(ks.min(axis=0), past, b, MASK_CHECK_ELEMENTS):
        k1 = past + q1
        allowed = _allowed(m[:, q0:q1, k0:k1])  # [B, c, k1 - k0]
        own = past + torch.arange(q0, q1, device=dev)  # [c]
        sees_self = allowed.gather(2, (own - k0).expand(b, -1).unsqueeze(-1)).squeeze(-1)
        keys = torch.arange(k0, k1, device=dev)
        in_range = (keys >= ks_dev[:, q0:q1, None]) & (keys <= own[None, :, None])
        bad[:, q0:q1] = (in_range & ~allowed).any(-1) & sees_self
    if not bool(bad.any()):
        return
    r, q = (int(x) for x in torch.nonzero(bad)[0])
    row = _allowed(m[r, q])
    start, own_key = int(ks[r, q]), past + q
    hidden = int(torch.nonzero(~row[start : own_key + 1])[0]) + start
    if hidden == start:
        raise ValueError(
            f"the attention mask hides key {start} (the first token of its document by the "
            f"position ids) from query {q} of batch row {r}, which sees itself: packshard's "
            "indexer takes documents from position ids restarting at 0 at each document; with "
            "left padding, give the first real token position 0 (right padding needs nothing)"
        )
    raise ValueError(
        f"the attention mask hides key {hidden}, inside the document of query {q} of batch row "
        f"{r} (keys {start}..{own_key} by the position ids): packshard's indexer selects from "
        "whole document ranges and cannot leave out single keys; drop the keys from the row, "
        "or run the model's own indexer (restore())"
    )


@dataclass
class _Ranges:
    """ks/ke of one forward, flattened over the batch, and what they were computed from."""

    key: tuple
    refs: tuple[weakref.ref, ...]
    ks: torch.Tensor  # int32 [B*S] on the host, pinned when q is on a GPU
    ke: torch.Tensor
    held: tuple[torch.UntypedStorage, ...] = ()  # inference tensors' memory, for one forward

    def matches(self, key: tuple, objs: tuple[torch.Tensor, ...]) -> bool:
        return key == self.key and all(r() is o for r, o in zip(self.refs, objs, strict=True))


def _identity(
    x: torch.Tensor | None,
) -> tuple[torch.Tensor | None, tuple, torch.UntypedStorage | None]:
    """What pins down x's contents: the tensor owning its memory (kept as a weak reference)
    and its view and version, for a tensor with a version counter. An inference tensor
    (torch.inference_mode) has none, and its views have no base, so it is known by its
    memory's address, with that memory held (the third item) so that no other tensor can get
    the address while the ranges are kept: only until the routed model's forward returns."""
    if x is None:
        return None, (), None
    view = (x.shape, x.stride(), x.storage_offset(), x.device)
    if x.is_inference():
        storage = x.untyped_storage()
        return None, (*view, storage.data_ptr()), storage
    base = x._base if x._base is not None else x
    return base, (*view, x._version), None


@dataclass
class PackshardIndexer:
    """Handle of the routed indexers: `restore()` puts the model's own forwards back."""

    modules: dict[str, nn.Module]  # qualified name -> indexer module
    config: IndexerConfig = FIXED_CONFIG
    unused_slots: UnusedSlots = "query"
    hadamard: bool = False
    calls: int = 0  # indexer forwards served
    _ranges: _Ranges | None = field(default=None, repr=False)
    _model: weakref.ref | None = field(default=None, repr=False)
    _hooks: tuple[Any, ...] = field(default=(), repr=False)  # around the model's forwards
    _depth: int = field(default=0, repr=False)  # routed forwards in progress
    # `with` blocks: whether each open one routed the model (and so restores it on exit); the
    # routing a use_packshard_indexer call made belongs to the next block entered, if any
    _blocks: list[bool] = field(default_factory=list, repr=False)
    _call_routed: bool = field(default=False, repr=False)

    def restore(self) -> None:
        """Put back each module's own forward (idempotent)."""
        for m in self.modules.values():
            if getattr(m, "_packshard_indexer", None) is self:
                del m.forward
                del m._packshard_indexer
        model = self._model() if self._model is not None else None
        if model is not None and getattr(model, "_packshard_indexer", None) is self:
            del model._packshard_indexer
        for hook in self._hooks:
            hook.remove()
        self._hooks = ()
        self._ranges = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled and deep-copied with the model it routes (torch.save of a whole model, TRL's
        reference copy): the weak reference travels as the model itself, so a copy's handle
        points at the copied model, not at the original (copy and pickle keep a weak reference
        as it is, or cannot pickle it at all); the planning cache of a forward stays behind."""
        state = dict(self.__dict__)
        state["_model"] = self._model() if self._model is not None else None
        state["_ranges"] = None
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> PackshardIndexer:
        """A deep copy of the model (reached through it) points at the model's copy and its
        indexers' copies; a copy of a part (a layer, the handle alone) keeps pointing at the
        original model and at the original indexers it did not copy itself, instead of copying
        all of them."""
        model = self._model() if self._model is not None else None
        twin = memo.get(id(model)) if model is not None else None
        # the indexers this deepcopy copies: those inside the module it was called on (the
        # first object it memoises; a layer, model.model), found among the model's modules
        root = next(iter(memo), None)
        top = next((m for m in model.modules() if id(m) == root), None) if model else None
        copied = {id(m) for m in top.modules()} if top is not None else set()
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key == "_model":
                new._model = weakref.ref(twin if twin is not None else model) if model else None
            elif key == "_ranges":
                new._ranges = None
            elif key == "modules" and twin is None:
                new.modules = {
                    name: copy.deepcopy(m, memo) if id(m) in copied else m
                    for name, m in value.items()
                }
            else:
                setattr(new, key, copy.deepcopy(value, memo))
        return new

    def __setstate__(self, state: dict[str, Any]) -> None:
        model = state.pop("_model")
        self.__dict__.update(state)
        self._model = weakref.ref(model) if model is not None else None

    @property
    def active(self) -> bool:
        return any(getattr(m, "_packshard_indexer", None) is self for m in self.modules.values())

    def _route(self) -> None:
        """Put this handle's forward on every module (each must be free of other handles)."""
        for name, m in self.modules.items():
            other = getattr(m, "_packshard_indexer", None)
            if other is not None and other is not self:
                raise ValueError(
                    f"{name} is already routed by another handle (use_packshard_indexer on an "
                    "enclosing module?); call .restore() on that handle first"
                )
        model = self._model() if self._model is not None else None
        if model is not None:
            _check_unused_slots(model, self.unused_slots)
        ropes = [_rope_of(m) for m in self.modules.values()]  # all found before any is routed
        for m, rope in zip(self.modules.values(), ropes, strict=True):
            m.forward = functools.partial(self.forward, m, rope)
            m._packshard_indexer = self
        if model is not None:
            model._packshard_indexer = self
            self._hooks = (
                model.register_forward_pre_hook(self._forward_begins),
                model.register_forward_hook(self._forward_ends, always_call=True),
            )

    def _forward_begins(self, module: nn.Module, args: Any) -> None:
        self._depth += 1

    def _forward_ends(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._ranges is not None and self._ranges.held:
            self._ranges = None  # lets the inference tensors' memory go

    def __enter__(self) -> PackshardIndexer:
        """The handle; a restored handle routes its model again (one handle, many blocks). A
        block restores on exit only the routing it owns: its own, or that of the
        use_packshard_indexer call it was entered from. A block entered from a call that found
        the model routed already (``with use_packshard_indexer(model):`` inside code that
        routed it for the whole run) leaves that routing in place."""
        owns = not self.active or self._call_routed
        if not self.active:
            self._route()
        self._call_routed = False
        self._blocks.append(owns)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._blocks.pop() if self._blocks else True:
            self.restore()

    def ranges(
        self,
        position_ids: torch.Tensor | None,
        mask: torch.Tensor | None,
        shape: tuple[int, int, int],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Host int32 ks, ke [B*S] of the flattened batch; computed once per forward."""
        b, s, t = shape
        past = t - s
        pos_id, mask_id = _identity(position_ids), _identity(mask)
        held = tuple(h for h in (pos_id[2], mask_id[2]) if h is not None)
        key = (b, s, t, str(device), pos_id[1], mask_id[1])
        objs = tuple(o for o in (pos_id[0], mask_id[0]) if o is not None)
        if self._ranges is not None and self._ranges.matches(key, objs):
            return self._ranges.ks, self._ranges.ke
        if position_ids is None:
            pos = np.broadcast_to(past + np.arange(s, dtype=np.int64), (b, s))
        else:
            if position_ids.dim() != 2 or position_ids.shape[-1] != s:
                raise ValueError(
                    f"position_ids must be [batch, {s}] for {s} query tokens, got shape "
                    f"{tuple(position_ids.shape)}"
                )
            pos = np.broadcast_to(position_ids.detach().cpu().numpy(), (b, s))
        ks, ke = document_ranges(pos, past)
        if mask is not None:
            _check_mask(mask, ks, past)
        offset = (np.arange(b, dtype=np.int64) * t)[:, None]
        ks_t = torch.from_numpy((ks + offset).astype(np.int32).reshape(-1))
        ke_t = torch.from_numpy((ke + offset).astype(np.int32).reshape(-1))
        if device.type == "cuda":
            ks_t, ke_t = ks_t.pin_memory(), ke_t.pin_memory()
        if held and not self._depth:  # outside a hooked forward: nothing marks its end
            self._ranges = None  # (inside one, _forward_ends drops them when it returns)
        else:
            self._ranges = _Ranges(key, tuple(weakref.ref(o) for o in objs), ks_t, ke_t, held)
        return ks_t, ke_t

    @torch.no_grad()
    def forward(
        self,
        module: nn.Module,
        rope: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        hidden_states: torch.Tensor,
        q_resid: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        past_key_values: Any = None,
    ) -> torch.Tensor:
        """The indexer's forward (the model's arguments after `module` and `rope`, bound by
        `use_packshard_indexer`): int32 [B, S, topk] indices in the row's key coordinates."""
        cache = cache if cache is not None else past_key_values
        b, s, _ = hidden_states.shape
        h, d, r = module.n_heads, module.head_dim, module.qk_rope_head_dim
        cos, sin = position_embeddings
        # q, k and the head weights exactly as the model's own forward computes them
        q = module.wq_b(q_resid).view(b, s, h, d)
        q_rot, q_pass = torch.split(q, [r, d - r], dim=-1)
        k = module.k_norm(module.wk(hidden_states)).unsqueeze(2)
        k_rot, k_pass = torch.split(k, [r, d - r], dim=-1)
        q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = torch.cat([q_rot, q_pass], dim=-1)
        k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
        if cache is not None:
            k = cache.update_indexer(k, module.layer_idx)
            k = k[:, : _cached_tokens(cache, module.layer_idx, s, k.shape[1])]
        t = k.shape[1]
        if self.hadamard:  # the cache keeps the model's own k; the rotation is for scoring only
            rot = hadamard_matrix(d, q.dtype, q.device)
            q, k = q @ rot, k @ rot
        scale = module.n_heads**-0.5 * module.softmax_scale  # relu(c x) = c relu(x), c > 0
        w = module.weights_proj(hidden_states.to(module.weights_proj.weight.dtype)).float() * scale
        ks, ke = self.ranges(position_ids, attention_mask, (b, s, t), q.device)
        topk = min(module.index_topk, t)
        idx = fp8_indexer_topk(
            q.reshape(b * s, h, d), k.reshape(b * t, d), w.reshape(b * s, h), ks, ke, topk,
            config=self.config,
        )  # fmt: skip
        rows = torch.arange(b * s, device=idx.device)
        offset = (rows // s) * t
        if self.unused_slots == "query":
            fill = (t - s + rows % s).unsqueeze(1)
        else:
            fill = torch.full((1, 1), -1, dtype=rows.dtype, device=idx.device)
        out = torch.where(idx == b * t, fill, idx - offset.unsqueeze(1))
        self.calls += 1
        return out.to(torch.int32).view(b, s, topk)


def _power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@functools.lru_cache(maxsize=8)
def hadamard_matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The normalised n x n Hadamard matrix (Sylvester's construction; n a power of two):
    symmetric and orthogonal, every entry +-n^-0.5 (rounded alike in `dtype`, which scales the
    whole matrix by one factor and so changes no selection)."""
    if not _power_of_two(n):
        raise ValueError(f"a Hadamard matrix here needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * n**-0.5).to(dtype=dtype, device=device)


def _cached_tokens(cache: Any, layer_idx: int, s: int, buffer: int) -> int:
    """Keys held for this layer after this call: the model's attention has already cached the
    call's s tokens (both versions update the cache before the indexer runs). A static cache
    returns its whole buffer, unfilled past that count."""
    seen = getattr(cache, "get_seq_length", None)
    n = int(seen(layer_idx)) if seen is not None else buffer
    if not s <= n <= buffer:
        raise ValueError(
            f"the cache holds {n} tokens for layer {layer_idx} after a call of {s} tokens, with "
            f"{buffer} indexer keys: expected {s} <= tokens <= keys"
        )
    return n


def find_indexers(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> each DSA indexer module packshard can route; ValueError if none.

    Raises ValueError naming the model's class when it has no indexer, or names the reason
    when its indexer is of a family packshard does not route (deepseek_v4).
    """
    found: dict[str, nn.Module] = {}
    for name, m in model.named_modules():
        cls, family = _family_of(m)
        if cls and family is None:
            raise ValueError(f"{name or type(model).__name__} is a {cls}: {UNSUPPORTED[cls]}")
        if family is not None:
            missing = [a for a in _ATTRIBUTES if not hasattr(m, a)]
            if missing:
                raise ValueError(
                    f"{name} ({cls}) lacks {missing}: this transformers version's indexer is "
                    "not the one packshard reproduces (transformers 5.17-5.25)"
                )
            found[name] = m
    if not found:
        names = ", ".join(f"{f.indexer_class} ({f.model_type})" for f in FAMILIES.values())
        raise ValueError(
            f"{type(model).__name__} has no DSA lightning indexer packshard can route; it "
            f"routes {names} modules of transformers"
        )
    return found


def use_packshard_indexer(
    model: nn.Module,
    *,
    config: IndexerConfig = FIXED_CONFIG,
    unused_slots: UnusedSlots = "query",
    hadamard: bool = False,
) -> PackshardIndexer:
    """Route every DSA indexer of `model` to `fp8_indexer_topk` (module docstring); a handle.

    `hadamard=True` rotates q and k by the normalised Hadamard matrix before they are quantised,
    as DeepSeek's reference indexer does (module docstring, "Hadamard rotation"); the indexers'
    head_dim must then be a power of two.

    Calling it again on a routed model returns the same handle when the settings are the same
    and raises ValueError otherwise (`restore()` first). The handle is a context manager that
    restores on exit the routing it made (``with use_packshard_indexer(model):`` in code whose
    caller routed the model already leaves it routed); entering a restored handle routes the
    model again. `unused_slots=
    "minus_one"` is refused for the eager and SDPA attentions, which scatter the indices into a
    mask (the check runs again whenever the handle routes).
    """
    if unused_slots not in ("query", "minus_one"):
        raise ValueError(f"unused_slots={unused_slots!r}: must be 'query' or 'minus_one'")
    if not isinstance(config, IndexerConfig):
        raise TypeError(f"config must be an IndexerConfig, got {type(config).__name__}")
    if not isinstance(hadamard, bool):
        raise TypeError(f"hadamard must be True or False, got {hadamard!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"use_packshard_indexer takes the model (a torch.nn.Module), got {type(model).__name__}"
        )
    existing = getattr(model, "_packshard_indexer", None)
    if isinstance(existing, PackshardIndexer) and existing.active:
        settings = (existing.config, existing.unused_slots, existing.hadamard)
        if settings != (config, unused_slots, hadamard):
            raise ValueError(
                f"{type(model).__name__} is already routed with config={existing.config}, "
                f"unused_slots={existing.unused_slots!r}, hadamard={existing.hadamard}; "
                "call .restore() on its handle first"
            )
        existing._call_routed = False  # a block entered from this call leaves the routing
        return existing
    modules = find_indexers(model)
    for name, m in modules.items():
        heads = int(m.n_heads)
        if _next_pow2(heads) > config.logits.block_n:
            raise ValueError(
                f"{name} has index_n_heads={heads}; the kernel takes up to "
                f"{config.logits.block_n} heads (LogitsConfig.block_n, heads padded to a power of two)"
            )
    if hadamard:
        for name, m in modules.items():
            if not _power_of_two(int(m.head_dim)):
                raise ValueError(
                    "hadamard=True needs a power-of-two head_dim; "
                    f"{name} has index_head_dim={m.head_dim}"
                )
    handle = PackshardIndexer(modules, config, unused_slots, hadamard)
    handle._model = weakref.ref(model)
    handle._route()
    handle._call_routed = True
    return handle


def _check_unused_slots(model: nn.Module, unused_slots: str) -> None:
    """ValueError for -1 slots under an attention that scatters the indices into a mask (a
    bare indexer module passes: its caller decides what consumes the indices)."""
    if unused_slots != "minus_one" or _family_of(model)[1] is not None:
        return
    # the model's config, or those of the models a wrapper (a user's module, DDP) holds
    impls = [
        getattr(getattr(m, "config", None), "_attn_implementation", None) for m in model.modules()
    ]
    impl = next((i for i in impls if i in MASK_ATTENTIONS), None)
    if impl is not None:
        raise ValueError(
            "unused_slots='minus_one' is for sparse attention kernels that read -1 as no key "
            f"(FlashMLA); this model's {impl!r} attention scatters the indices into a mask, "
            "which takes only keys in [0, T): use unused_slots='query' (the default)"
        )
