"""Kernel benchmarks as ratios against the vendor / PyTorch reference, side by side in one run.

    python benchmarks/kernels.py            # GPU: compiled Triton kernels at the papers' sizes
                                            # CPU: the same comparisons at small sizes, PyTorch paths only
    python benchmarks/kernels.py --quick    # a seconds-long check that the script runs (benchmarks/gpu.sh --cpu-check)
    python benchmarks/kernels.py --out PATH # results elsewhere than benchmarks/results/kernels-<device>.json
    python benchmarks/kernels.py --aot      # no GPU needed: compile every kernel for sm_90 (Triton + ptxas) and
                                            # report registers and spills per config

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
if "--aot" in sys.argv:  # compile for a GPU target, not interpret (the kernels modules read this when imported)
    import os

    os.environ["TRITON_INTERPRET"] = "0"

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


def aot(arch: int = 90) -> list[dict]:
    """Compile each kernel ahead of time for sm_<arch> (bf16; every TBIK tile config, the first config of the
    others) and read registers / spill bytes from the cubin: a GPU-free check that the kernels compile and fit."""
    import os
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    rows = []

    def compile_one(name, fn, sig, consts, cfg):
        t0 = time.perf_counter()
        row = {"kernel": name, "config": {**consts, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}}
        try:
            k = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", arch, 32),
                               options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
            with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
                f.write(k.asm["cubin"])
            use = subprocess.run([str(cuobjdump), "-res-usage", f.name], capture_output=True, text=True).stdout
            os.unlink(f.name)
            m = re.search(r"REG:(\d+) STACK:(\d+)", use)
            row.update(ok=True, registers=int(m[1]) if m else None, spill_bytes=int(m[2]) if m else None,
                       wgmma="wgmma" in k.asm["ptx"], shared_bytes=k.metadata.shared)
        except Exception as e:  # noqa: BLE001 - report and go on
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        row["compile_s"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(row, flush=True)

    i32, c = "i32", "constexpr"
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32", "M": i32, "N": i32, "seg_len": i32,
           "n_leaves": i32, "n_segments": i32, "stride_xm": i32, "stride_xk": i32, "stride_wk": i32, "stride_wn": i32,
           "BM": c, "BN": c, "BK_": c, "UPCAST": c, "DEPTH": c, "SDEPTH": c, "GROUP_M": c}
    for cfg in K.MATMUL_CONFIGS:  # K = 8192 at TP 1: 16 leaves a segment, 16 segments (the most slots)
        compile_one("tbik_shard_matmul", K._shard_matmul_kernel.fn, sig,
                    {**cfg.kwargs, "BK_": K.BK, "UPCAST": False, "DEPTH": 5, "SDEPTH": 5, "GROUP_M": 8}, cfg)
    tables = {"tok_ptr": "*i32", "dst_ptr": "*i32", "gid_ptr": "*i32", "lo_ptr": "*i32", "hi_ptr": "*i32",
              "N": i32, "T": i32, "D": i32, "KS": i32, "scale": "fp32", "BM": c, "BN": c, "BD": c, "UPCAST": c,
              "PREC": c}
    cfg = WA.CONFIGS[0]
    consts = {"BM": 64, **cfg.kwargs, "BD": 64, "UPCAST": False, "PREC": WA._PREC}
    for dt in ("bf16", "fp32"):
        qkv = {"q_ptr": f"*{dt}", "k_ptr": f"*{dt}", "v_ptr": f"*{dt}"}
        grads = {"do_ptr": f"*{dt}", "lse_ptr": "*fp32", "delta_ptr": "*fp32"}
        compile_one(f"window_fwd_{dt}", WA._window_fwd_kernel.fn,
                    {**qkv, "o_ptr": "*fp32", "lse_ptr": "*fp32", **tables}, consts, cfg)
        compile_one(f"window_bwd_dq_{dt}", WA._window_bwd_dq_kernel.fn,
                    {**qkv, **grads, "dq_ptr": "*fp32", **tables}, consts, cfg)
        compile_one(f"window_bwd_dkdv_{dt}", WA._window_bwd_dkdv_kernel.fn,
                    {**qkv, **grads, "dk_ptr": "*fp32", "dv_ptr": "*fp32", **tables}, consts, cfg)
    cfg = T.CONFIGS[0]
    for name, fn, src in (("gather", T._gather_kernel.fn, "x_ptr"), ("scatter", T._scatter_kernel.fn, "y_ptr")):
        compile_one(name, fn, {src: "*bf16", "idx_ptr": "*i64", "out_ptr": "*bf16", "L": i32, "n": i32,
                               "n_bucket": i32, "D": i32, "BN": c, "BD": c}, {**cfg.kwargs, "BD": 128}, cfg)
    return rows


def device_slug() -> str:
    name = torch.cuda.get_device_name() if GPU else "cpu"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes: check that the script runs")
    ap.add_argument("--out", type=Path, help="results file (default benchmarks/results/kernels-<device>.json)")
    ap.add_argument("--aot", action="store_true", help="no GPU needed: compile the kernels for sm_90, report")
    args = ap.parse_args()
    if args.aot:
        rows = aot()
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"aot_sm90": rows}, indent=1))
        sys.exit(0 if all(r["ok"] for r in rows) else 1)
    out = {"device": torch.cuda.get_device_name() if GPU else platform.processor() or "cpu", "gpu": GPU,
           "quick": args.quick, "torch": torch.__version__}
    path = args.out or Path(__file__).parent / "results" / f"kernels-{device_slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    for name, bench in (("tbik", bench_tbik), ("token_sparse", bench_token_sparse),
                        ("window_attention", bench_window_attention)):
        out[name] = bench(args.quick)
        path.write_text(json.dumps(out, indent=1))  # after each part: a time limit keeps what finished
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
