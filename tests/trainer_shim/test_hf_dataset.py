"""PackedShardDataset and StreamStateCallback without a model: items, passes, DP ranks, the
topology rules, and how accelerate wraps an IterableDataset (its own `prepare_data_loader`, the
code Trainer calls, with 2 processes' ranks given explicitly)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from torch.utils.data import DataLoader, IterableDataset
from transformers.trainer_utils import RemoveColumnsCollator

from packshard.packers import ShardDataset
from packshard.trainer_shim import PackedShardStream
from packshard.trainer_shim.hf import (
    PackedRow,
    PackedShardDataset,
    StreamStateCallback,
    packed_collator,
    topology_for,
)
from packshard.trainer_shim.topology import Topology


def rows_of(items) -> list[int]:
    return [int(it["row"]) for it in items]


def test_items_are_whole_rows_that_trainers_column_filter_leaves_alone(small_dataset: Path):
    ds = PackedShardDataset(str(small_dataset), shuffle=False)
    items = list(ds)
    assert rows_of(items) == list(range(ShardDataset.open(str(small_dataset)).num_rows))
    item = items[0]
    assert isinstance(item, PackedRow) and not isinstance(item, dict) and "row" in item
    # Trainer wraps the collator so that dict items lose the keys the model's forward lacks
    filtered = RemoveColumnsCollator(packed_collator, signature_columns=["input_ids", "labels"])
    assert torch.equal(filtered(items[:2])["labels"], packed_collator(items[:2])["labels"])
    with pytest.raises(KeyError, match="whole"):
        filtered([dict(it) for it in items[:2]])


def test_every_pass_starts_at_the_start_so_a_peek_moves_nothing(small_dataset: Path):
    ds = PackedShardDataset(str(small_dataset), seed=3)
    first = next(iter(ds))  # SFTTrainer's look at the first example
    a, b = rows_of(ds), rows_of(ds)
    assert a == b and a[0] == first["row"] and ds.items_yielded == len(a)


def test_two_dp_ranks_split_the_rows_in_a_plain_loop(small_dataset: Path):
    """Outside a Trainer (a torch DataLoader, no accelerate wrapper) each rank iterates its own
    rows, those of a PackedShardStream of the same rank, and the ranks cover every row once."""
    n = ShardDataset.open(str(small_dataset)).num_rows
    got = []
    for rank in range(2):
        ds = PackedShardDataset(str(small_dataset), dp_rank=rank, dp_size=2, rows_per_rank=3)
        batches = list(DataLoader(ds, batch_size=3, collate_fn=packed_collator))
        assert len(batches) == ds.micro_batches_per_epoch // 3
        got.append([r for r in rows_of(ds) if r >= 0])
        stream = PackedShardStream(str(small_dataset), dp_rank=rank, dp_size=2, rows_per_step=6)
        assert got[-1] == [int(mb["row"]) for mb in stream if mb["row"] >= 0]
    assert sorted(got[0] + got[1]) == list(range(n))


@pytest.mark.filterwarnings("ignore:Got pickle error:UserWarning")
def test_dataloader_workers_are_refused(small_dataset: Path):
    ds = PackedShardDataset(str(small_dataset))
    with pytest.raises(RuntimeError, match="dataloader_num_workers=0"):
        list(DataLoader(ds, batch_size=1, num_workers=1, collate_fn=packed_collator))
    # spawn / forkserver (macOS, Python 3.14's default) pickle the dataset for the worker
    loader = DataLoader(
        ds, batch_size=1, num_workers=1, collate_fn=packed_collator, multiprocessing_context="spawn"
    )
    with pytest.raises(
        TypeError, match=r"cannot be sent to another process.*dataloader_num_workers=0"
    ):
        list(loader)


@pytest.mark.parametrize(
    "bad", [{"cp_size": 2}, {"device": "cuda"}, {"rows_per_step": 4}, {"dp_rank": 0}]
)
def test_arguments_the_dataset_sets_itself_are_refused(small_dataset: Path, bad: dict):
    with pytest.raises(ValueError, match="PackedShardDataset"):
        PackedShardDataset(str(small_dataset), **bad)


def test_topology_follows_accelerates_mesh_order(
    small_dataset: Path, monkeypatch: pytest.MonkeyPatch
):
    assert topology_for(5, 8, tp=2) == topology_for(4, 8, tp=2)  # a TP pair shares rows
    t = topology_for(13, 16, cp=2, tp=2)
    assert (t.dp_rank, t.dp_size) == (3, 4)
    with pytest.raises(ValueError, match="multiple"):
        topology_for(0, 6, cp=4)
    # DeepSpeed's sequence-parallel ranks each read rows of their own (its Ulysses adapter
    # gathers one batch from every SP rank and trains them in turn)
    assert [topology_for(r, 8, sp=2) for r in range(8)] == [
        Topology(dp_rank=r, dp_size=8) for r in range(8)
    ]
    # DeepSpeed's SP groups are consecutive global ranks, not accelerate's mesh: with TP or CP
    # beside SP, which ranks must share rows is unknown, so it is refused
    for kw in ({"tp": 2}, {"cp": 2}, {"cp": 2, "tp": 2}):
        with pytest.raises(ValueError, match="sequence parallelism"):
            topology_for(0, 16, sp=2, **kw)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    with pytest.raises(ValueError, match="attend to each other"):
        PackedShardDataset(str(small_dataset))
    ds = PackedShardDataset(
        str(small_dataset), allow_cross_document_attention=True, rows_per_rank=2
    )
    assert (ds.topology.dp_rank, ds.topology.dp_size) == (1, 2)


class PassThrough(IterableDataset):
    """Yields a dataset's items, hiding it from the dataset's check of its caller."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds

    def __iter__(self) -> Iterator[Any]:
        yield from self.ds


