"""End-to-end padding ablation (issue 6): one entry point for every step.

    # here, on CPU: pack the two workloads (plus long_greedy) into .bench/e2e_data (~40 MB)
    PYTHONPATH=. .venv/bin/python benchmarks/e2e_ablation/run.py --prepare-data .bench/e2e_data
    # on the H200 (one device call, carry .bench/e2e_data): everything under $OUT
    PYTHONPATH=. python3 benchmarks/e2e_ablation/run.py --data .bench/e2e_data --out $OUT
    # here, afterwards: append the fetched results to benchmarks/RESULTS.md
    PYTHONPATH=. .venv/bin/python benchmarks/e2e_ablation/run.py --append-results /path/to/e2e_results.json
    # CPU smoke test of the whole path at toy sizes (synthetic data, torch reference indexer)
    PYTHONPATH=. .venv/bin/python benchmarks/e2e_ablation/run.py --smoke --out /tmp/e2e_smoke

The GPU run writes e2e_results.json (everything, including the RESULTS.md section under
"markdown"), e2e_results.md, e2e_step_times.png and e2e_run.log into --out, after every
workload, so a run stopped by its deadline or a timeout still returns what it finished.
Workloads run in the order given (default long_greedy, long, math: the most telling first).
--deadline-s (from the process start, default 360) starts no step that would end past it (the
last interleaved step's duration is the estimate), skips workloads not started, and keeps a
few seconds to write the results.
See README.md beside this file for the model, FLOPs, seq_len choice and device command.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROCESS_START = time.monotonic()  # --deadline-s counts from here (imports included)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before torch loads

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.e2e_ablation.config import ARM_BY_NUMBER, PRESETS, RunConfig, with_overrides  # noqa: E402

log = logging.getLogger("e2e_ablation")

WORKLOAD_INFO = {  # what --prepare-data builds (data.py); the smoke run reuses the names for toy data
    "long": "long multi-turn agent trajectories (22 real SWE-agent + synthetic, median ~17K tokens), BFD rows",
    "math": "GSM8K chats (95-567 tokens), BFD rows",
    "long_greedy": "the long mix packed in order (greedy next-fit), as sequential loaders do",
}


def _setup_logging(out: Path | None) -> None:
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stdout)]
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(out / "e2e_run.log"))
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=handlers,
        force=True,
    )


def _model_summary(run: RunConfig) -> str:
    from benchmarks.e2e_ablation.flops import per_token_weights

    m = run.model
    w = per_token_weights(m)
    return (
        f"{m.n_layers} layers, d_model {m.d_model}, vocab {m.vocab_size} ({'tied' if m.tie_embeddings else 'untied'}, input x sqrt(d)), MQA sparse attention {m.n_heads} heads x "
        f"({m.kv_dim} latent + {m.rope_dim} RoPE), indexer {m.index_heads} x {m.index_dim} top-{m.index_topk}, MoE "
        f"{m.n_experts} experts top-{m.expert_topk} x SwiGLU {m.expert_dim}; {w['dense'] / 1e6:.0f}M dense + "
        f"{w['lm_head'] / 1e6:.0f}M LM-head weights per token"
    )


def _indexer_for(arm_number: int, run: RunConfig) -> Any:
    from benchmarks.e2e_ablation.indexers import make_indexer

    tuned = ARM_BY_NUMBER[arm_number].autotuned_indexer
    if run.indexer == "reference":
        return make_indexer("reference_autotuned" if tuned else "reference")
    return make_indexer("autotuned" if tuned else "fixed")


def self_checks(run: RunConfig, device: torch.device) -> tuple[Any, dict[str, str]]:
    """Check the fixed indexer against the reference and pick the sparse-attention and
    cross-entropy kernels (Triton where its self-check passes, else torch)."""
    from benchmarks.e2e_ablation.loss import self_check as ce_self_check
    from benchmarks.e2e_ablation.sparse_attention import self_check
    from benchmarks.e2e_ablation.train import Impl

    checks: dict[str, str] = {}
    m = run.model
    if run.indexer == "kernel":
        from benchmarks.e2e_ablation.indexers import self_check_problem
        from packshard.kernels import fp8_indexer_topk, reference_indexer_topk

        q, k, w, ks, ke = self_check_problem(m.index_heads, m.index_dim)
        got = fp8_indexer_topk(
            q.to(device), k.to(device), w.to(device), ks.to(device), ke.to(device), 64
        ).cpu()
        ref = reference_indexer_topk(q, k, w, ks, ke, 64)
        agree = float((got == ref).float().mean())
        checks["indexer"] = (
            f"fixed kernel vs torch reference: {agree:.2%} of top-64 slots identical"
        )
        if agree < 0.99:
            log.warning(
                "the fixed indexer disagrees with the reference on %.2f%% of slots",
                100 * (1 - agree),
            )
    impl = run.attention
    if impl in ("auto", "triton"):
        ok, msg = self_check(
            device,
            getattr(torch, run.dtype),
            h=m.n_heads,
            dc=m.kv_dim,
            dr=m.rope_dim,
            topk=m.index_topk,
        )
        checks["sparse_attention"] = msg
        if not ok and impl == "triton":
            raise RuntimeError(f"--attention triton: the kernel's self-check failed: {msg}")
        impl = "triton" if ok else "torch"
        if not ok:
            log.warning("sparse attention falls back to the torch reference: %s", msg)
    checks["sparse_attention_impl"] = impl
    ce_triton = False
    if device.type == "cuda":
        ce_triton, msg = ce_self_check(device, getattr(torch, run.dtype), vocab=m.vocab_size)
        checks["cross_entropy"] = msg
        if not ce_triton:
            log.warning("the cross entropy falls back to torch: %s", msg)
    checks["cross_entropy_impl"] = "triton" if ce_triton else "torch"
    return Impl(attention=impl, ce_triton=ce_triton), checks


RESERVE_S = 8.0  # kept before the deadline: the same-weights check and writing the results
MIN_WORKLOAD_S = 45.0  # a workload is not started with less time left (a few timed steps at least)


def run_workload(name: str, data_dir: Path, run: RunConfig, device: torch.device, impl: Any, deadline: float | None,
                 info: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:  # fmt: skip
    """Train every arm on this workload; returns its record and arm 4's longest row (tensors)."""
    from benchmarks.e2e_ablation.arms import arm_summary, build_arms
    from benchmarks.e2e_ablation.train import build_base_model, make_arm, train_interleaved

    arms = tuple(ARM_BY_NUMBER[n] for n in run.arms)
    batches = build_arms(str(data_dir / name / "pad8"), str(data_dir / name / "padseq"), run, arms)
    base = build_base_model(run, device)
    runs = [
        make_arm(a.number, base, _indexer_for(a.number, run), batches[a.number], run, device)
        for a in arms
    ]
    del base
    t0 = time.monotonic()
    done, stopped = train_interleaved(
        runs, run, device, impl, deadline=deadline, reserve_s=RESERVE_S
    )
    same = _same_weights(runs, done, run, device, impl)
    record = {
        "name": name, "rows_per_step": run.rows_per_step, "n_experts": run.model.n_experts, "steps_done": done,
        "stopped_early": stopped, "wall_s": time.monotonic() - t0,
        "data": {"description": WORKLOAD_INFO.get(name, name), **info, "rows": run.rows_needed},
        "arms": [r.record() for r in runs],
        "arm_data": {r.number: arm_summary(r.batches) for r in runs},
        "flops_per_step": _flops(run, runs), "same_weights": same,
    }  # fmt: skip
    ref4 = batches.get(4)
    sample = max(ref4, key=lambda mb: mb.meta["num_tokens"]).to(device).tensors if ref4 else None
    del runs, batches
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record, sample


