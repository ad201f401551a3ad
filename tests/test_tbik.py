"""TBIK kernels and pipeline parts: bitwise invariance across TP sizes, the tree order, baselines' divergence.

Triton kernels run interpreted on CPU (TRITON_INTERPRET=1) and compiled when a GPU is present (same tests)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton  # noqa: E402

from kernels import tbik as K  # noqa: E402
from models import tbik as M  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU")


def _pair(m, n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 10 ** (torch.rand(k, generator=g) * 4 - 2)
    w = torch.randn(k, n, generator=g)
    return x.to(dtype).to(DEVICE), w.to(dtype).to(DEVICE)


def _python_tree(values: list[float]) -> torch.Tensor:
    """The canonical order written as plain recursion on fp32 scalars."""
    if len(values) == 1:
        return torch.tensor(values[0], dtype=torch.float32)
    head = 1 << (len(values).bit_length() - 1)  # largest power of two in n: the left block
    if head == len(values):
        head //= 2  # a perfect tree: halves
    return _python_tree(values[:head]) + _python_tree(values[head:])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 11, 16, 21])
def test_tree_sum_is_the_canonical_order(n):
    g = torch.Generator().manual_seed(n)
    v = (torch.randn(n, generator=g) * 10 ** (torch.rand(n, generator=g) * 8 - 4)).float()
    assert torch.equal(K.tree_sum(v), _python_tree(v.tolist()))


# shapes: length-1 rows and columns with K smaller than one leaf; segments of 40 and 70 (not a multiple of BK=32,
# 2 and 3 leaves: a non-power-of-two leaf tree); M, N not multiples of the tile sizes
CASES = [(1, 1, 16, torch.float32), (5, 33, 640, torch.bfloat16), (3, 70, 1120, torch.float32),
         (4, 16, 256, torch.bfloat16)]


@pytest.mark.parametrize("m,n,k,dtype", CASES)
def test_tbik_matmul_bitwise_invariant_across_every_tp_size(m, n, k, dtype):
    x, w = _pair(m, n, k, dtype)
    outs = {tp: K.tbik_matmul(x, w, tp) for tp in K.TP_SIZES}
    for tp, out in outs.items():
        assert out.dtype == dtype and out.shape == (m, n)
        assert torch.equal(out, outs[1]), f"TP={tp} differs from TP=1"
    exact = x.double() @ w.double()
    ref = K.tbik_matmul_ref(x.cpu(), w.cpu(), 1).to(DEVICE)
    tol = (x.double().abs() @ w.double().abs()) * (2e-6 if dtype == torch.float32 else 8e-3)
    assert ((outs[1].double() - exact).abs() <= tol).all()
    assert ((outs[1].double() - ref.double()).abs() <= tol).all()


def test_kernel_and_reference_share_the_tree_bitwise():
    """Leaf-exact inputs (one nonzero product per 32-wide leaf) make every leaf dot exact whatever its internal
    order, while the tree additions of mixed magnitudes round: kernel and reference must then agree bitwise."""
    m, n, k = 3, 8, 16 * 70  # 3 leaves per segment
    g = torch.Generator().manual_seed(1)
    x = torch.zeros(m, k)
    x[:, torch.arange(0, k, 70)[:, None] + torch.arange(0, 70, K.BK)] = 1.0  # first column of every leaf
    w = (torch.randn(k, n, generator=g) * 2.0 ** torch.randint(-20, 20, (k, n), generator=g)).float()
    kernel, ref = K.tbik_matmul(x.to(DEVICE), w.to(DEVICE), 4).cpu(), K.tbik_matmul_ref(x, w, 4)
    assert torch.equal(kernel, ref)
    sequential = (x[:, :, None] * w[None]).cumsum(1)[:, -1]
    assert not torch.equal(ref, sequential), "inputs too benign to see the order"
    s = x * w[:, 0]  # (M, K): one nonzero per leaf, the same leaf-exact construction for the sum
    assert torch.equal(K.tbik_sum(s.to(DEVICE), 2).cpu(), K.tbik_sum_ref(s, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tbik_sum_invariant_and_close(dtype):
    x = (torch.randn(17, 16 * 45) * 10 ** (torch.rand(16 * 45) * 6 - 3)).to(dtype).to(DEVICE)
    outs = {tp: K.tbik_sum(x, tp) for tp in K.TP_SIZES}
    assert all(torch.equal(o, outs[1]) for o in outs.values())
    assert torch.allclose(outs[1].double(), x.double().sum(-1), rtol=1e-5, atol=1e-3 * x.double().abs().max().item())
    refs = {tp: K.tbik_sum_ref(x.cpu(), tp) for tp in K.TP_SIZES}
    assert all(torch.equal(o, refs[1]) for o in refs.values())


def test_naive_and_batch_invariant_kernels_match_references_and_diverge_across_tp():
    x, w = M.make_case({"seed": 3, "M": 16, "N": 64, "K": 512, "scale_spread": 3.0})
    x, w = x.to(DEVICE), w.to(DEVICE)
    naive = {tp: K.naive_tp_matmul(x, w, tp) for tp in (1, 4)}
    bi = {tp: K.batch_invariant_tp_matmul(x, w, tp) for tp in (1, 4)}
    for tp in (1, 4):
        scale = (x.double().abs() @ w.double().abs()) * 1e-2
        assert ((naive[tp].double() - K.naive_tp_matmul_ref(x.cpu(), w.cpu(), tp).double().to(DEVICE)).abs()
                <= scale).all()
        assert ((bi[tp].double() - K.batch_invariant_tp_matmul_ref(x.cpu(), w.cpu(), tp).double().to(DEVICE)).abs()
                <= scale).all()
    assert not torch.equal(naive[1], naive[4])
    assert M.pair_stats(naive)["max_ulp"] > 0
    assert M.pair_stats({tp: K.tbik_matmul(x, w, tp) for tp in (1, 4)})["differing_elements"] == 0


def _rank_worker(rank: int, world: int, m: int, n: int, k: int, dtype: torch.dtype, init: str, out_dir: str):
    """One real rank: its K-slice of x and w, its subtree root in one pass, gloo all-gather, tree merge."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        x, w = _pair(m, n, k, dtype)
        step = k // world
        y = K.tbik_matmul_distributed(x[:, rank * step : (rank + 1) * step], w[rank * step : (rank + 1) * step])
        torch.save(y.cpu(), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_real_ranks_with_gloo_equal_tp1_bitwise(world, tmp_path):
    """torch.distributed processes, each computing only its shard: every rank's result equals TP = 1 bitwise."""
    import torch.multiprocessing as mp

    m, n, k, dtype = 3, 20, 16 * 40, torch.bfloat16  # segments of 40: two leaves, one of them padded
    # fork on CPU: the ranks inherit the imported modules (spawn re-imports torch and Triton, seconds apiece); a
    # process that has initialised CUDA cannot fork, so GPUs spawn
    method = "spawn" if torch.cuda.is_available() else "fork"
    import torch.distributed as dist

    if dist.is_initialized():  # an earlier in-process training left its one-rank group: the ranks must not inherit it
        dist.destroy_process_group()
    mp.start_processes(_rank_worker, nprocs=world, join=True, start_method=method,
                       args=(world, m, n, k, dtype, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)))
    x, w = _pair(m, n, k, dtype)
    expected = K.tbik_matmul(x, w, 1).cpu()
    for rank in range(world):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), expected), f"rank {rank} of {world}"


