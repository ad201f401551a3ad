"""LDKA: learnability-driven knowledge assimilation for class-incremental semantic segmentation.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 5. Spec: ../shared/papers/ldka.md.

What it implements (function names in brackets):
- synthetic 32x32 scenes with confusable class pairs [prepare, render_scene, class_look]: every new class has an old
  look-alike (same shape, texture frequency `gap` apart, colour pulled towards the old class by `lookalike`), so
  new-class pixels sit at low margins; `lookalike: 0` gives new classes their own colours and removes the regime;
- protocols "4-2", "6-1", "4-4" (any "<base>-<increment>") over 8 classes [protocol_steps]; at each step only the
  current classes are labelled, everything else is background;
- base learner (also the baseline) [UNet, _step_fn]: a 3-level U-Net (base width 8) with a per-pixel MLP head on
  its decoder feature f; PLOP pseudo-labels (old model confident > 0.7 on background pixels) and MiB's unbiased
  logit distillation on old classes;
- pixel margin m = z_y - max_{c != y} z_c [pixel_margin];
- Progressive Margin Learning [pml_weights]: w = (1 - a) + a N softmax_p(-m_p / tau), tau = batch std of m, a
  rising linearly 0 -> 1 over the step's epochs, weights renormalised to mean 1, margins detached;
- Smooth Knowledge Distillation [skd_curvature, unbiased_kd]: finite-difference curvature of m along
  u = grad_f m / |grad_f m| at the decoder feature (eps = 0.1), normalised by the first-order change over the same
  step (see deviations), plus distillation through a Gaussian-perturbed feature f + delta (sigma = 0.1);
- Misclassification-Aware Decoupling [mad_loss]: EMA competition matrix C_ij (mean softmax mass of class j on
  pixels labelled i, diagonal zeroed, rows normalised) weighting max(0, cos) between batch class prototypes and
  between classifier weight vectors, averaged over the classes seen (see deviations);
- arms: base, LDKA (PML + SKD + MAD); full profile adds fine-tuning (lower bound), joint training (upper bound) and
  single-component ablations [ARMS]; the first step's model is trained once per seed and shared by every arm;
- selection on a validation split [candidates, select_on_validation]: every arm trains one network per value of its
  own loss weight (`grid`: base lambda_kd, LDKA and the SKD ablation lambda_skd, the MAD ablation lambda_mad; grids
  of equal length, so each arm gets the same selection effort) and keeps the one with the best all-class mIoU on
  fully labelled validation scenes, disjoint from train and test; the test split scores only the kept networks;
- premises: the shared first step learns the base classes; with lambda_skd = 0 (LDKA's grid includes it) the
  incremental steps keep old-class mIoU within MAX_DROP of the first step's; the base learner learns the new
  classes at all;
- metrics: mIoU after the last step over old (background + base classes), new and all classes, forgetting, and the
  low-margin fraction of new-class test pixels [evaluate];
- VOC 2012 (JPEGImages + SegmentationClassAug) and ADE20K (ADEChallengeData2016) loaders for the full profile
  [load_voc, load_ade20k].

Deviations from the paper (choices the abstract left open):
- The weighting, curvature, noise and decoupling formulas above are the spec's stated choices, not the paper's.
- Loss weights: neither the paper's abstract nor the spec gives any. lambda_kd = 5 and lambda_mad = 1 are our
  defaults; lambda_skd and the base learner's lambda_kd are selected on validation from the profile's grid.
- The curvature penalty is normalised: mean [m(f+eps u) - 2m(f) + m(f-eps u)]^2 over mean [m(f+eps u) -
  m(f-eps u)]^2 instead of the spec's mean [.]^2 / eps^4. The raw form grows with the square of the logit scale
  (a fixed weight means a different strength as the logits grow, and at the earlier 0.05 it acted as 500 on the
  squared differences) and is minimised by a flat head, which predicts background everywhere; the ratio is
  dimensionless, unchanged when the logits are scaled, and both its terms carry gradient.
- The decoupling loss is divided by the number of classes seen (the spec's sum over pairs grows with it: on the
  smoke world it outweighed the cross-entropy several times at lambda_mad = 1, and LDKA with lambda_skd = 0 lost
  more old-class mIoU than the declared premise allows).
- The head is a per-pixel 2-layer MLP so that m(f) has curvature at the decoder feature (a linear head makes the
  finite-difference curvature vanish almost everywhere).
- The competition matrix is all-reduced across ranks before its EMA update, so every rank holds the same C.
- Seeds differ in initialisation and batch order; all seeds, arms and candidates of a step train in lock-step in
  one engine. Smoke and full use one seed per replicate (the replicates vary data, initialisation and order).
- Real data: the last n_val training images are the validation split; the dataset's val set is the test split.
- Step pools: a training image belongs to step t when it contains a class of step t (the overlapped setting),
  capped at `images_per_step`.
- Full profile: DeepLabv3-ResNet101 [DeepLabV3] at output stride 16 (the paper's CISS setting), its ImageNet
  backbone from a local torchvision checkpoint [load_backbone] (nothing downloads); BatchNorm as in the paper.
- The head's hidden activation is GELU (C^2, so the curvature is defined; with ReLU, finite differences across kinks
  scale as eps^-2).
- Each incremental step starts a fresh AdamW; `step_decay` / `step_warmup` give it a schedule (smoke: one-epoch
  warm-up, then cosine decay to 0 over the step, as CISS pipelines such as MiB and PLOP decay the rate within
  every step) and `step_lr` its own peak rate, the same for every arm; the first step keeps a constant `lr`.
- BatchNorm in the U-Net blocks (GroupNorm(1) sat at "all background" for ~100 steps) and a longer first step
  (`base_epochs`) so that the base classes are learnt before the incremental steps begin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from models.common.lockstep import LockStep
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

SHAPES = ("disk", "square", "triangle", "diamond")
BASE_COLOURS = np.array([[0.9, 0.2, 0.2], [0.2, 0.8, 0.3], [0.25, 0.35, 0.95], [0.95, 0.85, 0.2]])
OWN_COLOURS = np.array([[0.9, 0.2, 0.9], [0.2, 0.9, 0.9], [0.6, 0.4, 0.1], [0.5, 0.5, 0.5]])
ARMS = {  # name -> (PML, SKD, MAD, distil + pseudo-labels)
    "base": (False, False, False, True), "ldka": (True, True, True, True), "finetune": (False, False, False, False),
    "pml": (True, False, False, True), "skd": (False, True, False, True), "mad": (False, False, True, True),
    "joint": (False, False, False, False),  # upper bound: trained on every seen class's labels (see train)
}
STEP0_BAR = 0.5  # premise: old-class mIoU (background + base classes) of the shared first-step model
MAX_DROP = 0.10  # premise: the most old-class mIoU the incremental steps may lose with lambda_skd = 0
NEW_BAR = 0.10  # premise: the base learner's new-class mIoU (the new classes are learnt at all)
TUNED = {"base": "lambda_kd", "ldka": "lambda_skd", "skd": "lambda_skd", "mad": "lambda_mad"}  # arm -> own weight


class Params(PaperParams):
    source: Literal["synthetic", "voc", "ade20k"] = Field("synthetic", description="Synthetic scenes, VOC or ADE20K.")
    data_root: str = Field("", description="voc/ade20k: dataset root folder.")
    n_classes: int = Field(8, ge=2, description="Foreground classes (background is class 0).")
    protocols: list[str] = Field(["4-2"], min_length=1, description="Protocols '<base>-<increment>'.")
    n_train: int = Field(1200, ge=1, description="Training image pool (steps draw from it).")
    n_val: int = Field(100, ge=1, description="Validation images, fully labelled, disjoint from train and test; "
                                             "every arm's own loss weight is selected on them (`grid`).")
    n_test: int = Field(200, ge=1, description="Test images, fully labelled.")
    image_size: int = Field(32, ge=8, description="Side of the square images.")
    max_objects: int = Field(3, ge=1, description="Objects per image: uniform in 1..max_objects.")
    gap: float = Field(0.6, ge=0, description="Texture-frequency gap between a new class and its old look-alike.")
    lookalike: float = Field(1.0, ge=0, le=1, description="Colour pull of a new class towards its old look-alike; "
                                                          "0 = own colour (no low-margin regime).")
    noise: float = Field(0.08, ge=0, description="Pixel noise.")
    images_per_step: int = Field(400, ge=1, description="Training images per incremental step.")
    epochs: int = Field(4, ge=1, description="Epochs per incremental step.", json_schema_extra={"passes": True})
    base_epochs: int = Field(8, ge=1, description="Epochs of the first (base-class) step, shared by every arm.",
                             json_schema_extra={"passes": True})
    batch_size: int = Field(32, ge=2)
    lr: float = Field(3e-3, gt=0, description="Learning rate of the first (base-class) step, and of the incremental "
                                              "steps when `step_lr` is unset.")
    step_lr: float | None = Field(None, gt=0, description="Learning rate of each incremental step's fresh AdamW, "
                                  "the same for every arm and candidate (unset: `lr`). The incremental steps train few "
                                  "optimizer steps from a converged model, so they may need a larger rate than the "
                                  "first step's long run from scratch.")
    step_decay: Literal["constant", "cosine"] = Field("constant", description="Learning-rate schedule of each "
                                                      "incremental step (a fresh AdamW per step): constant, or "
                                                      "cosine decay to 0 over the step.")
    step_warmup: int = Field(0, ge=0, description="Linear warm-up steps at the start of each incremental step.")
    width: int = Field(8, ge=2, description="U-Net base width.")
    arch: Literal["unet", "deeplabv3"] = Field("unet", description="The segmenter: the small U-Net, or DeepLabv3 "
                                              "(ResNet backbone at output stride 16 + ASPP) as in the paper (full).")
    backbone_depth: Literal[50, 101] = Field(101, description="deeplabv3: ResNet-50 or ResNet-101 backbone.")
    backbone_weights: str = Field("", description="deeplabv3: local ImageNet ResNet checkpoint in torchvision's "
                                                  "format (a state dict, .pth or .safetensors); empty = random init.")
    arms: list[str] = Field(["base", "ldka"], min_length=1, description="Arms among " + ", ".join(ARMS))
    n_seeds: int = Field(2, ge=1, description="Seeds (seed, seed+1, ...).")
    pseudo_threshold: float = Field(0.7, gt=0, lt=1, description="PLOP confidence for old-class pseudo-labels.")
    lambda_kd: float = Field(5.0, ge=0, description="Weight of the unbiased distillation (our choice; the spec "
                                                  "gives no weights).")
    lambda_skd: float = Field(1.0, ge=0, description="Weight of the normalised curvature penalty (our choice).")
    lambda_mad: float = Field(1.0, ge=0, description="Weight of the decoupling loss (our choice).")
    grid: dict[str, list[float]] = Field({}, description="Candidate values of a loss weight, e.g. {lambda_kd: [...], "
                                         "lambda_skd: [...]}: each arm trains one network per value of its own "
                                         "weight (TUNED) and keeps the one with the best validation mIoU; arms "
                                         "whose weight has no grid train one. Every arm with a weight of its "
                                         "own gets the same number of candidates (equal selection effort).")
    eps: float = Field(0.1, gt=0, description="Finite-difference step of the curvature.")
    sigma: float = Field(0.1, ge=0, description="Feature noise of perturbation-stabilised distillation.")
    ema: float = Field(0.9, ge=0, lt=1, description="EMA of the competition matrix.")

    @model_validator(mode="after")
    def _equal_selection_effort(self):
        unknown = set(self.arms) - set(ARMS) or set(self.grid) - {"lambda_kd", "lambda_skd", "lambda_mad"}
        if unknown:
            raise ValueError(f"unknown arms or grid weights: {sorted(unknown)}")
        sizes = {a: len(self.grid.get(TUNED[a], [None])) for a in self.arms if a in TUNED}  # untuned: 1 network
        if len(set(sizes.values())) > 1 or 0 in sizes.values():
            raise ValueError(f"tuned arms need non-empty grids of equal length (equal selection effort): {sizes}")
        return self


def candidates(p: Params, arm: str) -> list[float | None]:
    """The values of the arm's own loss weight it trains one network for ([None]: one network, defaults)."""
    return list(p.grid.get(TUNED.get(arm, ""), [None]))


