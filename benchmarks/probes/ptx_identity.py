"""Every kernel the indexer's fixed path compiles, as sm_90a PTX, without a GPU.

    .venv/bin/uv pip install --python .venv/bin/python --target /tmp/t36 triton==3.6.0
    PYTHONPATH=.:/tmp/t36 .venv/bin/python benchmarks/probes/ptx_identity.py [--out DIR] > a.txt
    # change the code (or check out another commit), run again into b.txt, then
    diff a.txt b.txt    # no output: the GPU runs the same code

A refactor of `packshard.kernels` that should leave the GPU path alone (a module split, removed
variants, docstrings) is checked here: each launch of the fixed path is compiled for sm_90a
(Triton's own compiler and ptxas, no driver, no launch) and its PTX, with the debug
information (`.loc`, `.file`, debug sections) and comments stripped, is hashed: one line
`launch kernel sha1` a compile. The launches: the select's two stages at topk 8, 64, 512 and
2048 on 16-aligned and unaligned rows, the radix order, the Triton logits kernel at H = 16-128
in its one-block and paired forms, the Triton quantizer and the warp-specialised kernel at
H = 32 and 64 (`WS_LAUNCH`). Use the Triton the device runs (3.6: the Gluon kernel does not
compile under 3.9's API; the others do). `--out DIR` also writes each PTX.

It works by making Triton believe an sm_90 device is active (a stand-in driver that answers
the target, device 0 and stream 0) and by turning every launch into a compile
(`JITFunction.run(..., warmup=True)`): the launchers run as in the fixed path, on CPU tensors.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

COMPILED: list[tuple[str, object]] = []


def clean_ptx(ptx: str) -> str:
    """PTX without debug information and comments: what two identical compiles share."""
    keep, skip = [], False
    for line in ptx.splitlines():
        s = line.strip()
        if s.startswith(".section") and ".debug" in s:
            skip = True
        if skip:
            skip = s != "}"
            continue
        if s.startswith((".loc", ".file")):
            continue
        keep.append(re.sub(r"\s*//.*$", "", line))
    return "\n".join(keep)


def _compile_only() -> None:
    """Make every Triton launch a compile for sm_90a on a machine without a GPU."""
    os.environ.pop("TRITON_INTERPRET", None)
    import triton.runtime.jit as jit
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Sm90:
        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

    driver.set_active(_Sm90())
    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        COMPILED.append((self.fn.__name__, kernel))
        return kernel

    jit.JITFunction.run = compile_only


def _emit(tag: str, out: Path | None) -> None:
    for i, (name, kernel) in enumerate(COMPILED):
        ptx = clean_ptx(kernel.asm["ptx"])
        print(f"{tag} {name} {hashlib.sha1(ptx.encode()).hexdigest()[:16]}", flush=True)
        if out is not None:
            (out / f"{tag}_{i}_{name}.ptx").write_text(ptx)
    COMPILED.clear()


def _select_and_order(out: Path | None) -> None:
    import torch

    from packshard.kernels import FIXED_TOPK_CONFIG
    from packshard.kernels.order import order_topk
    from packshard.kernels.topk import TopkWorkspace, launch_select

    rows = 64
    for topk in (2048, 512, 64, 8):
        ws = TopkWorkspace.allocate(rows, topk, FIXED_TOPK_CONFIG, torch.device("cpu"))
        for width in (8192, 8190):  # 16-aligned rows (ballots) and not (prefix sums)
            ks = torch.zeros(rows, dtype=torch.int32)
            ke = torch.full((rows,), width, dtype=torch.int32)
            launch_select(
                torch.empty(rows, width), 0, ks, ke, ws, topk=topk, row0=0, n_rows=rows,
                sentinel=width,
            )  # fmt: skip
            _emit(f"select_k{topk}_w{width}", out)
        order_topk(ws, torch.empty(rows, topk, dtype=torch.int32), rows, topk, FIXED_TOPK_CONFIG)
        _emit(f"order_k{topk}", out)  # nothing below 32 slots: the torch sort runs there


def _logits(out: Path | None) -> None:
    import torch

    from packshard.kernels.logits import launch_logits

    fp8 = torch.float8_e4m3fn
    for heads, d in ((64, 128), (32, 128), (16, 64), (128, 32)):
        for keys, n in ((16384, 16384), (4096, 1024), (4000, 64)):  # paired, one-block, masked
            launch_logits(
                torch.empty(n * heads, d, dtype=fp8), torch.empty(n * heads),
                torch.empty(keys, d, dtype=fp8), torch.empty(keys),
                torch.zeros(n, dtype=torch.int32), torch.full((n,), keys, dtype=torch.int32),
                torch.empty(n, keys + 16), heads=heads, row0=0, n_rows=n, col0=0,
            )  # fmt: skip
            _emit(f"logits_h{heads}_d{d}_k{keys}_r{n}", out)


def _quant(out: Path | None) -> None:
    import torch

    import packshard.kernels.quant as quant

    quant._triton_quant_usable = lambda x: True  # the CUDA path, on a CPU tensor
    for shape in ((1024, 64, 128), (100, 3, 32)):
        quant.quantize_fp8(torch.randn(*shape, dtype=torch.bfloat16))
        _emit(f"quant_{'x'.join(map(str, shape))}", out)


def _warp_specialised(out: Path | None) -> None:
    from benchmarks.probes.ws_sass import compile_ws
    from packshard.kernels.logits import WS_LAUNCH

    for heads in (64, 32):
        COMPILED.append(("_ws_logits_kernel", compile_ws(heads, WS_LAUNCH[heads]["worker_regs"])))
        _emit(f"ws_h{heads}", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="also write each compile's PTX here")
    args = ap.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    _compile_only()
    import triton

    print(f"# triton {triton.__version__}, sm_90a", flush=True)
    for part in (_select_and_order, _logits, _quant, _warp_specialised):
        try:
            part(args.out)
        except triton.CompilationError as e:  # Gluon's API under another Triton than 3.6
            print(f"# {part.__name__[1:]}: does not compile with this Triton: {e}".split("\n")[0])


if __name__ == "__main__":
    main()
