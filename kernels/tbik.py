"""TBIK: tree-based invariant matmul and sum kernels, bit-for-bit identical across tensor-parallel (TP) sizes.

Paper: 003_9a806cafa3d919df.txt, abstract 7. Spec: ../shared/papers/tbik.md.

A row-parallel linear `y = x @ w` shards the reduction dimension K over `tp_size` ranks; each rank computes a
partial product and an all-reduce adds the partials. The result then depends on `tp_size`, because fp32 and bf16
additions are not associative. TBIK fixes ONE reduction tree that does not depend on `tp_size`:

- K is cut into S = 16 equal segments (16 = the largest supported TP size); each segment into leaf chunks of
  BK = 32 (the last one zero-padded, so a segment width such as 11008 / 16 = 688 works);
- a leaf is one fixed-shape `tl.dot` accumulated in fp32; the leaves of a segment are added by a fixed pairwise
  tree (`tree_sum`: the largest power-of-two block of leaves as a perfect binary tree, plus the rest recursively),
  and the 16 segment roots by a perfect binary tree;
- a shard of K / p owns 16 / p whole segments, a complete subtree, and returns its root in fp32, uncast; the
  "all-reduce" adds the p roots by the upper levels of the same tree and casts once.

The kernel makes one pass per shard: a program owns a (BM, BN) output tile, walks the shard's K tiles in order and
merges partial sums up the tree in registers, with two binary counters of accumulators (leaves within a segment,
segment roots within the shard); it stores only the shard's root, so a shard writes M x N fp32 once. Only the
tensor-parallel merge runs outside: `tree_merge` (simulated ranks) or `tbik_matmul_distributed` (a real
torch.distributed group: all-gather of the roots, pairwise adds in tree order, one cast). BK is fixed; BM, BN,
num_warps and num_stages are autotuned on GPUs (one config when interpreted).

So `tbik_matmul(x, w, p)` is bitwise the same for p in TP_SIZES = (1, 2, 4, 8, 16), any M and N, and any K that 16
divides. `tbik_sum` reduces the last dimension (an RMSNorm sum of squares, a softmax denominator over a
vocabulary-parallel lm_head) with the same tree. fp32 and bf16 inputs.

Beside them: `naive_tp_matmul` (each shard a Triton matmul accumulating BK tiles in sequence, cast to the input
dtype, partials folded in rank order: what serving engines do), `batch_invariant_tp_matmul` (same shard kernel but
fp32 partials, rank-order fold, one cast: invariant to the batch, not to TP) and `torch_tp_matmul` (torch.matmul per
shard, then a sum). Every Triton function has a PyTorch reference of the same order (`*_ref`), which the CPU
pipeline uses for the model and which the tests compare with.

Caveats: on CPU Triton runs only interpreted (`TRITON_INTERPRET=1`, set here when no GPU is present). The
interpreter's bf16 `tl.dot` is wrong in triton 3.9, so interpreted kernels upcast tiles to fp32 before the dot (a
bf16 x bf16 product is exact in fp32, so only the leaf's internal summation order can differ from a GPU bf16 dot).
A leaf's internal order is the hardware's (or NumPy's) and equal across TP sizes because the leaf shape is fixed;
kernel and reference therefore agree bitwise on the trees but only to rounding inside a leaf.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import autotune_configs  # noqa: E402

SEGMENTS = 16  # canonical tree width = the largest TP size
BK = 32  # leaf width along K
TP_SIZES = (1, 2, 4, 8, 16)
MAX_LEAVES = 63  # leaves per segment the kernels' 6 tree slots hold: K <= 16 * 63 * 32 = 32256
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(k: int, tp_size: int) -> int:
    if tp_size not in TP_SIZES:
        raise ValueError(f"tp_size must be one of {TP_SIZES}, got {tp_size}")
    if k % SEGMENTS:
        raise ValueError(f"the reduction dimension ({k}) must be divisible by {SEGMENTS}, the largest TP size")
    n_leaves = triton.cdiv(k // SEGMENTS, BK)
    if n_leaves > MAX_LEAVES:
        raise ValueError(f"K={k} needs {n_leaves} leaves per segment; the kernels hold at most {MAX_LEAVES}")
    return n_leaves


# ---- the fixed tree, in PyTorch ------------------------------------------------------------------------------
def tree_sum(parts: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """Sum along `dim` in the canonical order: the largest power-of-two prefix as a perfect pairwise tree, plus
    the rest recursively (what the kernels' binary-counter slots compute); fp32 in, fp32 out."""
    dim = dim % parts.dim()
    n = parts.shape[dim]
    if n == 1:
        return parts.select(dim, 0)
    head = 1 << (n.bit_length() - 1)
    if head == n:
        while parts.shape[dim] > 1:  # one level: pair (0, 1), (2, 3), ...
            even, odd = parts.unflatten(dim, (-1, 2)).unbind(dim + 1)
            parts = even + odd
        return parts.select(dim, 0)
    return tree_sum(parts.narrow(dim, 0, head), dim) + tree_sum(parts.narrow(dim, head, n - head), dim)


def _shard_roots_ref(x: torch.Tensor, w: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    k = x.shape[-1]
    n_leaves = _check(k, tp_size)
    seg = k // SEGMENTS
    width = min(BK, seg)  # a lone leaf narrower than BK needs no zero padding (zeros add nothing)
    xs = x.float().reshape(-1, SEGMENTS, seg)  # (M, S, seg)
    ws = w.float().reshape(SEGMENTS, seg, -1)  # (S, seg, N)
    pad = n_leaves * width - seg
    xs = torch.nn.functional.pad(xs, (0, pad)).unflatten(2, (n_leaves, width))  # (M, S, L, BK)
    ws = torch.nn.functional.pad(ws, (0, 0, 0, pad)).unflatten(1, (n_leaves, width))  # (S, L, BK, N)
    per = SEGMENTS // tp_size
    roots = []
    for r in range(tp_size):  # shard r owns segments [r * per, (r + 1) * per): a complete subtree
        xr = xs[:, r * per : (r + 1) * per].permute(1, 2, 0, 3)  # (per, L, M, BK)
        leaves = xr @ ws[r * per : (r + 1) * per]  # (per, L, M, N): one fp32 matmul per leaf
        roots.append(tree_sum(tree_sum(leaves, 1), 0))  # leaves -> segment roots -> shard root (M, N)
    return roots


def tbik_matmul_ref(x: torch.Tensor, w: torch.Tensor, tp_size: int) -> torch.Tensor:
    """PyTorch reference of `tbik_matmul` (same trees); differentiable, used by the CPU pipeline."""
    roots = _shard_roots_ref(x.reshape(-1, x.shape[-1]), w, tp_size)
    return tree_sum(torch.stack(roots)).to(x.dtype).reshape(*x.shape[:-1], w.shape[1])  # all-reduce, one cast


def tbik_sum_ref(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """PyTorch reference of `tbik_sum`: the last dimension reduced by the canonical tree, fp32 result."""
    d = x.shape[-1]
    n_leaves = _check(d, tp_size)
    seg = d // SEGMENTS
    xs = torch.nn.functional.pad(x.float().reshape(*x.shape[:-1], SEGMENTS, seg), (0, n_leaves * BK - seg))
    leaves = xs.unflatten(-1, (n_leaves, BK)).sum(-1)  # (..., S, L): one fixed-width sum per leaf
    per = SEGMENTS // tp_size
    roots = [tree_sum(tree_sum(leaves[..., r * per : (r + 1) * per, :], -1), -1) for r in range(tp_size)]
    return tree_sum(torch.stack(roots))


# ---- baselines, in PyTorch ---------------------------------------------------------------------------------
def _shards(x: torch.Tensor, w: torch.Tensor, tp_size: int):
    k = x.shape[-1]
    if k % tp_size:
        raise ValueError(f"K={k} is not divisible by tp_size={tp_size}")
    step = k // tp_size
    return [(x[..., r * step : (r + 1) * step], w[r * step : (r + 1) * step]) for r in range(tp_size)]


def _rank_fold(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[0]
    for part in parts[1:]:  # ((p0 + p1) + p2) + ...: the all-reduce's rank order, in the partials' dtype
        out = out + part
    return out


def _sequential_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A shard's sequential kernel: fp32 accumulator += one BK-wide tile product at a time."""
    acc = None
    for k0 in range(0, x.shape[-1], BK):
        tile = x[..., k0 : k0 + BK].float() @ w[k0 : k0 + BK].float()
        acc = tile if acc is None else acc + tile
    return acc


def naive_tp_matmul_ref(x: torch.Tensor, w: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Reference of `naive_tp_matmul`: sequential shards cast to the input dtype, folded in rank order."""
    return _rank_fold([_sequential_ref(xr, wr).to(x.dtype) for xr, wr in _shards(x, w, tp_size)])


def batch_invariant_tp_matmul_ref(x: torch.Tensor, w: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Reference of `batch_invariant_tp_matmul`: sequential fp32 shards, fp32 rank-order fold, one cast."""
    return _rank_fold([_sequential_ref(xr, wr) for xr, wr in _shards(x, w, tp_size)]).to(x.dtype)


def torch_tp_matmul(x: torch.Tensor, w: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Framework default: torch.matmul (cuBLAS / oneDNN) per shard, then a sum in rank order."""
    return _rank_fold([xr @ wr for xr, wr in _shards(x, w, tp_size)])


def naive_tp_sum_ref(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """A vocabulary-parallel softmax denominator as frameworks compute it: torch.sum per shard, rank-order fold."""
    step = x.shape[-1] // tp_size
    return _rank_fold([x[..., r * step : (r + 1) * step].float().sum(-1) for r in range(tp_size)])


# ---- Triton kernels ----------------------------------------------------------------------------------------
@triton.jit
def _push(s0, s1, s2, s3, s4, s5, leaf, i, DEPTH: tl.constexpr):
    """Push leaf i into a binary counter of complete subtrees: before the push, slot L is full iff bit L of i is 1.
    The carry climbs while the slots it meets are full, merging with each (older slot + carry: left + right), and
    lands in the first empty one. The branches are on the scalar i, so a push costs the adds it merges (one on
    average) and one move, not a select per slot. Levels >= DEPTH (the bit length of the leaf count) are never
    reached; the levels are written out because nested calls and loops over tuples are slow or unsupported when
    interpreted."""
    if (i & 1) == 0:
        s0 = leaf
    else:
        c = s0 + leaf
        if DEPTH > 1:
            if (i & 2) == 0:
                s1 = c
            else:
                c = s1 + c
                if DEPTH > 2:
                    if (i & 4) == 0:
                        s2 = c
                    else:
                        c = s2 + c
                        if DEPTH > 3:
                            if (i & 8) == 0:
                                s3 = c
                            else:
                                c = s3 + c
                                if DEPTH > 4:
                                    if (i & 16) == 0:
                                        s4 = c
                                    else:
                                        c = s4 + c
                                        if DEPTH > 5:
                                            s5 = c
    return s0, s1, s2, s3, s4, s5


@triton.jit
def _fold(s0, s1, s2, s3, s4, s5, n, DEPTH: tl.constexpr):
    """Root of n pushed leaves: the full slots (bits of n) added smallest (rightmost) first."""
    r = s0
    have = (n & 1) != 0
    if DEPTH > 1:
        r, have = tl.where((n & 2) != 0, tl.where(have, s1 + r, s1), r), have | ((n & 2) != 0)
    if DEPTH > 2:
        r, have = tl.where((n & 4) != 0, tl.where(have, s2 + r, s2), r), have | ((n & 4) != 0)
    if DEPTH > 3:
        r, have = tl.where((n & 8) != 0, tl.where(have, s3 + r, s3), r), have | ((n & 8) != 0)
    if DEPTH > 4:
        r, have = tl.where((n & 16) != 0, tl.where(have, s4 + r, s4), r), have | ((n & 16) != 0)
    if DEPTH > 5:
        r = tl.where((n & 32) != 0, tl.where(have, s5 + r, s5), r)
    return r


# Tile configs of the shard kernel. BK is not among them: it fixes the leaves, hence the reduction order. BM and BN
# only choose which outputs a program owns, num_warps / num_stages how it is scheduled; every config computes the
# same trees (`test_every_tile_config_gives_the_same_bits`, compiled, checks that the leaf dot does not change with
# them either).
# Up to 10 (BM, BN) fp32 slots stay live (K = 8192: 5 leaf + 5 segment levels), so tiles are small for their warps.
# Compiled ahead of time for sm_90 (`benchmarks/kernels.py --aot`: Triton + ptxas, no GPU needed), 64 x 32 on 8
# warps spills nothing, 64 x 64 and 128 x 32 on 8 warps spill a little (kept: fewer loads per FLOP; the autotuner
# decides), 4 warps, 16 warps and 128 x 64 spill more and are left out. BM stays a multiple of 64, so every config
# issues the same Hopper wgmma instructions.
MATMUL_CONFIGS = [triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=st)
                  for bm, bn, w, st in [(64, 32, 8, 3), (64, 32, 8, 4), (64, 32, 8, 2), (64, 64, 8, 3),
                                        (64, 64, 8, 4), (128, 32, 8, 3)]]
# Interpreted: BM = 64, since the interpreter's cost is per program (a 16-row tile made the LM's passes 4x slower);
# the tile only chooses which outputs a program owns, not the trees.
_ONE_CONFIG = (triton.Config({"BM": 64, "BN": 64}, num_warps=4, num_stages=1) if INTERPRET else MATMUL_CONFIGS[0])


# Keyed on what every TP size shares (M, N, the segment width, the dtypes), not on the shard's K: in one process
# all TP sizes run with the config the first call picked.
@triton.autotune(configs=autotune_configs(MATMUL_CONFIGS, _ONE_CONFIG), key=["M", "N", "seg_len"])
@triton.jit
def _shard_matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, seg_len, n_leaves, n_segments,
                         stride_xm, stride_xk, stride_wk, stride_wn,
                         BM: tl.constexpr, BN: tl.constexpr, BK_: tl.constexpr, UPCAST: tl.constexpr,
                         DEPTH: tl.constexpr, SDEPTH: tl.constexpr, GROUP_M: tl.constexpr):
    """One program = one (BM, BN) output tile of one shard, in one pass: it walks the shard's n_segments * n_leaves
    K tiles in order; a leaf (one fixed-shape tl.dot) is pushed into the leaf counter (slots s*), a segment's root,
    folded from it, into the segment counter (slots t*); the program stores only the shard's subtree root.
    Program axis 1 is the shard (several simulated ranks in one launch; a real rank launches one)."""
    pid, shard = tl.program_id(0), tl.program_id(1).to(tl.int64)
    grid_m, grid_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * grid_n)  # grouped order: programs that run together share rows of x (L2 reuse)
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)  # int64 offsets: no int32 overflow checks when interpreted
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK_).to(tl.int64)
    zero = tl.zeros((BM, BN), dtype=tl.float32)
    s0, s1, s2, s3, s4, s5 = zero, zero, zero, zero, zero, zero
    t0, t1, t2, t3, t4, t5 = zero, zero, zero, zero, zero, zero
    m_ok, n_ok = rm[:, None] < M, rn[None, :] < N
    for seg in range(0, n_segments):
        k_seg = (shard * n_segments + seg) * seg_len
        for leaf in range(0, n_leaves):  # stale slots need no reset: a push or fold reads only slots it filled
            kk = leaf * BK_ + rk  # position inside the segment; past seg_len = zero padding
            k_abs = k_seg + kk
            a = tl.load(x_ptr + rm[:, None] * stride_xm + k_abs[None, :] * stride_xk,
                        mask=m_ok & (kk[None, :] < seg_len), other=0.0)  # (BM, BK)
            b = tl.load(w_ptr + k_abs[:, None] * stride_wk + rn[None, :] * stride_wn,
                        mask=(kk[:, None] < seg_len) & n_ok, other=0.0)  # (BK, BN)
            if UPCAST:
                v = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
            else:
                v = tl.dot(a, b, out_dtype=tl.float32)
            # v has several uses below, so the compiler cannot fold an addition into the dot's accumulator
            s0, s1, s2, s3, s4, s5 = _push(s0, s1, s2, s3, s4, s5, v, leaf, DEPTH)
        root = _fold(s0, s1, s2, s3, s4, s5, n_leaves, DEPTH)
        t0, t1, t2, t3, t4, t5 = _push(t0, t1, t2, t3, t4, t5, root, seg, SDEPTH)
    out = _fold(t0, t1, t2, t3, t4, t5, n_segments, SDEPTH)
    tl.store(out_ptr + shard * M * N + rm[:, None] * N + rn[None, :], out, mask=m_ok & n_ok)


@triton.jit
def _shard_sum_kernel(x_ptr, out_ptr, R, seg_len, n_leaves, n_segments, stride_r, BR: tl.constexpr,
                      BK_: tl.constexpr, DEPTH: tl.constexpr, SDEPTH: tl.constexpr):
    """One program = BR rows of one shard, in one pass: leaves of BK_ elements (one tl.sum each) into the leaf
    counter, segment roots into the segment counter; stores the shard's root. Not autotuned: tl.sum's internal order
    follows the tile layout, so BR and num_warps stay fixed."""
    pid, shard = tl.program_id(0), tl.program_id(1).to(tl.int64)
    rr = pid.to(tl.int64) * BR + tl.arange(0, BR)
    rk = tl.arange(0, BK_).to(tl.int64)
    zero = tl.zeros((BR,), dtype=tl.float32)
    s0, s1, s2, s3, s4, s5 = zero, zero, zero, zero, zero, zero
    t0, t1, t2, t3, t4, t5 = zero, zero, zero, zero, zero, zero
    for seg in range(0, n_segments):
        k_seg = (shard * n_segments + seg) * seg_len
        for leaf in range(0, n_leaves):
            kk = leaf * BK_ + rk
            v = tl.load(x_ptr + rr[:, None] * stride_r + (k_seg + kk)[None, :],
                        mask=(rr[:, None] < R) & (kk[None, :] < seg_len), other=0.0)
            s0, s1, s2, s3, s4, s5 = _push(s0, s1, s2, s3, s4, s5, tl.sum(v.to(tl.float32), axis=1), leaf, DEPTH)
        root = _fold(s0, s1, s2, s3, s4, s5, n_leaves, DEPTH)
        t0, t1, t2, t3, t4, t5 = _push(t0, t1, t2, t3, t4, t5, root, seg, SDEPTH)
    tl.store(out_ptr + shard * R + rr, _fold(t0, t1, t2, t3, t4, t5, n_segments, SDEPTH), mask=rr < R)


@triton.jit
def _sequential_matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wk, stride_wn,
                              BM: tl.constexpr, BN: tl.constexpr, BK_: tl.constexpr, UPCAST: tl.constexpr):
    """The usual kernel: an fp32 accumulator adds one BK-wide tile product after the other; stores in out's dtype."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m.to(tl.int64) * BM + tl.arange(0, BM)  # int64 offsets: no int32 overflow checks when interpreted
    rn = pid_n.to(tl.int64) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK_).to(tl.int64)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK_):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :] * stride_wn,
                    mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b, out_dtype=tl.float32)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def _upcast(x: torch.Tensor) -> bool:
    return INTERPRET or x.dtype == torch.float32


def _depth(seg_len: int) -> int:
    return triton.cdiv(seg_len, BK).bit_length()  # leaf-counter slots a segment's leaves need


def shard_roots(x: torch.Tensor, w: torch.Tensor, n_shards: int, n_segments: int) -> torch.Tensor:
    """x (M, K) @ w (K, N), K cut into n_shards shards of n_segments segments each -> (n_shards, M, N) fp32: each
    shard's subtree root, all shards in one launch (a real rank passes its own K-slice and n_shards=1)."""
    m, k = x.shape
    n = w.shape[1]
    seg_len = k // (n_shards * n_segments)
    roots = torch.empty((n_shards, m, n), dtype=torch.float32, device=x.device)

    def grid(meta):
        return triton.cdiv(m, meta["BM"]) * triton.cdiv(n, meta["BN"]), n_shards

    _shard_matmul_kernel[grid](x, w, roots, m, n, seg_len, triton.cdiv(seg_len, BK), n_segments,
                               x.stride(0), x.stride(1), w.stride(0), w.stride(1), BK_=BK, UPCAST=_upcast(x),
                               DEPTH=_depth(seg_len), SDEPTH=n_segments.bit_length(), GROUP_M=8)
    return roots


def tbik_shard_root(x: torch.Tensor, w: torch.Tensor, n_segments: int) -> torch.Tensor:
    """One rank's work: (M, K_r) @ (K_r, N) with K_r = n_segments segments -> its subtree root (M, N), fp32."""
    return shard_roots(x, w, 1, n_segments)[0]


def tree_merge(roots: torch.Tensor | list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The all-reduce's arithmetic: the p shard roots (fp32) added pairwise by the upper levels of the tree, in rank
    order, then one cast. Elementwise fp32 additions: the same bits on every device."""
    roots = torch.stack(list(roots)) if isinstance(roots, list) else roots
    return tree_sum(roots).to(dtype)


def tbik_matmul(x: torch.Tensor, w: torch.Tensor, tp_size: int) -> torch.Tensor:
    """x (M, K) @ w (K, N) over `tp_size` simulated row-parallel ranks (one launch); bitwise the same for every
    TP size."""
    _check(x.shape[1], tp_size)
    return tree_merge(shard_roots(x, w, tp_size, SEGMENTS // tp_size), x.dtype)


def tbik_matmul_distributed(x_local: torch.Tensor, w_local: torch.Tensor, group=None) -> torch.Tensor:
    """Row-parallel linear over a real torch.distributed group: this rank holds x's and w's K-slice (rank r of p:
    columns / rows [r K / p, (r + 1) K / p)); it computes its subtree root in one pass, the roots are all-gathered
    and merged by the tree's upper levels. Equal bitwise, on every rank, to `tbik_matmul(x, w, 1)`."""
    import torch.distributed as dist

    p = dist.get_world_size(group)
    _check(x_local.shape[1] * p, p)
    root = tbik_shard_root(x_local, w_local, SEGMENTS // p)
    if root.is_cuda and dist.get_backend(group) == "gloo":
        root = root.cpu()  # gloo gathers host memory; fp32 additions give the same bits on either side
    roots = [torch.empty_like(root) for _ in range(p)]
    dist.all_gather(roots, root, group=group)
    return tree_merge(roots, x_local.dtype).to(x_local.device)


def tbik_sum(x: torch.Tensor, tp_size: int, br: int = 16) -> torch.Tensor:
    """Sum over the last dimension of x (R, D) with the canonical tree over `tp_size` shards; fp32 (R,)."""
    x = x.contiguous()
    r_, d = x.shape
    _check(d, tp_size)
    per, seg_len = SEGMENTS // tp_size, d // SEGMENTS
    roots = torch.empty((tp_size, r_), dtype=torch.float32, device=x.device)
    _shard_sum_kernel[(triton.cdiv(r_, br), tp_size)](x, roots, r_, seg_len, triton.cdiv(seg_len, BK), per,
                                                      x.stride(0), BR=br, BK_=BK, DEPTH=_depth(seg_len),
                                                      SDEPTH=per.bit_length())
    return tree_sum(roots)


def _sequential_shard(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, bm: int = 16, bn: int = 64):
    m, k = x.shape
    n = w.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    _sequential_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, w, out, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        BM=bm, BN=bn, BK_=BK, UPCAST=_upcast(x))
    return out


def naive_tp_matmul(x: torch.Tensor, w: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Each shard: the sequential Triton kernel, cast to x's dtype; the all-reduce folds partials in rank order."""
    return _rank_fold([_sequential_shard(xr, wr, x.dtype) for xr, wr in _shards(x, w, tp_size)])


def batch_invariant_tp_matmul(x: torch.Tensor, w: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Batch-invariant kernels only: fixed order within a shard, fp32 partials folded in rank order, one cast."""
    return _rank_fold([_sequential_shard(xr, wr, torch.float32) for xr, wr in _shards(x, w, tp_size)]).to(x.dtype)