# ---- data --------------------------------------------------------------------------------------------------
def class_look(c: int, p: Params) -> tuple[str, np.ndarray, float]:
    """Class c (1-based) -> (shape, colour, texture frequency). Class c + 4 is the look-alike of class c."""
    k, new = (c - 1) % 4, c > 4
    colour = BASE_COLOURS[k] if not new else p.lookalike * BASE_COLOURS[k] + (1 - p.lookalike) * OWN_COLOURS[k]
    return SHAPES[k], colour, 1.0 + (p.gap if new else 0.0) + 0.5 * ((c - 1) // 8)


def _shape_mask(shape: str, yy: np.ndarray, xx: np.ndarray, cy: float, cx: float, r: float) -> np.ndarray:
    dy, dx = yy - cy, xx - cx
    if shape == "disk":
        return dy**2 + dx**2 <= r**2
    if shape == "square":
        return (np.abs(dy) <= 0.85 * r) & (np.abs(dx) <= 0.85 * r)
    if shape == "diamond":
        return np.abs(dy) + np.abs(dx) <= 1.2 * r
    return (dy <= 0.8 * r) & (dy >= -r + 2 * np.abs(dx) * 0.9)  # triangle, apex up


def render_scene(rng: np.random.Generator, p: Params) -> tuple[np.ndarray, np.ndarray]:
    """(S, S, 3) uint8 image and (S, S) uint8 mask: textured background plus 1..max_objects textured shapes."""
    s = p.image_size
    yy, xx = np.mgrid[0:s, 0:s].astype(np.float64)
    angle = rng.uniform(0, np.pi)
    bg = 0.35 + 0.1 * np.sin(2 * np.pi * (xx * np.cos(angle) + yy * np.sin(angle)) / rng.uniform(6, 12))
    img = np.repeat(bg[..., None], 3, -1) * rng.uniform(0.6, 1.0, 3)
    mask = np.zeros((s, s), np.uint8)
    for _ in range(int(rng.integers(1, p.max_objects + 1))):
        c = int(rng.integers(1, p.n_classes + 1))
        shape, colour, freq = class_look(c, p)
        r = rng.uniform(0.15, 0.28) * s
        cy, cx = rng.uniform(r, s - r, 2)
        m = _shape_mask(shape, yy, xx, cy, cx, r)
        theta = rng.uniform(0, np.pi)
        stripes = 0.5 + 0.5 * np.sin(2 * np.pi * freq * (xx * np.cos(theta) + yy * np.sin(theta)) / 8)
        img[m] = (colour * (0.55 + 0.45 * stripes[..., None]))[m]
        mask[m] = c
    img = img + p.noise * rng.standard_normal(img.shape)
    return (np.clip(img, 0, 1) * 255).astype(np.uint8), mask


def protocol_steps(protocol: str, n_classes: int) -> list[list[int]]:
    """'4-2' over 8 classes -> [[1, 2, 3, 4], [5, 6], [7, 8]]."""
    base, inc = (int(x) for x in protocol.split("-"))
    steps = [list(range(1, base + 1))]
    while steps[-1][-1] < n_classes:
        steps.append(list(range(steps[-1][-1] + 1, min(steps[-1][-1] + inc, n_classes) + 1)))
    return steps


def prepare(p: Params, out_dir: Path) -> None:
    if p.source == "synthetic":
        rng = np.random.default_rng(p.seed)
        scenes = [render_scene(rng, p) for _ in range(p.n_train + p.n_val + p.n_test)]
        pools = ["train"] * p.n_train + ["val"] * p.n_val + ["test"] * p.n_test
    else:  # real data: the last n_val training images become the validation split (the test split stays the val set)
        scenes, pools = (load_voc if p.source == "voc" else load_ade20k)(input_path(p.data_root), p.image_size)
        train = [i for i, pool in enumerate(pools) if pool == "train"]
        for i in train[max(len(train) - p.n_val, 1):]:
            pools[i] = "val"
    write_table(out_dir / "images.parquet", {"img_id": np.arange(len(scenes)), "pool": np.asarray(pools),
                                             "pixels": np.stack([s[0].reshape(-1) for s in scenes])})
    write_table(out_dir / "masks.parquet", {"img_id": np.arange(len(scenes)),
                                            "mask": np.stack([s[1].reshape(-1) for s in scenes])})
    rows = [(proto, t, ",".join(map(str, cls))) for proto in p.protocols
            for t, cls in enumerate(protocol_steps(proto, p.n_classes))]
    columns = zip(("protocol", "step", "classes"), zip(*rows, strict=True), strict=True)
    write_table(out_dir / "protocols.parquet", {k: np.asarray(v) for k, v in columns})


def _resize_pair(img_path: Path, mask_path: Path, size: int, remap) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image

    img = np.asarray(Image.open(img_path).convert("RGB").resize((size, size), Image.BILINEAR), np.uint8)
    mask = np.asarray(Image.open(mask_path).resize((size, size), Image.NEAREST)).astype(np.int64)
    return img, remap(mask).astype(np.uint8)


def load_voc(root: Path, size: int) -> tuple[list, list]:
    """VOC 2012 aug: ImageSets/Segmentation/{train_aug,val}.txt (or train.txt), JPEGImages, SegmentationClassAug.
    Label 255 (boundary) becomes background: CISS pipelines ignore it; we have no ignore index."""
    scenes, pools = [], []
    for split, pool in ((("train_aug.txt", "train.txt"), "train"), (("val.txt",), "test")):
        listing = next(root / "ImageSets" / "Segmentation" / n for n in (*split, split[-1])
                       if (root / "ImageSets" / "Segmentation" / n).exists() or n == split[-1])
        for name in listing.read_text().split():
            scenes.append(_resize_pair(root / "JPEGImages" / f"{name}.jpg", root / "SegmentationClassAug" /
                                       f"{name}.png", size, lambda m: np.where(m == 255, 0, m)))
            pools.append(pool)
    return scenes, pools


def load_ade20k(root: Path, size: int) -> tuple[list, list]:
    """ADEChallengeData2016: images/{training,validation}/*.jpg and annotations/.../*.png (0 = other -> background)."""
    scenes, pools = [], []
    for split, pool in (("training", "train"), ("validation", "test")):
        for img in sorted((root / "images" / split).glob("*.jpg")):
            scenes.append(_resize_pair(img, root / "annotations" / split / f"{img.stem}.png", size, lambda m: m))
            pools.append(pool)
    return scenes, pools


# ---- network -----------------------------------------------------------------------------------------------
def _block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU(),
                         nn.Conv2d(c_out, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU())


class UNet(nn.Module):
    """3-level U-Net -> decoder feature f (B, 2w, S, S); per-pixel MLP head f -> logits over 1 + n_classes."""

    def __init__(self, width: int, n_classes: int):
        super().__init__()
        w = width
        self.e1, self.e2, self.e3 = _block(3, w), _block(w, 2 * w), _block(2 * w, 4 * w)
        self.d2, self.d1 = _block(6 * w, 2 * w), _block(3 * w, 2 * w)
        # GELU, not ReLU: the curvature penalty needs a C^2 head (finite differences across ReLU kinks scale as eps^-2)
        self.head = nn.Sequential(nn.Conv2d(2 * w, 2 * w, 1), nn.GELU(), nn.Conv2d(2 * w, n_classes + 1, 1))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.e1(x)  # (B, w, S, S)
        e2 = self.e2(F.max_pool2d(e1, 2))  # (B, 2w, S/2, S/2)
        e3 = self.e3(F.max_pool2d(e2, 2))  # (B, 4w, S/4, S/4)
        d2 = self.d2(torch.cat([F.interpolate(e3, scale_factor=2.0), e2], 1))  # (B, 2w, S/2, S/2)
        return self.d1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], 1))  # (B, 2w, S, S)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return self.head(f), f  # (B, C+1, S, S), (B, 2w, S, S)


