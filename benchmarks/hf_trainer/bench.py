"""Head to head with TRL's own packing, in TRL's SFTTrainer, on one GPU (README.md beside this).

Arms, on the same chats (`data.py`), the same random-init model (one initial state, loaded into
each run), the same optimizer (fused AdamW, constant LR, bf16 autocast), the same batch geometry
and steps:
- ``trl``: SFTTrainer from the jsonl with packing on (BFD, padding-free), as TRL's docs advise
  for SFT (dataset_num_proc: all cores for its tokenization);
- ``packshard``: the same SFTTrainer (`packshard.trainer_shim.hf.sft_trainer`) on the rows
  packshard packed offline (`data.pack`, timed apart), read by `PackedShardDataset`;
- ``*_ctl``: each arm again with another data seed (order), the spread a loss difference is
  judged against;
- on ``glm_moe_dsa`` the packshard arm runs with `packshard.kernels.hf.use_packshard_indexer`
  (``packshard``) and with the model's own indexer (``packshard_own``); TRL with the model's own.

Measured per run: time to the first step (from reading the data to the end of the first optimizer
step: TRL tokenizes and packs in it; packshard reads an already packed dataset), steady trained
tokens/s (true tokens over the steps after `--warmup`, synchronised at each step end), padding
(positions fed that are not tokens), the loss of every step, peak GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.hf_trainer import data as mix  # noqa: E402

SCALES: dict[str, dict[str, Any]] = {
    # ~0.6B Qwen3 (Qwen3-0.6B's shape), rows of <= 8K tokens, 1 row a micro-batch x 4 accumulation
    # steps (one 8K row a forward: a flattened pair would double sdpa's masked attention work).
    "h200": {"repeats": 2, "limit": None, "seq_len": 8192, "device": "cuda", "bf16": True,
             "qwen3": {"steps": 20, "warmup": 4, "batch": 1, "accum": 4},
             "glm": {"steps": 16, "warmup": 4, "batch": 1, "accum": 4}},
    "cpu": {"repeats": 1, "limit": 240, "seq_len": 512, "device": "cpu", "bf16": False,
            "qwen3": {"steps": 4, "warmup": 1, "batch": 1, "accum": 2},
            "glm": {"steps": 3, "warmup": 1, "batch": 1, "accum": 2}},
}  # fmt: skip


def qwen3_config(scale: str, vocab: int) -> Any:
    from transformers import Qwen3Config

    if scale == "cpu":
        return Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           max_position_embeddings=32768, attn_implementation="sdpa")  # fmt: skip
    return Qwen3Config(vocab_size=vocab, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                       max_position_embeddings=40960, rope_theta=1e6, attn_implementation="sdpa")  # fmt: skip


def glm_config(scale: str, vocab: int) -> Any:
    from transformers import GlmMoeDsaConfig

    small = scale == "cpu"
    return GlmMoeDsaConfig(
        vocab_size=vocab, hidden_size=32 if small else 1024, intermediate_size=64 if small else 2048,
        moe_intermediate_size=16 if small else 512, num_hidden_layers=2 if small else 4,
        num_attention_heads=2 if small else 8, num_key_value_heads=2 if small else 8,
        n_routed_experts=4 if small else 8, num_experts_per_tok=2, n_group=1, topk_group=1,
        kv_lora_rank=16 if small else 256, q_lora_rank=16 if small else 256,
        qk_rope_head_dim=8 if small else 64, v_head_dim=8 if small else 64, qk_nope_head_dim=8 if small else 64,
        index_topk=16 if small else 2048, index_head_dim=32 if small else 128, index_n_heads=8 if small else 32,
        first_k_dense_replace=1, max_position_embeddings=32768, attn_implementation="sdpa",
        mlp_layer_types=["dense", "sparse"] if small else None,
        # GLM-5's pattern: a "shared" layer reuses the previous layer's selection (2 indexers of 4)
        indexer_types=None if small else ["full", "shared", "full", "shared"],
    )  # fmt: skip


@dataclass
class Run:
    arm: str
    model: str
    seed: int
    first_step_s: float = 0.0
    step_end_s: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # true tokens per step
    positions: list[int] = field(default_factory=list)  # positions fed per step
    loss: list[float] = field(default_factory=list)
    peak_mem_gib: float = 0.0
    data_tokens: int = 0  # tokens in the packed data the arm trains from (both sides must agree)
    data_rows: int = 0

    def steady_tokens_per_s(self, warmup: int) -> float:
        t = np.diff(self.step_end_s)[warmup - 1 :] if warmup else np.diff([0.0, *self.step_end_s])
        return float(sum(self.tokens[warmup:]) / t.sum())

    @property
    def padding(self) -> float:
        return 1.0 - sum(self.tokens) / sum(self.positions)


def _callbacks(run: Run, t0: float, device: str) -> list[Any]:
    import torch
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            run.step_end_s.append(now)
            if state.global_step == 1:
                run.first_step_s = now - t0

    return [Clock()]


def _count(collate: Any, counts: list[tuple[int, int]]) -> Any:
    def wrapped(items: list) -> Any:
        batch = collate(items)
        n = batch["input_ids"].numel()
        true = sum(int(it["num_tokens"]) for it in items) if "num_tokens" in items[0] else n
        counts.append((true, n))
        return batch

    return wrapped


def train_once(
    arm: str, model_name: str, seed: int, opts: argparse.Namespace, env: dict[str, Any]
) -> Run:
    import torch
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    geo = SCALES[opts.scale][model_name]
    run = Run(arm, model_name, seed)
    device = SCALES[opts.scale]["device"]
    torch.manual_seed(0)
    model = env["cls"](env["config"]).to(device)
    model.load_state_dict(env["init"])
    handle = None
    if arm in ("packshard", "packshard_ctl") and model_name == "glm":  # the ctl: another seed
        from packshard.kernels.hf import use_packshard_indexer

        handle = use_packshard_indexer(model, **env["indexer_kwargs"])
    tok = AutoTokenizer.from_pretrained(opts.tokenizer)
    counts: list[tuple[int, int]] = []
    out = tempfile.mkdtemp(prefix=f"hfb_{arm}_")
    common = dict(
        output_dir=out, max_steps=geo["steps"], per_device_train_batch_size=geo["batch"],
        gradient_accumulation_steps=geo["accum"], learning_rate=opts.lr, lr_scheduler_type="constant",
        warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none", bf16=SCALES[opts.scale]["bf16"],
        use_cpu=device == "cpu", seed=seed, data_seed=seed, dataloader_num_workers=0, disable_tqdm=True,
        optim="adamw_torch_fused" if device == "cuda" else "adamw_torch", max_length=opts.seq_len,
    )  # fmt: skip
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    if arm.startswith("trl"):
        from datasets import load_dataset

        ds = load_dataset(
            "json", data_files=str(env["jsonl"]), split="train", cache_dir=tempfile.mkdtemp()
        )
        args = SFTConfig(**common, packing=True, packing_strategy="bfd", padding_free=True,
                         dataset_num_proc=opts.num_proc)  # fmt: skip
        trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                             callbacks=_callbacks(run, t0, device))  # fmt: skip
    else:
        from packshard.trainer_shim.hf import PackedShardDataset, sft_trainer

        ds = PackedShardDataset(env["url"], rows_per_rank=geo["batch"] * geo["accum"], seed=seed)
        args = SFTConfig(**common, packing=False, padding_free=False)
        trainer = sft_trainer(ds, model=model, args=args, processing_class=tok,
                              callbacks=_callbacks(run, t0, device))  # fmt: skip
    trainer.data_collator = _count(trainer.data_collator, counts)
    if arm.startswith("trl"):
        lengths = trainer.train_dataset.map(
            lambda b: {"n": [len(x) for x in b["input_ids"]]}, batched=True
        )["n"]
        run.data_tokens, run.data_rows = int(sum(lengths)), len(lengths)
    else:
        run.data_tokens, run.data_rows = (
            int(ds.stream.dataset.index_column("num_tokens").sum()),
            ds.stream.dataset.num_rows,
        )
    trainer.train()
    per_step = geo["accum"]
    for s in range(geo["steps"]):
        part = counts[s * per_step : (s + 1) * per_step]
        run.tokens.append(sum(c[0] for c in part))
        run.positions.append(sum(c[1] for c in part))
    run.loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    run.step_end_s = [t - t0 for t in run.step_end_s]
    if device == "cuda":
        run.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30
    if handle is not None:
        handle.restore()
    del trainer, model
    if device == "cuda":
        torch.cuda.empty_cache()
    return run


def model_env(model_name: str, opts: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoTokenizer, GlmMoeDsaForCausalLM, Qwen3ForCausalLM

    vocab = len(AutoTokenizer.from_pretrained(opts.tokenizer))
    vocab = (vocab + 127) // 128 * 128
    config = (qwen3_config if model_name == "qwen3" else glm_config)(opts.scale, vocab)
    cls = Qwen3ForCausalLM if model_name == "qwen3" else GlmMoeDsaForCausalLM
    torch.manual_seed(0)
    init = {k: v.detach().clone() for k, v in cls(config).state_dict().items()}
    kwargs: dict[str, Any] = {}
    if opts.scale == "cpu" and model_name == "glm":
        import dataclasses

        from packshard.kernels import IndexerConfig, TopkConfig

        kwargs["config"] = IndexerConfig(topk=dataclasses.replace(TopkConfig(), sample=64, block=64, min_cap=16,
                                                                   rows_per_program=256, chunk=16, compact="scan"))  # fmt: skip
    n_params = sum(v.numel() for v in init.values())
    if SCALES[opts.scale]["device"] == "cuda":
        warm_up(cls, config, init, opts.seq_len, model_name, kwargs)
    return {
        "cls": cls,
        "config": config,
        "init": init,
        "indexer_kwargs": kwargs,
        "params": n_params,
    }


def warm_up(
    cls: Any, config: Any, init: dict, seq_len: int, model_name: str, indexer_kwargs: dict
) -> None:
    """One forward and backward per indexer path before any timed run: CUDA's context, cuBLAS,
    the attention kernels and our indexer's Triton compile are not charged to the first arm."""
    import torch

    model = cls(config).to("cuda")
    model.load_state_dict(init)
    ids = torch.randint(0, 1000, (1, seq_len), device="cuda")
    pos = torch.cat([torch.arange(seq_len // 2), torch.arange(seq_len - seq_len // 2)]).cuda()[None]
    paths = [None, "ours"] if model_name == "glm" else [None]
    for path in paths:
        handle = None
        if path == "ours":
            from packshard.kernels.hf import use_packshard_indexer

            handle = use_packshard_indexer(model, **indexer_kwargs)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss.backward()
        if handle is not None:
            handle.restore()
    torch.cuda.synchronize()
    del model
    torch.cuda.empty_cache()


ARMS = {"qwen3": ["trl", "packshard", "trl_ctl", "packshard_ctl"],
        "glm": ["trl", "packshard", "packshard_own", "trl_ctl", "packshard_ctl"]}  # fmt: skip


def mean_abs(a: list[float], b: list[float]) -> float:
    n = min(len(a), len(b))
    return float(np.mean(np.abs(np.asarray(a[:n]) - np.asarray(b[:n])))) if n else float("nan")


def summarise(
    runs: list[Run], opts: argparse.Namespace, pack: dict[str, Any], params: dict[str, int]
) -> tuple[str, dict]:
    lines, data = [], {"pack": pack, "params": params, "runs": [asdict(r) for r in runs]}
    lines.append(
        f"Data: {pack['samples_in']} chats ({opts.scale} scale), {pack['num_tokens']:,} tokens; packshard's "
        f"offline pack (encode + BFD + write, one process) {pack['pack_s']:.1f} s into {pack['rows']} rows "
        f"of <= {opts.seq_len} tokens, padding {pack['padding_fraction']:.3%}.\n"
    )
    for model_name in ARMS:
        mr = {r.arm: r for r in runs if r.model == model_name}
        if not mr:
            continue
        geo = SCALES[opts.scale][model_name]
        w = geo["warmup"]
        if "trl" not in mr or "packshard" not in mr:
            continue
        a, b = mr["trl"], mr["packshard"]
        ctl = [
            mean_abs(x.loss, mr[c].loss)
            for x, c in ((a, "trl_ctl"), (b, "packshard_ctl"))
            if c in mr
        ]
        spread = max(ctl) if ctl else float("nan")
        lines.append(f"**{model_name}** ({params[model_name] / 1e6:.0f}M parameters, {geo['steps']} steps of "
                     f"{geo['batch']}x{geo['accum']} rows, steady = steps {w + 1}-{geo['steps']}):\n")  # fmt: skip
        lines.append(
            "| arm | first step (s) | steady trained tok/s | padding | mean abs loss diff vs trl | peak GiB |"
        )
        lines.append("| --- | ---: | ---: | ---: | ---: | ---: |")
        for arm, r in mr.items():
            lines.append(f"| {arm} | {r.first_step_s:.2f} | {r.steady_tokens_per_s(w):,.0f} | {r.padding:.3%} | "
                         f"{mean_abs(r.loss, a.loss):.4f} | {r.peak_mem_gib:.1f} |")  # fmt: skip
        lines.append(
            f"\nPacked data: TRL {a.data_tokens:,} tokens in {a.data_rows} rows, packshard "
            f"{b.data_tokens:,} tokens in {b.data_rows} rows."
        )
        tput = b.steady_tokens_per_s(w) / a.steady_tokens_per_s(w)
        first = a.first_step_s / b.first_step_s
        diff = mean_abs(a.loss, b.loss)
        verdict = {
            "tokens_per_s_ratio": tput,
            "first_step_ratio": first,
            "loss_diff": diff,
            "control_spread": spread,
        }
        data[model_name] = verdict
        lines.append(
            f"\npackshard / TRL: steady trained tokens/s {tput:.3f}x (target >= 1), time to the first step "
            f"{first:.1f}x faster (target >= 5), mean |loss diff| {diff:.4f} against a control spread of "
            f"{spread:.4f} (target: within).\n"
        )
    return "\n".join(lines), data


def plot(runs: list[Run], out: Path, opts: argparse.Namespace) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for model_name in ARMS:
        mr = [r for r in runs if r.model == model_name]
        if not mr:
            continue
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        for r in mr:
            ax1.plot(range(1, len(r.loss) + 1), r.loss, label=f"{r.arm} (seed {r.seed})")
        (
            ax1.set_xlabel("step"),
            ax1.set_ylabel("loss"),
            ax1.legend(),
            ax1.set_title(f"{model_name}: loss per step"),
        )
        w = SCALES[opts.scale][model_name]["warmup"]
        ax2.bar([r.arm for r in mr], [r.steady_tokens_per_s(w) for r in mr])
        ax2.set_ylabel("steady trained tokens/s"), ax2.set_title("throughput")
        for i, r in enumerate(mr):
            ax2.annotate(
                f"first step {r.first_step_s:.1f}s", (i, 0), ha="center", va="bottom", rotation=90
            )
        fig.tight_layout()
        path = out / f"hf_trainer_{model_name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--data",
        type=Path,
        default=REPO / ".bench_data",
        help="the carried data folder (prepare.sh)",
    )
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/hf_trainer_bench")))
    p.add_argument("--scale", choices=list(SCALES), default="h200")
    p.add_argument("--models", default="qwen3,glm")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument(
        "--num-proc", type=int, default=min(16, os.cpu_count() or 1), help="TRL's dataset_num_proc"
    )
    p.add_argument(
        "--budget-s", type=float, default=480, help="start no run after this many seconds"
    )
    p.add_argument(
        "--append-results", action="store_true", help="record into benchmarks/RESULTS.md"
    )
    p.add_argument("--record", type=Path, help="only record a hf_trainer.json written by a GPU run")
    opts = p.parse_args(argv)
    if opts.scale == "cpu":  # Triton kernels (our indexer) run in Triton's interpreter on a CPU
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if opts.record is not None:
        return record(json.loads(opts.record.read_text()))
    scale = SCALES[opts.scale]
    opts.seq_len = scale["seq_len"]
    opts.tokenizer = str(opts.data / "tokenizers" / "qwen3")
    opts.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hfb_data_"))
    records = mix.build_mix(opts.data, repeats=scale["repeats"], limit=scale["limit"])
    jsonl = work / "mix.jsonl"
    mix.write_jsonl(records, jsonl)
    print(f"mix: {len(records)} chats -> {jsonl}", flush=True)
    url = str(work / "packed")
    pack = mix.pack(jsonl, opts.tokenizer, Path(url), seq_len=opts.seq_len)
    print(
        f"packshard offline pack: {pack['pack_s']:.1f} s ({pack['rows']} rows, {pack['num_tokens']:,} tokens)",
        flush=True,
    )
    runs, params, skipped = [], {}, []
    start = time.perf_counter()
    for model_name in opts.models.split(","):
        if time.perf_counter() - start > opts.budget_s:
            skipped.append(model_name)
            continue
        env = model_env(model_name, opts) | {"jsonl": jsonl, "url": url}
        params[model_name] = env["params"]
        for arm in ARMS[model_name]:
            if time.perf_counter() - start > opts.budget_s:
                skipped.append(f"{model_name}/{arm}")
                continue
            seed = 2 if arm.endswith("_ctl") else 1
            t = time.perf_counter()
            run = train_once(arm, model_name, seed, opts, env)
            runs.append(run)
            print(f"{model_name} {arm}: first step {run.first_step_s:.2f} s, steady "
                  f"{run.steady_tokens_per_s(SCALES[opts.scale][model_name]['warmup']):,.0f} tok/s, "
                  f"loss {run.loss[0]:.3f} -> {run.loss[-1]:.3f} ({time.perf_counter() - t:.0f} s)", flush=True)  # fmt: skip
            write(runs, opts, pack, params, skipped)  # what a run cut short by its time limit keeps
    data = write(runs, opts, pack, params, skipped, final=True)
    print(data["body"])
    if opts.append_results:
        record(data)
    return 0


def write(
    runs: list[Run], opts: argparse.Namespace, pack: dict[str, Any], params: dict[str, int],
    skipped: list[str], *, final: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """hf_trainer.json / .md (and, at the end, the plots) under --out; returns the data."""
    from benchmarks._results import machine_description

    body, data = summarise(runs, opts, pack, params)
    if skipped:
        body += f"\nNot run (past --budget-s {opts.budget_s:.0f}): {', '.join(skipped)}.\n"
    if not final:
        body += "\n(partial: the run had not finished)\n"
    data.update(command=shlex.join(["python", *sys.argv]), load=os.getloadavg(), scale=opts.scale,
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                body=body, machine=machine_description())  # fmt: skip
    (opts.out / "hf_trainer.json").write_text(json.dumps(data, indent=1))
    (opts.out / "hf_trainer.md").write_text(body)
    if final:
        plot(runs, opts.out, opts)
    return data


def record(data: dict[str, Any]) -> int:
    """Make a saved run (`--out`'s hf_trainer.json) the benchmark's RESULTS.md section, with the
    run's own date, machine and load (not the recording machine's)."""
    from benchmarks._results import record_saved

    saved = {**data, "markdown": data["body"], "load": [round(x, 2) for x in data["load"]]}
    record_saved(saved, "hf_trainer", f"HF Trainer / TRL head to head ({data['scale']} scale)",
                 "hf_trainer.json from `bench.py --out`")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
