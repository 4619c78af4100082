"""Multi-GPU DP x CP run of the e2e DSA MoE model (issue 8): count vs cost balance, trained
tokens/s, and the top-k identity check across CP ranks. Entry points: `launch.sh` / `launch.py`
(torchrun + report), `run.py` (the per-rank worker); README.md has the device commands. Modules
are imported by path (they load torch and Triton), so nothing is re-exported here.
"""

__all__: list[str] = []