class Bottleneck(nn.Module):
    """torchvision's ResNet bottleneck (same parameter names, so its ImageNet checkpoints load as they are)."""

    def __init__(self, c_in: int, planes: int, stride: int, dilation: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c_in, planes, 1, bias=False), nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, dilation, dilation, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3, self.bn3 = nn.Conv2d(planes, 4 * planes, 1, bias=False), nn.BatchNorm2d(4 * planes)
        self.downsample = None if stride == 1 and c_in == 4 * planes else nn.Sequential(
            nn.Conv2d(c_in, 4 * planes, 1, stride, bias=False), nn.BatchNorm2d(4 * planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.relu(self.bn3(self.conv3(h)) + (x if self.downsample is None else self.downsample(x)))


class DeepLabV3(nn.Module):
    """DeepLabv3 (Chen et al. 2017): ResNet-50/101 backbone, last stage dilated (output stride 16), ASPP (rates
    6, 12, 18 + image pooling) -> 256-d features upsampled to the input -> the same per-pixel head as the U-Net,
    so PML, SKD and MAD act on it unchanged. Backbone names follow torchvision (`load_backbone`)."""

    def __init__(self, n_classes: int, depth: int = 101, width: int = 64, aspp: int = 256):
        super().__init__()
        blocks, self.depth = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3)}[depth], depth
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        c = width
        for i, (n, stride, dilation) in enumerate(zip(blocks, (1, 2, 2, 1), (1, 1, 1, 2), strict=True)):
            layers = [Bottleneck(c, width * 2**i, stride, dilation if i < 3 else 1)]
            c = 4 * width * 2**i
            layers += [Bottleneck(c, width * 2**i, 1, dilation) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*layers))
        self.aspp = nn.ModuleList([nn.Sequential(nn.Conv2d(c, aspp, 1, bias=False), nn.BatchNorm2d(aspp), nn.ReLU())]
                                  + [nn.Sequential(nn.Conv2d(c, aspp, 3, padding=r, dilation=r, bias=False),
                                                   nn.BatchNorm2d(aspp), nn.ReLU()) for r in (6, 12, 18)])
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(c, aspp, 1, bias=False), nn.ReLU())
        self.project = nn.Sequential(nn.Conv2d(5 * aspp, aspp, 1, bias=False), nn.BatchNorm2d(aspp), nn.ReLU())
        self.head = nn.Sequential(nn.Conv2d(aspp, aspp, 1), nn.GELU(), nn.Conv2d(aspp, n_classes + 1, 1))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)  # (B, w, S/4, S/4)
        h = self.layer4(self.layer3(self.layer2(self.layer1(h))))  # (B, 32w, S/16, S/16)
        pooled = self.pool(h).expand(-1, -1, *h.shape[-2:])
        h = self.project(torch.cat([branch(h) for branch in self.aspp] + [pooled], 1))  # (B, A, S/16, S/16)
        return F.interpolate(h, size=x.shape[-2:], mode="bilinear", align_corners=False)  # (B, A, S, S)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.features(x)
        return self.head(f), f  # (B, C+1, S, S), (B, A, S, S)


