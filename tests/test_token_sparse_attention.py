"""Token Sparse Attention: Triton gather / scatter vs PyTorch, selection rules, equivalence with dense attention.

Triton kernels run interpreted on CPU (TRITON_INTERPRET=1) and compiled when a GPU is present (same tests)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton  # noqa: E402

from kernels import token_sparse as T  # noqa: E402
from models import token_sparse_attention as M  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")


def _qkv(b, h, length, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, length, d, generator=g).to(dtype).to(DEVICE) for _ in range(3)]


@pytest.mark.parametrize("b,h,length,d,n", [(1, 1, 1, 8, 1), (2, 3, 70, 16, 23), (1, 2, 130, 12, 130)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_match_torch_bitwise(b, h, length, d, n, dtype):
    x, y, _ = _qkv(b, h, length, d, dtype)
    g = torch.Generator().manual_seed(n)
    idx = torch.stack([torch.randperm(length, generator=g)[:n].sort().values for _ in range(b * h)]).view(b, h, n)
    idx = idx.to(DEVICE)
    assert torch.equal(T.gather_tokens(x, idx), T.gather_tokens_ref(x, idx))
    yc = y[:, :, :n]
    out = T.scatter_tokens(yc, idx, length)
    assert torch.equal(out, T.scatter_tokens_ref(yc, idx, length))
    unselected = torch.ones(b, h, length, dtype=torch.bool, device=DEVICE).scatter(2, idx, False)
    assert (out[unselected] == 0).all()  # skipped positions get zero for that head


@gpu
@pytest.mark.gpu
def test_compiled_gather_scatter_every_config_bitwise_bf16():
    """Compiled, bf16, a long-context head layout: each autotune config of both kernels moves exactly the bits."""
    x, y, _ = _qkv(1, 8, 8192, 128, torch.bfloat16)
    idx = torch.stack([torch.randperm(8192, device=DEVICE)[:2500].sort().values for _ in range(8)]).view(1, 8, 2500)
    want_g, want_s = T.gather_tokens_ref(x, idx), T.scatter_tokens_ref(y[:, :, :2500], idx, 8192)
    assert torch.equal(T.gather_tokens(x, idx), want_g)
    assert torch.equal(T.scatter_tokens(y[:, :, :2500].contiguous(), idx, 8192), want_s)
    yc = y[:, :, :2500].contiguous()
    for cfg in T.CONFIGS:
        kw = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages, "BD": 128}
        grid = (8, triton.cdiv(2500, cfg.kwargs["BN"]))
        out = torch.empty_like(want_g)
        T._gather_kernel.fn[grid](x, idx, out, 8192, 2500, 4096, 128, **kw)
        assert torch.equal(out, want_g)
        out = torch.zeros_like(want_s)
        T._scatter_kernel.fn[grid](yc, idx, out, 8192, 2500, 4096, 128, **kw)
        assert torch.equal(out, want_s)


@pytest.mark.parametrize("causal", [True, False])
def test_keep_ratio_one_equals_dense(causal):
    q, k, v = _qkv(2, 2, 37, 8)
    assert torch.equal(T.token_sparse_attention(q, k, v, keep_ratio=1.0, causal=causal),
                       T.dense_attention_ref(q, k, v, causal=causal))


def test_selection_keeps_window_sorted_per_head_and_matches_attention_on_subset():
    q, k, v = _qkv(1, 2, 64, 8)
    out, idx = T.token_sparse_attention(q, k, v, keep_ratio=0.25, window=8, return_indices=True)
    assert idx.shape == (1, 2, 14 + 8)  # round(0.25 * 56) + W
    assert (idx.diff(dim=-1) > 0).all()
    assert (idx[..., -8:] == torch.arange(56, 64, device=DEVICE)).all()
    for head in range(2):  # the kept rows equal causal attention restricted to the kept tokens
        sel = idx[0, head]
        sub = T.dense_attention_ref(*(z[:, head : head + 1, sel] for z in (q, k, v)))
        assert torch.allclose(out[0, head, sel], sub[0, 0], atol=1e-6)
    one = T.token_sparse_attention(q, k, v, keep_ratio=1e-6, window=8, return_indices=True)[1]
    assert one.shape[-1] == 1 + 8  # one token kept besides the window


def test_importance_scores_find_the_attended_token():
    q, k, v = _qkv(1, 1, 40, 8)
    k[0, 0, 5] = q[0, 0, -16:].mean(0) * 20  # every window query attends to key 5
    s = T.importance_scores(q, k, window=16, pool=1)
    assert int(s[0, 0].argmax()) == 5


def test_coverage_budget_drops_the_low_mass_prefix():
    scores = torch.tensor([[[0.5, 0.3, 0.1, 0.05, 0.05]]])  # (B=1, H=1, L-W=5)
    assert T.coverage_budget(scores, 0.0, n_min=1) == 5
    assert T.coverage_budget(scores, 0.11, n_min=1) == 3  # drops 0.05 + 0.05 (< 0.11), not the 0.1
    assert T.coverage_budget(scores, 0.99, n_min=2) == 2  # n_min floor


def test_data_answers_follow_from_the_sequences():
    p = M.Params(seq_len=64, n_pairs=3, hops=3)
    rng = np.random.default_rng(0)
    seq, ans, _ = M.make_recall(rng, p)
    assert len(seq) == 64 and seq[-2] == M.QUERY
    i = max(j for j in range(len(seq) - 2) if seq[j] == seq[-1] and seq[j + 1] == M.ASSIGN)
    assert seq[i + 2] == ans
    seq, ans, _ = M.make_tracking(rng, p)
    env = {}
    for j in range(len(seq) - 2):
        if seq[j + 1] == M.ASSIGN and j + 2 < len(seq) - 2:
            rhs = seq[j + 2]
            env[seq[j]] = env.get(rhs, rhs)
    assert env[seq[-1]] == ans


def test_model_modes_run_and_tsa_with_all_tokens_equals_dense():
    p = M.Params(seq_len=48, width=16, n_layers=2, n_heads=2, window=8, n_min=2)
    torch.manual_seed(0)
    model = M.LM(p).eval()
    tok = torch.randint(0, 64, (1, 48))
    with torch.no_grad():
        dense = model(tok)
        assert torch.equal(model(tok, "tsa", {"keep_ratio": 1.0, "window": 8, "pool": 7, "n_min": 2}), dense)
        blk = {"block": 8, "block_keep": 0.5}
        for mode, budget in (("tsa", {"coverage": 0.2}), ("evict", {"keep_ratio": 0.3}), ("sink", {"n_keep": 12}),
                             ("block", blk), ("tsa_block", {"coverage": 0.2, **blk})):
            out = model(tok, mode, {"window": 8, "pool": 7, "n_min": 2, **budget})
            assert out.shape == (1, 64) and torch.isfinite(out).all()


def test_eviction_scores_are_head_averaged_attention_probabilities():
    """GemFilter's rule: full causal softmax per head, the window queries' probabilities to each earlier key,
    summed over the window, then averaged over heads (not mean(q) . mean(k))."""
    q, k, _ = (z.cpu() for z in _qkv(2, 3, 20, 8))
    w = 5
    probs = (q @ k.transpose(-1, -2) / 8**0.5).masked_fill(~torch.ones(20, 20, dtype=torch.bool).tril(),
                                                           float("-inf")).softmax(-1)  # (B, H, L, L)
    want = probs[..., -w:, : 20 - w].sum(-2).mean(1)  # (B, L - W)
    assert torch.allclose(M.eviction_scores(q, k, w, pool=1), want, atol=1e-6)
    # two heads attending to different tokens with opposite queries: mean(q) is zero, the probabilities are not
    q, k = torch.zeros(1, 2, 24, 4), torch.zeros(1, 2, 24, 4)
    q[0, 0, :, 0], q[0, 1, :, 0] = 10.0, -10.0
    k[0, 0, 3, 0], k[0, 1, 9, 0] = 1.0, -1.0
    idx = M.eviction_indices(q, k, keep_ratio=2 / 16, window=8, pool=1)
    assert idx.shape == (1, 2 + 8) and idx[0, :2].tolist() == [3, 9]


def test_coverage_is_chosen_on_validation_accuracy_only():
    rows = [{"c": 0.1, "val_acc": 0.90, "acc": 0.50}, {"c": 0.2, "val_acc": 0.95, "acc": 0.99},
            {"c": 0.3, "val_acc": 0.70, "acc": 1.00}]
    assert M.choose_coverage(rows, dense_val=0.955)["c"] == 0.2  # the most pruning within a point on val
    assert M.choose_coverage(rows, dense_val=1.0)["c"] == 0.2  # none within a point: the smallest val drop


def test_context_chance_and_validation_split(tmp_path):
    v = list(M.VALUES)
    tok = torch.tensor([[M.BOS, 4, M.ASSIGN, v[0], 5, M.ASSIGN, v[1], 6, M.ASSIGN, v[1], M.QUERY, 4],
                        [M.BOS, 4, M.ASSIGN, v[2], 5, M.ASSIGN, v[3], 6, M.ASSIGN, v[4], M.QUERY, 4]])
    assert np.isclose(M.context_chance(tok), (1 / 2 + 1 / 3) / 2)
    p = M.Params(seq_len=48, n_pairs=2, chains=2, n_train=8, n_test=4)
    M.prepare(p, tmp_path)
    splits = {s: M._load(tmp_path, s)[0] for s in ("train", "test", "val")}
    assert [len(splits[s]) for s in ("train", "test", "val")] == [8, 4, 4]
    assert not torch.equal(splits["test"], splits["val"])


def _block_sparse_by_mask(q, k, v, block, keep):
    """The same selection written as a dense (L, L) mask over full attention, one (batch, head) at a time."""
    b, h, length, d = q.shape
    nb = -(-length // block)
    pad = nb * block - length
    qm, km = (torch.nn.functional.pad(z, (0, 0, 0, pad)).view(b, h, nb, block, d).mean(3) for z in (q, k))
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            mask = torch.zeros(length, length, dtype=torch.bool)
            for i in range(nb):
                score = qm[bi, hi, i] @ km[bi, hi, : i + 1].T
                score[i] = float("inf")
                for j in score.topk(int(np.ceil(keep * (i + 1) - 1e-9))).indices.tolist():
                    mask[i * block : (i + 1) * block, j * block : (j + 1) * block] = True
            mask &= torch.ones(length, length, dtype=torch.bool).tril()
            out[bi, hi] = torch.nn.functional.scaled_dot_product_attention(q[bi, hi], k[bi, hi], v[bi, hi],
                                                                           attn_mask=mask)
    return out


@pytest.mark.parametrize("keep", [0.3, 0.5, 1.0])
def test_block_sparse_attention_matches_masked_dense_attention(keep):
    """Gathering only the selected blocks equals full attention under the block mask; keep = 1 is dense."""
    q, k, v = (z.cpu() for z in _qkv(2, 3, 70, 8))
    got = M.block_sparse_attention(q, k, v, block=16, keep=keep)
    assert torch.allclose(got, _block_sparse_by_mask(q, k, v, 16, keep), atol=1e-5)
    if keep == 1.0:
        assert torch.allclose(got, T.dense_attention_ref(q, k, v), atol=1e-5)


def test_composed_attention_is_block_sparse_on_the_kept_tokens():
    q, k, v = (z.cpu() for z in _qkv(1, 2, 64, 8, seed=1))
    out, idx = M.composed_attention(q, k, v, 8, 0.5, keep_ratio=0.5, window=8, pool=3, n_min=2)
    assert torch.equal(idx, T.select_tokens(q, k, keep_ratio=0.5, window=8, pool=3, n_min=2))
    want = M.block_sparse_attention(*(T.gather_tokens_ref(z, idx) for z in (q, k, v)), block=8, keep=0.5)
    assert torch.allclose(out.gather(2, idx[..., None].expand(-1, -1, -1, 8)), want)
    dropped = torch.ones(1, 2, 64, dtype=torch.bool).scatter(2, idx, False)
    assert (out[dropped] == 0).all()  # decompressed: zeros where a head dropped the token
    full, _ = M.composed_attention(q, k, v, 8, 1.0, keep_ratio=1.0, window=8, pool=3, n_min=2)
    assert torch.allclose(full, T.dense_attention_ref(q, k, v), atol=1e-5)


def test_latency_probe_times_every_arm_interleaved_and_the_composed_speedup_is_context():
    p = M.Params(width=16, n_heads=2, window=8, pool=3, block_size=8, block_keep=0.5)
    times = M.attention_latency(64, 0.5, p, repeats=5)
    assert set(times) == {"dense", "tsa", "block", "composed"}
    assert all(len(v) == 5 and min(v) > 0 for v in times.values())
    claim = M.PAPER.claim
    parts = {c.left for c in claim.all_of}
    assert "method/composed/speedup_vs_block" not in parts  # nearly by construction: shown, not evidence
    assert [c.left for c in claim.context] == ["method/composed/speedup_vs_block"]
    assert [c.left for c in claim.all_of if c.timed] == ["method/speedup_longest"]
