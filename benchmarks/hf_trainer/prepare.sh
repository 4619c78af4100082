#!/usr/bin/env bash
# Fill what the GPU run of benchmarks/hf_trainer needs and cannot fetch there (no network):
#   .whl/        TRL and what it needs that the H200 image lacks (trl, datasets, dill, multiprocess,
#                and the fsspec datasets 4.7 was released against):
#                datasets 4.7, the oldest TRL 1.16 takes, which needs pyarrow >= 21 and huggingface-hub
#                < 2 (datasets 5 wants pyarrow >= 24, which the image may not have)
#   .bench_data/ the shared data files the mix reads, and the Qwen3 tokenizer (~17 MiB)
# Both are ignored through .git/info/exclude; carry them: carry=[".whl", ".bench_data"].
# Run from the repository root, with ../shared/data beside the checkout (or SHARED_DATA=...).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
SHARED_DATA="${SHARED_DATA:-$(cd .. && pwd)/shared/data}"
PY="${PYTHON:-.venv/bin/python}"
for p in /.whl/ /.bench_data/; do
    grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
done
rm -rf .whl && mkdir -p .whl
# Python 3.12 on x86-64 (the H200 image); pure-Python wheels, one version of each.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
    trl==1.16.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18 fsspec==2026.2.0
rm -rf .bench_data && mkdir -p .bench_data
"$PY" - "$SHARED_DATA" <<'PY'
import shutil, sys
from pathlib import Path
sys.path.insert(0, ".")
from benchmarks.hf_trainer.data import DATA_FILES
src, dst = Path(sys.argv[1]), Path(".bench_data")
for name in [*DATA_FILES, "tokenizers/qwen3/vocab.json", "tokenizers/qwen3/merges.txt",
             "tokenizers/qwen3/tokenizer_config.json"]:
    (dst / name).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src / name, dst / name)
PY
du -sh .whl .bench_data