def load_backbone(net: DeepLabV3, path: Path) -> None:
    """An ImageNet ResNet checkpoint in torchvision's format (state dict; .safetensors or a torch file, possibly
    under "state_dict" / "model") into the backbone; its classifier (fc.*) is dropped. Every backbone tensor must
    be there with its shape: a wrong depth or format fails here, not silently."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
        state = state.get("state_dict", state.get("model", state))
    state = {k.removeprefix("module."): v for k, v in state.items() if not k.startswith(("fc.", "module.fc."))}
    backbone = {k for k in net.state_dict() if k.startswith(("conv1.", "bn1.", "layer"))}
    missing, unexpected = backbone - set(state), set(state) - backbone
    if missing or unexpected:
        raise ValueError(f"{path}: not a torchvision ResNet-{net.depth} state dict ({len(missing)} missing, e.g. "
                         f"{sorted(missing)[:2]}; {len(unexpected)} unexpected, e.g. {sorted(unexpected)[:2]})")
    net.load_state_dict(state, strict=False)


def segmenter(p: Params) -> nn.Module:
    """The arms' network: the small U-Net, or DeepLabv3 (ImageNet backbone from a local file when given)."""
    if p.arch == "unet":
        return UNet(p.width, p.n_classes)
    net = DeepLabV3(p.n_classes, p.backbone_depth, p.width)
    if p.backbone_weights:
        from models.inputs import input_path

        load_backbone(net, input_path(p.backbone_weights))
    return net


