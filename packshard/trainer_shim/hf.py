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
Ranks that hold the same rows under accelerate's `ParallelismConfig` (tensor and context
parallel: accelerate splits their batch itself) share a DP rank: ``dp_rank = rank // (tp * cp)``
without sequence parallelism. DeepSpeed's sequence parallelism (``sp_backend='deepspeed'``)
wants a different batch on each SP rank (its Ulysses adapter gathers one from every SP rank and
trains them in turn), so SP ranks read rows of their own: ``dp_size = world / (tp * cp)``.
Accelerate's torch context parallelism (accelerate 1.10+) replaces the attention mask by
``is_causal``, so packed documents would attend to each other: the dataset refuses it unless
``allow_cross_document_attention=True`` (packshard's own CP is `PackedShardStream(cp_size=...)`
with a document-masked attention). The topology is read at construction and again when
iteration starts; the one in use is logged.

How Trainer wraps an IterableDataset, and what this module does about it (accelerate 1.16):
- ``dispatch_batches`` (on by default for an IterableDataset) makes rank 0 read every rank's
  batch and concatenate them, which fails for rows of different lengths: with several
  processes, set ``accelerator_config={"dispatch_batches": False}`` (the callback says so).
  One process works either way.
- without dispatch, accelerate wraps the dataset in ``IterableDatasetShard``, which keeps
  1/num_processes of what each rank yields: on a dataset already split by rank that would drop
  rows. `StreamStateCallback.on_train_begin` turns that wrapper into a pass-through (as Trainer
  does for its own rank-aware sampler); the dataset refuses to be iterated by a wrapper that
  still re-shards, or by the dispatcher over several processes. Outside a Trainer (a plain loop, a torch DataLoader) nothing wraps it, and
  each rank iterates its own rows.
- every iteration starts from the dataset's start position (the beginning, or the state loaded
  by the callback on resume): SFTTrainer's ``next(iter(dataset))`` peek at construction moves
  nothing. The stream reads ahead itself (a remote dataset on its prefetch thread), so
  ``dataloader_num_workers=0`` is the right setting; workers are refused (each would read every
  row).
