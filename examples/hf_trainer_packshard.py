"""Train a Hugging Face causal LM on a packshard dataset with Trainer, or with TRL's SFTTrainer.

    python examples/hf_trainer_packshard.py --data DIR --tokenizer ../shared/data/tokenizers/qwen3
    python examples/hf_trainer_packshard.py --data DIR --tokenizer ... --trl --resume
    torchrun --nproc-per-node 8 examples/hf_trainer_packshard.py --data s3://... --model Qwen/Qwen3-0.6B

Without --model it trains a tiny random-init Qwen3 on the CPU (a smoke run: 10 steps take ~1
minute on 2 cores). Checkpoints every --save-steps into --output-dir; --resume continues from
the last one, on the rows the uninterrupted run would have trained (StreamStateCallback). The
logs carry trained tokens/s and padding next to the loss.
"""

from __future__ import annotations

import argparse
import functools

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="packshard dataset URL")
    p.add_argument("--tokenizer", required=True, help="tokenizer name or path (TRL needs one)")
    p.add_argument("--model", help="a Hugging Face model name or path (default: tiny random Qwen3)")
    p.add_argument("--trl", action="store_true", help="TRL's SFTTrainer instead of Trainer")
    p.add_argument("--attn", default="sdpa", help="sdpa, flash_attention_2, flex_attention, eager")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=1, help="packed rows per micro-batch per rank")
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--output-dir", default="/tmp/packshard_hf_example")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from packshard.trainer_shim.hf import PackedShardDataset, StreamStateCallback, packed_collator

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    if a.model:
        model = AutoModelForCausalLM.from_pretrained(
            a.model, attn_implementation=a.attn, dtype=torch.bfloat16
        )
    else:
        model = Qwen3ForCausalLM(Qwen3Config(
            vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, attn_implementation=a.attn,
        ))  # fmt: skip
    # epochs=None: endless (reshuffled each epoch); --steps decides how long it trains
    ds = PackedShardDataset(a.data, rows_per_rank=a.batch * a.accum, epochs=None)
    # flash-attention's varlen kernels take the document boundaries directly
    collate = functools.partial(packed_collator, varlen=a.attn.startswith("flash"))
    common = dict(
        output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=a.accum, learning_rate=1e-4, logging_steps=1,
        save_steps=a.save_steps, report_to="none", ignore_data_skip=True,
        bf16=torch.cuda.is_available(), use_cpu=not torch.cuda.is_available(),
        accelerator_config={"dispatch_batches": False},
    )  # fmt: skip
    if a.trl:
        from trl import SFTConfig

        from packshard.trainer_shim.hf import sft_trainer

        args = SFTConfig(**common, packing=False, padding_free=False)
        trainer = sft_trainer(
            ds, model=model, args=args, processing_class=tok, data_collator=collate
        )
    else:
        from transformers import Trainer, TrainingArguments

        trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=ds,
                          data_collator=collate, callbacks=[StreamStateCallback(ds)])  # fmt: skip
    trainer.train(resume_from_checkpoint=a.resume or None)


if __name__ == "__main__":
    main()
