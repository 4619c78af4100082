"""End-to-end padding ablation (issue 6): a DSA-style MoE LM trained on packshard rows in four
padding arms on one GPU. Entry point: `benchmarks/e2e_ablation/run.py`; design, FLOPs and the
device command: README.md beside this file. Modules are imported by path (they load torch and
Triton), so nothing is re-exported here.
"""

__all__: list[str] = []
