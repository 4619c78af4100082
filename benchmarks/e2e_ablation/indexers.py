"""The indexers the arms run: the fixed-config fp8 kernel, an autotuned-per-length variant of
the same kernel, and the torch reference (CPU smoke runs).

All three implement `kernels.fp8_indexer.fp8_indexer_topk`'s contract. What differs between
arms 3 and 4 is only the launch configuration:

- `fixed` (arm 4, and arms 1 and 2): `kernels.FIXED_CONFIG`, one compiled kernel for every
  row length (keys padded to 128 inside the kernel's launcher).
- `autotuned` (arm 3): what a Triton indexer with `@triton.autotune(key=[seq_len])` does.
  On the first call with a new (queries, keys) shape it times every candidate config on the
  real inputs with `triton.testing.do_bench(warmup=25, rep=100)` (the autotuner's defaults),
  keeps the fastest, and reuses it for every later call of that shape (all layers of the
  row). Rows padded only to a multiple of 8 have a new shape almost every row, so it retunes
  almost every row; rows padded to seq_len would tune once. Compilation of each candidate
  happens once per process (in the warm-up steps); the retuning afterwards is timing alone,
  ~0.15 s per candidate per new length.
  `make_indexer("autotuned")` uses `benchmarks.indexer_peers.autotuned_indexer_topk` (the
  peer bench_indexer.py measures: `triton.autotune` over the distinct kernels of
  `SWEEP_CONFIGS`, keyed on the exact lengths, keys not padded to 16) with one launcher kept
  for the whole run; the
  local `AutotunedIndexer` over 8 logits configs is the fallback if that module is missing.
- `reference`: `kernels.reference_indexer_topk`, fp32 torch (small shapes only).

Each indexer records the seconds it spent tuning (`tune_seconds`) so the report can split an
arm's time into tuning and training.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal

import numpy as np
import torch

log = logging.getLogger(__name__)

IndexerKind = Literal["fixed", "autotuned", "reference", "reference_autotuned"]
PEER_FUNCTION = "autotuned_indexer_topk"


class Indexer:
    """Callable indexer with bookkeeping (`calls`, `tune_seconds`, `tunings`, `implementation`)."""

    def __init__(self, name: str, fn: Callable[..., torch.Tensor], implementation: str) -> None:
        self.name = name
        self.implementation = implementation
        self._fn = fn
        self.calls = 0
        self.tune_seconds = 0.0
        self.tunings = 0

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        w: torch.Tensor,
        ks: torch.Tensor,
        ke: torch.Tensor,
        topk: int,
    ) -> torch.Tensor:
        self.calls += 1
        return self._fn(q, k, w, ks, ke, topk)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "implementation": self.implementation, "calls": self.calls,
                "tunings": self.tunings, "tune_seconds": round(self.tune_seconds, 3)}  # fmt: skip


class AutotunedIndexer(Indexer):
    """Tune per new shape key among `configs` with `bench(fn) -> seconds`, then reuse.

    `runner(q, k, w, ks, ke, topk, config)` runs the indexer under one config. Configs that
    fail to compile or launch (too much shared memory, say) are skipped and logged, as
    Triton's autotuner prunes them.
    """

    def __init__(
        self, name: str, runner: Callable[..., torch.Tensor], configs: Sequence[Any], bench: Callable[[Callable[[], Any]], float],
        implementation: str, skip_errors: tuple[type[BaseException], ...] = (),
    ) -> None:  # fmt: skip
        if not configs:
            raise ValueError("AutotunedIndexer needs at least one config")
        super().__init__(name, self._run, implementation)
        self.runner, self.configs, self.bench = runner, list(configs), bench
        self.skip_errors = skip_errors
        self.best: dict[Hashable, Any] = {}

    def _run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        w: torch.Tensor,
        ks: torch.Tensor,
        ke: torch.Tensor,
        topk: int,
    ) -> torch.Tensor:
        key = (q.shape[0], k.shape[0], q.shape[1], q.shape[2], topk)
        if key not in self.best:
            t0 = time.perf_counter()
            timings: dict[int, float] = {}
            for i, cfg in enumerate(self.configs):
                try:
                    timings[i] = self.bench(lambda cfg=cfg: self.runner(q, k, w, ks, ke, topk, cfg))
                except self.skip_errors as e:
                    log.warning("autotune: config %s failed at shape %s, skipped: %s", cfg, key, e)
            if not timings:
                raise RuntimeError(
                    f"autotune: every config failed at shape {key}; see the warnings above"
                )
            best = min(timings, key=timings.__getitem__)
            self.best[key] = self.configs[best]
            if q.is_cuda:
                torch.cuda.synchronize(q.device)
            self.tune_seconds += time.perf_counter() - t0
            self.tunings += 1
            log.debug(
                "autotune %s: config %d of %d in %.2f s",
                key,
                best,
                len(self.configs),
                time.perf_counter() - t0,
            )
        return self.runner(q, k, w, ks, ke, topk, self.best[key])


def candidate_logits_configs() -> list[Any]:
    """The autotuned arm's search space: the fixed config and 7 neighbours (block_n x block_k
    x warps x stages), a typical @triton.autotune list."""
    from packshard.kernels import FIXED_LOGITS_CONFIG, LogitsConfig

    shapes = [
        (256, 32, 4, 3),
        (256, 128, 8, 3),
        (128, 64, 4, 3),
        (128, 128, 8, 4),
        (256, 64, 8, 2),
        (512, 64, 8, 3),
        (256, 64, 4, 4),
    ]
    return [FIXED_LOGITS_CONFIG] + [
        LogitsConfig(block_n=n, block_k=k, num_warps=w, num_stages=s) for n, k, w, s in shapes
    ]


def _do_bench(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) / 1e3


def _once(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _peer_module() -> Any | None:
    """benchmarks.indexer_peers if it offers the autotuned indexer and a fresh launcher."""
    try:
        import benchmarks.indexer_peers as peers
    except ImportError as e:
        log.warning(
            "benchmarks.indexer_peers not importable (%s); arm 3 uses the local autotuner", e
        )
        return None
    if callable(getattr(peers, PEER_FUNCTION, None)) and callable(
        getattr(peers, "fresh_autotuned_launcher", None)
    ):
        return peers
    log.warning(
        "benchmarks.indexer_peers lacks %s/fresh_autotuned_launcher; arm 3 uses the local autotuner",
        PEER_FUNCTION,
    )
    return None


def make_indexer(kind: IndexerKind) -> Indexer:
    """An indexer of this kind (module docstring)."""
    if kind == "fixed":
        from packshard.kernels import fp8_indexer_topk

        return Indexer(
            "fixed", fp8_indexer_topk, "packshard.kernels.fp8_indexer_topk (FIXED_CONFIG)"
        )
    if kind == "reference":
        from packshard.kernels import reference_indexer_topk

        return Indexer(
            "reference", reference_indexer_topk, "packshard.kernels.reference_indexer_topk"
        )
    if kind == "reference_autotuned":  # CPU smoke: the autotune bookkeeping over the reference
        from packshard.kernels import reference_indexer_topk

        def run_ref(q, k, w, ks, ke, topk, _cfg):  # type: ignore[no-untyped-def]
            return reference_indexer_topk(q, k, w, ks, ke, topk)

        return AutotunedIndexer(
            "autotuned", run_ref, ["a", "b"], _once, "reference, retuned per length (smoke)"
        )
    if kind == "autotuned":
        peers = _peer_module()
        if peers is not None:
            return _PeerIndexer(peers)
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources

        from packshard.kernels import IndexerConfig, fp8_indexer_topk

        def run_cfg(q, k, w, ks, ke, topk, cfg):  # type: ignore[no-untyped-def]
            return fp8_indexer_topk(q, k, w, ks, ke, topk, config=IndexerConfig(logits=cfg))

        return AutotunedIndexer(
            "autotuned", run_cfg, candidate_logits_configs(), _do_bench,
            "packshard.kernels.fp8_indexer_topk, logits config autotuned per length (local: do_bench 25/100 ms over 8 configs)",
            skip_errors=(OutOfResources, CompilationError, RuntimeError),
        )  # fmt: skip
    raise ValueError(
        f"indexer kind {kind!r}: choose fixed, autotuned, reference or reference_autotuned"
    )


class _PeerIndexer(Indexer):
    """benchmarks.indexer_peers.autotuned_indexer_topk with one persistent `launcher` (its
    triton.autotune cache), as a training process keeps one. Tuning seconds are the
    autotuner's own `bench_time` of every tuning it did (Triton >= 2.2 records it), else the
    synchronised wall time of the calls that tuned."""

    def __init__(self, peers: Any) -> None:
        self._launcher = peers.fresh_autotuned_launcher()
        fn = functools.partial(peers.autotuned_indexer_topk, launcher=self._launcher)
        n = len(getattr(peers, "SWEEP_CONFIGS", ()))
        super().__init__(
            "autotuned",
            fn,
            f"benchmarks.indexer_peers.{PEER_FUNCTION} (triton.autotune over the distinct kernels of {n} configs, keyed on the exact length)",
        )

    def _tuners(self) -> list[Any]:
        return list(getattr(self._launcher, "_tuned", {}).values())

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        w: torch.Tensor,
        ks: torch.Tensor,
        ke: torch.Tensor,
        topk: int,
    ) -> torch.Tensor:
        before = {id(t): len(getattr(t, "cache", {})) for t in self._tuners()}
        t0 = time.perf_counter()
        out = super().__call__(q, k, w, ks, ke, topk)
        grew = [t for t in self._tuners() if len(getattr(t, "cache", {})) > before.get(id(t), 0)]
        if grew:
            self.tunings += sum(len(t.cache) - before.get(id(t), 0) for t in grew)
            bench = [getattr(t, "bench_time", None) for t in grew]
            if all(isinstance(b, float) for b in bench):
                self.tune_seconds += sum(bench)  # type: ignore[arg-type]
            else:
                if q.is_cuda:
                    torch.cuda.synchronize(q.device)
                self.tune_seconds += time.perf_counter() - t0
        return out


def self_check_problem(
    heads: int, dim: int, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, w, ks, ke) on the CPU: a packed row of documents 300, 200 and 100 long followed by
    40 padding positions (empty ranges), the start-up check of an indexer against the reference."""
    g = torch.Generator().manual_seed(seed)
    docs, pad = [300, 200, 100], 40
    n = sum(docs)
    q = torch.randn(n + pad, heads, dim, generator=g).bfloat16()
    k = torch.randn(n + pad, dim, generator=g).bfloat16()
    w = torch.randn(n + pad, heads, generator=g)
    starts = np.repeat(np.cumsum([0, *docs[:-1]]), docs)
    ks = torch.tensor(np.concatenate([starts, np.arange(n, n + pad)]), dtype=torch.int32)
    ke = torch.tensor(
        np.concatenate([np.arange(1, n + 1), np.arange(n, n + pad)]), dtype=torch.int32
    )
    return q, k, w, ks, ke
