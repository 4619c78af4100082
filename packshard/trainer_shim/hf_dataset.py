"""`PackedShardDataset`: a packshard dataset as the torch IterableDataset Hugging Face's Trainer
and TRL's SFTTrainer take, one packed row per item (`PackedRow`), this rank's rows only.

The rules it follows for Trainer (why each item is a `PackedRow`, how the DP rank is found, why
every iteration starts at the start position, what it keeps for the callback) are in
`trainer_shim.hf`, whose `StreamStateCallback` it works with. It needs torch, not transformers.
"""

from __future__ import annotations

import logging
import os
import sys
from collections import deque
from collections.abc import Iterator, Mapping
from types import FrameType
from typing import Any

from packshard._extras import require
from packshard.packers.urls import dataset_url, redact_url
from packshard.trainer_shim.meter import COUNT_KEYS
from packshard.trainer_shim.planning import Position
from packshard.trainer_shim.stream import PackedShardStream
from packshard.trainer_shim.topology import Topology, rank_world

require("train", "torch", "packshard.trainer_shim.hf_dataset")  # before torch is imported
from torch.utils.data import IterableDataset, get_worker_info  # noqa: E402

log = logging.getLogger(__name__)

ITEM_KEYS = (
    "input_ids", "labels", "position_ids", "cu_seqlens", "num_tokens", "num_loss_tokens",
    "padded_len", "attn_cost", "row", "step", "micro_step", "num_micro_steps", "epoch",
)  # fmt: skip
RECORDS = 8192  # items' positions kept: far more than Trainer holds ahead of its step
_NOT_STREAM_KWARGS = {
    "cp_rank": "the dataset yields whole rows; CP ranks get the same rows (accelerate splits them)",
    "cp_size": "the dataset yields whole rows; CP ranks get the same rows (accelerate splits them)",
    "cp_layout": "the dataset yields whole rows",
    "device": "Trainer moves batches to the device itself",
}