# ---- the mechanism -----------------------------------------------------------------------------------------
def pixel_margin(logits: torch.Tensor, y: torch.Tensor, n_seen: int) -> torch.Tensor:
    """m = z_y - max_{c != y} z_c over the classes seen so far. logits (B, C, S, S), y (B, S, S) -> (B, S, S)."""
    z = logits[:, :n_seen]
    z_y = z.gather(1, y[:, None])[:, 0]
    others = z.scatter(1, y[:, None], float("-inf"))
    return z_y - others.amax(1)


def pml_weights(margin: torch.Tensor, alpha: float) -> torch.Tensor:
    """Progressive Margin Learning: (1 - a) + a N softmax(-m / tau) over all pixels, renormalised to mean 1."""
    m = margin.detach().flatten()
    tau = m.std().clamp(min=1e-6)
    w = (1 - alpha) + alpha * m.numel() * torch.softmax(-m / tau, 0)
    return (w / w.mean()).view_as(margin)


def skd_curvature(head: nn.Module, f: torch.Tensor, y: torch.Tensor, n_seen: int, eps: float) -> torch.Tensor:
    """Normalised curvature of the margin along u = grad_f m / |grad_f m| (detached) at the decoder feature:

        mean_p [m(f + eps u) - 2 m(f) + m(f - eps u)]^2  /  mean_p [m(f + eps u) - m(f - eps u)]^2,

    the second-order change of m over one step of length eps against its first-order change over the same step
    (about (eps m'' / 2 m')^2 per pixel). Dimensionless, unchanged when the logits are scaled, 0 for a linear head.
    The spec's [.]^2 / eps^4 form is the raw m''^2: its size follows the logit scale, and a flat head (predicting
    background everywhere) drives it to 0, so a weight large enough to act pushes towards that collapse."""
    f_leaf = f.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(pixel_margin(head(f_leaf), y, n_seen).sum(), f_leaf)  # pixelwise head: per pixel
    u = grad / grad.norm(dim=1, keepdim=True).clamp(min=1e-8)  # (B, D, S, S)
    m0 = pixel_margin(head(f), y, n_seen)
    up, down = pixel_margin(head(f + eps * u), y, n_seen), pixel_margin(head(f - eps * u), y, n_seen)  # (B, S, S)
    return ((up - 2 * m0 + down) ** 2).mean() / (((up - down) ** 2).mean() + 1e-12)


