"""Shared helpers for benchmark scripts: machine description and appending to RESULTS.md.

Every benchmark prints its table and appends it here with the date, the machine and the exact
command, so RESULTS.md is a log of what was measured where (newest at the bottom).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"


def machine_description() -> str:
    """One line naming the machine: CPU count, memory, GPU if any, Python and key versions."""
    parts = [f"{platform.machine()} {os.cpu_count()} cores"]
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        parts.append(f"{kb / 2**20:.0f} GiB RAM")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch

        if torch.cuda.is_available():
            parts.append(f"GPU {torch.cuda.get_device_name(0)}")
        parts.append(f"torch {torch.__version__}")
    except ImportError:
        pass
    try:
        import triton

        parts.append(f"triton {triton.__version__}")
    except ImportError:
        pass
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def command_line() -> str:
    """The command that ran this benchmark, as a user would retype it."""
    return "python " + " ".join(shlex.quote(a) for a in sys.argv)


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    """A GitHub-flavoured markdown table; floats keep the precision they were formatted with."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def append_result(
    title: str, body: str, *, command: str | None = None, machine: str | None = None
) -> None:
    """Append one dated section (title, machine, command, body) to benchmarks/RESULTS.md."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (
        f"\n## {title}\n\n"
        f"- date: {stamp}\n"
        f"- machine: {machine or machine_description()}\n"
        f"- command: `{command or command_line()}`\n\n"
        f"{body.rstrip()}\n"
    )
    if not RESULTS_MD.exists():
        RESULTS_MD.write_text(
            "# Benchmark results\n\nAppended by the scripts in this folder; newest last.\n"
        )
    with RESULTS_MD.open("a") as f:
        f.write(section)


def append_saved_result(path: Path | str, title: str, what: str) -> str:
    """Append the section a GPU run saved as JSON (keys markdown, machine, command) under
    `title`; returns the markdown. `what` names the file in errors, e.g. "indexer_final.json
    from `bench_indexer.py --final`"."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a saved results file ({e}); pass the {what}") from e
    for key in ("markdown", "command", "machine"):
        if key not in saved:
            raise ValueError(f"{path}: no {key!r} key; not the {what}")
    append_result(title, saved["markdown"], command=saved["command"], machine=saved["machine"])
    return saved["markdown"]


def probe_main(
    doc: str,
    title: str,
    script: str,
    saved: str,
    run: Callable[..., object],
    add_options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """The command line of a GPU diagnostic (`select_probe.py`, `logits_clock_probe.py`,
    `indexer_timeline.py`, `logits_probe.py`, `indexer_sync.py`, `logits_ws_probe.py`):
    `--out DIR` runs `run(DIR or None)` on the GPU and saves `saved` (a JSON with the RESULTS.md
    section) there; `--append-results FILE` appends a fetched one here, under `title`, without
    a GPU. `add_options` adds a probe's own options: `run(DIR or None, args)` then."""
    import torch

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default="", help=f"folder for {saved} and its markdown")
    ap.add_argument("--append-results", default="", help=f"append a fetched {saved}")
    if add_options is not None:
        add_options(ap)
    args = ap.parse_args()
    if args.append_results:
        append_saved_result(args.append_results, title, f"{saved} from `{script} --out`")
        return
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA GPU")
    out = Path(args.out) if args.out else None
    run(out) if add_options is None else run(out, args)


def save_probe(out: Path | None, stem: str, res: dict) -> dict:
    """A GPU diagnostic's result: `stem`.json (with the RESULTS.md section under "markdown") and
    `stem`.md under `out` (when given), the markdown printed; returns `res`."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
        (out / f"{stem}.md").write_text(res["markdown"])
    print(res["markdown"], flush=True)
    return res
