"""The warp-specialised logits kernel's machine code, without a GPU.

    .venv/bin/uv pip install --python .venv/bin/python --target /tmp/t36 triton==3.6.0
    PYTHONPATH=.:/tmp/t36 .venv/bin/python benchmarks/probes/ws_sass.py [--heads 64 32] \
        [--worker-regs 128 120] [--uniform-ranges on|off] [--early-tiles on|off] [--out DIR]

Compiles `kernels.logits_ws._ws_logits_kernel` for sm_90a on any machine (Triton's compiler and
its bundled ptxas and nvdisasm; no GPU) with the fixed path's launch (`kernels.logits.WS_LAUNCH`)
at each head count and register split, and prints shared memory, ptxas's registers and spills,
and each innermost tile loop of the SASS: instructions, QGMMA, local-memory (spill) and shared
loads, barriers. Warpgroups 1-3's loops come first in the SASS, warpgroup 0's (the producer's)
last. Use the Triton the device runs (3.6: Gluon's API moves between releases; the repo's
environment has another, which is why this is not a CI test).

It finds spills before a GPU does: at H = 32 warpgroups 1-3 spill at 128 registers a thread and
not at 120 (`WS_LAUNCH`). A change that should not touch the fixed path can be checked here
first: same SASS, same loops. `--uniform-ranges` and `--early-tiles` override the fixed path's
launch options (both on in `WS_LAUNCH`). `--out DIR` also writes each compile's PTX and SASS.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BACK_BRANCH = re.compile(r"BRA\s+`?\(?(\.L_x_\d+)")


@dataclass(frozen=True)
class Loop:
    """One loop of a SASS listing: lines [start, end] (its label to its branch back)."""

    start: int
    end: int
    instructions: int
    qgmma: int
    local_memory: int  # LDL / STL: spills
    shared_loads: int  # LDS / LDSM
    barriers: int  # BAR.*


def sass_loops(sass: str) -> list[Loop]:
    """The innermost loops of an nvdisasm listing that issue wgmma (QGMMA): the tile loops.

    A loop is a branch to a label above it; innermost, when no other loop lies inside it.
    """
    lines = sass.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = _LABEL.match(line)
        if m:
            labels[m.group(1)] = i
    spans = []
    for i, line in enumerate(lines):
        m = _BACK_BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i:
            spans.append((labels[m.group(1)], i))
    loops = []
    for a, b in spans:
        if any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans):
            continue  # a loop lies inside: not innermost
        body = [x.split(";")[0] for x in lines[a : b + 1]]
        ops = [x for x in body if x.strip() and not _LABEL.match(x)]
        loops.append(
            Loop(
                start=a,
                end=b,
                instructions=len(ops),
                qgmma=sum("QGMMA" in x for x in ops),
                local_memory=sum(re.search(r"\b(LDL|STL)\b", x) is not None for x in ops),
                shared_loads=sum(re.search(r"\bLDS", x) is not None for x in ops),
                barriers=sum(re.search(r"\bBAR\.", x) is not None for x in ops),
            )
        )
    return [lp for lp in loops if lp.qgmma]


def _bin(tool: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / tool
    if not path.exists():
        raise SystemExit(f"ws_sass: {path} is missing: this Triton has no bundled {tool}")
    return str(path)


def compile_ws(heads: int, worker_regs: int, **flags: bool):
    """Triton's compiled `_ws_logits_kernel` for sm_90a: the fixed path's launch at `heads`
    (`WS_LAUNCH`) with warpgroups 1-3 at `worker_regs` registers; `flags` sets the launcher's
    `uniform_ranges` and `early_tiles`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from packshard.kernels import logits_ws as ws
    from packshard.kernels.logits import WS_LAUNCH

    kwargs = {"start_align": 16, **WS_LAUNCH[heads], "worker_regs": worker_regs, **flags}
    qbox, meta = ws.kernel_meta(heads, **kwargs)
    options = {"num_warps": meta.pop("num_warps"), "maxnreg": meta.pop("maxnreg")}

    def desc(rows: int) -> str:
        layout = ws._fp8_layout((rows, 128))
        return f"tensordesc<fp8e4nv[{rows}, 128],{layout!r}>"

    types = {
        "q_desc": desc(qbox), "k_desc": desc(ws.BLOCK_K),
        "kscale_ptr": "*fp32", "wq_ptr": "*fp32", "ks_ptr": "*i32", "ke_ptr": "*i32",
        "out_ptr": "*fp32", "row0": "i32", "n_rows": "i32", "col0": "i32", "stride_out": "i32",
    }  # fmt: skip
    constants = {**meta, "num_warps": options["num_warps"]}
    names = [p.name for p in ws._ws_logits_kernel.params]
    unknown = set(names) - set(types) - set(constants)
    if unknown:  # the kernel grew an argument this script does not know
        raise SystemExit(f"ws_sass: no type for the kernel's arguments {sorted(unknown)}")
    signature = {n: types.get(n, "constexpr") for n in names}
    constexprs = {(names.index(n),): v for n, v in constants.items() if n in names}
    src = GluonASTSource(ws._ws_logits_kernel, signature, constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def inspect(heads: int, worker_regs: int, out: Path | None, **flags: bool) -> dict:
    """Shared memory, ptxas's counts and the tile loops of one compile."""
    compiled = compile_ws(heads, worker_regs, **flags)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx.write_text(compiled.asm["ptx"])
        ptxas = subprocess.run(
            [_bin("ptxas"), "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        sass = subprocess.run(
            [_bin("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    regs = re.search(r"Used (\d+) registers", ptxas.stderr)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas.stderr)
    res = {
        "heads": heads,
        "worker_regs": worker_regs,
        **flags,
        "shared_bytes": compiled.metadata.shared,
        "registers": int(regs.group(1)) if regs else None,
        "spill_store_bytes": int(spills.group(1)) if spills else 0,
        "spill_load_bytes": int(spills.group(2)) if spills else 0,
        "tile_loops": [asdict(lp) for lp in sass_loops(sass)],
    }
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        stem = f"ws_h{heads}_r{worker_regs}" + "".join(
            f"_{k}_{'on' if v else 'off'}" for k, v in flags.items()
        )
        (out / f"{stem}.ptx").write_text(compiled.asm["ptx"])
        (out / f"{stem}.sass").write_text(sass)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--heads", type=int, nargs="+", default=[64, 32])
    ap.add_argument("--worker-regs", type=int, nargs="+", default=[128, 120])
    for flag in ("uniform_ranges", "early_tiles"):
        ap.add_argument(
            f"--{flag.replace('_', '-')}",
            choices=("on", "off"),
            default=None,
            help=f"launcher's {flag} (default: the fixed path's, WS_LAUNCH)",
        )
    ap.add_argument("--out", type=Path, default=None, help="write ws_sass.json, PTX and SASS here")
    args = ap.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # a compile, not the interpreter
    flags = {
        flag: getattr(args, flag) == "on"
        for flag in ("uniform_ranges", "early_tiles")
        if getattr(args, flag) is not None
    }
    from packshard.kernels.logits import WS_LAUNCH

    results = []
    for heads in args.heads:
        # the options compiled, recorded whether given or taken from the fixed path's launch
        resolved = {f: flags.get(f, WS_LAUNCH[heads][f]) for f in ("uniform_ranges", "early_tiles")}
        for regs in args.worker_regs:
            r = inspect(heads, regs, args.out, **resolved)
            results.append(r)
            print(
                f"H={heads} worker_regs={regs} {resolved}: shared {r['shared_bytes']} B, "
                f"{r['registers']} registers, spills {r['spill_store_bytes']} B stored / "
                f"{r['spill_load_bytes']} B loaded"
            )
            for lp in r["tile_loops"]:
                print(
                    f"  loop at SASS line {lp['start']}: {lp['instructions']} instructions, "
                    f"{lp['qgmma']} QGMMA, {lp['local_memory']} LDL/STL, "
                    f"{lp['shared_loads']} LDS, {lp['barriers']} BAR"
                )
    if args.out is not None:
        (args.out / "ws_sass.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