def test_one_launch_writes_only_the_shard_roots():
    x, w = _pair(5, 9, 16 * 64, torch.float32)  # two leaves a segment
    roots = K.shard_roots(x, w, 4, 4)
    assert roots.shape == (4, 5, 9) and roots.dtype == torch.float32
    for r in range(4):  # each equals its rank's own launch and the reference's subtree root
        xr, wr = x[:, r * 256 : (r + 1) * 256], w[r * 256 : (r + 1) * 256]
        assert torch.equal(roots[r], K.tbik_shard_root(xr, wr, 4))
    assert torch.allclose(roots.cpu(), torch.stack(K._shard_roots_ref(x.cpu(), w.cpu(), 4)), rtol=1e-5, atol=1e-4)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tile_config_gives_the_same_bits(dtype):
    """Compiled: BM, BN, num_warps and num_stages must not change a bit (ranks in different processes may each
    autotune to a different config), at an LLM-like shape; TP 16 through the autotuned path equals them all."""
    m, n, k = 256, 384, 16 * 256
    x, w = _pair(m, n, k, dtype)
    seg = k // K.SEGMENTS
    outs = []
    for cfg in K.MATMUL_CONFIGS:  # the full list, also where PAPERLINE_AUTOTUNE=0 gives the autotuner one
        roots = torch.empty((1, m, n), dtype=torch.float32, device=DEVICE)
        grid = (triton.cdiv(m, cfg.kwargs["BM"]) * triton.cdiv(n, cfg.kwargs["BN"]), 1)
        K._shard_matmul_kernel.fn[grid](x, w, roots, m, n, seg, triton.cdiv(seg, K.BK), K.SEGMENTS, x.stride(0),
                                        x.stride(1), w.stride(0), w.stride(1), BK_=K.BK, UPCAST=K._upcast(x),
                                        DEPTH=K._depth(seg), SDEPTH=K.SEGMENTS.bit_length(), GROUP_M=8,
                                        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.kwargs)
        outs.append(K.tree_merge(roots, dtype))
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(outs[0], K.tbik_matmul(x, w, 16))