class PackedRow(Mapping[str, Any]):
    """One packed row (`ITEM_KEYS`). A read-only mapping, not a dict: Trainer's
    ``RemoveColumnsCollator`` strips from dict items every key the model's forward does not
    take, and only passes other objects to the collator whole."""

    __slots__ = ("_data",)

    def __init__(self, data: dict[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"PackedRow(row={self._data['row']}, padded_len={self._data['padded_len']})"


def topology_for(rank: int, world: int, *, tp: int = 1, cp: int = 1, sp: int = 1) -> Topology:
    """The data-parallel rank and size of global `rank` under accelerate's mesh order
    (dp_replicate, dp_shard, cp, tp; tp fastest). The ranks of one (cp, tp) group read the
    same rows. Sequence-parallel ranks read different rows (DeepSpeed's Ulysses adapter gathers
    one batch from each SP rank and trains them in turn), so with sp > 1 every rank is a data
    rank; DeepSpeed groups SP ranks as consecutive global ranks, whatever accelerate's mesh
    says, so sp > 1 together with tp or cp > 1 is refused (which ranks would share rows is
    not known here)."""
    group = tp * cp * sp
    if min(tp, cp, sp) < 1 or world % group:
        raise ValueError(
            f"world size {world} is not a multiple of tp*cp*sp = {tp}*{cp}*{sp} = {group}"
        )
    if sp > 1 and tp * cp > 1:
        raise ValueError(
            f"PackedShardDataset: sequence parallelism (sp={sp}) together with tp={tp} / cp={cp} "
            "is not supported: DeepSpeed puts consecutive ranks in one SP group, accelerate's "
            "mesh puts TP and CP ranks there, so the ranks that must share rows are not known"
        )
    return Topology(dp_rank=rank // (tp * cp), dp_size=world // (tp * cp))


def parallel_sizes() -> tuple[int, int, int, str]:
    """(tp, cp, sp, cp_backend) of accelerate's ParallelismConfig when an Accelerator is set up,
    else of the PARALLELISM_CONFIG_* variables `accelerate launch` sets, else (1, 1, 1, "").
    DeepSpeed's AutoTP (``tensor_parallel.autotp_size`` in its config) counts as tp: accelerate
    gives its consecutive ranks one batch, as it does for its own tp."""
    try:
        from accelerate.state import AcceleratorState, is_initialized
    except ImportError:  # accelerate absent (or too old for ParallelismConfig): no CP, stated
        return 1, 1, 1, ""
    state = AcceleratorState() if is_initialized() else None
    pc = state.parallelism_config if state is not None else None
    if pc is not None:
        tp, cp, sp, backend = pc.tp_size, pc.cp_size, pc.sp_size, getattr(pc, "cp_backend", "torch")
    else:
        env = os.environ
        tp, cp, sp = (int(env.get(f"PARALLELISM_CONFIG_{k}_SIZE", "1")) for k in ("TP", "CP", "SP"))
        backend = env.get("PARALLELISM_CONFIG_CP_BACKEND", "torch")
    autotp = _deepspeed_autotp_size(state)
    return (autotp if autotp > 1 else tp), cp, sp, str(backend)


def _deepspeed_autotp_size(state: Any) -> int:
    """The AutoTP size of the DeepSpeed config an Accelerator runs with, else 1."""
    plugin = getattr(state, "deepspeed_plugin", None)
    config = getattr(plugin, "deepspeed_config", None)
    tp = config.get("tensor_parallel") if isinstance(config, dict) else None
    size = tp.get("autotp_size") if isinstance(tp, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 1 else 1


WRAPPER_FRAMES = 10  # callers of __iter__ looked at for an accelerate wrapper
EVAL_FRAMES = 20  # ... and for Trainer's evaluation loop


class PackedShardDataset(IterableDataset):
    """This rank's packed rows of a packshard dataset, one `PackedRow` per item (module
    docstring). ``rows_per_rank`` rows per rank make one planning step (cost-balanced across
    DP ranks): set it to ``per_device_train_batch_size * gradient_accumulation_steps`` (``/ sp``
    under DeepSpeed's sequence parallelism, ``/`` the processes under accelerate's
    ``split_batches=True``) so a planning step is an optimizer step. Other keyword arguments go to `PackedShardStream`
    (seed, epochs, shuffle, balance, cache_dir, storage_options, prefetch, read_threads,
    seq_len, cost_model, verify, cache_limit_bytes, read_ahead_bytes, stall_timeout_s,
    prefetch_thread).
    Unsized: give Trainer ``max_steps`` (`micro_batches_per_epoch` helps)."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        rows_per_rank: int = 1,
        dp_rank: int | None = None,
        dp_size: int | None = None,
        allow_cross_document_attention: bool = False,
        **stream_kwargs: Any,
    ) -> None:
        super().__init__()
        for key, why in _NOT_STREAM_KWARGS.items():
            if key in stream_kwargs:
                raise ValueError(f"PackedShardDataset: {key}= is not taken: {why}")
        if "rows_per_step" in stream_kwargs:
            raise ValueError(
                "PackedShardDataset: give rows_per_rank (rows per DP rank per planning step); "
                "rows_per_step follows from it and the DP size"
            )
        if rows_per_rank < 1:
            raise ValueError(f"PackedShardDataset: rows_per_rank={rows_per_rank} must be >= 1")
        if (dp_rank is None) != (dp_size is None):
            raise ValueError("PackedShardDataset: give both dp_rank and dp_size, or neither")
        self._url = dataset_url(url)  # as given: it reads the dataset
        self.url = redact_url(self._url)  # printed: without credentials or a signature
        self.rows_per_rank = rows_per_rank
        self.allow_cross_document_attention = allow_cross_document_attention
        self._explicit = None if dp_size is None else Topology(dp_rank=dp_rank, dp_size=dp_size)  # type: ignore[arg-type]
        self._stream_kwargs = stream_kwargs
        self.topology = self._resolve_topology()
        self.stream = self._open(self.topology)
        self._start: dict[str, Any] = self.stream.state_dict()
        self._start_items = 0  # items of this rank trained before the start position
        self._records: deque[tuple[int, tuple[int, ...], dict[str, int]]] = deque(maxlen=RECORDS)
        self._yielded = 0
        self._pass = 0

    # ---- topology -------------------------------------------------------------------------

    def _resolve_topology(self) -> Topology:
        if self._explicit is not None:
            return self._explicit
        rank, world, source = rank_world()
        tp, cp, sp, backend = parallel_sizes()
        if cp > 1 and backend == "torch" and not self.allow_cross_document_attention:
            raise ValueError(
                f"accelerate's context parallelism (cp_size={cp}, cp_backend='torch') replaces the "
                "attention mask by is_causal=True, so the documents of a packed row would attend to "
                "each other. Use packshard's own CP (PackedShardStream(cp_size=...) with a document-"
                "masked attention), sequence parallelism (sp_backend='deepspeed'), or pass "
                "allow_cross_document_attention=True to accept it"
            )
        try:
            topo = topology_for(rank, world, tp=tp, cp=cp, sp=sp)
        except ValueError as e:
            raise ValueError(f"{e} (rank {rank} of {world} from {source})") from None
        log.info(
            "PackedShardDataset %s: rank %d of %d (%s), tp %d cp %d sp %d -> dp %d/%d",
            self.url, rank, world, source, tp, cp, sp, topo.dp_rank, topo.dp_size,
        )  # fmt: skip
        return topo

    def _open(self, topo: Topology) -> PackedShardStream:
        return PackedShardStream(
            self._url,
            dp_rank=topo.dp_rank,
            dp_size=topo.dp_size,
            rows_per_step=self.rows_per_rank * topo.dp_size,
            **self._stream_kwargs,
        )

    def _ensure_topology(self) -> None:
        topo = self._resolve_topology()
        if topo == self.topology:
            return
        log.info("PackedShardDataset: topology changed %s -> %s; reopening", self.topology, topo)
        self.stream.close()
        self.topology = topo
        self.stream = self._open(topo)
        self.stream.load_state_dict(self._start)  # global position: valid for any rank
        self._start = self.stream.state_dict()

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def micro_batches_per_epoch(self) -> int:
        """Items (rows) this rank yields per epoch of the data; Trainer's batches per epoch is
        this / per_device_train_batch_size."""
        return self.stream.steps_per_epoch * self.stream.num_micro_steps

    def items_from_start(self) -> int | None:
        """Items one iteration yields from the start position (None: endless, epochs=None)."""
        pos = self._start["position"]
        steps = self.stream.planner.remaining_steps(
            Position(pos["epoch"], pos["offset"], pos["step"])
        )
        return None if steps is None else steps * self.stream.num_micro_steps - pos["micro_step"]

    # ---- iteration ----------------------------------------------------------------------------

    def __reduce__(self) -> Any:
        raise TypeError(
            "PackedShardDataset cannot be sent to another process (DataLoader workers under spawn "
            "or forkserver, multiprocessing): it holds open shards and reading threads, so use "
            "dataloader_num_workers=0; each process of a distributed run builds its own"
        )

    def __iter__(self) -> Iterator[PackedRow]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "PackedShardDataset runs in a DataLoader worker: each worker would read every row. "
                "It reads ahead itself; use dataloader_num_workers=0"
            )
        evaluating = self._in_evaluation(sys._getframe(1))
        refusal = (self._evaluation_refusal() if evaluating else None) or self._wrapper_refusal(
            sys._getframe(1)
        )
        if refusal is not None:
            raise RuntimeError(refusal)
        self._ensure_topology()
        self.stream.load_state_dict(self._start)
        self._pass += 1
        self._records.clear()
        self._yielded = self._start_items
        return self._items(self._pass, fillers=not evaluating)

    @staticmethod
    def _in_evaluation(caller: FrameType | None) -> bool:
        """Whether Trainer's evaluation (or prediction) loop is among the callers."""
        for _ in range(EVAL_FRAMES):
            if caller is None:
                return False
            trainer = caller.f_locals.get("self")
            if caller.f_code.co_name in ("evaluation_loop", "prediction_loop") and any(
                c.__name__ == "Trainer" for c in type(trainer).__mro__
            ):
                return True
            caller = caller.f_back
        return False

    def _evaluation_refusal(self) -> str | None:
        """Why Trainer's evaluation loop cannot evaluate on this dataset, else None: an endless
        one (epochs=None) never ends the loop, and over several processes each rank's last step
        is filled with rows without tokens to keep the ranks in step (their loss is NaN), and
        accelerate's shard of it would keep part of each rank's rows. On one process the loop
        gets no filler rows (`_items`)."""
        if self.items_from_start() is None:
            return (
                "Trainer evaluates on a PackedShardDataset with epochs=None, which never "
                "ends: build the eval dataset with epochs=1"
            )
        dp = self._resolve_topology().dp_size
        if dp > 1:
            return (
                f"evaluating a PackedShardDataset over {dp} data-"
                "parallel ranks is not supported (each rank's last step is filled with "
                "rows that hold no tokens, whose loss is NaN): evaluate on one process"
            )
        return None

    def _wrapper_refusal(self, caller: FrameType | None) -> str | None:
        """Why accelerate's wrapper that is iterating this dataset would lose rows, else None.

        Looked for among the callers of ``__iter__`` (a few frames: torch's fetcher sits
        between a DataLoader and the dataset): an ``IterableDatasetShard`` that still re-shards
        (num_processes > 1: Trainer without `StreamStateCallback`) would keep 1/num_processes
        of this rank's rows; a ``DataLoaderDispatcher`` over several processes (accelerate's
        default ``dispatch_batches`` for an IterableDataset) trains process 0's rows alone. A
        plain loop, a torch DataLoader, or a wrapper the callback made a pass-through pass.
        """
        for _ in range(WRAPPER_FRAMES):
            if caller is None:
                return None
            obj = caller.f_locals.get("self")
            kind = type(obj).__name__
            if kind == "IterableDatasetShard" and getattr(obj, "dataset", None) is self:
                n = getattr(obj, "num_processes", 1)
                if n <= 1:
                    return None
                return (
                    f"accelerate's IterableDatasetShard would keep 1/{n} of the rows of this rank, "
                    "which PackedShardDataset already reads alone: add StreamStateCallback(dataset) "
                    "to the Trainer's callbacks (it makes the wrapper a pass-through)"
                )
            if kind == "DataLoaderDispatcher" and getattr(obj, "dataset", None) is self:
                n = getattr(getattr(obj, "state", None), "num_processes", 1)
                if n <= 1:
                    return None
                return (
                    f"accelerate dispatches batches from process 0 to all {n} processes "
                    "(dispatch_batches, its default for an IterableDataset), so only rank 0's rows "
                    "would be trained: pass TrainingArguments(accelerator_config="
                    "{'dispatch_batches': False}) and add StreamStateCallback(dataset)"
                )
            caller = caller.f_back
        return None

    def _items(self, pass_no: int, *, fillers: bool = True) -> Iterator[PackedRow]:
        """The stream's rows as items; without `fillers` (evaluation on one process), not the
        rows without tokens that complete an epoch's last step (a batch of them only would
        evaluate to a NaN loss)."""
        for mb in self.stream:
            if pass_no != self._pass:
                raise RuntimeError(
                    "this iteration of PackedShardDataset was superseded by a new one"
                )
            if not fillers and mb["row"] < 0:
                continue
            self._yielded += 1
            self._records.append(
                (self._yielded, tuple(int(mb[k]) for k in COUNT_KEYS), self.stream.state_dict()["position"])
            )  # fmt: skip
            yield PackedRow({k: mb[k] for k in ITEM_KEYS})

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The stream's state after the last item yielded (see `state_after` for what a
        Trainer has trained)."""
        return self.stream.state_dict()

    def load_state_dict(self, state: Mapping[str, Any], *, items: int = 0) -> None:
        """Start the next iteration at `state` (a `PackedShardStream` state); `items` is the
        number of this rank's items trained before it (kept for `state_after`)."""
        self.stream.load_state_dict(state)
        self._start = self.stream.state_dict()
        self._start_items = items

    @property
    def items_yielded(self) -> int:
        """Items of this rank before the last one yielded, counted like `load_state_dict`'s
        `items` (the start position's count plus this iteration's items)."""
        return self._yielded

    def _record(self, items: int) -> tuple[tuple[int, ...], dict[str, int]]:
        first = self._records[0][0] if self._records else self._yielded + 1
        if not first <= items <= self._yielded:
            raise RuntimeError(
                f"the stream position after item {items} is not kept (items {first}..{self._yielded} "
                f"are; {RECORDS} at most): the Trainer is further behind the dataset than expected"
            )
        rec = self._records[items - first]
        return rec[1], rec[2]

    def state_after(self, items: int) -> dict[str, Any]:
        """The stream state after this rank's `items`-th item (counted like `items_yielded`)."""
        if items == self._start_items:
            return dict(self._start)
        return {**self._start, "position": dict(self._record(items)[1])}

    def counts_between(self, first: int, last: int) -> list[dict[str, int]]:
        """Whole-row counts (`COUNT_KEYS`) of items first+1..last, for `TrainedTokenMeter`."""
        return [
            dict(zip(COUNT_KEYS, self._record(i)[0], strict=True))
            for i in range(first + 1, last + 1)
        ]

    def close(self) -> None:
        self.stream.close()
