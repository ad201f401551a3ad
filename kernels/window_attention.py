"""T3 multi-scale weight-sharing window attention: close blocks + strided remote groups, one set of Q, K, V.

Paper: 003_9a806cafa3d919df.txt, abstract 8 (T3-Video). Spec: ../shared/papers/t3_video.md.

A token grid (frames, height, width) (or one axis when `grid=None`) is cut into blocks of a given shape; a block
extent of -1 (or one not smaller than the axis) keeps that axis whole, which is the "axis-preserving" shape (e.g.
(1, -1, -1): one whole frame; (-1, h, w): the whole temporal axis). Edge blocks may be partial. Two kinds of group:
- close: the tokens of one contiguous block [group_table(..., "close")];
- remote: the tokens at the same offset inside every block, i.e. a strided sub-grid [group_table(..., "remote")].
Every query attends (non-causally) to the keys of its own group only. For each window shape in `window_sizes` the
close output (and, with `remote=True`, the remote output) are computed with the same q, k, v and averaged
[multiscale_window_attention]. With `remote=False` and one window covering every token this is full attention.

Implementations, all equal up to float rounding:
- `window_attention_ref`: a dense (N, N) "same group" mask through SDPA; obviously right, O(N^2) memory;
- the PyTorch fast path (`use_triton=False`): each group's tokens are gathered into a padded contiguous tile
  (G, S, D), SDPA runs on the tiles with a key-padding mask, and the result is scattered back; the CPU pipeline uses
  this path;
- the Triton kernels (`window_attention_triton`, used with `use_triton=True`): one launch for all windows and kinds
  of a layer. Groups are packed into query tiles sized to them (several small groups share a tile, a large one spans
  whole tiles); a program gathers its tile's tokens through the slot table, runs an online-softmax (flash) loop over
  the tile's key slots masked to the same group, and stores its rows at their positions (the scatter) in one fp32
  buffer per kind; the mean over kinds rounds once. A backward pass recomputes the probabilities from the saved
  log-sum-exp (FlashAttention-style: one kernel for dQ, one for dK and dV), so training can run through it.
  BN, num_warps and num_stages are autotuned on GPUs. On CPU it runs only interpreted (TRITON_INTERPRET=1, set here
  when no GPU is present), i.e. in tests.

Cost: a query attends to the keys of its group, so a layer costs sum_groups |g|^2 attended pairs per kind instead of
N^2 [attended_pairs]; FLOPs are 4 * pairs * head_dim per head (QK^T and PV).
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import autotune_configs  # noqa: E402

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# ---- groups ------------------------------------------------------------------------------------------------
def _norm(window_sizes, grid: tuple[int, ...]) -> list[tuple[int, ...]]:
    """One window or a list of them -> list of block shapes, each clipped to the grid (-1 = whole axis)."""
    if isinstance(window_sizes, int) or (len(window_sizes) and isinstance(window_sizes[0], int) and len(grid) > 1
                                         and len(window_sizes) == len(grid)):
        window_sizes = [window_sizes]
    out = []
    for w in window_sizes:
        w = (w,) if isinstance(w, int) else tuple(int(e) for e in w)
        if len(w) != len(grid):
            raise ValueError(f"window {w} has {len(w)} axes; the grid {grid} has {len(grid)}")
        if any(e == 0 or e < -1 for e in w):
            raise ValueError(f"window {w}: extents must be positive or -1 (whole axis)")
        out.append(tuple(n if e == -1 else min(e, n) for e, n in zip(w, grid, strict=True)))
    if not out:
        raise ValueError("window_sizes is empty")
    return out


@lru_cache(maxsize=256)
def _group_table_cpu(grid: tuple[int, ...], block: tuple[int, ...], kind: str) -> torch.Tensor:
    n = math.prod(grid)
    coords = torch.stack(torch.meshgrid(*(torch.arange(s) for s in grid), indexing="ij"), -1).view(n, len(grid))
    b = torch.tensor(block)
    n_blocks = torch.tensor([-(-s // e) for s, e in zip(grid, block, strict=True)])
    if kind == "close":  # same block
        key, shape = coords // b, n_blocks
    elif kind == "remote":  # same offset inside the block
        key, shape = coords % b, b
    else:
        raise ValueError(f"kind must be close or remote, got {kind!r}")
    lin = torch.zeros(n, dtype=torch.long)
    for axis in range(len(grid)):
        lin = lin * int(shape[axis]) + key[:, axis]
    order = torch.argsort(lin, stable=True)  # tokens grouped, ascending position inside a group
    _, counts = torch.unique_consecutive(lin[order], return_counts=True)
    size = int(counts.max())
    col = torch.arange(n) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    table = torch.full((len(counts), size), -1, dtype=torch.int32)
    table[torch.repeat_interleave(torch.arange(len(counts)), counts), col] = order.to(torch.int32)
    return table


def group_table(grid: tuple[int, ...], block: tuple[int, ...], kind: str, device=None) -> torch.Tensor:
    """(G, S) int32 token indices of each group, padded with -1 (S = the largest group)."""
    return _group_table_cpu(tuple(grid), tuple(block), kind).to(device or "cpu")


def _groups(n: int, window_sizes, grid, remote: bool) -> list[tuple[tuple[int, ...], tuple[int, ...], str]]:
    grid = (n,) if grid is None else tuple(int(s) for s in grid)
    if math.prod(grid) != n:
        raise ValueError(f"grid {grid} holds {math.prod(grid)} tokens, the tensors hold {n}")
    return [(grid, blk, kind) for blk in _norm(window_sizes, grid) for kind in (("close", "remote") if remote
                                                                                 else ("close",))]


def attended_pairs(grid: tuple[int, ...], window_sizes, remote: bool = True) -> float:
    """Query-key pairs one head scores per layer: sum over kinds and windows of sum_groups |g|^2."""
    total = 0.0
    for g, blk, kind in _groups(math.prod(grid), window_sizes, grid, remote):
        sizes = (group_table(g, blk, kind) >= 0).sum(1).double()
        total += float((sizes**2).sum())
    return total


def attended_pairs_analytic(grid: tuple[int, ...], window_sizes, remote: bool = True) -> float:
    """The same count in closed form (per axis, blocks of extent e over n: full blocks and one partial), for grids
    too large to enumerate (a 4K latent has ~5e5 tokens)."""
    total = 0.0
    for blk in _norm(window_sizes, tuple(grid)):
        close = remote_ = 1.0
        for n, e in zip(grid, blk, strict=True):
            full, rest = divmod(n, e)
            close *= full * e**2 + rest**2  # sum over blocks along this axis of extent^2
            # offsets o < rest occur in full + 1 blocks, the others in `full`
            remote_ *= rest * (full + 1) ** 2 + (e - rest) * full**2
        total += close + (remote_ if remote else 0.0)
    return total


# ---- references --------------------------------------------------------------------------------------------
def window_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_sizes, grid=None,
                         remote: bool = True) -> torch.Tensor:
    """(B, H, N, D) -> (B, H, N, D) through dense masks, one per (window, kind), averaged."""
    n = q.shape[-2]
    outs = []
    for g, blk, kind in _groups(n, window_sizes, grid, remote):
        table = group_table(g, blk, kind).long()
        gid = torch.empty(n, dtype=torch.long)
        rows = torch.arange(len(table))[:, None].expand_as(table)
        gid[table[table >= 0]] = rows[table >= 0]
        mask = (gid[:, None] == gid[None, :]).to(q.device)  # (N, N) same group
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    return torch.stack(outs).mean(0)


def _tiles_torch(q, k, v, table: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """Gather groups into padded tiles (B, H G, S, D), SDPA with key padding (only where a group is partial),
    scatter back. Tiles stay 4-D so SDPA can take its fused CPU / GPU kernels."""
    b, h, n, d = q.shape
    g, s = table.shape
    valid = table >= 0  # (G, S)
    idx = table.clamp_min(0).long().flatten()
    tile = lambda x: x[:, :, idx].view(b, h * g, s, d)  # noqa: E731  (B, H G, S, D)
    mask = None if bool(valid.all()) else valid.repeat(h, 1)[None, :, None, :]  # (1, H G, 1, S)
    y = F.scaled_dot_product_attention(tile(q), tile(k), tile(v), attn_mask=mask).view(b, h, g * s, d)
    if mask is None:
        return y[:, :, torch.argsort(idx)].to(out_dtype or q.dtype)  # every token once: invert the gather
    out = q.new_empty(b, h, n, d, dtype=out_dtype or q.dtype)
    keep = valid.flatten()
    out[:, :, idx[keep]] = y[:, :, keep].to(out.dtype)
    return out


# ---- Triton ------------------------------------------------------------------------------------------------
# One launch covers every (window, kind) of a layer. The groups of all kinds are packed into one slot list
# (`_layout`): a group no larger than a query tile never straddles a tile boundary, so one BM-row tile holds several
# small groups (a 16-token remote group does not cost a 64 x 64 tile of its own), and a larger group starts on a tile
# boundary and spans whole tiles. A tile's keys are the slot range of the groups it holds; a "same group" mask keeps
# the block diagonal. Each slot's row is stored at (kind, token) of an fp32 (kinds, B H, N, D) buffer; the mean over
# kinds, in PyTorch, rounds once. The backward recomputes the probabilities from the saved log-sum-exp, like
# FlashAttention's: one kernel for dQ (per query tile), one for dK and dV (per key tile; a tile's queries are the
# same slot range, attention inside a group being symmetric).
@lru_cache(maxsize=64)
def _layout_cpu(groups: tuple, n: int, bm: int) -> tuple[torch.Tensor, ...]:
    """Packed slots of all groups: tok (T,) token index or -1, dst (T,) kind * n + token or -1, gid (T,) group id or
    -1, and per query tile (T / bm,) the slot range [lo, hi) of its keys; int32."""
    sizes, members = [], []
    for g, blk, kind in groups:
        table = group_table(g, blk, kind)
        sizes.append((table >= 0).sum(1))
        members.append(table[table >= 0])
    starts, pos = [], 0
    for size in torch.cat(sizes).tolist():  # place the groups one after the other
        room = bm - pos % bm
        if size > room and pos % bm:
            pos += room  # it would straddle a tile boundary: start it on the next tile
        starts.append(pos)
        pos += size
    total = -(-pos // bm) * bm
    size_all = torch.cat(sizes)
    start_all = torch.tensor(starts, dtype=torch.long)
    n_groups = len(starts)
    gid_of = torch.repeat_interleave(torch.arange(n_groups), size_all)
    slot = start_all[gid_of] + torch.arange(len(gid_of)) - torch.repeat_interleave(torch.cumsum(size_all, 0)
                                                                                    - size_all, size_all)
    kind_of = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([len(s) for s in sizes]))
    kind_slot = torch.repeat_interleave(kind_of, size_all)
    tok = torch.full((total,), -1, dtype=torch.long)
    tok[slot] = torch.cat(members).long()
    dst = torch.full((total,), -1, dtype=torch.long)
    dst[slot] = kind_slot * n + tok[slot]
    gid = torch.full((total,), -1, dtype=torch.long)
    gid[slot] = gid_of
    lo = torch.full((total,), total, dtype=torch.long)
    hi = torch.zeros(total, dtype=torch.long)
    lo[slot], hi[slot] = start_all[gid_of], (start_all + size_all)[gid_of]
    lo, hi = lo.view(-1, bm).min(1).values, hi.view(-1, bm).max(1).values
    return tuple(t.to(torch.int32) for t in (tok, dst, gid, lo, hi))


def _tile_rows(groups) -> int:
    """Query tile rows sized to the groups: the largest group up to 64 (a power of two, at least 16)."""
    largest = max(int((group_table(*grp) >= 0).sum(1).max()) for grp in groups)
    return min(64, max(16, triton.next_power_of_2(largest)))


# BN (key tile), num_warps, num_stages; BM comes from the layout. Interpreted: one config, nothing to time.
CONFIGS = [triton.Config({"BN": bn}, num_warps=w, num_stages=st)
           for bn, w, st in [(32, 4, 2), (16, 4, 2), (64, 4, 2), (32, 4, 3), (64, 8, 3), (32, 8, 2)]]
_ONE = triton.Config({"BN": 16}, num_warps=4, num_stages=1) if _INTERPRETED else CONFIGS[0]
# fp32 dots (bf16 ones ignore it): compiled, 3 x TF32 on tensor cores, about fp32 accuracy and quick to
# build (IEEE fp32 dots unroll into FMAs: 10-30 s of compile per kernel, and they spill); interpreted, IEEE
_PREC = "ieee" if _INTERPRETED else "tf32x3"


@triton.jit
def _load_rows(ptr, base, rows, ok, rd, D, UPCAST: tl.constexpr):
    x = tl.load(ptr + base + rows[:, None] * D + rd[None, :], mask=ok[:, None] & (rd[None, :] < D), other=0.0)
    if UPCAST:  # the interpreter's bf16 tl.dot is wrong (Triton 3.9); compiled kernels keep bf16 tensor cores
        x = x.to(tl.float32)
    return x


@triton.autotune(configs=autotune_configs(CONFIGS, _ONE), key=["T", "D", "BM"])
@triton.jit
def _window_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, tok_ptr, dst_ptr, gid_ptr, lo_ptr, hi_ptr,
                       N, T, D, KS, scale, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                       UPCAST: tl.constexpr, PREC: tl.constexpr):
    """One (batch*head, query tile): online softmax over the tile's key slots, masked to the same group."""
    bh, qt = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = bh * N * D
    rm = qt * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rows = tl.load(tok_ptr + rm).to(tl.int64)
    row_ok = rows >= 0
    gq = tl.load(gid_ptr + rm)
    q = _load_rows(q_ptr, base, rows, row_ok, rd, D, UPCAST)
    lo, hi = tl.load(lo_ptr + qt), tl.load(hi_ptr + qt)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    for start in range(lo, hi, BN):
        rn = start + tl.arange(0, BN)
        inside = rn < hi
        cols = tl.load(tok_ptr + rn, mask=inside, other=-1).to(tl.int64)
        gk = tl.load(gid_ptr + rn, mask=inside, other=-1)
        col_ok = cols >= 0
        k = _load_rows(k_ptr, base, cols, col_ok, rd, D, UPCAST)
        v = _load_rows(v_ptr, base, cols, col_ok, rd, D, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale  # (BM, BN)
        s = tl.where(col_ok[None, :] & (gq[:, None] == gk[None, :]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep exp() finite
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC).to(tl.float32)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    dst = tl.load(dst_ptr + rm).to(tl.int64)
    tl.store(o_ptr + (bh * N * D + (dst // N) * KS + (dst % N) * D)[:, None] + rd[None, :],
             acc / l_safe[:, None], mask=row_ok[:, None] & (rd[None, :] < D))
    tl.store(lse_ptr + bh * T + rm, m_i + tl.log(l_safe), mask=row_ok)


@triton.autotune(configs=autotune_configs(CONFIGS, _ONE), key=["T", "D", "BM"])
@triton.jit
def _window_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, tok_ptr, dst_ptr, gid_ptr, lo_ptr,
                          hi_ptr, N, T, D, KS, scale, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                          UPCAST: tl.constexpr, PREC: tl.constexpr):
    """dQ of one (batch*head, query tile): dS = P * (dP - delta), dQ = scale * dS K over the tile's key slots."""
    bh, qt = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = bh * N * D
    rm = qt * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rows = tl.load(tok_ptr + rm).to(tl.int64)
    row_ok = rows >= 0
    gq = tl.load(gid_ptr + rm)
    q = _load_rows(q_ptr, base, rows, row_ok, rd, D, UPCAST)
    do = _load_rows(do_ptr, base, rows, row_ok, rd, D, UPCAST)  # the kind's share of dO (dO / kinds)
    lse = tl.load(lse_ptr + bh * T + rm, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + bh * T + rm, mask=row_ok, other=0.0)
    lo, hi = tl.load(lo_ptr + qt), tl.load(hi_ptr + qt)
    dq = tl.zeros((BM, BD), tl.float32)
    for start in range(lo, hi, BN):
        rn = start + tl.arange(0, BN)
        inside = rn < hi
        cols = tl.load(tok_ptr + rn, mask=inside, other=-1).to(tl.int64)
        gk = tl.load(gid_ptr + rn, mask=inside, other=-1)
        col_ok = cols >= 0
        k = _load_rows(k_ptr, base, cols, col_ok, rd, D, UPCAST)
        v = _load_rows(v_ptr, base, cols, col_ok, rd, D, UPCAST)
        s = tl.dot(q, tl.trans(k), input_precision=PREC).to(tl.float32) * scale
        keep = row_ok[:, None] & col_ok[None, :] & (gq[:, None] == gk[None, :])
        p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC).to(tl.float32)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC).to(tl.float32)
    dst = tl.load(dst_ptr + rm).to(tl.int64)
    tl.store(dq_ptr + (bh * N * D + (dst // N) * KS + (dst % N) * D)[:, None] + rd[None, :], dq * scale,
             mask=row_ok[:, None] & (rd[None, :] < D))


@triton.autotune(configs=autotune_configs(CONFIGS, _ONE), key=["T", "D", "BM"])
@triton.jit
def _window_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, tok_ptr, dst_ptr,
                            gid_ptr, lo_ptr, hi_ptr, N, T, D, KS, scale, BM: tl.constexpr, BN: tl.constexpr,
                            BD: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """dK, dV of one (batch*head, key tile of BM slots): dV = P^T dO, dK = scale * dS^T Q over the query slots that
    see these keys, which are the tile's own slot range [lo, hi)."""
    bh, kt = tl.program_id(0).to(tl.int64), tl.program_id(1)
    base = bh * N * D
    rn = kt * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    cols = tl.load(tok_ptr + rn).to(tl.int64)
    col_ok = cols >= 0
    gk = tl.load(gid_ptr + rn)
    k = _load_rows(k_ptr, base, cols, col_ok, rd, D, UPCAST)
    v = _load_rows(v_ptr, base, cols, col_ok, rd, D, UPCAST)
    lo, hi = tl.load(lo_ptr + kt), tl.load(hi_ptr + kt)
    dk = tl.zeros((BM, BD), tl.float32)
    dv = tl.zeros((BM, BD), tl.float32)
    for start in range(lo, hi, BN):
        rm = start + tl.arange(0, BN)
        inside = rm < hi
        rows = tl.load(tok_ptr + rm, mask=inside, other=-1).to(tl.int64)
        gq = tl.load(gid_ptr + rm, mask=inside, other=-1)
        row_ok = rows >= 0
        q = _load_rows(q_ptr, base, rows, row_ok, rd, D, UPCAST)
        do = _load_rows(do_ptr, base, rows, row_ok, rd, D, UPCAST)
        lse = tl.load(lse_ptr + bh * T + rm, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + bh * T + rm, mask=row_ok, other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=PREC).to(tl.float32) * scale  # (BM keys, BN queries)
        keep = col_ok[:, None] & row_ok[None, :] & (gk[:, None] == gq[None, :])
        pt = tl.where(keep, tl.exp(st - lse[None, :]), 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=PREC).to(tl.float32)
        dpt = tl.dot(v, tl.trans(do), input_precision=PREC).to(tl.float32)
        dst_ = pt * (dpt - delta[None, :])
        dk += tl.dot(dst_.to(q.dtype), q, input_precision=PREC).to(tl.float32)
    dst = tl.load(dst_ptr + rn).to(tl.int64)
    off = (bh * N * D + (dst // N) * KS + (dst % N) * D)[:, None] + rd[None, :]
    mask = col_ok[:, None] & (rd[None, :] < D)
    tl.store(dk_ptr + off, dk * scale, mask=mask)
    tl.store(dv_ptr + off, dv, mask=mask)


@lru_cache(maxsize=64)
def _layout_on(groups: tuple, n: int, device: str):
    """(BM, slot tables on `device`), cached: a training step calls a layer's layout twice per block and step."""
    bm = _tile_rows(groups)
    return bm, [t.to(device) for t in _layout_cpu(groups, n, bm)]


def _layout(groups, n: int, device):
    return _layout_on(tuple(groups), n, str(torch.device(device)))


def _per_kind(x: torch.Tensor, nk: int) -> torch.Tensor:
    return torch.empty((nk, *x.shape), dtype=torch.float32, device=x.device)


class _WindowAttention(torch.autograd.Function):
    """All groups of a layer in one forward launch; the backward recomputes P from the saved log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, groups):
        b, h, n, d = q.shape
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        bm, (tok, dst, gid, lo, hi) = _layout(groups, n, q.device)
        nk, t = len(groups), tok.numel()
        o = _per_kind(q, nk)  # (kinds, B, H, N, D) fp32: each kind's output, every token once per kind
        lse = torch.empty((b * h, t), dtype=torch.float32, device=q.device)
        bd = max(16, triton.next_power_of_2(d))
        _window_fwd_kernel[(b * h, t // bm)](q, k, v, o, lse, tok, dst, gid, lo, hi, n, t, d, o[0].numel(),
                                             1.0 / math.sqrt(d), BM=bm, BD=bd, UPCAST=_INTERPRETED, PREC=_PREC)
        ctx.save_for_backward(q, k, v, o, lse, tok, dst, gid, lo, hi)
        ctx.bm, ctx.bd = bm, bd
        return (o.sum(0) / nk if nk > 1 else o[0]).to(q.dtype)  # the mean over kinds, one rounding

    @staticmethod
    def backward(ctx, grad):
        q, k, v, o, lse, tok, dst, gid, lo, hi = ctx.saved_tensors
        b, h, n, d = q.shape
        nk, t, bm = o.shape[0], tok.numel(), ctx.bm
        do = (grad.float() / nk).contiguous()  # every kind's output enters the mean with weight 1 / kinds
        # delta = rowsum(dO * O) per slot: slot j holds token tok[j] of kind dst[j] // n
        ok = tok >= 0
        delta = torch.zeros((b * h, t), dtype=torch.float32, device=q.device)
        o_slots = o.view(nk, b * h, n, d)[(dst[ok] // n).long(), :, tok[ok].long()]  # (slots, B H, D)
        delta[:, ok] = (o_slots * do.view(b * h, n, d)[:, tok[ok].long()].transpose(0, 1)).sum(-1).T
        do_in = do.to(q.dtype) if not _INTERPRETED else do
        dq, dk, dv = _per_kind(q, nk), _per_kind(q, nk), _per_kind(q, nk)
        scale = 1.0 / math.sqrt(d)
        meta = {"BM": bm, "BD": ctx.bd, "UPCAST": _INTERPRETED, "PREC": _PREC}
        _window_bwd_dq_kernel[(b * h, t // bm)](q, k, v, do_in, lse, delta, dq, tok, dst, gid, lo, hi, n, t, d,
                                                o[0].numel(), scale, **meta)
        _window_bwd_dkdv_kernel[(b * h, t // bm)](q, k, v, do_in, lse, delta, dk, dv, tok, dst, gid, lo, hi, n, t,
                                                  d, o[0].numel(), scale, **meta)
        return dq.sum(0).to(q.dtype), dk.sum(0).to(k.dtype), dv.sum(0).to(v.dtype), None


def window_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups) -> torch.Tensor:
    """The mean over `groups` ((grid, block, kind) triples) of group attention, one Triton launch; differentiable."""
    return _WindowAttention.apply(q, k, v, tuple(groups))


def multiscale_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_sizes, grid=None,
                                remote: bool = True, use_triton: bool = True) -> torch.Tensor:
    """(B, H, N, D) each -> (B, H, N, D): the mean over windows (and close / remote kinds) of group attention.

    `window_sizes`: one window or a list; with `grid=(F, H, W)` a window is an (f, h, w) block shape, with
    `grid=None` a length; -1 keeps the axis whole."""
    groups = _groups(q.shape[-2], window_sizes, grid, remote)
    if use_triton:
        return window_attention_triton(q, k, v, groups)
    tiles = _tiles_torch
    if len(groups) == 1:
        return tiles(q, k, v, group_table(*groups[0], q.device))
    # several outputs: keep each in fp32 and round once, after the mean
    out = sum(tiles(q, k, v, group_table(g, blk, kind, q.device), torch.float32) for g, blk, kind in groups)
    return (out / len(groups)).to(q.dtype)


def full_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)
