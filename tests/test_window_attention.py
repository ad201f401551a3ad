"""T3 window attention: Triton kernel and PyTorch tile path vs the dense-mask reference, group structure, costs.

Triton kernels run interpreted on CPU (TRITON_INTERPRET=1) and compiled when a GPU is present (same tests)."""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kernels import window_attention as W  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")


def _qkv(b, h, n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE) for _ in range(3)]


# (batch, heads, tokens, head dim, windows, grid, remote): length 1; lengths not a multiple of the window or of the
# kernel's 16-row tiles; groups larger than one tile (S = 70 > 64); several windows at once; 3D grids with partial
# edge blocks and whole-axis (-1) extents
CASES = [
    (1, 1, 1, 8, [4], None, True),
    (2, 2, 37, 16, [8], None, True),
    (1, 1, 70, 12, [70, 9], None, True),
    (2, 2, 36, 16, [(1, -1, -1)], (3, 3, 4), True),
    (1, 2, 60, 8, [(2, 2, 3), (-1, 1, 5)], (3, 4, 5), True),
    (1, 1, 64, 32, [(-1, 2, 8)], (4, 4, 4), False),
]


@pytest.mark.parametrize("b,h,n,d,windows,grid,remote", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_and_tile_path_match_the_dense_reference(b, h, n, d, windows, grid, remote, dtype):
    q, k, v = _qkv(b, h, n, d, dtype)
    ref32 = W.window_attention_ref(q.float(), k.float(), v.float(), windows, grid, remote)
    # tolerance: twice the error of the same-precision reference against fp32 (fp32: a few ulps)
    ref_same = W.window_attention_ref(q, k, v, windows, grid, remote).float()
    tol = max(2 * float((ref_same - ref32).abs().max()), 1e-5)
    for use_triton in (True, False):
        out = W.multiscale_window_attention(q, k, v, windows, grid, remote, use_triton=use_triton)
        assert out.dtype == dtype and out.shape == q.shape
        err = float((out.float() - ref32).abs().max())
        assert err <= tol, f"use_triton={use_triton}: max abs error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("n,grid,window", [(1, None, [1]), (37, None, [37]), (37, None, [-1]),
                                           (48, (3, 4, 4), [(-1, -1, -1)]), (48, (3, 4, 4), [(5, 9, 9)])])
@pytest.mark.parametrize("use_triton", [True, False])
def test_one_window_covering_everything_without_remote_is_full_attention(n, grid, window, use_triton):
    q, k, v = _qkv(2, 2, n, 16)
    out = W.multiscale_window_attention(q, k, v, window, grid, remote=False, use_triton=use_triton)
    # compiled, the kernels' fp32 dots are 3 x TF32 (about fp32 accuracy, not IEEE order)
    atol = 1e-5 if use_triton and DEVICE == "cuda" else 2e-6
    assert torch.allclose(out, W.full_attention_ref(q, k, v), atol=atol)


# backward cases: groups over two tiles (S = 70), several windows and both kinds in one launch, a 3D grid with
# partial edge blocks, a single token
GRAD_CASES = [
    (1, 1, 70, 12, [70, 9], None, True, torch.float32),
    (1, 2, 60, 8, [(2, 2, 3), (-1, 1, 5)], (3, 4, 5), True, torch.float32),
    (2, 1, 37, 16, [8], None, True, torch.bfloat16),
    (1, 1, 1, 8, [4], None, True, torch.float32),
]


