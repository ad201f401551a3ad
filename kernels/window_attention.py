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
- the Triton kernel `_group_attention_kernel`: one program per (batch*head, group, query tile) loads its group's
  tokens through the index table (the gather), runs an online-softmax (flash) loop over the group's key tiles in
  SRAM and stores the rows back at their positions (the scatter). On CPU it runs only interpreted (TRITON_INTERPRET=1,
  set here when no GPU is present), i.e. in tests.

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
@triton.jit
def _group_attention_kernel(q_ptr, k_ptr, v_ptr, o_ptr, tab_ptr, N, S, D, scale,
                            BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, UPCAST: tl.constexpr):
    """One (batch*head, group, query tile): flash attention over the group's keys, gathered through the table."""
    bh, grp, qt = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64), tl.program_id(2)
    base = bh * N * D
    rm = qt * BM + tl.arange(0, BM)
    rd = tl.arange(0, BD)
    rows = tl.load(tab_ptr + grp * S + rm, mask=rm < S, other=-1).to(tl.int64)  # (BM,) token positions
    row_ok = rows >= 0
    dmask = rd[None, :] < D
    q = tl.load(q_ptr + base + rows[:, None] * D + rd[None, :], mask=row_ok[:, None] & dmask, other=0.0)
    if UPCAST:  # the interpreter's bf16 tl.dot is wrong (Triton 3.9); compiled kernels keep bf16 tensor cores
        q = q.to(tl.float32)
    m_i = tl.full((BM,), float("-inf"), tl.float32)
    l_i = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, BD), tl.float32)
    for start in range(0, S, BN):
        rn = start + tl.arange(0, BN)
        cols = tl.load(tab_ptr + grp * S + rn, mask=rn < S, other=-1).to(tl.int64)  # (BN,)
        col_ok = cols >= 0
        kv_mask = col_ok[:, None] & dmask
        k = tl.load(k_ptr + base + cols[:, None] * D + rd[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + base + cols[:, None] * D + rd[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee").to(tl.float32) * scale  # (BM, BN)
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee").to(tl.float32)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + base + rows[:, None] * D + rd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & dmask)


def _tiles_triton(q, k, v, table: torch.Tensor, out_dtype=None) -> torch.Tensor:
    b, h, n, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    table = table.to(q.device).contiguous()
    out = torch.empty(q.shape, dtype=out_dtype or q.dtype, device=q.device)
    g, s = table.shape
    bm = min(64, max(16, triton.next_power_of_2(s)))
    bd = max(16, triton.next_power_of_2(d))
    _group_attention_kernel[(b * h, g, triton.cdiv(s, bm))](q, k, v, out, table, n, s, d, 1.0 / math.sqrt(d),
                                                            BM=bm, BN=bm, BD=bd, UPCAST=_INTERPRETED)
    return out


def multiscale_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_sizes, grid=None,
                                remote: bool = True, use_triton: bool = True) -> torch.Tensor:
    """(B, H, N, D) each -> (B, H, N, D): the mean over windows (and close / remote kinds) of group attention.

    `window_sizes`: one window or a list; with `grid=(F, H, W)` a window is an (f, h, w) block shape, with
    `grid=None` a length; -1 keeps the axis whole."""
    tiles = _tiles_triton if use_triton else _tiles_torch
    groups = _groups(q.shape[-2], window_sizes, grid, remote)
    if len(groups) == 1:
        return tiles(q, k, v, group_table(*groups[0], q.device))
    # several outputs: keep each in fp32 and round once, after the mean
    out = sum(tiles(q, k, v, group_table(g, blk, kind, q.device), torch.float32) for g, blk, kind in groups)
    return (out / len(groups)).to(q.dtype)


def full_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)