def unbiased_kd(new_logits: torch.Tensor, old_logits: torch.Tensor, n_old: int, n_seen: int) -> torch.Tensor:
    """MiB distillation: KL(old || new) over [background, old classes], the new model's background absorbing the
    new classes (logsumexp), so old-model background may legitimately become a new class."""
    new = torch.cat([torch.logsumexp(torch.cat([new_logits[:, :1], new_logits[:, n_old:n_seen]], 1), 1, keepdim=True),
                     new_logits[:, 1:n_old]], 1).log_softmax(1)  # (B, n_old, S, S)
    old = old_logits[:, :n_old].softmax(1)
    return (old * (old.clamp(min=1e-8).log() - new)).sum(1).mean()


def mad_loss(f: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, competition: torch.Tensor) -> torch.Tensor:
    """(1/n) sum_{i != j} C_ij max(0, cos(mu_i, mu_j)) over batch prototypes and over classifier weight vectors:
    C's rows sum to 1, so each row is a competition-weighted mean cosine and the loss their mean over the n classes
    seen (in [0, 2]; the spec's plain sum grows with n, so a fixed weight would strengthen at every step)."""
    n = competition.shape[0]
    onehot = F.one_hot(y, n).permute(0, 3, 1, 2).float()  # (B, n, S, S)
    count = onehot.sum((0, 2, 3))  # (n,)
    mu = torch.einsum("bnhw,bdhw->nd", onehot, f) / count.clamp(min=1)[:, None]  # (n, D) class prototypes
    present = (count > 0).float()
    cos_mu = F.cosine_similarity(mu[:, None], mu[None], dim=-1).clamp(min=0) * present[:, None] * present[None]
    cos_w = F.cosine_similarity(weight[:n, None], weight[None, :n], dim=-1).clamp(min=0)  # (n, n)
    off = 1 - torch.eye(n)
    return (competition * off * (cos_mu + cos_w)).sum() / n