@pytest.mark.parametrize("b,h,n,d,windows,grid,remote,dtype", GRAD_CASES)
def test_backward_matches_autograd_of_the_reference(b, h, n, d, windows, grid, remote, dtype):
    q, k, v = (t.requires_grad_() for t in _qkv(b, h, n, d, dtype))
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(b, h, n, d, generator=g).to(dtype).to(DEVICE)
    out = W.multiscale_window_attention(q, k, v, windows, grid, remote, use_triton=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref32 = torch.autograd.grad(W.window_attention_ref(*(t.float() for t in (q, k, v)), windows, grid, remote),
                                (q, k, v), dout.float())
    ref_same = torch.autograd.grad(W.window_attention_ref(q, k, v, windows, grid, remote), (q, k, v), dout)
    for name, got, want, same in zip("qkv", grads, ref32, ref_same, strict=True):
        assert got.dtype == dtype and got.shape == q.shape
        # fp32: a few ulps of the gradient's scale; bf16: twice the same-precision reference's own error
        tol = max(2 * float((same.float() - want.float()).abs().max()), 1e-5 * float(want.abs().max()) + 1e-6)
        err = float((got.float() - want.float()).abs().max())
        assert err <= tol, f"d{name}: max abs error {err:.3g} > {tol:.3g}"


def test_layout_packs_small_groups_into_shared_tiles_and_never_splits_one():
    grid, blocks = (4, 6, 6), [(1, -1, -1)]  # close groups: frames of 36 tokens; remote groups: 4 tokens
    groups = W._groups(144, blocks, grid, True)
    bm = W._tile_rows(groups)
    assert bm == 64  # sized to the largest group (36 -> 64)
    tok, dst, gid, lo, hi = (t.long() for t in W._layout_cpu(tuple(groups), 144, bm))
    valid = tok >= 0
    assert sorted(dst[valid].tolist()) == list(range(2 * 144))  # every token once per kind
    assert (dst[valid] % 144 == tok[valid]).all()
    for gi in gid[valid].unique().tolist():  # a group no larger than a tile lies inside one tile
        slots = (gid == gi).nonzero().flatten()
        assert (slots.diff() == 1).all()
        assert slots[0] // bm == slots[-1] // bm
    # 4 close groups of 36 take a tile each (two would not fit in 64); the 36 remote groups of 4 fill the rest of the
    # last one and two more: 6 tiles instead of the 40 of one tile per group
    assert len(tok) == 6 * bm
    for t in range(6):  # a tile's key range spans exactly the groups of its query rows
        ids = gid[t * bm : (t + 1) * bm]
        slots = torch.isin(gid, ids[ids >= 0]).nonzero().flatten()
        assert (int(lo[t]), int(hi[t])) == (int(slots.min()), int(slots.max()) + 1)


@gpu
@pytest.mark.gpu
def test_compiled_bf16_forward_and_backward_at_a_video_size():
    """Compiled, bf16 tensor cores: 16 x 16 x 16 tokens, whole-frame blocks (close 256, remote 16), vs fp32."""
    grid, windows = (16, 16, 16), [(1, -1, -1)]
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 4096, 64, torch.bfloat16))
    dout = torch.randn_like(q)
    out = W.multiscale_window_attention(q, k, v, windows, grid, use_triton=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = W.window_attention_ref(*(t.float() for t in (q, k, v)), windows, grid)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.float())
    assert float((out.float() - ref).abs().max()) < 2e-2
    for got, want in zip(grads, ref_grads, strict=True):
        assert float((got.float() - want).abs().max()) <= 2e-2 * float(want.abs().max()) + 1e-3


def test_groups_partition_the_tokens_into_blocks_and_strided_offsets():
    grid, block = (3, 4, 5), (2, 2, 3)  # partial edge blocks on every axis
    coords = torch.stack(torch.meshgrid(*(torch.arange(s) for s in grid), indexing="ij"), -1).view(-1, 3)
    for kind in ("close", "remote"):
        table = W.group_table(grid, block, kind)
        members = table[table >= 0]
        assert sorted(members.tolist()) == list(range(60))  # every token in exactly one group
        for row in table:
            c = coords[row[row >= 0].long()]
            key = c // torch.tensor(block) if kind == "close" else c % torch.tensor(block)
            assert (key == key[0]).all()  # one block / one offset per group
    assert W.group_table(grid, block, "close").shape[0] == 2 * 2 * 2  # ceil(3/2) ceil(4/2) ceil(5/3) blocks
    assert W.group_table(grid, block, "remote").shape[0] == 2 * 2 * 3  # offsets inside a block


def test_remote_attention_mixes_only_tokens_at_the_same_offset():
    q, k, v = _qkv(1, 1, 24, 8)
    out = W.multiscale_window_attention(q, k, v, [6], None, remote=True, use_triton=False)
    close = W.multiscale_window_attention(q, k, v, [6], None, remote=False, use_triton=False)
    far = 2 * out - close  # the remote half: tokens 3, 9, 15, 21 form one group
    sel = torch.tensor([3, 9, 15, 21], device=DEVICE)
    sub = W.full_attention_ref(q[:, :, sel], k[:, :, sel], v[:, :, sel])
    assert torch.allclose(far[:, :, sel], sub, atol=1e-5)


@pytest.mark.parametrize("grid,windows", [((16,), [5]), ((3, 4, 5), [(2, 2, 3)]), ((4, 8, 8), [(1, -1, -1)]),
                                          ((4, 8, 8), [(-1, 3, 3), (2, -1, 5)])])
def test_pair_count_enumerated_equals_closed_form_and_blocks_cut_cost(grid, windows):
    for remote in (True, False):
        assert W.attended_pairs(grid, windows, remote) == W.attended_pairs_analytic(grid, windows, remote)
    n = math.prod(grid)
    assert W.attended_pairs(grid, windows, remote=False) < len(windows) * n * n
    # one frame of a 16-frame grid: close costs N^2 / 16, remote N * 16
    assert W.attended_pairs_analytic((16, 136, 240), [(1, -1, -1)]) == 522240 * (32640 + 16)


def test_bad_windows_are_rejected():
    q, k, v = _qkv(1, 1, 12, 8)
    with pytest.raises(ValueError, match="grid"):
        W.multiscale_window_attention(q, k, v, [(1, 2, 2)], grid=(2, 2, 2))
    with pytest.raises(ValueError, match="axes"):
        W.multiscale_window_attention(q, k, v, [(1, 2)], grid=(3, 2, 2))
    with pytest.raises(ValueError, match="positive"):
        W.multiscale_window_attention(q, k, v, [0], grid=None)
