#!/usr/bin/env bash
# Launch the DP x CP measurement (issue 8); arguments go to launch.py (see its --help).
# NVLink multicast stays off on the shared H200 hosts (device README, KINDS.md): exported here,
# set again by launch.py for torchrun and every rank, and checked by every GPU rank at start-up.
set -euo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
exec env PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" "$PY" benchmarks/multigpu/launch.py "$@"
