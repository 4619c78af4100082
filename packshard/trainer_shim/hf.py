"""Hugging Face `Trainer` / TRL `SFTTrainer` on a packshard dataset: the dataset, the collator,
and a callback for exact resume and trained-token throughput.

    ds = PackedShardDataset("s3://bucket/packed/run1", rows_per_rank=8, cache_dir="/nvme/ps")
    trainer = Trainer(model, args=TrainingArguments(..., max_steps=1000, ignore_data_skip=True,
                      accelerator_config={"dispatch_batches": False}),    # several GPUs
                      train_dataset=ds, data_collator=packed_collator,
                      callbacks=[StreamStateCallback(ds)])

`PackedShardDataset` (a torch ``IterableDataset``) yields one packed row per item (`PackedRow`:
``input_ids``, shifted ``labels``, ``position_ids``, ``cu_seqlens``, the row's counts and
``row``, its index in index.arrow) from a `PackedShardStream` that reads only this rank's rows.
`packed_collator` joins the ``per_device_train_batch_size`` rows of a batch into one padding-free
sequence (`flatten.py`): ``input_ids`` [1, L], ``position_ids`` restarting per document,
unshifted ``labels`` for the model's own loss, and on request ``shift_labels`` and the
flash-attention varlen arguments. No attention mask: the model then masks per document from the
position ids (flash_attention_2 / 3 from them or from ``cu_seq_lens_*``; sdpa, eager and
flex_attention through transformers' packed-sequence mask), and ``use_cache=False`` so that no
cache switches that detection off.

Topology. DP rank and size come from torch.distributed when it is initialised (accelerate does
it when TrainingArguments are built), else from the launcher's RANK / WORLD_SIZE, else 0 / 1.
Ranks that hold the same rows under accelerate's `ParallelismConfig` (tensor, context or
sequence parallel: accelerate splits their batch itself) share a DP rank:
``dp_rank = rank // (tp * cp * sp)``. Accelerate's torch context parallelism (accelerate 1.10+)
replaces the attention mask by ``is_causal``, so packed documents would attend to each other:
the dataset refuses it unless ``allow_cross_document_attention=True`` (packshard's own CP is
`PackedShardStream(cp_size=...)` with a document-masked attention). The topology is read at
construction and again when iteration starts; the one in use is logged.

How Trainer wraps an IterableDataset, and what this module does about it (accelerate 1.16):
- ``dispatch_batches`` (on by default for an IterableDataset) makes rank 0 read every rank's
  batch and concatenate them, which fails for rows of different lengths: with several
  processes, set ``accelerator_config={"dispatch_batches": False}`` (the callback says so).
  One process works either way.
- without dispatch, accelerate wraps the dataset in ``IterableDatasetShard``, which keeps
  1/num_processes of what each rank yields: on a dataset already split by rank that would drop
  rows. `StreamStateCallback.on_train_begin` turns that wrapper into a pass-through (as Trainer
  does for its own rank-aware sampler), and the dataset refuses to go past a first item under
  several ranks without it.
- every iteration starts from the dataset's start position (the beginning, or the state loaded
  by the callback on resume): SFTTrainer's ``next(iter(dataset))`` peek at construction moves
  nothing. The prefetch thread makes ``dataloader_num_workers=0`` the right setting; workers
  are refused (each would read every row).
- Trainer fetches ahead (accelerate keeps one batch in hand), so "where the stream is" is not
  "what was trained": the dataset keeps the stream's position after each item it yielded, and
  the callback saves the position after the ``global_step * batch * grad_accum`` items trained.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any, cast

from torch.utils.data import IterableDataset, get_worker_info

from packshard._extras import require
from packshard.trainer_shim.flatten import flatten_rows
from packshard.trainer_shim.meter import StepStats, TrainedTokenMeter
from packshard.trainer_shim.stream import PackedShardStream
from packshard.trainer_shim.topology import Topology

require("hf", "transformers", "packshard.trainer_shim.hf")
from transformers import TrainerCallback  # noqa: E402

log = logging.getLogger(__name__)

ITEM_KEYS = (
    "input_ids", "labels", "position_ids", "cu_seqlens", "num_tokens", "num_loss_tokens",
    "padded_len", "attn_cost", "row", "step", "micro_step", "num_micro_steps", "epoch",
)  # fmt: skip
COUNT_KEYS = ("num_tokens", "num_loss_tokens", "padded_len", "attn_cost", "row")
RECORDS = 8192  # items' positions kept: far more than Trainer holds ahead of its step
STATE_KEY = "packshard_stream"  # in TrainerState.stateful_callbacks (saved in trainer_state.json)
STATE_VERSION = 1
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
    """DP rank and size of global `rank` under accelerate's mesh order (dp_replicate, dp_shard,
    cp, sp, tp; tp fastest): the ranks of one (cp, sp, tp) group share a DP rank."""
    group = tp * cp * sp
    if group < 1 or world % group:
        raise ValueError(
            f"world size {world} is not a multiple of tp*cp*sp = {tp}*{cp}*{sp} = {group}"
        )
    return Topology(dp_rank=rank // group, dp_size=world // group)


def _rank_world() -> tuple[int, int, str]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), "torch.distributed"
    try:
        rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE must be integers ({e})") from None
    return rank, world, ("RANK/WORLD_SIZE" if "WORLD_SIZE" in os.environ else "one process")


def _parallel_sizes() -> tuple[int, int, int, str]:
    """(tp, cp, sp, cp_backend) of accelerate's ParallelismConfig when an Accelerator is set up,
    else of the PARALLELISM_CONFIG_* variables `accelerate launch` sets, else (1, 1, 1, "")."""
    try:
        from accelerate.state import AcceleratorState, is_initialized
    except ImportError:  # accelerate absent (or too old for ParallelismConfig): no CP, stated
        return 1, 1, 1, ""
    pc = AcceleratorState().parallelism_config if is_initialized() else None
    if pc is not None:
        return pc.tp_size, pc.cp_size, pc.sp_size, str(getattr(pc, "cp_backend", "torch"))
    env = os.environ
    sizes = [int(env.get(f"PARALLELISM_CONFIG_{k}_SIZE", "1")) for k in ("TP", "CP", "SP")]
    return sizes[0], sizes[1], sizes[2], env.get("PARALLELISM_CONFIG_CP_BACKEND", "torch")


class PackedShardDataset(IterableDataset):
    """This rank's packed rows of a packshard dataset, one `PackedRow` per item (module
    docstring). ``rows_per_rank`` rows per rank make one planning step (cost-balanced across
    DP ranks): set it to ``per_device_train_batch_size * gradient_accumulation_steps`` so a
    planning step is an optimizer step. Other keyword arguments go to `PackedShardStream`
    (seed, epochs, shuffle, balance, cache_dir, storage_options, prefetch, read_threads,
    seq_len, cost_model, verify, cache_limit_bytes). Unsized: give Trainer ``max_steps``
    (`micro_batches_per_epoch` helps)."""

    def __init__(
        self,
        url: str,
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
        self.url = url
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
        self._unsharded = False  # set by StreamStateCallback once accelerate's re-sharding is off

    # ---- topology -------------------------------------------------------------------------

    def _resolve_topology(self) -> Topology:
        if self._explicit is not None:
            return self._explicit
        rank, world, source = _rank_world()
        tp, cp, sp, backend = _parallel_sizes()
        if cp > 1 and backend == "torch" and not self.allow_cross_document_attention:
            raise ValueError(
                f"accelerate's context parallelism (cp_size={cp}, cp_backend='torch') replaces the "
                "attention mask by is_causal=True, so the documents of a packed row would attend to "
                "each other. Use packshard's own CP (PackedShardStream(cp_size=...) with a document-"
                "masked attention), sequence parallelism (sp_backend='deepspeed'), or pass "
                "allow_cross_document_attention=True to accept it"
            )
        topo = topology_for(rank, world, tp=tp, cp=cp, sp=sp)
        log.info(
            "PackedShardDataset %s: rank %d of %d (%s), tp %d cp %d sp %d -> dp %d/%d",
            self.url, rank, world, source, tp, cp, sp, topo.dp_rank, topo.dp_size,
        )  # fmt: skip
        return topo

    def _open(self, topo: Topology) -> PackedShardStream:
        return PackedShardStream(
            self.url,
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

    # ---- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[PackedRow]:
        if get_worker_info() is not None:
            raise RuntimeError(
                "PackedShardDataset runs in a DataLoader worker: each worker would read every row. "
                "It prefetches in its own thread; use dataloader_num_workers=0"
            )
        self._ensure_topology()
        self.stream.load_state_dict(self._start)
        self._pass += 1
        self._records.clear()
        self._yielded = self._start_items
        return self._items(self._pass)

    def _items(self, pass_no: int) -> Iterator[PackedRow]:
        for k, mb in enumerate(self.stream):
            if k == 1 and self.topology.dp_size > 1 and not self._unsharded:
                raise RuntimeError(
                    f"PackedShardDataset under {self.topology.dp_size} DP ranks already splits rows by "
                    "rank: add StreamStateCallback(dataset) to the Trainer's callbacks (it stops "
                    "accelerate's IterableDatasetShard from keeping only 1/num_processes of them); "
                    "outside a Trainer, iterate a PackedShardStream"
                )
            if pass_no != self._pass:
                raise RuntimeError(
                    "this iteration of PackedShardDataset was superseded by a new one"
                )
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


def packed_collator(
    items: list[Mapping[str, Any]], *, varlen: bool = False, shift_labels: bool = False
) -> dict[str, Any]:
    """Trainer's ``data_collator`` for `PackedShardDataset`: the batch's rows as one padding-free
    sequence [1, L] with ``input_ids``, ``position_ids`` (restarting per document), ``labels``
    (unshifted: the model's causal-LM loss shifts them) and ``use_cache=False``. Options (bind
    them with ``functools.partial``): ``varlen=True`` adds ``cu_seq_lens_q/k`` (int32) and
    ``max_length_q/k`` for flash-attention's varlen kernels (computed here on the CPU instead of
    from position ids in every layer); ``shift_labels=True`` adds the pre-shifted labels (context
    parallelism, losses that take ``shift_labels``)."""
    flat = flatten_rows(items)
    batch: dict[str, Any] = {
        "input_ids": flat["input_ids"],
        "position_ids": flat["position_ids"],
        "labels": flat["labels"],
        "use_cache": False,
    }
    if shift_labels:
        batch["shift_labels"] = flat["shift_labels"]
    if varlen:
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = flat["cu_seqlens"]
        batch["max_length_q"] = batch["max_length_k"] = flat["max_seqlen"]
    return batch


class StreamStateCallback(TrainerCallback):
    """Exact resume and trained-token throughput for a `PackedShardDataset` in Trainer.

    - Saves, at every step, the stream position after the items trained so far into the
      TrainerState (``stateful_callbacks["packshard_stream"]``, written with each checkpoint's
      trainer_state.json). On ``train(resume_from_checkpoint=...)``: with
      ``ignore_data_skip=True`` the dataset continues from that position (nothing re-read);
      with Trainer's default it starts from the beginning and Trainer's own skip of the trained
      batches brings it there, which the callback checks against the saved position at the
      first step. Either way the resumed run sees the rows the uninterrupted one would have.
    - Turns accelerate's IterableDatasetShard into a pass-through (module docstring).
    - Feeds a `TrainedTokenMeter` the trained rows of each step and adds to every log:
      ``trained_tokens``, ``trained_tokens_per_s``, ``trained_tokens_per_s_per_gpu``,
      ``loss_tokens_per_s``, ``padding_fraction`` and ``rank_imbalance`` (over the log window;
      the state's log_history and callbacks after this one see them).
    """

    def __init__(
        self, dataset: PackedShardDataset, *, meter: TrainedTokenMeter | None = None
    ) -> None:
        if not isinstance(dataset, PackedShardDataset):
            raise TypeError(
                f"StreamStateCallback takes a PackedShardDataset, got {type(dataset).__name__}"
            )
        self.dataset = dataset
        self.meter = meter
        self._per_step = 0
        self._base_step = 0
        self._base_items = 0
        self._trained = 0
        self._check: dict[str, Any] | None = None
        self._window: list[StepStats] = []
        self.total_tokens = 0

    # ---- set-up -------------------------------------------------------------------------------

    def _unshard(self, dataloader: Any, world: int) -> None:
        try:
            from accelerate.data_loader import DataLoaderDispatcher, IterableDatasetShard
        except ImportError:
            return
        if isinstance(dataloader, DataLoaderDispatcher) and world > 1:
            raise ValueError(
                "accelerate dispatches the batches of an IterableDataset from rank 0 and concatenates "
                "them, which fails for packed rows of different lengths: pass "
                "TrainingArguments(accelerator_config={'dispatch_batches': False})"
            )
        shard = getattr(dataloader, "dataset", None)
        if isinstance(shard, IterableDatasetShard) and shard.dataset is self.dataset:
            if shard.num_processes > 1:
                log.info(
                    "StreamStateCallback: accelerate's IterableDatasetShard (%d processes) is now a "
                    "pass-through: PackedShardDataset already reads only this rank's rows",
                    shard.num_processes,
                )
            shard.num_processes, shard.process_index = 1, 0
        self.dataset._unsharded = True

    def on_train_begin(
        self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any
    ) -> None:
        if getattr(args, "n_gpu", 1) > 1:
            raise ValueError(
                "PackedShardDataset under nn.DataParallel (several GPUs, one process) is not supported: "
                "launch one process per GPU (torchrun / accelerate launch)"
            )
        if args.dataloader_num_workers:
            raise ValueError(
                "PackedShardDataset prefetches in a thread: set dataloader_num_workers=0"
            )
        self._unshard(train_dataloader, args.world_size)
        self._per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        step = state.global_step
        self._base_step, self._base_items, self._check = 0, self.dataset._start_items, None
        if step > 0:
            saved = (state.stateful_callbacks or {}).get(STATE_KEY)
            self._resume(saved, step, bool(args.ignore_data_skip))
        self._trained = self._base_items + (step - self._base_step) * self._per_step
        if self.meter is None:
            self.meter = TrainedTokenMeter(dp_rank=self.dataset.topology.dp_rank)
        self.meter.start()

    def _resume(self, saved: Any, step: int, ignore_data_skip: bool) -> None:
        if not isinstance(saved, dict) or saved.get("version") != STATE_VERSION:
            raise ValueError(
                f"the checkpoint of step {step} has no packshard stream state (trainer_state.json's "
                f"stateful_callbacks[{STATE_KEY!r}]): it was saved without StreamStateCallback, so the "
                "rows it trained are unknown. Resume from a checkpoint saved with the callback"
            )
        if saved["global_step"] != step:
            raise ValueError(
                f"stream state of step {saved['global_step']} in a checkpoint of step {step}"
            )
        if ignore_data_skip:
            self.dataset.load_state_dict(saved["stream"], items=saved["items"])
            self._base_step, self._base_items = step, saved["items"]
            log.info(
                "StreamStateCallback: the dataset resumes at step %d from its saved position", step
            )
            return
        if saved["items_per_step"] != self._per_step:
            raise ValueError(
                f"the checkpoint trained {saved['items_per_step']} rows a step per rank, this run "
                f"{self._per_step}: Trainer's skip of the trained batches would land elsewhere. "
                "Set ignore_data_skip=True to resume from the saved stream position"
            )
        self._check = saved
        log.info(
            "StreamStateCallback: Trainer re-reads the %d trained rows per rank to skip them "
            "(ignore_data_skip=False); ignore_data_skip=True resumes from the saved position at once",
            saved["items"],
        )

    # ---- per step -------------------------------------------------------------------------------

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        items = self._base_items + (state.global_step - self._base_step) * self._per_step
        items = min(items, self.dataset.items_yielded)  # a short last step when the data ran out
        if self._check is not None and items >= self._check["items"]:
            got = self.dataset.state_after(self._check["items"])["position"]
            if got != self._check["stream"]["position"]:
                raise RuntimeError(
                    f"after Trainer's skip the stream is at {got}, the checkpoint saved "
                    f"{self._check['stream']['position']}: resume with ignore_data_skip=True"
                )
            self._check = None
        assert self.meter is not None
        for counts in self.dataset.counts_between(self._trained, items):
            self.meter.update(counts)
        self._trained = items
        stats = self.meter.step(state.global_step)
        self.total_tokens += stats.num_tokens
        self._window.append(stats)
        if state.stateful_callbacks is None:
            state.stateful_callbacks = {}
        state.stateful_callbacks[STATE_KEY] = {
            "version": STATE_VERSION,
            "global_step": state.global_step,
            "items": items,
            "items_per_step": self._per_step,
            "stream": self.dataset.state_after(items),
        }

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if not self._window or logs is None or "loss" not in logs:
            return
        w, self._window = self._window, []
        dt = sum(s.step_time_s for s in w)
        tokens = sum(s.num_tokens for s in w)
        padded = sum(s.padded_tokens for s in w)
        per_gpu = self.meter.num_gpus() if self.meter is not None else 1
        extra = {
            "trained_tokens": self.total_tokens,
            "trained_tokens_per_s": tokens / dt,
            "trained_tokens_per_s_per_gpu": tokens / dt / per_gpu,
            "loss_tokens_per_s": sum(s.num_loss_tokens for s in w) / dt,
            "padding_fraction": (padded - tokens) / padded if padded else 0.0,
            "rank_imbalance": max(s.imbalance for s in w),
        }
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)


def sft_trainer(dataset: PackedShardDataset, **kwargs: Any) -> Any:
    """TRL's ``SFTTrainer`` training on a `PackedShardDataset`.

    SFTTrainer (TRL 1.x) takes only 🤗 ``datasets`` as ``train_dataset``, tokenizes and packs
    them itself, and refuses a torch IterableDataset. The rows here are already tokenized and
    packed, so the trainer is built on a one-row stand-in (its type check and its look at the
    first example), with ``dataset_kwargs={"skip_prepare_dataset": True}``, ``packing`` and
    ``padding_free`` off (the rows are packed and the collator is padding-free already) and
    ``dispatch_batches`` off (as SFTTrainer sets for an IterableDataset), then handed the
    dataset. ``data_collator`` defaults to `packed_collator` and a `StreamStateCallback` is
    added unless one is given. Everything else of SFTTrainer stays: its fused LM head (the loss
    without materialising the logits), its entropy and token-accuracy logs. Returns the trainer.
    """
    from datasets import Dataset
    from datasets.table import InMemoryTable
    from trl import SFTConfig, SFTTrainer

    args = kwargs.get("args")
    if not isinstance(args, SFTConfig):
        raise TypeError("sft_trainer needs args=SFTConfig(...)")
    if args.packing or args.padding_free:
        raise ValueError(
            "sft_trainer: the rows are packed already; set SFTConfig(packing=False, padding_free=False) "
            "(packed_collator gives the padding-free batch)"
        )
    given = args.dataset_kwargs if isinstance(args.dataset_kwargs, dict) else {}
    args.dataset_kwargs = {**given, "skip_prepare_dataset": True}
    cast(Any, args.accelerator_config).dispatch_batches = False  # an AcceleratorConfig by now
    callbacks = list(kwargs.pop("callbacks", None) or [])
    if not any(isinstance(c, StreamStateCallback) and c.dataset is dataset for c in callbacks):
        callbacks.append(StreamStateCallback(dataset))
    kwargs.setdefault("data_collator", packed_collator)
    # a fixed fingerprint: nothing to hash (datasets would pickle the table to make one)
    table = InMemoryTable.from_pydict({"input_ids": [[0]], "labels": [[0]]})
    stand_in = Dataset(table, fingerprint="packshard-sft-stand-in")
    trainer = SFTTrainer(train_dataset=stand_in, callbacks=callbacks, **kwargs)
    trainer.train_dataset = dataset
    return trainer
