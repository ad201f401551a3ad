"""Token Sparse Attention: per-head token selection, compress (gather) -> dense attention -> decompress (scatter).

Paper: 000_2dd18ae8605fb5c1.txt, abstract 3. Spec: ../shared/papers/token_sparse_attention.md.

Per head, a reduced set of token positions is chosen [importance_scores, select_tokens]; Q, K and V are gathered
to it [gather_tokens, a Triton kernel], unchanged causal dense attention runs on the compact tensors (PyTorch
SDPA: FlashAttention on GPUs), and the outputs are scattered back to their positions [scatter_tokens, a Triton
kernel; both autotuned on GPUs]; unselected positions get zero for that head, so their residual stream passes
unchanged and a later layer may select them again (reversible, unlike eviction). Sorted indices keep causal masking
valid on the compact sequence. With keep_ratio=1.0 every token is kept and the result equals dense attention.

Scoring and budget (the abstract names neither; the spec's choices):
1. importance: per head, attention probabilities of the last W queries (observation window) to the earlier keys,
   summed over the window queries, smoothed by average pooling (kernel 7);
2. budget: by a kept fraction per head (`keep_ratio`), or by coverage c: normalise the head-averaged scores, sort
   ascending, drop the longest prefix whose cumulative mass stays below c; n_keep = max(n_min, L - W - n_drop)
   per head by per-head top-k, plus the W window tokens; indices sorted ascending.

Caveats: on CPU Triton runs only interpreted (TRITON_INTERPRET=1, set here when no GPU is present) and is slow, so
the CPU pipeline passes `use_triton=False` (torch.gather / scatter, the references); tests compare the two.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # Triton runs on CPU only through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels import autotune_configs  # noqa: E402

# ---- Triton gather / scatter -------------------------------------------------------------------------------
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


# kept tokens per program (BN), num_warps, num_stages; pure copies, so every config moves the same bits.
CONFIGS = [triton.Config({"BN": bn}, num_warps=w, num_stages=st)
           for bn, w, st in [(64, 4, 2), (16, 2, 1), (32, 4, 1), (128, 4, 2), (64, 8, 3), (128, 8, 3)]]
_ONE = triton.Config({"BN": 64}, num_warps=4, num_stages=1) if _INTERPRETED else CONFIGS[0]


# keyed on the kept count rounded to a power of two, so a new budget per layer or per prompt does not retune
@triton.autotune(configs=autotune_configs(CONFIGS, _ONE), key=["n_bucket", "D"])
@triton.jit
def _gather_kernel(x_ptr, idx_ptr, out_ptr, L, n, n_bucket, D, BN: tl.constexpr, BD: tl.constexpr):
    """out[bh, j, :] = x[bh, idx[bh, j], :] for a block of BN kept tokens of one (batch, head)."""
    bh, pid = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    rj = pid * BN + tl.arange(0, BN)
    rd = tl.arange(0, BD)
    src = tl.load(idx_ptr + bh * n + rj, mask=rj < n, other=0).to(tl.int64)  # (BN,) source positions
    mask = (rj[:, None] < n) & (rd[None, :] < D)
    vals = tl.load(x_ptr + bh * L * D + src[:, None] * D + rd[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + bh * n * D + rj[:, None] * D + rd[None, :], vals, mask=mask)


@triton.autotune(configs=autotune_configs(CONFIGS, _ONE), key=["n_bucket", "D"])
@triton.jit
def _scatter_kernel(y_ptr, idx_ptr, out_ptr, L, n, n_bucket, D, BN: tl.constexpr, BD: tl.constexpr):
    """out[bh, idx[bh, j], :] = y[bh, j, :]; `out` is zero-initialised, indices are distinct."""
    bh, pid = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    rj = pid * BN + tl.arange(0, BN)
    rd = tl.arange(0, BD)
    dst = tl.load(idx_ptr + bh * n + rj, mask=rj < n, other=0).to(tl.int64)
    mask = (rj[:, None] < n) & (rd[None, :] < D)
    vals = tl.load(y_ptr + bh * n * D + rj[:, None] * D + rd[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + bh * L * D + dst[:, None] * D + rd[None, :], vals, mask=mask)


def _grid(bh: int, n: int):
    return lambda meta: (bh, triton.cdiv(n, meta["BN"]))


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x (B, H, L, D), idx (B, H, n) -> (B, H, n, D), Triton."""
    b, h, length, d = x.shape
    n = idx.shape[-1]
    x, idx = x.contiguous(), idx.contiguous()
    out = torch.empty((b, h, n, d), dtype=x.dtype, device=x.device)
    _gather_kernel[_grid(b * h, n)](x, idx, out, length, n, triton.next_power_of_2(max(n, 1)), d,
                                    BD=triton.next_power_of_2(d))
    return out


