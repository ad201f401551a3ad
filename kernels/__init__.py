"""Triton kernels of the kernel papers (TBIK, Token Sparse Attention, T3 window attention); see DESIGN.md, Kernels."""

from __future__ import annotations

import os


def autotune_configs(full: list, single) -> list:
    """Configs handed to `triton.autotune`: the full list on a GPU; only `single` when interpreted (the autotuner
    then times nothing) or with PAPERLINE_AUTOTUNE=0 (compiled tests: one compile per shape instead of one per
    config; benchmarks/gpu.sh sets it for its test step)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("PAPERLINE_AUTOTUNE", "1") == "0":
        return [single]
    return full