def test_bad_shapes_are_rejected():
    x, w = _pair(2, 2, 24, torch.float32)
    with pytest.raises(ValueError, match="divisible by 16"):
        K.tbik_matmul(x, w, 1)
    x, w = _pair(2, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="tp_size"):
        K.tbik_matmul(x, w, 3)


def test_ulp_distance():
    a = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    b = torch.nextafter(a.float(), torch.tensor([2.0, 0.0])).bfloat16()  # rounds to a itself
    assert M.ulp_distance(a, a) == 0 and M.ulp_distance(a, b) == 0
    up = (a.view(torch.int16) + 1).view(torch.bfloat16)  # one bf16 step away from zero
    assert M.ulp_distance(a, up) == 1
    assert M.ulp_distance(torch.tensor([0.0]).bfloat16(), torch.tensor([-0.0]).bfloat16()) == 0  # +0 == -0


def test_lm_rollout_and_training_logprobs_agree_only_with_tbik():
    torch.manual_seed(0)
    lm = M.TinyLM(vocab=64, d=64, n_layers=1, n_heads=2, max_len=24)
    tok = torch.randint(0, 64, (4, 24))
    with torch.no_grad():
        lp = {f: {tp: lm.logprobs(tok, f, tp) for tp in (1, 4, 16)} for f in ("tbik", "naive")}
        fp32 = lm.logprobs(tok)
    assert all(torch.equal(lp["tbik"][1], v) for v in lp["tbik"].values())
    assert any(not torch.equal(lp["naive"][1], v) for v in lp["naive"].values())
    assert (lp["tbik"][1] - fp32).abs().max() < 0.1  # bf16 inference stays close to the fp32 training path
    # the REINFORCE step: rollout at TP=4 and training recompute at TP=1 give rho == 1 exactly with TBIK
    seq = tok[:, :12]
    roll = lm.logprobs(seq[:, :-1], "tbik", 4, kernels=True)[:, 3:].detach()  # the rollout engine's scoring
    loss, stats = M.rl_step(lm, "tbik", 1, seq, roll, torch.ones(4), prompt_len=4)  # the trainer's kernels
    assert float(stats["dlogp"].max()) == 0.0 and float(stats["rho_ne1"].max()) == 0.0
    loss.backward()
    assert lm.layers[0]["o"].grad is not None and torch.isfinite(lm.layers[0]["o"].grad).all()


