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
    assert torch.allclose(out, W.full_attention_ref(q, k, v), atol=2e-6)


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