def test_accelerates_iterable_shard_is_undone_by_the_callback(small_dataset: Path):
    """accelerate's prepare_data_loader (what Trainer calls) with dispatch_batches off wraps the
    dataset in IterableDatasetShard; on a dataset split by rank it keeps half of each rank's rows
    unless the callback turns it into a pass-through."""
    from accelerate.data_loader import IterableDatasetShard, prepare_data_loader

    def rank_rows(rank: int, fix: bool) -> list[int]:
        ds = PackedShardDataset(str(small_dataset), dp_rank=rank, dp_size=2, rows_per_rank=2)
        seen: list[int] = []

        def collate(items):
            seen.extend(rows_of(items))
            return packed_collator(items)

        dl = prepare_data_loader(
            DataLoader(ds, batch_size=1, collate_fn=collate), num_processes=2, process_index=rank,
            dispatch_batches=False, put_on_device=False,
        )  # fmt: skip
        assert isinstance(dl.dataset, IterableDatasetShard)
        if fix:
            StreamStateCallback(ds)._unshard(dl, world=2)
            for _ in dl:
                pass
        else:
            with pytest.raises(RuntimeError, match=r"1/2 of the rows.*StreamStateCallback"):
                next(iter(dl))
            assert seen == []  # refused before any row
            dl.dataset.dataset = PassThrough(ds)  # what accelerate alone does with the rows
            for _ in dl:
                pass
        return seen

    for rank in range(2):
        own = [
            int(mb["row"])
            for mb in PackedShardStream(
                str(small_dataset), dp_rank=rank, dp_size=2, rows_per_step=4
            )
        ]
        assert rank_rows(rank, fix=True) == own
        assert len(rank_rows(rank, fix=False)) < len(own)  # accelerate alone drops rows