def test_lm_routes_tp_dependent_ops_through_the_kernels(monkeypatch):
    """kernels=True: the row-parallel matmuls run the family's Triton kernel and the TBIK denominator tbik_sum;
    TBIK's kernel log-probs are bitwise equal across TP sizes, the naive kernels' are not, and the trainer's
    rollout-vs-training gap is measured through them (naive: non-zero)."""
    torch.manual_seed(0)
    lm = M.TinyLM(vocab=64, d=32, n_layers=1, n_heads=2, max_len=16)
    tok = torch.randint(0, 64, (2, 12))
    calls = {"tbik_matmul": 0, "naive_tp_matmul": 0, "tbik_sum": 0}
    for name in calls:
        real = getattr(M.K, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(M.K, name, counted)
    monkeypatch.setitem(M.FAMILIES, "tbik", (M.K.tbik_matmul_ref, M.K.tbik_matmul))
    monkeypatch.setitem(M.FAMILIES, "naive", (M.K.naive_tp_matmul_ref, M.K.naive_tp_matmul))
    with torch.no_grad():
        lp = {f: {tp: lm.logprobs(tok, f, tp, kernels=True) for tp in (1, 4)} for f in ("tbik", "naive")}
    assert calls["tbik_matmul"] == 2 * 2 and calls["naive_tp_matmul"] == 2 * 2  # o and down, per TP size
    assert calls["tbik_sum"] == 2  # the vocabulary-parallel denominator, per TP size
    assert torch.equal(lp["tbik"][1], lp["tbik"][4])
    assert not torch.equal(lp["naive"][1], lp["naive"][4])
    ref = lm.logprobs(tok, "tbik", 1)  # the reference of the same order: equal up to rounding inside a leaf
    assert (lp["tbik"][1] - ref).abs().max() < 0.05
    seq = tok[:, :10]
    roll = lm.logprobs(seq[:, :-1], "naive", 4, kernels=True)[:, 3:].detach()
    _, stats = M.rl_step(lm, "naive", 1, seq, roll, torch.ones(2), prompt_len=4)
    assert float(stats["dlogp"].max()) > 0.0


def test_kernel_matmul_backward_is_the_exact_products_gradient():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 32, generator=g, requires_grad=True), torch.randn(32, 16, generator=g, requires_grad=True)
    out = M._KernelMatmul.apply(x, w, M.K.tbik_matmul, 4)
    assert out.shape == (3, 5, 16) and (out - x @ w).abs().max() < 0.1  # bf16 forward
    up = torch.randn(3, 5, 16, generator=g)
    gx, gw = torch.autograd.grad((out * up).sum(), (x, w))
    ex, ew = torch.autograd.grad(((x @ w) * up).sum(), (x, w))
    assert torch.allclose(gx, ex, atol=1e-5) and torch.allclose(gw, ew, atol=1e-4)
    v = torch.rand(4, 64, generator=g, requires_grad=True)
    total = M._TreeSum.apply(v, 4)
    assert torch.equal(total, M.K.tbik_sum(v.detach(), 1, br=64)) and torch.allclose(total, v.sum(-1).detach())
    total.sum().backward()
    assert torch.equal(v.grad, torch.ones_like(v))


def test_bigram_reward_and_first_divergence():
    seq = torch.tensor([[1, 2, 1, 2, 3], [2, 1, 1, 1, 1]])
    assert M.bigram_reward(seq, (1, 2)).tolist() == [2.0, 0.0]
    a, b = torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([[1, 2, 3], [1, 0, 3]])
    assert M.first_divergence(a, a) == 3 and M.first_divergence(a, b) == 1


def test_kernel_steps_are_evenly_spaced_and_include_the_ends():
    assert M.kernel_steps(M.Params(rl_steps=30, rl_kernel_steps=3)) == {0, 14, 29}
    assert M.kernel_steps(M.Params(rl_steps=30, rl_kernel_steps=1)) == {0}
    assert M.kernel_steps(M.Params(rl_steps=5)) == set(range(5))  # None: every step
    assert M.kernel_steps(M.Params(rl_steps=2, rl_kernel_steps=9)) == {0, 1}


def test_reference_steps_call_no_kernel_and_keep_the_orders(monkeypatch):
    """kernels=False (the RL steps off the kernel schedule): rollout scoring and recompute run the references
    only; TBIK's reference still gives rho == 1 exactly between TP 4 and TP 1, the naive reference does not."""
    torch.manual_seed(0)
    lm = M.TinyLM(vocab=64, d=32, n_layers=1, n_heads=2, max_len=16)
    seq = torch.randint(0, 64, (4, 12))

    def forbidden(*a, **kw):
        raise AssertionError("a kernel ran on a reference step")
    for fam in ("tbik", "naive"):
        monkeypatch.setitem(M.FAMILIES, fam, (M.FAMILIES[fam][0], forbidden))
    monkeypatch.setattr(M.K, "tbik_sum", forbidden)
    gaps = {}
    for fam in ("tbik", "naive"):
        roll = lm.logprobs(seq[:, :-1], fam, 4, kernels=False)[:, 3:].detach()
        _, stats = M.rl_step(lm, fam, 1, seq, roll, torch.ones(4), prompt_len=4, kernels=False)
        gaps[fam] = float(stats["dlogp"].max())
    assert gaps["tbik"] == 0.0 and gaps["naive"] > 0.0