def gather_tokens_ref(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))


def scatter_tokens(y: torch.Tensor, idx: torch.Tensor, length: int) -> torch.Tensor:
    """y (B, H, n, D), idx (B, H, n) -> (B, H, L, D) with zeros at unselected positions, Triton."""
    b, h, n, d = y.shape
    y, idx = y.contiguous(), idx.contiguous()
    out = torch.zeros((b, h, length, d), dtype=y.dtype, device=y.device)
    _scatter_kernel[_grid(b * h, n)](y, idx, out, length, n, triton.next_power_of_2(max(n, 1)), d,
                                     BD=triton.next_power_of_2(d))
    return out


def scatter_tokens_ref(y: torch.Tensor, idx: torch.Tensor, length: int) -> torch.Tensor:
    out = y.new_zeros(*y.shape[:2], length, y.shape[-1])
    return out.scatter(2, idx[..., None].expand(-1, -1, -1, y.shape[-1]), y)


# ---- scoring and selection ---------------------------------------------------------------------------------
def importance_scores(q: torch.Tensor, k: torch.Tensor, window: int = 16, pool: int = 7) -> torch.Tensor:
    """(B, H, L, D) -> (B, H, L - W): attention of the last W queries to the earlier keys, summed, avg-pooled."""
    length, d = q.shape[-2], q.shape[-1]
    w = min(window, length - 1)
    logits = q[..., -w:, :] @ k[..., : length - w, :].transpose(-1, -2) / math.sqrt(d)  # (B, H, W, L - W)
    # the window queries also see the window keys; include them in the softmax so the mass is comparable
    tail = q[..., -w:, :] @ k[..., -w:, :].transpose(-1, -2) / math.sqrt(d)  # (B, H, W, W)
    causal = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
    probs = torch.cat([logits, tail.masked_fill(~causal, float("-inf"))], -1).softmax(-1)[..., : length - w]
    s = probs.sum(-2)  # (B, H, L - W)
    if pool > 1 and s.shape[-1] > 1:
        s = F.avg_pool1d(s.flatten(0, 1)[:, None], pool, stride=1, padding=pool // 2,
                         count_include_pad=False)[:, 0].unflatten(0, s.shape[:2])
    return s


def coverage_budget(scores: torch.Tensor, coverage: float, n_min: int) -> int:
    """Tokens to keep per head (besides the window): drop the longest low-score prefix whose normalised
    head-averaged mass stays below `coverage` (one budget for the batch: the smallest kept count over it)."""
    mass = scores.mean(1)  # (B, L - W)
    mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-12)
    cum = mass.sort(-1).values.cumsum(-1)  # ascending
    n_drop = int((cum < coverage).sum(-1).min())
    return max(min(n_min, scores.shape[-1]), scores.shape[-1] - n_drop)


def select_tokens(q: torch.Tensor, k: torch.Tensor, keep_ratio: float | None = None, coverage: float | None = None,
                  window: int = 16, pool: int = 7, n_min: int = 16) -> torch.Tensor:
    """Sorted per-head indices (B, H, n_keep + W) of the tokens to keep."""
    b, h, length, _ = q.shape
    w = min(window, length - 1)
    if keep_ratio is not None and keep_ratio >= 1.0:
        return torch.arange(length, device=q.device).expand(b, h, length)
    scores = importance_scores(q, k, w, pool)  # (B, H, L - W)
    if keep_ratio is not None:
        n_keep = max(1, min(scores.shape[-1], round(keep_ratio * scores.shape[-1])))
    elif coverage is not None:
        n_keep = coverage_budget(scores, coverage, n_min)
    else:
        raise ValueError("give keep_ratio or coverage")
    top = scores.topk(n_keep, dim=-1).indices  # (B, H, n_keep)
    tail = torch.arange(length - w, length, device=q.device).expand(b, h, w)
    return torch.cat([top, tail], -1).sort(-1).values


def token_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep_ratio: float | None = None,
                           coverage: float | None = None, causal: bool = True, window: int = 16, pool: int = 7,
                           n_min: int = 16, use_triton: bool = True, return_indices: bool = False):
    """(B, H, L, D) each -> (B, H, L, D): compress per head, dense attention, decompress (zeros elsewhere)."""
    idx = select_tokens(q, k, keep_ratio, coverage, window, pool, n_min)  # (B, H, n)
    gather = gather_tokens if use_triton else gather_tokens_ref
    scatter = scatter_tokens if use_triton else scatter_tokens_ref
    qc, kc, vc = gather(q, idx), gather(k, idx), gather(v, idx)  # (B, H, n, D) each
    yc = F.scaled_dot_product_attention(qc, kc, vc, is_causal=causal)
    out = scatter(yc, idx, q.shape[-2])
    return (out, idx) if return_indices else out


def dense_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