def test_the_callback_sees_tensor_parallelism_set_up_after_the_dataset(
    small_dataset: Path, monkeypatch: pytest.MonkeyPatch
):
    """Trainer sets up TP (a model loaded with tp_size, a ParallelismConfig) after the dataset
    is built: at on_train_begin the two TP ranks are one DP rank, for the meter, the size check
    and a resumed state alike."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("PARALLELISM_CONFIG_TP_SIZE", raising=False)
    ds = PackedShardDataset(str(small_dataset), rows_per_rank=2)
    assert (ds.topology.dp_rank, ds.topology.dp_size) == (1, 2)
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    callback = StreamStateCallback(ds)
    args = SimpleNamespace(
        n_gpu=1, dataloader_num_workers=0, world_size=2, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, ignore_data_skip=False,
    )  # fmt: skip
    rows = ShardDataset.open(str(small_dataset)).num_rows
    state = SimpleNamespace(global_step=0, stateful_callbacks={}, max_steps=rows // 2)
    callback.on_train_begin(args, state, None)  # a DP size of 2 would hold rows // 2 items
    assert (ds.topology.dp_rank, ds.topology.dp_size) == (0, 1)
    assert callback.meter is not None and callback.meter.dp_rank == 0


def test_the_callbacks_meter_weighs_rows_with_the_datasets_cost_model(small_dataset: Path):
    from packshard.packers import CostModel

    cost = CostModel(token_weight=1.0, attn_weight=0.5)
    ds = PackedShardDataset(str(small_dataset), rows_per_rank=2, cost_model=cost)
    callback = StreamStateCallback(ds)
    args = SimpleNamespace(
        n_gpu=1, dataloader_num_workers=0, world_size=1, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, ignore_data_skip=False,
    )  # fmt: skip
    callback.on_train_begin(args, SimpleNamespace(global_step=0, max_steps=2), None)
    assert callback.meter is not None and callback.meter.cost_model is cost


@pytest.mark.parametrize("event", ["on_evaluate", "on_save"])
def test_evaluation_and_saving_are_not_counted_as_training_time(small_dataset: Path, event: str):
    """trained tokens/s is what loaders are compared by: an evaluation or a checkpoint between
    two steps must not land in the next step's time."""
    from packshard.trainer_shim.meter import TrainedTokenMeter

    now = [0.0]
    ds = PackedShardDataset(str(small_dataset), rows_per_rank=2)
    callback = StreamStateCallback(ds)
    callback.meter = TrainedTokenMeter(clock=lambda: now[0])
    args = SimpleNamespace(
        n_gpu=1, dataloader_num_workers=0, world_size=1, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, ignore_data_skip=False,
    )  # fmt: skip
    state = SimpleNamespace(global_step=0, max_steps=2)
    callback.on_train_begin(args, state, None)
    now[0] = 5.0  # a 5 s evaluation / checkpoint save, after the step that ended at 0
    getattr(callback, event)(args, state, None)
    now[0] = 6.0
    assert callback.meter.step(1).step_time_s == 1.0