def _same_weights(
    runs: list[Any], done: int, run: RunConfig, device: torch.device, impl: Any
) -> dict[str, Any]:
    """Arm 4's model after its last step on every (non-control) arm's rows of that step."""
    from benchmarks.e2e_ablation.train import same_weights_losses

    ref = next((r for r in runs if r.number == 4 and r.error is None), None)
    if ref is None or done < 1:
        return {}
    others = [r for r in runs if r.error is None and ARM_BY_NUMBER[r.number].control_of is None]
    try:
        losses = same_weights_losses(ref.model, others, done, run, device, impl)
    except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
        log.exception("the same-weights check failed")
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    return {"model_arm": 4, "step": done, "losses": losses}


def _flops(run: RunConfig, runs: list[Any]) -> dict[str, dict[str, float]]:
    from benchmarks.e2e_ablation.flops import row_flops

    out = {}
    for r in runs:
        tot: dict[str, float] = {}
        for mb in r.batches:
            f = row_flops(
                run.model, mb.meta["padded_len"], mb.meta["ranked_pairs"], mb.meta["selected_pairs"]
            )
            for k, v in f.items():
                tot[k] = tot.get(k, 0.0) + v / run.steps
        out[str(r.number)] = tot
    return out


def write_outputs(result: dict[str, Any], out: Path) -> None:
    from benchmarks.e2e_ablation.report import plot_step_times, results_markdown, summarize

    for w in result["workloads"]:
        summarize(w, result["run"]["timed_from"], result["run"]["loss_tolerance"])
    result["plot"] = "e2e_step_times.png"
    result["markdown"] = results_markdown(result)
    (out / "e2e_results.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "e2e_results.md").write_text(result["markdown"] + "\n")
    try:
        plot_step_times(result, out / "e2e_step_times.png")
    except (ImportError, ValueError, OSError) as e:
        log.warning("plot not written: %s", e)


def run_all(
    run: RunConfig,
    data_dir: Path,
    out: Path,
    workloads: list[str],
    deadline_s: float | None,
    device: torch.device,
) -> dict[str, Any]:
    from benchmarks._results import run_stamp
    from benchmarks.e2e_ablation.report import print_table

    start = PROCESS_START
    deadline = start + deadline_s if deadline_s else None
    info_path = data_dir / "data_info.json"
    data_info = (
        json.loads(info_path.read_text()).get("workloads", {}) if info_path.is_file() else {}
    )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    impl, checks = self_checks(run, device)
    result: dict[str, Any] = {
        **run_stamp(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "run": {**{k: v for k, v in run.__dict__.items() if k != "model"}, "deadline_s": deadline_s},
        "model": run.model.__dict__, "model_summary": _model_summary(run), "attention_impl": impl.attention,
        "ce_impl": "triton" if impl.ce_triton else "torch", "self_checks": checks,
        "indexers": {"fixed": _indexer_for(4, run).implementation, "autotuned": _indexer_for(3, run).implementation},
        "workloads": [], "notes": [],
    }  # fmt: skip
    sample = None
    for name in workloads:
        if not (data_dir / name / "pad8").is_dir():
            result["notes"].append(
                f"workload {name}: no data under {data_dir / name}; skipped (prepare it with --prepare-data)"
            )
            log.warning(result["notes"][-1])
            continue
        if deadline is not None and deadline - time.monotonic() < MIN_WORKLOAD_S:
            result["notes"].append(
                f"workload {name} skipped: the deadline (--deadline-s {deadline_s:.0f}) was reached"
            )
            log.warning(result["notes"][-1])
            continue
        t0 = time.monotonic()
        log.info("workload %s: start", name)
        try:
            record, row = run_workload(
                name, data_dir, run, device, impl, deadline, data_info.get(name, {})
            )
            sample = sample if sample is not None else row
        except (
            RuntimeError,
            ValueError,
            OSError,
        ) as e:  # one workload's failure must not lose the others
            log.exception("workload %s failed", name)
            result["notes"].append(f"workload {name} FAILED: {type(e).__name__}: {e}"[:2000])
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        result["workloads"].append(record)
        result["elapsed_s"] = time.monotonic() - start
        write_outputs(result, out)
        log.info(
            "workload %s: done in %.1f s (%.1f s since start)",
            name,
            time.monotonic() - t0,
            result["elapsed_s"],
        )
    if (
        sample is not None
        and device.type == "cuda"
        and (deadline is None or deadline - time.monotonic() > 20)
    ):
        from benchmarks.e2e_ablation.components import time_components

        try:
            result["components_ms"] = time_components(sample, run, impl)
            log.info("component times (ms, one row): %s", result["components_ms"])
        except (RuntimeError, ValueError, torch.OutOfMemoryError) as e:
            log.exception("component timing failed")
            result["notes"].append(f"component timing failed: {type(e).__name__}: {e}"[:500])
        result["elapsed_s"] = time.monotonic() - start
        write_outputs(result, out)
    if not result["workloads"]:
        raise RuntimeError(f"no workload ran: no data under {data_dir}")
    print_table(result)
    return result


def prepare_smoke_data(root: Path, run: RunConfig) -> None:
    """Two tiny workloads of synthetic token ids (Zipf 1.1 over the vocabulary), each packed
    twice (pad8 / padseq), with packers."""
    import pyarrow as pa

    from packshard.packers import DatasetWriter, pack_table

    rng = np.random.default_rng(0)
    specs = {"long": (40, 230), "math": (12, 48)}
    info: dict[str, Any] = {"workloads": {}}
    for name, (lo, hi) in specs.items():
        n = 3 * run.rows_needed * run.seq_len // (lo + hi)
        lengths = rng.integers(lo, hi, n)
        ranks = np.arange(1, run.model.vocab_size - 1)
        zipf = 1.0 / ranks**1.1  # a text-like unigram law: something to learn in 6 steps
        ids = [
            (2 + rng.choice(ranks.size, k, p=zipf / zipf.sum())).astype(np.int32) for k in lengths
        ]
        masks = [np.arange(k) >= k // 3 for k in lengths]
        table = pa.table(
            {
                "input_ids": pa.array(ids, type=pa.list_(pa.int32())),
                "loss_mask": pa.array(masks, type=pa.list_(pa.bool_())),
            }
        )
        for sub, pm, pad_id in (("pad8", run.pad_multiple, 1), ("padseq", run.seq_len, 0)):
            batch, _ = pack_table(table, seq_len=run.seq_len, pad_multiple=pm, pad_token_id=pad_id)
            cfg = {"seq_len": run.seq_len, "cp": math.gcd(8, pm), "pad_multiple": pm, "pad_token_id": pad_id, "packing": {"algorithm": "bfd"},
                   "overlong": "truncate", "seed": 0, "inputs": ["smoke"], "tokenizer": {"name": "synthetic", "fingerprint": "-"}}  # fmt: skip
            w = DatasetWriter(str(root / name / sub), cfg, max_rows=16)
            w.write(batch)
            w.close({"samples_in": n, "samples_kept": n, "dropped": {}})
        info["workloads"][name] = {
            "samples": n,
            "packer": "in-process packers.pack_table (bfd)",
            "description": f"smoke toy data, Zipf-distributed ids, documents of {lo}-{hi} tokens",
        }
    (root / "data_info.json").write_text(json.dumps(info))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--prepare-data",
        metavar="DIR",
        type=Path,
        help="pack the workloads into DIR (CPU, needs ../shared/data)",
    )
    mode.add_argument(
        "--smoke",
        action="store_true",
        help="toy sizes on CPU with synthetic data (the test's path)",
    )
    mode.add_argument(
        "--append-results",
        metavar="FILE",
        type=Path,
        help="record a GPU run's e2e_results.json as e2e_ablation's latest result (RESULTS.md and "
        "benchmarks/history/)",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=REPO / ".bench" / "e2e_data",
        help="prepared data (default .bench/e2e_data)",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / ".bench" / "e2e_out",
    )
    p.add_argument(
        "--workloads", default="long_greedy,long,math", help="comma-separated, run in this order"
    )
    p.add_argument(
        "--arms",
        default=None,
        help="comma-separated arm numbers (default 1,2,3,4,5; 5 = arm 4 again, the control)",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--rows-per-step", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help="--prepare-data: rows per dataset (default steps x rows_per_step + 4)",
    )
    p.add_argument("--attention", choices=["auto", "triton", "torch"], default=None)
    p.add_argument("--indexer", choices=["kernel", "reference"], default=None)
    p.add_argument(
        "--no-pipeline",
        action="store_true",
        help="--prepare-data: pack in process, not with packshard.pipeline.pack",
    )
    p.add_argument(
        "--deadline-s",
        type=float,
        default=360.0,
        help="seconds from process start by which the run must be done (0: none)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.append_results is not None:
        from benchmarks.e2e_ablation.report import append_results_file

        print(append_results_file(args.append_results))
        print(f"\nappended to {REPO / 'benchmarks' / 'RESULTS.md'}")
        return 0
    preset = PRESETS["smoke" if args.smoke else "h200"]
    arms = tuple(int(a) for a in args.arms.split(",")) if args.arms else None
    run = with_overrides(preset, steps=args.steps, rows_per_step=args.rows_per_step, seq_len=args.seq_len,
                         attention=args.attention, indexer=args.indexer, arms=arms)  # fmt: skip
    workloads = [w for w in args.workloads.split(",") if w]
    if args.prepare_data is not None:
        _setup_logging(None)
        from benchmarks.e2e_ablation.data import prepare

        info = prepare(args.prepare_data, seq_len=run.seq_len, pad_multiple=run.pad_multiple, rows=args.rows or run.rows_needed + 4,
                       workloads=tuple(workloads), pipeline=not args.no_pipeline)  # fmt: skip
        print(json.dumps(info, indent=1))
        return 0
    _setup_logging(args.out)
    if args.smoke:
        torch.set_num_threads(
            1
        )  # toy shapes: more threads only contend (7x slower on a loaded 2-core box)
        with tempfile.TemporaryDirectory(prefix="e2e_smoke_") as tmp:
            prepare_smoke_data(Path(tmp), run)
            run_all(
                run,
                Path(tmp),
                args.out,
                [w for w in workloads if w in ("long", "math")],
                None,
                torch.device("cpu"),
            )
        return 0
    if not torch.cuda.is_available():
        log.error("no CUDA device: the full run needs the GPU (use --smoke on CPU)")
        return 2
    try:
        run_all(run, args.data, args.out, workloads, args.deadline_s or None, torch.device("cuda"))
    except Exception as e:  # record why in $OUT (the traceback is in e2e_run.log), then fail
        log.exception("the GPU run failed")
        (args.out / "e2e_error.txt").write_text(f"{type(e).__name__}: {e}\n")
        raise
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