def competition_stats(logits: torch.Tensor, y: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum over pixels labelled i of the softmax mass of class j (n, n), and pixel counts per label (n,)."""
    prob = logits[:, :n].detach().softmax(1)  # (B, n, S, S)
    onehot = F.one_hot(y, n).permute(0, 3, 1, 2).float()
    return torch.einsum("bihw,bjhw->ij", onehot, prob), onehot.sum((0, 2, 3))


# ---- training ----------------------------------------------------------------------------------------------
def _load(data_dir: Path, p: Params) -> dict:
    imgs, masks = read_table(data_dir / "images.parquet"), read_table(data_dir / "masks.parquet")
    s = p.image_size
    x = torch.from_numpy(imgs["pixels"].astype(np.float32) / 255).view(-1, s, s, 3).permute(0, 3, 1, 2).contiguous()
    y = torch.from_numpy(masks["mask"].astype(np.int64)).view(-1, s, s)
    pool = imgs["pool"]
    return {"x": x[pool == "train"], "y": y[pool == "train"], "x_val": x[pool == "val"], "y_val": y[pool == "val"],
            "x_test": x[pool == "test"], "y_test": y[pool == "test"]}


def _pool(y: torch.Tensor, classes: list[int], cap: int) -> torch.Tensor:
    """Training images of a step: those containing one of its classes (overlapped setting), the first `cap`."""
    has = torch.zeros(len(y), dtype=torch.bool)
    for c in classes:
        has |= (y == c).flatten(1).any(1)
    return torch.nonzero(has)[:, 0][:cap]


def _batches(d: dict, pool: torch.Tensor, seen: int, current: list[int], p: Params):
    per_epoch = -(-len(pool) // p.batch_size)
    cur = torch.zeros(p.n_classes + 1, dtype=torch.long)
    cur[current] = torch.tensor(current)  # label map: current classes keep their id, everything else -> 0

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        parts = []
        for s in range(p.n_seeds):
            g = torch.Generator().manual_seed((p.seed + s) * 100_003 + step // per_epoch)
            idx = pool[torch.randperm(len(pool), generator=g)[(step % per_epoch) * p.batch_size :][: p.batch_size]]
            y = d["y"][idx]
            parts.append({"x": d["x"][idx], "y": cur[y], "y_full": torch.where(y < seen, y, 0),
                          "who": torch.full((len(idx),), s)})
        return {k: torch.cat([part[k] for part in parts]) for k in parts[0]}

    return batch_fn, per_epoch


def net_names(p: Params) -> dict[str, tuple[str, float | None, int]]:
    """Networks of the incremental steps: '<arm>_c<k>_s<seed>' -> (arm, value of its own weight, seed)."""
    return {f"{a}_c{k}_s{s}": (a, v, s) for a in p.arms for k, v in enumerate(candidates(p, a))
            for s in range(p.n_seeds)}


def train(ctx) -> None:
    p: Params = ctx.params
    d = _load(ctx.data_dir, p)
    names = net_names(p)
    for proto in p.protocols:
        steps = protocol_steps(proto, p.n_classes)
        nets = {}
        for s in range(p.n_seeds):
            torch.manual_seed(p.seed + s)
            nets[f"s{s}"] = segmenter(p)
        model, old_nets = LockStep(nets), {}
        for t, current in enumerate(steps):
            seen, n_old = current[-1] + 1, current[0]  # classes [0, seen) known after this step; [0, n_old) before
            if t == 1:  # every arm and candidate starts from the shared first-step model of its seed
                nets = {name: _copy(model.nets[f"s{s}"], p) for name, (_, _, s) in names.items()}
            elif t > 1:
                nets = {name: _copy(net, p) for name, net in model.nets.items()}
            if t:
                old_nets = {name: _copy(net, p).eval().requires_grad_(False) for name, net in model.nets.items()}
                if t == 1:
                    old_nets = {name: old_nets[f"s{s}"] for name, (_, _, s) in names.items()}
                model = LockStep(nets)
            batch_fn, per_epoch = _batches(d, _pool(d["y"], current, p.images_per_step), seen, current, p)
            competition = {name: torch.full((seen, seen), float("nan")) for name in old_nets}  # EMA C, checkpointed
            step_fn = _step_fn(ctx, p, t, seen, n_old, per_epoch, old_nets, competition, names)
            epochs = p.base_epochs if t == 0 else p.epochs
            ctx.progress(f"{proto} step {t}: classes {current}, {len(model.nets)} networks, "
                         f"{epochs} epochs x {per_epoch} steps")
            schedule = {"steps": epochs * per_epoch, "warmup": p.step_warmup, "decay": p.step_decay} if t else {}
            lr = p.lr if t == 0 or p.step_lr is None else p.step_lr
            ctx.fit(f"{proto}_step{t}", ctx.engine(model, lr, arms=model.nets, **schedule), step_fn, batch_fn,
                    epochs * per_epoch, state=competition)


def _copy(net: nn.Module, p: Params) -> nn.Module:
    new = UNet(p.width, p.n_classes) if p.arch == "unet" else DeepLabV3(p.n_classes, p.backbone_depth, p.width)
    new.load_state_dict(net.state_dict())
    return new


def _step_fn(ctx, p: Params, t: int, seen: int, n_old: int, per_epoch: int, old_nets: dict, competition: dict,
             names: dict):

    def step_fn(engine, b, step):
        total, metrics, old_out = 0.0, {}, {}
        alpha = min(step // per_epoch / max(p.epochs - 1, 1), 1.0)  # PML: 0 -> 1 over the step's epochs
        for name, net in engine.module.nets.items():
            seed = int(name.rsplit("s", 1)[1])
            rows = b["who"] == seed
            x, y = b["x"][rows], b["y"][rows]
            logits, f = net(x)  # (B, C+1, S, S), (B, D, S, S)
            if t == 0:
                loss = F.cross_entropy(logits[:, :seen], y)
                total, metrics[f"{name}/ce"] = total + loss, float(loss.detach())
                continue
            arm, value, _ = names[name]
            lam = {"lambda_kd": p.lambda_kd, "lambda_skd": p.lambda_skd, "lambda_mad": p.lambda_mad}
            if value is not None:
                lam[TUNED[arm]] = value
            pml, skd, mad, distil = ARMS[arm]
            if arm == "joint":
                y = b["y_full"][rows]
            key = (id(old_nets[name]), seed)  # at step 1 every candidate of a seed shares its first-step model
            if key not in old_out:
                with torch.no_grad():
                    old_out[key] = old_nets[name](x)[0]
            old_logits = old_out[key]
            if distil:  # PLOP pseudo-labels: background pixels the old model confidently calls an old class
                conf, guess = old_logits[:, :n_old].softmax(1).max(1)
                y = torch.where((y == 0) & (guess > 0) & (conf > p.pseudo_threshold), guess, y)
            ce = F.cross_entropy(logits[:, :seen], y, reduction="none")  # (B, S, S)
            margin = pixel_margin(logits, y, seen)
            w = pml_weights(margin, alpha) if pml else torch.ones_like(ce)
            loss = (w * ce).mean()
            metrics[f"{name}/ce"] = float(loss.detach())
            if distil:
                noisy = net.head(f + p.sigma * torch.randn_like(f)) if skd else logits
                kd = unbiased_kd(noisy, old_logits, n_old, seen)
                loss, metrics[f"{name}/kd"] = loss + lam["lambda_kd"] * kd, float(kd.detach())
            if skd:
                curv = skd_curvature(net.head, f, y, seen, p.eps)
                loss, metrics[f"{name}/skd"] = loss + lam["lambda_skd"] * curv, float(curv.detach())
            if mad:
                stats, count = competition_stats(logits, y, seen)
                packed = ctx.all_reduce_sum(torch.cat([stats.flatten(), count]))  # same C on every rank
                stats, count = packed[: seen * seen].view(seen, seen), packed[seen * seen :]
                c_batch = (stats / count.clamp(min=1)[:, None]) * (1 - torch.eye(seen))
                c_batch = c_batch / c_batch.sum(1, keepdim=True).clamp(min=1e-8)
                prev = competition[name].nan_to_num(0.0)  # NaN = never updated (the fit state's "unset")
                c_new = torch.where((count > 0)[:, None], p.ema * prev + (1 - p.ema) * c_batch, prev)
                competition[name].copy_(c_new)
                dec = mad_loss(f, y, net.head[-1].weight[:seen, :, 0, 0], c_new)
                loss, metrics[f"{name}/mad"] = loss + lam["lambda_mad"] * dec, float(dec.detach())
            total = total + loss
            metrics[f"{name}/margin"] = float(margin.detach().mean())
        return total, metrics

    return step_fn


# ---- evaluation --------------------------------------------------------------------------------------------
def miou(pred: torch.Tensor, y: torch.Tensor, classes: list[int]) -> tuple[float, dict[int, float]]:
    """Mean IoU over `classes` (those absent from both prediction and truth are skipped)."""
    ious = {}
    for c in classes:
        inter, union = ((pred == c) & (y == c)).sum().item(), ((pred == c) | (y == c)).sum().item()
        if union:
            ious[c] = inter / union
    return (float(np.mean(list(ious.values()))) if ious else 0.0), ious


def select_on_validation(val_miou: list[float]) -> int:
    """The candidate with the best validation mIoU (the first among ties)."""
    return int(np.argmax(val_miou))


def evaluate(ctx) -> dict[str, float]:
    """Per arm and seed: the candidate (value of the arm's own weight) with the best all-class mIoU on the
    validation split, then its test metrics. The test split is read only for the chosen candidates' metrics and the
    premises (first-step mIoU, the lambda_skd = 0 candidate's forgetting)."""
    p: Params = ctx.params
    d = _load(ctx.data_dir, p)
    names = net_names(p)
    per: dict[str, list[float]] = {}
    add = lambda key, value: per.setdefault(key, []).append(float(value))  # noqa: E731
    margins, class_iou = {}, {}
    for proto in p.protocols:
        steps = protocol_steps(proto, p.n_classes)
        old_cls, new_cls = list(range(steps[0][-1] + 1)), [c for st in steps[1:] for c in st]
        first, final = ctx.network(f"{proto}_step0"), ctx.network(f"{proto}_step{len(steps) - 1}")
        with torch.no_grad():
            z0 = first.eval()(d["x_test"])
            z_val = final.eval()(d["x_val"])
            z = final(d["x_test"])
        y = d["y_test"]
        for s in range(p.n_seeds):
            old0, _ = miou(z0[f"s{s}"][0][:, : len(old_cls)].argmax(1), y, old_cls)
            add("detail/step0_old_miou", old0)
            for a in p.arms:
                cands = [name for name, (arm, _, seed) in names.items() if arm == a and seed == s]
                val = [miou(z_val[n][0].argmax(1), d["y_val"], old_cls + new_cls)[0] for n in cands]
                chosen = cands[select_on_validation(val)]
                if TUNED.get(a) in p.grid:
                    add(f"detail/{a}/chosen_{TUNED[a]}", names[chosen][1])
                if a == "ldka" and 0.0 in p.grid.get("lambda_skd", []):  # premise: the step without curvature
                    zero = next(n for n in cands if names[n][1] == 0.0)
                    add("detail/ldka_lambda0/forgetting", old0 - miou(z[zero][0].argmax(1), y, old_cls)[0])
                logits = z[chosen][0]  # (N, C+1, S, S)
                pred = logits.argmax(1)
                old, _ = miou(pred, y, old_cls)
                new, _ = miou(pred, y, new_cls)
                every, ious = miou(pred, y, old_cls + new_cls)
                m = pixel_margin(logits, y, p.n_classes + 1)
                is_new = torch.isin(y, torch.tensor(new_cls))
                low = float((m[is_new] < 0.5 * m.std()).float().mean()) if is_new.any() else 0.0
                prefix = "method/" if a == "ldka" else f"baseline/{a}/"
                for key, value in (("old_miou", old), ("new_miou", new), ("all_miou", every),
                                   ("forgetting", old0 - old), ("low_margin_frac", low), ("val_miou", max(val))):
                    add(prefix + key, value)
                    add(f"detail/{proto}/{a}/{key}", value)
                margins.setdefault(a, []).append(m[is_new].numpy())
                for c, v in ious.items():
                    class_iou.setdefault(a, {}).setdefault(c, []).append(v)
    out = {k: float(np.mean(v)) for k, v in per.items()}
    _plots(ctx.plots_dir, margins, class_iou)
    return out


def _plots(plots_dir: Path, margins: dict, class_iou: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for a, ms in margins.items():
        ax.hist(np.concatenate(ms), bins=60, histtype="step", density=True, label=a)
    ax.axvline(0, color="k", lw=0.8)
    ax.set(xlabel="pixel margin z_y - max z_c (new-class test pixels)", ylabel="density",
           title="Margins of new-class pixels after the last step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plots_dir / "new_class_margins.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    classes = sorted({c for v in class_iou.values() for c in v})
    for i, (a, per_class) in enumerate(class_iou.items()):
        ax.bar(np.arange(len(classes)) + i * 0.8 / len(class_iou) - 0.4, [np.mean(per_class.get(c, [0]))
               for c in classes], 0.8 / len(class_iou), label=a)
    ax.set_xticks(np.arange(len(classes)), [("bg" if c == 0 else str(c)) for c in classes])
    ax.set(xlabel="class", ylabel="IoU", title="Per-class IoU after the last step")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(plots_dir / "per_class_iou.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="ldka",
    title="LDKA: learnability-driven knowledge assimilation for class-incremental semantic segmentation",
    seed="000_2dd18ae8605fb5c1.txt, abstract 5",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/new_miou", "max"),
    claim=Claim(premises=(
        Compare("detail/step0_old_miou", ">=", STEP0_BAR, name="first_step_learns_base_classes"),
        Compare("detail/ldka_lambda0/forgetting", "<=", MAX_DROP, name="increment_keeps_base_classes_lambda0"),
        Compare("baseline/base/new_miou", ">=", NEW_BAR, name="base_learns_new_classes"),
    ), all_of=(
        Compare("method/new_miou", ">", "baseline/base/new_miou"),
        Compare("method/old_miou", ">=", "baseline/base/old_miou", margin=-0.01),
    ), summary="LDKA raises new-class mIoU over the base learner while losing at most 1 point of old-class mIoU",
        note="each arm keeps the value of its own loss weight with the best validation mIoU (base: lambda_kd, "
             "LDKA: lambda_skd, grids of equal length)"),
)