@pytest.mark.parametrize("parallelism_config", [False, True])
def test_deepspeed_autotp_ranks_share_a_dp_rank(
    monkeypatch: pytest.MonkeyPatch, parallelism_config: bool
):
    """DeepSpeed's AutoTP is set in its own config (``tensor_parallel.autotp_size``), not in
    accelerate's ParallelismConfig; accelerate gives its consecutive ranks one batch, so they
    must read the same rows: they count as tp."""
    import accelerate.state

    from packshard.trainer_shim.hf_dataset import parallel_sizes, topology_for

    plugin = SimpleNamespace(deepspeed_config={"tensor_parallel": {"autotp_size": 2}})
    pc = SimpleNamespace(tp_size=1, cp_size=1, sp_size=1, cp_backend="torch")
    state = SimpleNamespace(
        deepspeed_plugin=plugin, parallelism_config=pc if parallelism_config else None
    )
    monkeypatch.setattr(accelerate.state, "is_initialized", lambda: True)
    monkeypatch.setattr(accelerate.state, "AcceleratorState", lambda: state)
    for k in ("TP", "CP", "SP"):
        monkeypatch.delenv(f"PARALLELISM_CONFIG_{k}_SIZE", raising=False)
    tp, cp, sp, _ = parallel_sizes()
    assert (tp, cp, sp) == (2, 1, 1)
    ranks = [topology_for(r, 4, tp=tp, cp=cp, sp=sp) for r in range(4)]
    assert [(t.dp_rank, t.dp_size) for t in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    plugin.deepspeed_config = {"tensor_parallel": {"autotp_size": 1}, "train_batch_size": "auto"}
    assert parallel_sizes()[0] == 1
    state.deepspeed_plugin = None  # not DeepSpeed
    assert parallel_sizes()[0] == 1


def test_under_deepspeed_sp_a_step_trains_its_share_of_the_gathered_batches(
    monkeypatch: pytest.MonkeyPatch,
):
    from packshard.trainer_shim.hf import _rows_per_step

    args = SimpleNamespace(per_device_train_batch_size=1, gradient_accumulation_steps=4)
    monkeypatch.delenv("PARALLELISM_CONFIG_SP_SIZE", raising=False)
    assert _rows_per_step(args) == 4
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    assert _rows_per_step(args) == 2
    three = SimpleNamespace(per_device_train_batch_size=3, gradient_accumulation_steps=2)
    assert _rows_per_step(three) == 3
    # a micro-step trains one rank's whole batch: a step must take every SP rank's in turn
    for bs, ga in ((1, 3), (2, 1)):
        odd = SimpleNamespace(per_device_train_batch_size=bs, gradient_accumulation_steps=ga)
        with pytest.raises(ValueError, match="not a multiple of sp_size=2"):
            _rows_per_step(odd)


def test_the_callback_finds_accelerates_shard_inside_an_sp_adapter(small_dataset: Path):
    """DeepSpeed's Ulysses SP adapter wraps the prepared loader and holds it as `.dl`."""
    from accelerate.data_loader import prepare_data_loader

    ds = PackedShardDataset(str(small_dataset), dp_rank=0, dp_size=2, rows_per_rank=2)
    dl = prepare_data_loader(
        DataLoader(ds, batch_size=1, collate_fn=packed_collator), num_processes=2,
        process_index=0, dispatch_batches=False, put_on_device=False,
    )  # fmt: skip
    StreamStateCallback(ds)._unshard(SimpleNamespace(dl=dl), world=2)
    assert dl.dataset.num_processes == 1


def test_the_dispatcher_is_refused_inside_an_sp_adapter(small_dataset: Path):
    from accelerate.data_loader import DataLoaderDispatcher

    ds = PackedShardDataset(str(small_dataset), dp_rank=0, dp_size=1, rows_per_rank=2)
    dispatcher = DataLoaderDispatcher.__new__(DataLoaderDispatcher)  # what prepare would build
    dispatcher.dataset = ds
    with pytest.raises(ValueError, match="dispatch_batches"):
        StreamStateCallback(ds)._unshard(SimpleNamespace(dl=dispatcher), world=2)


def test_a_resume_under_deepspeed_sp_needs_ignore_data_skip(
    small_dataset: Path, monkeypatch: pytest.MonkeyPatch
):
    """Trainer's skip_first_batches reads `.dataset` of the loader it is given, which DeepSpeed's
    Ulysses adapter lacks: the resume would fail inside accelerate, so the callback refuses it
    first, naming the setting that works."""
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    ds = PackedShardDataset(str(small_dataset), dp_rank=0, dp_size=2, rows_per_rank=1)
    args = SimpleNamespace(
        n_gpu=1, dataloader_num_workers=0, world_size=2, per_device_train_batch_size=1,
        gradient_accumulation_steps=2, ignore_data_skip=False,
    )  # fmt: skip
    state = SimpleNamespace(global_step=3, stateful_callbacks={}, max_steps=4)
    with pytest.raises(ValueError, match=r"ignore_data_skip=True\): Trainer's skip"):
        StreamStateCallback(ds).on_train_begin(args, state, None)


def test_positions_after_items_are_kept_for_the_callback(small_dataset: Path):
    ds = PackedShardDataset(str(small_dataset), rows_per_rank=2)
    it = iter(ds)
    items = [next(it) for _ in range(5)]
    assert ds.items_yielded == 5
    assert ds.state_after(0) == ds._start
    s2 = ds.state_after(2)["position"]
    assert (s2["step"], s2["micro_step"]) == (1, 0)
    counts = ds.counts_between(1, 3)
    assert [c["row"] for c in counts] == rows_of(items[1:3])
    assert [c["num_tokens"] for c in counts] == [int(i["num_tokens"]) for i in items[1:3]]
    with pytest.raises(RuntimeError, match="not kept"):
        ds.state_after(6)
    # resuming from the state after 2 items gives the 3rd item next
    again = PackedShardDataset(str(small_dataset), rows_per_rank=2)
    again.load_state_dict(ds.state_after(2), items=2)
    assert next(iter(again))["row"] == items[2]["row"] and again.items_yielded == 3


def test_dispatching_batches_across_processes_is_refused_with_the_fix(small_dataset: Path):
    from accelerate.data_loader import DataLoaderDispatcher, prepare_data_loader

    ds = PackedShardDataset(str(small_dataset), dp_rank=0, dp_size=2)
    dl = prepare_data_loader(
        DataLoader(ds, batch_size=1, collate_fn=packed_collator), num_processes=2, process_index=0,
        dispatch_batches=True, put_on_device=True,
    )  # fmt: skip
    assert isinstance(dl, DataLoaderDispatcher)
    with pytest.raises(ValueError, match="dispatch_batches': False"):
        StreamStateCallback(ds)._unshard(dl, world=2)
    # without the callback (Trainer's default dispatch): refused when the dispatcher starts
    # iterating, on every process, before any row or collective
    dl.state = SimpleNamespace(num_processes=2, process_index=0, device=torch.device("cpu"))
    with pytest.raises(
        RuntimeError, match=r"only rank 0's rows would be trained.*dispatch_batches"
    ):
        next(iter(dl))
    assert ds.items_yielded == 0


def test_trainer_evaluates_on_a_finite_dataset_on_one_process(
    small_dataset: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """An eval set of epochs=None would never end Trainer's evaluation loop; over several
    ranks its last step holds rows without tokens (NaN loss). Both are refused, naming the fix;
    epochs=1 on one process evaluates."""
    from transformers import Trainer, TrainingArguments
    from transformers.modeling_outputs import CausalLMOutput

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, labels=None, **kw):
            return CausalLMOutput(loss=self.w * (labels != -100).float().mean())

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_eval_batch_size=1, report_to=[],
        use_cpu=True, disable_tqdm=True,
    )  # fmt: skip

    def evaluate(ds: PackedShardDataset) -> dict:
        trainer = Trainer(Tiny(), args=args, eval_dataset=ds, data_collator=packed_collator)
        return trainer.evaluate()

    assert evaluate(PackedShardDataset(str(small_dataset), rows_per_rank=1))["eval_loss"] > 0
    with pytest.raises(RuntimeError, match="epochs=None, which never ends"):
        evaluate(PackedShardDataset(str(small_dataset), rows_per_rank=1, epochs=None))
    ds = PackedShardDataset(str(small_dataset), rows_per_rank=1)
    monkeypatch.setattr(ds, "_resolve_topology", lambda: topology_for(0, 2))
    with pytest.raises(RuntimeError, match="over 2 data-parallel ranks is not supported"):
        evaluate(ds)


def test_evaluation_on_one_process_gets_no_filler_rows(small_dataset: Path, tmp_path: Path):
    """An epoch's last step is completed with rows that hold no tokens (ranks stay in step);
    a batch of them only has a NaN loss. One process's evaluation is given none."""
    from transformers import Trainer, TrainingArguments
    from transformers.modeling_outputs import CausalLMOutput

    class MeanOverTargets(torch.nn.Module):  # 1 per batch with targets, NaN without
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(1))

        def forward(self, labels=None, **kw):
            n = (labels != -100).sum()
            return CausalLMOutput(loss=self.w * n / n)

    rows = ShardDataset.open(str(small_dataset)).num_rows
    per_rank = next(k for k in range(2, 9) if rows % k >= 2)  # the last step: >= 2 fillers
    ds = PackedShardDataset(str(small_dataset), rows_per_rank=per_rank, epochs=1)
    assert [i["row"] for i in ds].count(-1) == per_rank - rows % per_rank  # plain iteration
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_eval_batch_size=1,
        report_to=[], use_cpu=True, disable_tqdm=True, logging_nan_inf_filter=False,
    )  # fmt: skip
    trainer = Trainer(MeanOverTargets(), args=args, eval_dataset=ds, data_collator=packed_collator)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(1.0)
