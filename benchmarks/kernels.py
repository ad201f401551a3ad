"""Kernel benchmarks as ratios against the vendor / PyTorch reference, side by side in one run.

    python benchmarks/kernels.py            # GPU: compiled Triton kernels at the papers' sizes
                                            # CPU: the same comparisons at small sizes, PyTorch paths only
    python benchmarks/kernels.py --quick    # a seconds-long check that the script runs (benchmarks/gpu.sh --cpu-check)
    python benchmarks/kernels.py --out PATH # results elsewhere than benchmarks/results/kernels-<device>.json

- TBIK: `tbik_matmul` (one pass per shard; TP 1 and TP 8 simulated in one launch) and `naive_tp_matmul` vs
  `torch.matmul` (cuBLAS) in bf16 at 4096-8192 LLM shapes, plus TFLOP/s (the paper: batch-invariant kernels cost
  about 20 % over cuBLAS);
- Token Sparse Attention vs SDPA (FlashAttention on GPUs) over lengths up to 128K and keep ratios (the paper: x3.23
  attention speedup at 128K);
- T3 window attention (one launch: close + remote groups of one block shape) vs full SDPA at 4K tokens (a 16 x 16 x 16
  latent) and at 64K, forward and forward + backward.
Times: `triton.testing.do_bench` (median ms) on GPUs, the median of a few calls on CPU. No numbers are committed
from a machine where this was not run.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import tbik as K  # noqa: E402
from kernels import token_sparse as T  # noqa: E402
from kernels import window_attention as WA  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"


def timed(fn, repeats: int = 5) -> float:
    """Seconds per call: do_bench's median on GPUs (warm-up, L2 flush between calls), else the median of `repeats`."""
    if GPU:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_tbik(quick: bool) -> list[dict]:
    if GPU:
        shapes = [(4096, 4096, 4096), (4096, 8192, 8192), (8192, 8192, 8192), (4096, 4096, 14336), (128, 4096, 14336)]
    else:
        shapes = [(16, 64, 256)] if quick else [(64, 256, 1024)]
    rows = []
    for m, n, k in shapes:
        x = torch.randn(m, k, device=DEV).bfloat16()
        w = torch.randn(k, n, device=DEV).bfloat16()
        base = timed(lambda: x @ w)  # noqa: B023
        row = {"M": m, "N": n, "K": k, "torch_ms": 1e3 * base, "torch_tflops": 2 * m * n * k / base / 1e12}
        if GPU:
            impls = {"tbik_tp1": (K.tbik_matmul, 1), "tbik_tp8": (K.tbik_matmul, 8),
                     "naive_tp8": (K.naive_tp_matmul, 8)}
            a, b = K.tbik_matmul(x, w, 1), K.tbik_matmul(x, w, 8)
            row["tbik_tp1_equals_tp8"] = bool(torch.equal(a, b))
        else:
            impls = {"tbik_ref_tp1": (K.tbik_matmul_ref, 1), "naive_ref_tp8": (K.naive_tp_matmul_ref, 8)}
        for name, (fn, tp) in impls.items():
            t = timed(lambda: fn(x, w, tp))  # noqa: B023
            row[f"{name}_ms"], row[f"{name}_vs_torch"] = 1e3 * t, t / base
            row[f"{name}_tflops"] = 2 * m * n * k / t / 1e12
        rows.append(row)
        print(row, flush=True)
    return rows


def bench_token_sparse(quick: bool) -> list[dict]:
    lengths = [8192, 32768, 131072] if GPU else [256] if quick else [1024, 4096]
    heads, dh = (32, 128) if GPU or not quick else (2, 16)
    rows = []
    for length in lengths:
        q, k, v = (torch.randn(1, heads, length, dh, device=DEV, dtype=torch.bfloat16 if GPU else torch.float32)
                   for _ in range(3))
        dense = timed(lambda: T.dense_attention_ref(q, k, v), 3)  # noqa: B023
        for ratio in (0.1, 0.3, 0.5):
            t = timed(lambda: T.token_sparse_attention(q, k, v, keep_ratio=ratio, use_triton=GPU), 3)  # noqa: B023
            rows.append({"L": length, "keep_ratio": ratio, "dense_ms": 1e3 * dense, "tsa_ms": 1e3 * t,
                         "speedup": dense / t})
            print(rows[-1], flush=True)
    return rows


def bench_window_attention(quick: bool) -> list[dict]:
    """T3 window attention (one block shape per layer, close + remote, one launch) vs full SDPA; achieved TFLOP/s
    counts the attended pairs (4 * pairs * head_dim per head, x 2.5 with the backward)."""
    grids = [(16, 16, 16), (16, 64, 64)] if GPU else [(2, 4, 4)] if quick else [(4, 32, 32)]
    blocks = [(1, -1, -1), (-1, -1, 2), (-1, 2, -1), (-1, 4, 4)]
    rows = []
    for grid in grids:
        n, heads, dh = grid[0] * grid[1] * grid[2], 16 if GPU else 4, 64 if GPU else 16
        q, k, v = (torch.randn(1, heads, n, dh, device=DEV, dtype=torch.bfloat16 if GPU else torch.float32,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)

        def fwd_bwd(f):
            out = f()
            torch.autograd.grad(out, (q, k, v), dout)  # noqa: B023

        with torch.no_grad():
            full = timed(lambda: WA.full_attention_ref(q, k, v), 3)  # noqa: B023
        full_train = timed(lambda: fwd_bwd(lambda: WA.full_attention_ref(q, k, v)), 3)  # noqa: B023
        for blk in blocks:
            def t3(blk=blk):
                return WA.multiscale_window_attention(q, k, v, [blk], grid, use_triton=GPU)  # noqa: B023

            with torch.no_grad():
                t = timed(t3, 3)
            t_train = timed(lambda: fwd_bwd(t3), 3)  # noqa: B023
            pairs = WA.attended_pairs_analytic(grid, [blk])
            rows.append({"grid": list(grid), "block": list(blk), "tokens": n, "full_ms": 1e3 * full,
                         "t3_ms": 1e3 * t, "speedup": full / t, "full_train_ms": 1e3 * full_train,
                         "t3_train_ms": 1e3 * t_train, "train_speedup": full_train / t_train,
                         "pair_ratio": n * n / pairs, "t3_tflops": 4 * pairs * dh * heads / t / 1e12,
                         "full_tflops": 4 * n * n * dh * heads / full / 1e12})
            print(rows[-1], flush=True)
    return rows


def device_slug() -> str:
    name = torch.cuda.get_device_name() if GPU else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: check that the script runs")
    ap.add_argument("--out", type=Path, help="results file (default benchmarks/results/kernels-<device>.json)")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name() if GPU else platform.processor() or "cpu", "gpu": GPU,
           "quick": args.quick, "torch": torch.__version__,
           "tbik": bench_tbik(args.quick), "token_sparse": bench_token_sparse(args.quick),
           "window_attention": bench_window_attention(args.quick)}
    path = args.out or Path(__file__).parent / "results" / f"kernels-{device_slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