- Trainer fetches ahead (accelerate keeps one batch in hand), so "where the stream is" is not
  "what was trained": the dataset keeps the stream's position after each item it yielded, and
  the callback saves the position after the ``global_step * batch * grad_accum`` items trained
  (``/ sp`` under DeepSpeed's sequence parallelism).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, cast

from packshard._extras import MissingExtraError, require

require("hf", "torch", "packshard.trainer_shim.hf")  # before the modules below import it
from packshard.trainer_shim.flatten import flatten_rows  # noqa: E402
from packshard.trainer_shim.hf_dataset import (  # noqa: E402
    PackedRow,
    PackedShardDataset,
    parallel_sizes,
    topology_for,
)
from packshard.trainer_shim.meter import StepStats, TrainedTokenMeter  # noqa: E402

require("hf", "transformers", "packshard.trainer_shim.hf")
from transformers import TrainerCallback  # noqa: E402

log = logging.getLogger(__name__)

STATE_KEY = "packshard_stream"  # in TrainerState.stateful_callbacks (saved in trainer_state.json)
STATE_VERSION = 1

__all__ = [
    "PackedRow",
    "PackedShardDataset",
    "StreamStateCallback",
    "packed_collator",
    "sft_trainer",
    "topology_for",
]


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


def _inner_loader(dataloader: Any) -> Any:
    """The loader that iterates the dataset (DeepSpeed's Ulysses SP adapter holds it as `.dl`)."""
    for _ in range(3):
        if dataloader is None or hasattr(dataloader, "dataset"):
            break
        dataloader = getattr(dataloader, "dl", None)
    return dataloader


def _rows_per_batch(args: Any, dataloader: Any) -> int:
    """Rows of this rank's dataset in one of its micro-batches: the prepared loader's batch size,
    which accelerate's ``split_batches=True`` divides by the processes
    (``per_device_train_batch_size`` is then the batch of all of them); Trainer's argument
    where no loader is at hand."""
    size = getattr(_inner_loader(dataloader), "batch_size", None)
    if isinstance(size, int) and size > 0:
        return size
    return int(args.per_device_train_batch_size)


def _rows_per_step(args: Any, dataloader: Any = None) -> int:
    """Rows of this rank's dataset one optimizer step trains: the micro-batches of a step,
    divided by sp under DeepSpeed's sequence parallelism, whose Ulysses adapter gathers one batch
    from every SP rank and trains them in turn (Trainer counts sp x the loader's batches)."""
    accumulation = args.gradient_accumulation_steps
    sp = parallel_sizes()[2]
    if sp > 1 and accumulation % sp:
        raise ValueError(
            f"gradient_accumulation_steps={accumulation} is not a multiple of sp_size={sp}: "
            "DeepSpeed's sequence parallelism trains the SP ranks' whole batches in turn, one a "
            "micro-step, so a step would end before every rank's batch trained; make it a multiple"
        )
    return _rows_per_batch(args, dataloader) * accumulation // sp


class StreamStateCallback(TrainerCallback):
    """Exact resume and trained-token throughput for a `PackedShardDataset` in Trainer.

    - Saves, at every step, the stream position after the items trained so far into the
      TrainerState (``stateful_callbacks["packshard_stream"]``, written with each checkpoint's
      trainer_state.json). On ``train(resume_from_checkpoint=...)``: with
      ``ignore_data_skip=True`` the dataset continues from that position (nothing re-read);
      with Trainer's default it starts from the beginning and Trainer's own skip of the trained
      batches brings it there, which the callback checks against the saved position at the
      first step. Either way the resumed run sees the rows the uninterrupted one would have.
      Under DeepSpeed's sequence parallelism only ``ignore_data_skip=True`` resumes (Trainer's
      skip cannot reach through its Ulysses adapter; the callback says so).
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
        dataloader = _inner_loader(dataloader)
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

    def on_train_begin(
        self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any
    ) -> None:
        if getattr(args, "n_gpu", 1) > 1:
            raise ValueError(
                "PackedShardDataset under nn.DataParallel (several GPUs, one process) is not supported: "
                "launch one process per GPU (torchrun / accelerate launch)"
            )
        if args.dataloader_num_workers:
            raise ValueError("PackedShardDataset reads ahead itself: set dataloader_num_workers=0")
        # Trainer may have set up tensor parallelism since the dataset was built (a model loaded
        # with tp_size, TrainingArguments(parallelism_config=...)): the DP topology of now
        self.dataset._ensure_topology()
        self._unshard(train_dataloader, args.world_size)
        self._per_step = _rows_per_step(args, train_dataloader)
        step = state.global_step
        self._base_step, self._base_items, self._check = 0, self.dataset._start_items, None
        if step > 0:
            if not args.ignore_data_skip and parallel_sizes()[2] > 1:
                raise ValueError(
                    "resuming under DeepSpeed's sequence parallelism needs "
                    "TrainingArguments(ignore_data_skip=True): Trainer's skip of the trained "
                    "batches (accelerate's skip_first_batches) cannot reach the loader inside "
                    "DeepSpeed's Ulysses adapter. With it, the dataset resumes from the position "
                    "saved in the checkpoint, reading nothing twice"
                )
            saved = (state.stateful_callbacks or {}).get(STATE_KEY)
            self._resume(saved, step, bool(args.ignore_data_skip))
        self._trained = self._base_items + (step - self._base_step) * self._per_step
        self._check_sizes(state.max_steps)
        if self.meter is None:
            self.meter = TrainedTokenMeter(
                dp_rank=self.dataset.topology.dp_rank, cost_model=self.dataset.stream.cost_model
            )  # the rank imbalance it logs weighs rows as the planning did
        self.meter.start()

    def _check_sizes(self, max_steps: int) -> None:
        """Refuse a run that would train past the dataset's epochs: Trainer would iterate it
        again from its start, the same rows in the same order, and the saved positions would
        no longer say what was trained. Warn when a planning step is not an optimizer step."""
        ds = self.dataset
        if ds.rows_per_rank != self._per_step:
            log.warning(
                "PackedShardDataset(rows_per_rank=%d), but Trainer trains %d rows a step per rank "
                "(its loader's batch x gradient_accumulation_steps, / sp under DeepSpeed's "
                "sequence parallelism): set rows_per_rank=%d "
                "so that each balanced planning step is one optimizer step (and the filler rows "
                "that complete an epoch's last step fall in that step, not across two)",
                ds.rows_per_rank, self._per_step, self._per_step,
            )  # fmt: skip
        available = ds.items_from_start()
        needed = (max_steps - self._base_step) * self._per_step
        if available is None or max_steps <= 0 or needed <= available:
            return
        per_epoch = ds.micro_batches_per_epoch
        raise ValueError(
            f"max_steps={max_steps} trains {needed:,} rows per rank from here ({self._per_step} a "
            f"step), but the dataset holds {available:,} (epochs={ds.stream.config.epochs}, "
            f"{per_epoch:,} rows per rank an epoch): Trainer would then iterate it again from the "
            "start, the same rows in the same order. Pass epochs=None to PackedShardDataset "
            "(endless, each epoch reshuffled; Trainer stops at max_steps), a larger epochs, or "
            f"max_steps <= {self._base_step + available // self._per_step}"
        )

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
        self.total_tokens = int(saved.get("trained_tokens", 0))
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
            "trained_tokens": self.total_tokens,
            "stream": self.dataset.state_after(items),
        }

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._restart_clock()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._restart_clock()

    def _restart_clock(self) -> None:
        """An evaluation or a checkpoint (after the step that ends a window) trains nothing:
        the next window's time starts after it, or trained tokens/s would count it."""
        if self.meter is not None:
            self.meter.start()

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
    try:
        from datasets import Dataset
        from datasets.table import InMemoryTable
        from trl import SFTConfig, SFTTrainer
    except ModuleNotFoundError as e:  # [hf] holds Trainer's side; TRL is the user's own
        raise MissingExtraError(
            f"sft_trainer needs TRL (and its datasets): {e.name!r} is not installed: "
            "pip install 'trl>=1.16'",
            name=e.name,
        ) from e

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
