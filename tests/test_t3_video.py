"""T3-Video: the retrofit's mechanism (no new weights, blocks that cover everything give back full attention,
information crossing every block boundary within the cycle), the data's resolution dependence, the FLOP count and
the clip-folder loader."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch

from kernels import window_attention as W
from models import t3_video as M
from models.common.tables import read_table

TINY = dict(n_train=8, n_test=4, n_frames=2, size_low=8, patch=4, width=16, depth=2, heads=2, clf_channels=4)


def _inputs(p, size, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, p.n_frames, 3, size, size, generator=g)
    return x, torch.rand(b, generator=g), torch.arange(b) % 4


def test_window_covering_everything_without_remote_gives_back_the_full_attention_model():
    p = M.Params(**TINY, local_block=[-1, -1, -1])
    torch.manual_seed(0)
    model = M.DiT(p)
    for blk in model.blocks:  # the zero-initialised output head would hide any difference
        torch.nn.init.normal_(blk["o"].weight)
    torch.nn.init.normal_(model.out.weight)
    x, t, c = _inputs(p, 16)
    full = model(x, t, c, "full")
    assert torch.allclose(model(x, t, c, "window"), full, atol=1e-5)
    # with remote groups and one all-covering block, every remote group is one token: out = (full_attn + v) / 2
    q, k, v = torch.randn(3, 1, 2, 20, 8).unbind(0)
    out = W.multiscale_window_attention(q, k, v, [-1], remote=True, use_triton=False)
    assert torch.allclose(out, (W.full_attention_ref(q, k, v) + v) / 2, atol=1e-6)
    assert not torch.allclose(model(x, t, c, "t3"), full, atol=1e-3)  # the retrofit does change the pattern


def test_retrofit_adds_no_weights_and_trains_the_shared_projections():
    p = M.Params(**TINY)
    torch.manual_seed(0)
    base = M.DiT(p)
    retro = M.Retrofit(p, base)
    for arm in retro.arms.values():
        assert arm.state_dict().keys() == base.state_dict().keys()
        assert all(torch.equal(a, b) for a, b in zip(arm.state_dict().values(), base.state_dict().values(),
                                                     strict=True))
    torch.nn.init.normal_(retro.arms["t3"].out.weight)  # zero-initialised at first: no gradient would pass
    x, _, c = _inputs(p, 16)
    losses = retro(x, c)
    losses["t3"].backward()
    qkv = retro.arms["t3"].blocks[0]["qkv"].weight.grad
    assert qkv is not None and qkv.abs().sum() > 0  # close and remote attention both go through the same q, k, v
    assert retro.arms["full_ft"].blocks[0]["qkv"].weight.grad is None  # lock-step: arms are independent


def test_pretraining_clips_the_dit_apart_from_the_judges():
    """The DiT and the two judge classifiers pretrain in one engine as three arms: every parameter in exactly one,
    and with the summed loss the DiT trains as it would alone; one clip over all three networks (the coupling the
    arms remove) lets the classifiers' gradient norms set the DiT's step."""
    from tasks.context import ArmsAdamW, _arm_groups

    p = M.Params(**TINY, label_dropout=0.0)
    torch.manual_seed(0)
    pre = M.Pretrain(p)
    torch.nn.init.normal_(pre.dit.out.weight)  # zero-initialised at first: only the output head would get gradient
    start = {k: v.clone() for k, v in pre.state_dict().items()}
    assert [grp["name"] for grp in _arm_groups(pre, pre.arms(), 1.0)] == ["dit", "frames", "video"]  # raises on a
    # parameter in no arm or in two

    def dit_after(mode: str, steps: int = 4) -> torch.Tensor:
        pre.load_state_dict(start)
        params = list(pre.parameters()) if mode == "together" else list(pre.dit.parameters())
        opt = (ArmsAdamW(_arm_groups(pre, pre.arms(), 1.0), lr=1e-2, weight_decay=0.0, partitioned=False)
               if mode == "arms" else torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0))
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            low, high = torch.randn(4, 2, 3, 8, 8, generator=g), torch.rand(4, 2, 3, 16, 16, generator=g)
            pre.zero_grad()
            torch.manual_seed(100 + step)  # the same noise draw in every mode
            losses = pre(low, high, torch.randperm(4, generator=g))
            (losses["rf"] if mode == "alone" else sum(losses.values())).backward()
            if mode != "arms":
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        return torch.cat([q.detach().flatten() for q in pre.dit.parameters()])

    first = torch.cat([start[n].flatten() for n, _ in pre.named_parameters() if n.startswith("dit.")])
    alone, beside, together = dit_after("alone"), dit_after("arms"), dit_after("together")
    assert torch.allclose(alone, beside, atol=1e-6) and (alone - first).abs().max() > 1e-3
    assert not torch.allclose(alone, together, atol=1e-4)


def _reach(grid, layers):
    """Boolean (N, N): token j can influence token i after the given layers (each a list of (block, kinds))."""
    n = math.prod(grid)
    reach = torch.eye(n, dtype=torch.bool)
    for block, kinds in layers:
        adj = torch.zeros(n, n, dtype=torch.bool)
        for kind in kinds:
            table = W.group_table(grid, tuple(block), kind).long()
            for row in table:
                m = row[row >= 0]
                adj[m[:, None], m[None, :]] = True
        reach = (adj.float() @ reach.float()) > 0
    return reach


@pytest.mark.parametrize("attn", ["full", "t3"])
def test_activation_checkpointing_gives_the_same_output_and_gradients(attn):
    x_grads = []
    for checkpointed in (False, True):
        p = M.Params(**TINY, checkpoint_blocks=checkpointed)
        torch.manual_seed(0)
        model = M.DiT(p)
        torch.nn.init.normal_(model.out.weight)  # zero-initialised at first: no gradient would reach the blocks
        x, t, c = _inputs(p, 16)
        model(x, t, c, attn).square().sum().backward()
        x_grads.append([q.grad.clone() for q in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*x_grads, strict=True))  # recomputation is bitwise the same


def test_hierarchical_blocking_crosses_every_block_boundary_within_the_cycle():
    p = M.Params()  # the smoke cycle on the smoke high-resolution grid (4 frames of 8x8 tokens)
    grid = (4, 8, 8)
    blocks = [tuple(min(e, n) if e > 0 else n for e, n in zip(b, grid, strict=True)) for b in p.blocks]
    assert any(b[1:] == grid[1:] or b[0] == grid[0] for b in blocks)  # an axis-preserving shape is in the cycle
    t3 = _reach(grid, [(b, ("close", "remote")) for b in blocks])
    assert t3.all()
    close_only = _reach(grid, [(b, ("close",)) for b in blocks[:1]])
    assert not close_only.all()  # one layer of close blocks alone does not
    local = _reach(grid, [(p.local_block, ("close",))] * len(blocks))
    assert not local.all()  # the single-scale local baseline never leaves its block


def test_prepare_low_is_the_area_downsample_and_the_texture_needs_high_resolution(tmp_path):
    p = M.Params(**TINY)
    M.prepare(p, tmp_path)
    hi, cls, split = M.load_videos(tmp_path, "videos_high")
    lo, cls_lo, _ = M.load_videos(tmp_path, "videos_low")
    assert hi.shape == (12, 2, 3, 16, 16) and lo.shape == (12, 2, 3, 8, 8) and torch.equal(cls, cls_lo)
    assert (split == "test").sum() == 4
    assert (torch.nn.functional.avg_pool2d(hi.flatten(0, 1), 2) - lo.flatten(0, 1)).abs().max() < 2 / 255 + 1e-6
    # fine texture: the bicubic upsampling of the low-resolution video loses high-frequency energy
    up = torch.nn.functional.interpolate(lo.flatten(0, 1), scale_factor=2, mode="bicubic", align_corners=False)

    def hf(x):
        return (x - torch.nn.functional.avg_pool2d(x, 3, 1, 1, count_include_pad=False)).pow(2).mean()

    assert hf(hi.flatten(0, 1)) > 1.5 * hf(up)
    meta = read_table(tmp_path / "params.parquet")
    assert set(meta) >= {"video_id", "class", "split", "n_sprites", "speed", "size"}


def test_attention_flops_at_4k_follow_the_block_sizes():
    p = M.Params()
    n = math.prod(M.GRID_4K)
    full, t3 = M.flops(M.GRID_4K, p, "full"), M.flops(M.GRID_4K, p, "t3")
    assert full[0] == 4 * p.width * n**2
    frames, h, w = M.GRID_4K
    assert t3[0] == 4 * p.width * n * (h * w + frames)  # one whole frame close + 16-token remote groups
    assert t3[1] == 4 * p.width * n * (frames * h * 2 + w // 2)  # tall strip of width 2, remote groups of 120


def test_clip_folder_loader_reads_npy_clips_and_captions(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(8):
        np.save(tmp_path / f"clip{i}.npy", rng.integers(0, 256, (3, 20, 24, 3), dtype=np.uint8))
        rows.append({"file": f"clip{i}.npy", "caption": ["a cat", "a dog"][i % 2]})
    with open(tmp_path / "captions.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["file", "caption"])
        writer.writeheader()
        writer.writerows(rows)
    vids, caps = M.load_clip_folder(tmp_path, 2, 8)
    assert vids.shape == (8, 2, 8, 8, 3) and caps[:2] == ["a cat", "a dog"]
    assert 0 <= vids.min() and vids.max() <= 1
    out = tmp_path / "data"
    out.mkdir()
    M.prepare(M.Params(**{**TINY, "n_train": 4, "n_test": 4, "clip_dir": str(tmp_path)}), out)
    hi, cls, split = M.load_videos(out, "videos_high")
    assert hi.shape == (8, 2, 3, 16, 16) and cls.tolist() == [0, 1] * 4 and (split == "test").sum() == 4
    with pytest.raises(ValueError, match="frames"):
        M.load_clip_folder(tmp_path, 5, 8)


def _mp4(path, frames):
    """A real mp4 (MPEG-4 part 2 in the FFmpeg that PyAV bundles), (F, H, W, 3) uint8 frames."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.height, stream.width, stream.pix_fmt = frames.shape[1], frames.shape[2], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def test_clip_folder_loader_decodes_mp4(tmp_path):
    levels = (30, 120, 210)
    _mp4(tmp_path / "clip.mp4", np.stack([np.full((24, 32, 3), v, np.uint8) for v in levels]))
    (tmp_path / "captions.csv").write_text("file,caption\nclip.mp4,a grey clip\n")
    vids, caps = M.load_clip_folder(tmp_path, 3, 8)
    assert vids.shape == (1, 3, 8, 8, 3) and caps == ["a grey clip"]
    assert np.allclose(vids[0].mean((1, 2, 3)), np.array(levels) / 255, atol=0.03)  # lossy codec
