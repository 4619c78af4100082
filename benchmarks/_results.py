"""Recording benchmark results: the latest run of each benchmark in RESULTS.md, every run in a
machine-readable history.

`record_result("bench_stream", title, body)` replaces the section of `benchmarks/RESULTS.md`
that starts with the marker `<!-- benchmark: bench_stream -->` (appending it when absent) with
the title, the date (UTC), the machine, its load average at the time of the call, the command
and the body; the same run is appended as one JSON line to
`benchmarks/history/bench_stream.jsonl` (keys benchmark, title, date, machine, load, command,
markdown, data). RESULTS.md so stays one screen a benchmark, and a run's numbers are never lost:
the history keeps all of them, oldest first.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import platform
import re
import shlex
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_MD = BENCH_DIR / "RESULTS.md"
HISTORY_DIR = BENCH_DIR / "history"
RESULTS_HEADER = (
    "# Benchmark results\n\n"
    "The latest run of each benchmark, written by `benchmarks/_results.py:record_result`; every\n"
    "run, older ones included, is one JSON line in `benchmarks/history/<benchmark>.jsonl`.\n"
    "`benchmarks/README.md` says what each benchmark compares and how to run it.\n"
)
MARKER = "<!-- benchmark: {} -->"
_MARKER_RE = re.compile(r"^<!-- benchmark: (\S+) -->$", re.M)
_ID_RE = re.compile(r"[a-z0-9][a-z0-9_.-]*")
DATE_FORMAT = "%Y-%m-%d %H:%M UTC"


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


def split_sections(text: str) -> tuple[str, dict[str, str]]:
    """RESULTS.md's text before the first marker, and each benchmark's section (from its marker
    up to the next one), keyed by benchmark id in file order."""
    marks = list(_MARKER_RE.finditer(text))
    head = text[: marks[0].start()] if marks else text
    sections: dict[str, str] = {}
    for i, m in enumerate(marks):
        if m.group(1) in sections:
            raise ValueError(
                f"{RESULTS_MD}: two sections marked {m.group(0)!r}; keep one (every run is in "
                f"{HISTORY_DIR.name}/{m.group(1)}.jsonl)"
            )
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        sections[m.group(1)] = text[m.start() : end]
    return head, sections


def render_section(entry: dict) -> str:
    """One benchmark's section of RESULTS.md from a history entry (see `record_result`)."""
    lines = [MARKER.format(entry["benchmark"]), f"## {entry['title']}", ""]
    lines += [f"- date: {entry['date']}", f"- machine: {entry['machine']}"]
    load = entry.get("load")
    if isinstance(load, list) and all(isinstance(x, int | float) for x in load):
        lines.append(f"- load average (1/5/15 min): {' / '.join(f'{x:.2f}' for x in load)}")
    elif load is not None:
        lines.append(f"- load average (1/5/15 min): {load}")
    lines += [f"- command: `{entry['command']}`", "", entry["markdown"].rstrip(), "", ""]
    return "\n".join(lines)


def history_path(benchmark: str) -> Path:
    """The JSON-lines file holding every recorded run of `benchmark`, oldest first."""
    return HISTORY_DIR / f"{benchmark}.jsonl"


def read_history(benchmark: str) -> list[dict]:
    """Every recorded run of `benchmark`, oldest first ([] when it never ran)."""
    path = history_path(benchmark)
    if not path.exists():
        return []
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not a JSON line ({e})") from e
    return out


def record_result(
    benchmark: str,
    title: str,
    body: str,
    *,
    data: dict | None = None,
    command: str | None = None,
    machine: str | None = None,
) -> None:
    """Make this run `benchmark`'s section of RESULTS.md and append it to its history.

    `benchmark` is a stable id (the script's name, e.g. "bench_stream"); `body` is the markdown
    under the title (tables, notes); `data` is anything JSON-serialisable a later analysis needs
    (raw timings, settings) and goes to the history only. `command` and `machine` default to
    this process's command line and machine; pass them when recording a run made elsewhere
    (a GPU run's saved JSON). The load average is this machine's at the time of the call.
    """
    if data is not None and not isinstance(data, dict):
        raise TypeError(f"data for {benchmark!r} is a {type(data).__name__}; pass a dict")
    _write(
        {
            "benchmark": benchmark,
            "title": title,
            "date": _now(),
            "machine": machine or machine_description(),
            "load": [round(x, 2) for x in os.getloadavg()],
            "command": command or command_line(),
            "markdown": body.rstrip(),
            "data": data,
        }
    )


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime(DATE_FORMAT)


def _write(entry: dict) -> None:
    """Replace (or add) the entry's section of RESULTS.md and append it to its history."""
    benchmark = entry["benchmark"]
    if not _ID_RE.fullmatch(benchmark):
        raise ValueError(
            f"benchmark id {benchmark!r}: use lower-case letters, digits, '_', '.', '-' "
            "(it names a file in benchmarks/history/ and a marker in RESULTS.md)"
        )
    if "\n" in entry["title"]:
        raise ValueError(f"title {entry['title']!r} spans lines; a section title is one line")
    line = json.dumps(entry, default=str)  # paths and numpy scalars as text
    section = render_section(entry)
    HISTORY_DIR.mkdir(parents=True, exist_ok=True)
    with open(RESULTS_MD, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # benchmarks running at once: one writer at a time
        f.seek(0)
        head, sections = split_sections(f.read() or RESULTS_HEADER)
        sections[benchmark] = section
        text = head.rstrip() + "\n\n" + "".join(s.rstrip() + "\n\n" for s in sections.values())
        f.seek(0)
        f.truncate()
        f.write(text.rstrip() + "\n")
        with history_path(benchmark).open("a", encoding="utf-8") as h:
            h.write(line + "\n")


_SAVED_KEYS = ("markdown", "command", "machine", "date", "load")


def record_saved_result(path: Path | str, benchmark: str, title: str, what: str) -> str:
    """Record the run a GPU machine saved as JSON at `path` (see `record_saved`) as
    `benchmark`'s latest; returns the markdown. `what` names the file in errors, e.g.
    "indexer_final.json from `bench_indexer.py --final`"."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a saved results file ({e}); pass the {what}") from e
    if not isinstance(saved, dict):
        raise ValueError(
            f"{path}: holds a JSON {type(saved).__name__}, not an object; not the {what}"
        )
    return record_saved(saved, benchmark, title, f"{path}: not the {what}")


def record_saved(saved: dict, benchmark: str, title: str, where: str) -> str:
    """Record a run made elsewhere: `saved` holds markdown, machine and command (date and load
    when the run saved them, `run_stamp`); everything else goes to the history's data.
    `where` starts the error message for a missing key. Returns the markdown."""
    for key in ("markdown", "command", "machine"):
        if key not in saved:
            raise ValueError(f"{where} (no {key!r} key)")
    _write(
        {
            "benchmark": benchmark,
            "title": title,
            "date": saved.get("date") or _now(),
            "machine": saved["machine"],
            "load": saved.get("load"),  # the GPU machine's, when the run saved it
            "command": saved["command"],
            "markdown": saved["markdown"].rstrip(),
            "data": {k: v for k, v in saved.items() if k not in _SAVED_KEYS},
        }
    )
    return saved["markdown"]


def run_stamp() -> dict:
    """The date, machine, load average and command of this run, for a GPU run's saved JSON
    (`record_saved_result` reads them back on the machine that records it)."""
    return {
        "date": _now(),
        "machine": machine_description(),
        "load": [round(x, 2) for x in os.getloadavg()],
        "command": command_line(),
    }
