"""Kernel benchmarks as ratios against the vendor / PyTorch reference, side by side in one run.

    python benchmarks/kernels.py            # GPU: compiled Triton kernels at LLM / long-context sizes
                                            # CPU: the same comparisons at small sizes, PyTorch paths only

- TBIK: `tbik_matmul` and `naive_tp_matmul` vs `torch.matmul` (cuBLAS) in bf16 at LLM shapes, plus TFLOP/s;
- Token Sparse Attention vs SDPA (FlashAttention on GPUs) over lengths and keep ratios (the paper reports x3.23
  attention speedup at 128K).
No numbers are committed from a machine where this was not run; results go to
benchmarks/results/kernels-<device>-<host>.json.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import tbik as K  # noqa: E402
from kernels import token_sparse as T  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def timed(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if GPU:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if GPU:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_tbik() -> list[dict]:
    shapes = [(4096, 4096, 4096), (4096, 4096, 11008), (128, 4096, 14336)] if GPU else [(64, 256, 1024)]
    rows = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device=DEV).bfloat16()
        w = torch.randn(k, n, device=DEV).bfloat16()
        base = timed(lambda: x @ w)  # noqa: B023
        row = {"M": m, "N": n, "K": k, "torch_ms": 1e3 * base, "torch_tflops": 2 * m * n * k / base / 1e12}
        if GPU:
            impls = {"tbik_tp1": (K.tbik_matmul, 1), "tbik_tp8": (K.tbik_matmul, 8),
                     "naive_tp8": (K.naive_tp_matmul, 8)}
        else:
            impls = {"tbik_ref_tp1": (K.tbik_matmul_ref, 1), "naive_ref_tp8": (K.naive_tp_matmul_ref, 8)}
        for name, (fn, tp) in impls.items():
            t = timed(lambda: fn(x, w, tp))  # noqa: B023
            row[f"{name}_ms"], row[f"{name}_vs_torch"] = 1e3 * t, t / base
        rows.append(row)
        print(row, flush=True)
    return rows


def bench_token_sparse() -> list[dict]:
    lengths = [8192, 32768, 131072] if GPU else [1024, 4096]
    rows = []
    for length in lengths:
        q, k, v = (torch.randn(1, 32, length, 128, device=DEV, dtype=torch.bfloat16 if GPU else torch.float32)
                   for _ in range(3))
        dense = timed(lambda: T.dense_attention_ref(q, k, v), 3)  # noqa: B023
        for ratio in (0.1, 0.3, 0.5):
            t = timed(lambda: T.token_sparse_attention(q, k, v, keep_ratio=ratio, use_triton=GPU), 3)  # noqa: B023
            rows.append({"L": length, "keep_ratio": ratio, "dense_ms": 1e3 * dense, "tsa_ms": 1e3 * t,
                         "speedup": dense / t})
            print(rows[-1], flush=True)
    return rows


def bench_window_attention() -> list[dict]:
    """T3 window attention (one block shape per call, close + remote) vs full SDPA at video token counts; achieved
    TFLOP/s counts the attended pairs (4 * pairs * head_dim per head)."""
    from kernels import window_attention as WA

    grids = [(16, 64, 64), (16, 68, 120)] if GPU else [(4, 32, 32)]
    blocks = [(1, -1, -1), (-1, -1, 2), (-1, 2, -1), (-1, 4, 4)]
    rows = []
    for grid in grids:
        n, heads, dh = grid[0] * grid[1] * grid[2], 16 if GPU else 4, 64 if GPU else 16
        q, k, v = (torch.randn(1, heads, n, dh, device=DEV, dtype=torch.bfloat16 if GPU else torch.float32)
                   for _ in range(3))
        full = timed(lambda: WA.full_attention_ref(q, k, v), 3)  # noqa: B023
        for blk in blocks:
            t = timed(lambda: WA.multiscale_window_attention(q, k, v, [blk], grid, use_triton=GPU), 3)  # noqa: B023
            pairs = WA.attended_pairs_analytic(grid, [blk])
            rows.append({"grid": list(grid), "block": list(blk), "tokens": n, "full_ms": 1e3 * full,
                         "t3_ms": 1e3 * t, "speedup": full / t, "pair_ratio": n * n / pairs,
                         "t3_tflops": 4 * pairs * dh * heads / t / 1e12,
                         "full_tflops": 4 * n * n * dh * heads / full / 1e12})
            print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    out = {"device": torch.cuda.get_device_name() if GPU else platform.processor() or "cpu",
           "tbik": bench_tbik(), "token_sparse": bench_token_sparse(), "window_attention": bench_window_attention()}
    path = Path(__file__).parent / "results" / f"kernels-{DEV}-{platform.node()}.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")
