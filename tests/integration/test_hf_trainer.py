"""Hugging Face Trainer and TRL SFTTrainer on a packshard dataset URL: train, checkpoint, resume.

A tiny random-init Qwen3 (the shared Qwen3 vocabulary, CPU, fp32) trains 5 optimizer steps
(2 rows a step: batch 1 x gradient accumulation 2) on rows packed from real chats. A second
run stops after step 3 (its checkpoint is saved there) and a third resumes from that checkpoint;
the rows each step trains on and the logged losses must equal the uninterrupted run's, both when
the dataset continues from its saved position (ignore_data_skip=True) and, for Trainer, when it
skips the trained batches itself (its default). TRL's SFTTrainer runs through `sft_trainer`. The logs carry the trained-token throughput and padding.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
import torch
from transformers import TrainerCallback

from packshard.packers import ShardDataset
from packshard.trainer_shim.hf import (
    PackedShardDataset,
    StreamStateCallback,
    packed_collator,
    sft_trainer,
)
from tests.trainer_shim._hf_fixtures import tiny_qwen3, write_packed_chats

pytestmark = [pytest.mark.shared, pytest.mark.slow]

STEPS, GA = 5, 2


@pytest.fixture(scope="module")
def url(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("hf_trainer") / "chats"
    write_packed_chats(shared_data, out, per_file=8, seq_len=256)
    return str(out)


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= self.step:
            control.should_training_stop = True


class Recorder:
    """The collator, recording the rows of every batch it builds."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, items: list) -> dict:
        self.batches.append([int(it["row"]) for it in items])
        return packed_collator(items)


def run(
    kind: str,
    url: str,
    out: Path,
    *,
    stop_at: int | None = None,
    resume: str | None = None,
    ignore_data_skip: bool = True,
    max_steps: int = STEPS,
    epochs: int | None = 1,
    prefetch_thread: bool | None = None,
) -> tuple[list[list[int]], dict[int, float], list[dict]]:
    """Train; returns (rows of every collated batch, loss by step, log history)."""
    torch.manual_seed(0)
    model = tiny_qwen3("sdpa")
    ds = PackedShardDataset(
        url, rows_per_rank=GA, seed=1, epochs=epochs, prefetch_thread=prefetch_thread
    )
    rec = Recorder()
    common = dict(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=GA, learning_rate=3e-3, lr_scheduler_type="constant",
        logging_steps=1, save_strategy="steps", save_steps=3, report_to="none", use_cpu=True,
        seed=0, ignore_data_skip=ignore_data_skip, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    callbacks = [StreamStateCallback(ds)] + ([StopAt(stop_at)] if stop_at else [])
    if kind == "trl":
        from transformers import AutoTokenizer
        from trl import SFTConfig

        tok = AutoTokenizer.from_pretrained(TOKENIZER)
        args = SFTConfig(
            **common, packing=False, padding_free=False, max_length=None,
            dataset_kwargs={"skip_prepare_dataset": True},
        )  # fmt: skip
        trainer = sft_trainer(
            ds, model=model, args=args, data_collator=rec, processing_class=tok, callbacks=callbacks
        )
    else:
        from transformers import Trainer, TrainingArguments

        trainer = Trainer(
            model=model, args=TrainingArguments(**common), train_dataset=ds,
            data_collator=rec, callbacks=callbacks,
        )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    assert ds.stream.prefetch_thread is bool(prefetch_thread)  # local: the iterating thread reads
    history = trainer.state.log_history
    losses = {h["step"]: h["loss"] for h in history if "loss" in h}
    ds.close()
    return rec.batches, losses, history


TOKENIZER = ""


@pytest.fixture(scope="module", autouse=True)
def _tokenizer(shared_data: Path) -> None:
    global TOKENIZER
    TOKENIZER = str(shared_data / "tokenizers" / "qwen3")


# A local dataset is read by the iterating thread (prefetch_thread=None); True runs the Trainer
# on the prefetch thread, the path of every remote dataset.
@pytest.mark.parametrize(
    ("kind", "skip_modes", "prefetch_thread"),
    [("trainer", (True, False), None), ("trainer", (True,), True), ("trl", (True,), None)],
)
def test_resume_sees_the_rows_and_losses_of_the_uninterrupted_run(
    kind: str, skip_modes: tuple[bool, ...], prefetch_thread: bool | None, url: str, tmp_path: Path
):
    if kind == "trl":
        pytest.importorskip("trl")
    full_rows, full_loss, history = run(
        kind, url, tmp_path / "full", prefetch_thread=prefetch_thread
    )
    trained = full_rows[: STEPS * GA]
    flat = [r for b in trained for r in b]
    assert len(flat) == len(set(flat)) == STEPS * GA  # distinct rows, one per micro-batch
    assert sorted(full_loss) == list(range(1, STEPS + 1))
    logged = [h for h in history if "loss" in h]
    for h in logged:
        assert h["trained_tokens_per_s"] > 0 and 0 <= h["padding_fraction"] < 0.5
    num_tokens = ShardDataset.open(url).index_column("num_tokens")
    assert logged[-1]["trained_tokens"] == int(num_tokens[flat].sum())

    first_rows, first_loss, _ = run(
        kind, url, tmp_path / "part", stop_at=3, prefetch_thread=prefetch_thread
    )
    assert first_rows[: 3 * GA] == trained[: 3 * GA]
    assert all(math.isclose(first_loss[s], full_loss[s], rel_tol=1e-6) for s in (1, 2, 3))
    ckpt = str(tmp_path / "part" / "checkpoint-3")
    for ignore in skip_modes:
        rows, losses, resumed_history = run(
            kind, url, tmp_path / f"resumed{ignore}", resume=ckpt, ignore_data_skip=ignore,
            prefetch_thread=prefetch_thread,
        )  # fmt: skip
        # the checkpoint carries the trained-token count on
        last = [h for h in resumed_history if "loss" in h][-1]
        assert last["trained_tokens"] == logged[-1]["trained_tokens"], ignore
        skipped = 0 if ignore else 3 * GA  # Trainer's own skip collates the trained batches again
        assert rows[skipped : skipped + (STEPS - 3) * GA] == trained[3 * GA :], ignore
        assert sorted(losses) == list(range(1, STEPS + 1))  # 1-3 from the checkpoint's history
        for s in range(4, STEPS + 1):
            assert math.isclose(losses[s], full_loss[s], rel_tol=1e-5), (
                ignore,
                s,
                losses[s],
                full_loss[s],
            )


def test_max_steps_past_the_datas_epochs_is_refused_before_training(url: str, tmp_path: Path):
    per_epoch = PackedShardDataset(url, rows_per_rank=GA, seed=1).micro_batches_per_epoch
    too_many = per_epoch // GA + 1
    with pytest.raises(
        ValueError, match=f"max_steps={too_many} trains {too_many * GA} rows per rank"
    ):
        run("trainer", url, tmp_path / "a", max_steps=too_many)
    # endless (epochs=None): Trainer's max_steps decides; stopped early here to stay quick
    run("trainer", url, tmp_path / "b", max_steps=too_many, epochs=None, stop_at=1)
