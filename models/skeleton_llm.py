"""SkeletonLLM: skeleton understanding by rendering skeletons into a (tiny) MLLM's native image modality.

Seed: 003_9a806cafa3d919df.txt, abstract 1. Spec: ../shared/papers/skeleton_llm.md.

What it implements (function names in brackets):
- a synthetic 3D humanoid (models.common.sequences) driven by parametric action programs [action_pose], emitted in
  three joint formats: A = NTU-25 order, B = COCO-17, C = 15 joints reordered [FORMATS, derive_joints];
- DrAction [DrAction]: root-centred, bounding-box-diagonal scaled joints; a learnable camera (yaw, pitch); each
  bone a soft segment exp(-d^2 / 2 sigma^2) with learnable sigma [segment_field]; bone colour from an MLP over a
  format-free joint descriptor (limb, side, depth along the limb) [joint_descriptor]; learnable soft temporal
  attention picks K=4 keyframes, tiled 2x2 with fading motion trails. Fully differentiable;
- a tiny MLLM from scratch [TinyViT + projector + PrefixLM]: stage 0 captions synthetic line drawings [drawings];
- cooperative training: joint DrAction+MLLM tuning (recognition + captioning), Causal Reasoning Distillation
  (rationale then answer, the teacher is the generator's program [TEXT]), Discriminative Finetuning: softmax CE over
  the sequence log-likelihoods of the label and its confusion partner [dft_loss];
- baselines: feature-vector alignment (temporal conv -> 4 prefix tokens) [FeatureArm], discrete motion tokens
  (VQ-VAE, 64 codes appended to the vocabulary) [VQArm], both reading the joints aligned by name across formats
  [by_name], so that they can transfer across formats at all; ablations frozen renderer, no CRD, no DFT, each
  trained for the same steps as the arm it is compared with:
  - no CRD branches at the CRD phase and trains on the same "why" prompts with the same teacher statements in
    post-hoc order, answer first ("a ; because f1 ; f2"), instead of CRD's causal chain ("f1 ; f2 ; so a")
    [why_texts]: what it lacks is the rationale-before-answer mechanism, not the rationale data (an arm that never
    saw a rationale would lose the reasoning comparison by construction);
  - no DFT branches at the DFT phase and trains its steps on the same tasks without the candidate loss (not a
    snapshot with fewer steps);
- premises: SkeletonLLM recognises the source format above ACC_BAR, and each compared baseline (feature, VQ,
  frozen renderer) above BASELINE_BAR (twice chance): otherwise the comparisons say nothing about the paper;
- metrics: recognition top-1, cross-format accuracy (train on A, zero-shot on B and C), confusable-pair accuracy,
  captioning BLEU-4 [bleu4], reasoning accuracy (generated rationale statements that match the facts) [reasoning].
- loaders for real data (full profile): NTU RGB+D `.skeleton` [load_ntu_skeleton], Kinetics-skeleton JSON
  [load_kinetics_json]; their formats are A and K (OpenPose-18).

Deviations from the paper (choices the abstract left open):
- all trained arms live in ONE DeepSpeed engine (a ModuleDict; start-up paid once). Each stage is a `ctx.fit` phase
  with a fresh AdamW state at a constant rate without warm-up: `lr`, except DFT at `dft_lr` [phase_lr], the same
  for every arm and chosen on a held-out world (another seed), not on a replicate's test set. A phase sets requires_grad
  only on the parameters it trains [TRAINABLE], so the others get no gradient, no all-reduce and no update.
  Branches (frozen renderer, no-CRD, no-DFT) are in-place copies made at phase boundaries; the after-tuning
  SkeletonLLM state is saved as a snapshot file (compared with the frozen renderer, which trains only in the tuning
  stage).
- "root" for centring is the sequence's bounding-box centre (the COCO-like format has no pelvis); descriptor depth is
  the depth along the limb chain (tree depth differs between formats, so it would not be format-free).
- cooperative training keeps earlier skills by replay [TASKS]: CRD trains rationale+answer together with recognition
  and captioning CE, DFT adds its candidate loss to the same three CE terms; the ablations replay the same tasks
  [ARM_TASKS]. Without replay, CRD lowered recognition and DFT erased reasoning and captions, and DFT without
  recognition CE lowered top-1 over all labels (its loss ranks a label against its partner only; smoke scale).
- the VQ codebook is initialised from encoded training frames (a collapsed codebook otherwise), trained in the stage-0
  phase and frozen afterwards. The frozen renderer's images are rendered once (it has nothing to learn).
- classification is by sequence likelihood over the label set (the usual MLLM evaluation); captions and rationales
  by greedy decoding. The smoke profile uses one trail copy per keyframe (trail: 1) to fit the CPU budget.
- the data make the renderer matter through `camera_jitter` (body heading): with large headings, left/right is
  ambiguous from 2D position alone and has to come from the learned side-aware bone colours and camera.
- real-data loaders give label text only: caption = label, rationale = no facts (CRD reduces to the answer).
  The full profile runs one seed per run (3 seeds = three runs with `seed` overridden).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from models.common.lm import TinyLM, WordVocab
from models.common.sequences import SKELETON, forward_kinematics
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

ACTIONS = ("wave_l", "wave_r", "kick_l", "kick_r", "squat", "jump", "arm_circle", "bow")
PARTNER = {"wave_l": "wave_r", "wave_r": "wave_l", "kick_l": "kick_r", "kick_r": "kick_l", "squat": "jump",
           "jump": "squat", "arm_circle": "bow", "bow": "arm_circle"}  # confusable pairs: side, or up/down motion
# action -> (answer, caption's verb phrase, the facts its rationale states: the CRD teacher reads them off the program)
TEXT = {"wave_l": ("wave left hand", "waves the left hand", ("left wrist above head", "left hand moves side to side")),
        "wave_r": ("wave right hand", "waves the right hand", ("right wrist above head",
                                                               "right hand moves side to side")),
        "kick_l": ("kick left leg", "kicks with the left leg", ("left foot goes forward", "left knee bends")),
        "kick_r": ("kick right leg", "kicks with the right leg", ("right foot goes forward", "right knee bends")),
        "squat": ("squat down", "squats down", ("hips go down", "both knees bend")),
        "jump": ("jump up", "jumps up", ("hips go up", "feet leave the ground")),
        "arm_circle": ("circle both arms", "circles both arms", ("both wrists above head", "arms swing round")),
        "bow": ("bow forward", "bows forward", ("head goes forward", "back bends"))}
CANON = [name for name, *_ in SKELETON]
# formats as "joint<parent" lists: A = NTU RGB+D 25 order, B = COCO 17, C = 15 reordered, K = OpenPose 18
_FORMATS = {
    "A": "pelvis spine<pelvis neck<spine_shoulder head<neck l_shoulder<spine_shoulder l_elbow<l_shoulder "
         "l_wrist<l_elbow l_hand<l_wrist r_shoulder<spine_shoulder r_elbow<r_shoulder r_wrist<r_elbow r_hand<r_wrist "
         "l_hip<pelvis l_knee<l_hip l_ankle<l_knee l_foot<l_ankle r_hip<pelvis r_knee<r_hip r_ankle<r_knee "
         "r_foot<r_ankle spine_shoulder<spine l_handtip<l_hand l_thumb<l_hand r_handtip<r_hand r_thumb<r_hand",
    "B": "nose l_eye<nose r_eye<nose l_ear<l_eye r_ear<r_eye l_shoulder<nose r_shoulder<nose l_elbow<l_shoulder "
         "r_elbow<r_shoulder l_wrist<l_elbow r_wrist<r_elbow l_hip<l_shoulder r_hip<r_shoulder l_knee<l_hip "
         "r_knee<r_hip l_ankle<l_knee r_ankle<r_knee",
    "C": "r_ankle<r_knee r_knee<r_hip r_hip<pelvis r_wrist<r_elbow r_elbow<r_shoulder r_shoulder<neck pelvis "
         "neck<pelvis head<neck l_shoulder<neck l_elbow<l_shoulder l_wrist<l_elbow l_hip<pelvis l_knee<l_hip "
         "l_ankle<l_knee",
    "K": "nose<neck neck r_shoulder<neck r_elbow<r_shoulder r_wrist<r_elbow l_shoulder<neck l_elbow<l_shoulder "
         "l_wrist<l_elbow r_hip<neck r_knee<r_hip r_ankle<r_knee l_hip<neck l_knee<l_hip l_ankle<l_knee r_eye<nose "
         "l_eye<nose r_ear<r_eye l_ear<l_eye",
}
FORMATS = {f: [tuple((j + "<").split("<")[:2]) for j in spec.split()] for f, spec in _FORMATS.items()}
PART = {"pelvis": ("torso", 0), "spine": ("torso", 1), "spine_shoulder": ("torso", 2), "neck": ("torso", 2),
        "head": ("head", 1), "nose": ("head", 1), "eye": ("head", 2), "ear": ("head", 2), "shoulder": ("arm", 0),
        "elbow": ("arm", 1), "wrist": ("arm", 2), "hand": ("arm", 3), "handtip": ("arm", 3), "thumb": ("arm", 3),
        "hip": ("leg", 0), "knee": ("leg", 1), "ankle": ("leg", 2), "foot": ("leg", 3)}
LIMBS = ("torso", "head", "arm", "leg")
COLOURS = {"red": (1, 0, 0), "green": (0, 1, 0), "blue": (0, 0, 1), "yellow": (1, 1, 0), "cyan": (0, 1, 1),
           "magenta": (1, 0, 1)}
VISUAL = ("skel", "frozen", "nocrd", "nodft")  # DrAction arms trained in the engine ("tuned" is a saved snapshot)
ACC_BAR = 0.5  # premise: SkeletonLLM's top-1 on the source format (chance is 1/6 with 6 actions, 1/8 with 8)
BASELINE_BAR = 1 / 3  # premise: every compared baseline learned above chance (twice chance with 6 actions)
EVAL_ARMS = {"skel": "method", "tuned": "detail/differentiable_tuned", "frozen": "baseline/frozen",
             "nocrd": "baseline/no_crd", "nodft": "baseline/no_dft", "feature": "baseline/feature", "vq": "baseline/vq"}


class Params(PaperParams):
    source: Literal["synthetic", "ntu", "kinetics"] = Field("synthetic", description="Action programs or a loader.")
    data_root: str = Field("", description="ntu/kinetics: folder of .skeleton or .json files.")
    n_actions: int = Field(6, ge=2, le=8, description="Actions used, in ACTIONS order (pairs stay together).")
    n_train: int = Field(300, ge=2, description="Training sequences (format A).")
    n_test: int = Field(60, ge=2, description="Test sequences (every format).")
    frames: int = Field(16, ge=4, description="Frames T per sequence.")
    joint_noise: float = Field(0.01, ge=0, description="Gaussian joint noise (metres).")
    speed: tuple[float, float] = Field((0.8, 1.6), description="Range of action cycles per clip; mid splits slow/fast.")
    camera_jitter: float = Field(0.3, ge=0, description="Body heading drawn from +-jitter (radians).")
    n_drawings: int = Field(512, ge=4, description="Stage-0 line drawings.")
    tile: int = Field(16, ge=8, description="Keyframe tile side; the image is 2 tiles x 2 tiles.")
    trail: int = Field(2, ge=0, description="Motion-trail copies behind each keyframe (fading).")
    patch: int = Field(8, ge=2, description="ViT patch side.")
    d_model: int = Field(64, ge=8, description="Width of the ViT, the decoder and the baseline encoders.")
    layers: int = Field(2, ge=1, description="Layers of the ViT and of the decoder.")
    heads: int = Field(4, ge=1)
    n_codes: int = Field(64, ge=2, description="VQ-VAE codebook size (motion tokens).")
    stage0_steps: int = Field(80, ge=1, description="Stage 0 (drawing captions) and VQ-VAE steps.")
    tune_steps: int = Field(150, ge=1, description="Joint DrAction+MLLM tuning steps (recognition, captioning).")
    crd_steps: int = Field(40, ge=1, description="Causal Reasoning Distillation steps.")
    dft_steps: int = Field(40, ge=1, description="Discriminative Finetuning steps.")
    batch_size: int = Field(32, ge=2)
    lr: float = Field(2e-3, gt=0, description="AdamW rate of stage 0, tuning and CRD (constant, no warm-up).")
    dft_lr: float | None = Field(None, gt=0, description="AdamW rate of every arm's DFT phase (None: lr); the DFT "
                                 "phase starts from a fresh AdamW state, with no warm-up, at this rate.")


# ---- data ----------------------------------------------------------------------------------------------------
def action_pose(action: str, t: np.ndarray, speed: float, phase: float, heading: float) -> np.ndarray:
    """Joints (T, 16, 3) of the canonical humanoid running an action program (angles of SKELETON's hinges)."""
    phi = 2 * np.pi * speed * t + phase  # (T,)
    ang, root = np.zeros((len(t), len(CANON))), np.zeros((len(t), 3))
    ang[:, 0] = heading
    side = 1.0 if action.endswith("_l") else -1.0
    up, pulse = (1 - np.cos(phi)) / 2, np.maximum(np.sin(phi), 0)
    if action.startswith("wave"):  # arm raised beside the head, swinging side to side
        sh, el = (4, 5) if side > 0 else (7, 8)
        ang[:, sh], ang[:, el] = side * (2.5 + 0.35 * np.sin(phi)), 0.5 * np.sin(phi)
    elif action.startswith("kick"):  # hip swings the foot forward (-x angle), knee bends before the kick
        hip, knee = (10, 11) if side > 0 else (13, 14)
        ang[:, hip], ang[:, knee] = -1.3 * pulse, 0.9 * np.maximum(-np.sin(phi), 0)
    elif action == "squat":
        root[:, 1], ang[:, [10, 13]], ang[:, [11, 14]] = -0.35 * up, -1.2 * up[:, None], 2.0 * up[:, None]
    elif action == "jump":
        crouch = np.maximum(-np.sin(phi), 0)
        root[:, 1], ang[:, [10, 13]], ang[:, [11, 14]] = 0.35 * pulse, -0.5 * crouch[:, None], 0.9 * crouch[:, None]
    elif action == "arm_circle":
        ang[:, 4], ang[:, 7] = np.mod(phi, 2 * np.pi), -np.mod(phi, 2 * np.pi)
    elif action == "bow":
        ang[:, 1], ang[:, 2] = 0.9 * up, 0.3 * up
    return forward_kinematics(root, ang)


def derive_joints(canon: np.ndarray, fmt: str) -> np.ndarray:
    """(T, 16, 3) canonical joints -> (T, J, 3) in a format; extra points are fixed offsets along the limbs."""
    c = {n: canon[:, i] for i, n in enumerate(CANON)}
    for s in "lr":
        fore = c[f"{s}_wrist"] - c[f"{s}_elbow"]
        c[f"{s}_hand"], c[f"{s}_handtip"] = c[f"{s}_wrist"] + 0.35 * fore, c[f"{s}_wrist"] + 0.7 * fore
        c[f"{s}_thumb"] = c[f"{s}_wrist"] + 0.5 * fore + np.array([0.0, 0.0, 0.04])
        c[f"{s}_foot"] = c[f"{s}_ankle"] + np.array([0.0, -0.04, 0.12])
        x = 1 if s == "l" else -1
        c[f"{s}_eye"], c[f"{s}_ear"] = c["head"] + np.array([0.035 * x, 0.01, 0.08]), c["head"] + [0.08 * x, 0, 0]
    c["spine_shoulder"], c["nose"] = c["spine"] + 0.8 * (c["neck"] - c["spine"]), c["head"] + [0, -0.03, 0.09]
    return np.stack([c[n] for n, _ in FORMATS[fmt]], 1)


def joint_descriptor(name: str) -> np.ndarray:
    """Format-free descriptor (6,): limb one-hot (torso, head, arm, leg), side (+1 left, -1 right), limb depth / 3."""
    side = 1.0 if name.startswith("l_") else -1.0 if name.startswith("r_") else 0.0
    limb, depth = PART[name[2:] if side else name]
    return np.array([*(np.asarray(LIMBS) == limb), side, depth / 3], dtype=np.float32)


def format_table(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Bones (E, 2) as (joint, parent) indices and joint descriptors (J, 6) of a format."""
    names = [n for n, _ in FORMATS[fmt]]
    bones = [(i, names.index(p)) for i, (_, p) in enumerate(FORMATS[fmt]) if p]
    return torch.tensor(bones), torch.from_numpy(np.stack([joint_descriptor(n) for n in names]))


def load_ntu_skeleton(path: Path) -> np.ndarray:
    """NTU RGB+D `.skeleton` text file -> (T, 25, 3) xyz of the first body (format A order)."""
    lines, frames, i = Path(path).read_text().split("\n"), [], 1
    for _ in range(int(lines[0])):
        n_bodies, i = int(lines[i]), i + 1
        joints = np.zeros((25, 3))
        for b in range(n_bodies):
            n_joints = int(lines[i + 1])  # lines[i] is the body's info line
            rows = np.array([[float(v) for v in lines[i + 2 + j].split()[:3]] for j in range(n_joints)])
            joints = rows if b == 0 else joints
            i += 2 + n_joints
        frames.append(joints)
    return np.stack(frames)


def load_kinetics_json(path: Path) -> tuple[np.ndarray, int]:
    """Kinetics-skeleton JSON (OpenPose 18, 2D) -> (T, 18, 3) with z = 0 (image y flipped up) and label_index."""
    doc = json.loads(Path(path).read_text())
    out = np.zeros((len(doc["data"]), 18, 3))
    for f, frame in enumerate(doc["data"]):
        if frame["skeleton"]:
            pose = np.asarray(frame["skeleton"][0]["pose"]).reshape(18, 2)
            out[f, :, 0], out[f, :, 1] = pose[:, 0], -pose[:, 1]
    return out, int(doc["label_index"])


def _real_sequences(p: Params) -> tuple[list[np.ndarray], list[str], str]:
    root = input_path(p.data_root)
    if p.source == "ntu":
        files = sorted(root.glob("*.skeleton"))
        return [load_ntu_skeleton(f) for f in files], [f"class {int(f.stem[-3:])}" for f in files], "A"
    loaded = [load_kinetics_json(f) for f in sorted(root.glob("*.json"))]
    return [x for x, _ in loaded], [f"class {y}" for _, y in loaded], "K"


def drawings(n: int, size: int, rng: np.random.Generator) -> tuple[np.ndarray, list[str]]:
    """Stage-0 images (n, 3, size, size): one coloured soft segment, captioned by colour, orientation, quadrant."""
    colour_names, orient = list(COLOURS), {"horizontal": (1, 0), "vertical": (0, 1), "diagonal": (0.7, 0.7)}
    images, captions = [], []
    for _ in range(n):
        colour, o = rng.choice(colour_names), list(orient)[rng.integers(3)]
        row, col = rng.integers(2), rng.integers(2)
        centre = np.array([(col - 0.5) * 0.5, (row - 0.5) * 0.5]) + rng.uniform(-0.05, 0.05, 2)  # (u, v)
        half = 0.15 * np.asarray(orient[o])
        seg = torch.tensor(np.stack([centre - half, centre + half]), dtype=torch.float32)  # (2, 2)
        field = segment_field(seg[None, 0], seg[None, 1], torch.tensor(0.03), size)  # (HW, 1)
        img = torch.tanh(2 * field @ torch.tensor([COLOURS[colour]], dtype=torch.float32))  # (HW, 3)
        images.append(img.T.reshape(3, size, size).numpy())
        captions.append(f"{colour} {o} line {('top', 'bottom')[row]} {('left', 'right')[col]}")
    return np.stack(images).astype(np.float32), captions


def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    t = np.arange(p.frames) / p.frames
    actions = ACTIONS[: p.n_actions]
    if p.source == "synthetic":
        n, fmts = p.n_train + p.n_test, ("A", "B", "C")
        labels = [actions[i % len(actions)] for i in rng.permutation(n)]
        speeds = rng.uniform(*p.speed, n)
        canon = [action_pose(a, t, s, rng.uniform(0, 2 * np.pi), rng.uniform(-p.camera_jitter, p.camera_jitter))
                 for a, s in zip(labels, speeds, strict=True)]
        seqs = {f: [derive_joints(c, f) + rng.normal(0, p.joint_noise, (p.frames, len(FORMATS[f]), 3))
                    for c in canon] for f in fmts}
        answers = [TEXT[a][0] for a in labels]
        mid = sum(p.speed) / 2
        captions = [f"a person {'slowly' if s < mid else 'quickly'} {TEXT[a][1]}" for a, s in zip(labels, speeds,
                                                                                                 strict=True)]
        rationale = [" ; ".join(TEXT[a][2]) for a in labels]
    else:  # real data: one format, label text only; sequences resampled to T frames
        raw, answers, fmt = _real_sequences(p)
        fmts, n = (fmt,), len(raw)
        seqs = {fmt: [x[np.linspace(0, len(x) - 1, p.frames).round().astype(int)] for x in raw]}
        labels, captions, rationale = answers, answers, [""] * n
    split = np.where(np.arange(n) < p.n_train, "train", "test")
    cols: dict[str, list] = {c: [] for c in ("seq_id", "format", "action", "split", "frame", "joint", "x", "y", "z")}
    for f in fmts:
        x = np.stack(seqs[f]).astype(np.float32)  # (N, T, J, 3), rows in (seq, frame, joint) order
        s_, t_, j_ = (g.ravel() for g in np.meshgrid(*map(np.arange, x.shape[:3]), indexing="ij"))
        xyz = x.reshape(-1, 3).T
        for c, v in (("seq_id", s_), ("format", np.full(len(s_), f)), ("action", np.asarray(labels)[s_]),
                     ("split", split[s_]), ("frame", t_), ("joint", j_), ("x", xyz[0]), ("y", xyz[1]), ("z", xyz[2])):
            cols[c].append(v)
    cols = {c: np.concatenate(v) for c, v in cols.items()}
    write_table(out_dir / "skeletons.parquet", cols)
    rows = [(f, i, n, p_) for f in FORMATS for i, (n, p_) in enumerate(FORMATS[f])]
    names = [[n for n, _ in FORMATS[f]] for f, *_ in rows]
    write_table(out_dir / "formats.parquet", {
        "format": [r[0] for r in rows], "bone_src": [r[1] for r in rows],
        "bone_dst": [nm.index(r[3]) if r[3] else -1 for r, nm in zip(rows, names, strict=True)],
        "joint_name": [r[2] for r in rows], "joint_descriptor": np.stack([joint_descriptor(r[2]) for r in rows])})
    text = {"seq_id": [], "task": [], "prompt": [], "rationale": [], "answer": []}
    for s in range(n):
        for task, prompt, rat, ans in (("recognise", "what action", "", answers[s]), ("caption", "describe", "",
                                       captions[s]), ("reason", "why", rationale[s], answers[s])):
            for c, v in zip(text, (s, task, prompt, rat, ans), strict=True):
                text[c].append(v)
    write_table(out_dir / "text.parquet", text)
    images, caps = drawings(p.n_drawings, 2 * p.tile, rng)
    write_table(out_dir / "drawings.parquet", {"drawing_id": np.arange(len(caps)), "caption": caps,
                                               "pixels": images.reshape(len(caps), -1)})


# ---- DrAction: the differentiable, format-agnostic renderer ----------------------------------------------------
def segment_field(a: torch.Tensor, b: torch.Tensor, sigma: torch.Tensor, size: int) -> torch.Tensor:
    """Soft segments a->b (..., E, 2) in [-0.5, 0.5]^2 (u right, v down) on a size^2 grid: (..., HW, E) intensities
    exp(-d^2 / 2 sigma^2), d = distance from the pixel centre to the segment. The forward pass is
    `segment_field_ref`'s, op for op (the same values); the backward is written out (`_SegmentField`)."""
    return _SegmentField.apply(a, b, sigma, size)


def _field_terms(a: torch.Tensor, b: torch.Tensor, sigma: torch.Tensor, size: int) -> tuple[torch.Tensor, ...]:
    """The field and what its gradient needs: s (the nearest point's position along the segment) and the offset
    e = pixel - nearest point (eu, ev), each (..., HW, E). Written per coordinate: stacked (u, v) pairs cost twice as
    much on CPU."""
    g = (torch.arange(size, dtype=a.dtype) + 0.5) / size - 0.5
    pu, pv = g.repeat(size)[:, None], g.repeat_interleave(size)[:, None]  # (HW, 1): column, row of pixel p
    ax, ay = a[..., None, :, 0], a[..., None, :, 1]  # (..., 1, E)
    dx, dy = b[..., None, :, 0] - ax, b[..., None, :, 1] - ay
    ru, rv = pu - ax, pv - ay  # (..., HW, E)
    s = ((ru * dx + rv * dy) * (1 / (dx * dx + dy * dy + 1e-8))).clamp(0, 1)  # projection onto the segment
    eu, ev = ru - s * dx, rv - s * dy
    return torch.exp((eu**2 + ev**2) * (-0.5 / sigma**2)), s, eu, ev


def segment_field_ref(a: torch.Tensor, b: torch.Tensor, sigma: torch.Tensor, size: int) -> torch.Tensor:
    """`segment_field` differentiated by autograd through every op (the reference its backward is tested against)."""
    return _field_terms(a, b, sigma, size)[0]


class _SegmentField(torch.autograd.Function):
    """The renderer's cost is these (B, K, S, HW, E) passes, and autograd's backward through the dozen elementwise
    ops of the field is most of it. Written out: d^2 = |e|^2 with e = p - (1 - s) a - s b at the nearest point s, so
    (the derivative along s vanishes at the nearest point, and s is held where it is clamped)
    dd^2/da = -2 (1 - s) e, dd^2/db = -2 s e, and df/dd^2 = -f / 2 sigma^2, df/dsigma = f d^2 / sigma^3."""

    @staticmethod
    def forward(ctx, a, b, sigma, size):
        if sigma.numel() != 1:  # the backward sums sigma's gradient over every pixel and bone
            raise ValueError(f"segment_field's written-out backward takes one sigma, got shape {tuple(sigma.shape)}")
        f, s, eu, ev = _field_terms(a, b, sigma, size)
        ctx.save_for_backward(f, s, eu, ev, sigma)
        return f

    @staticmethod
    def backward(ctx, grad):
        f, s, eu, ev, sigma = ctx.saved_tensors
        gf = grad * f  # (..., HW, E)
        ga = gb = gs = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            w = gf * (1 / sigma**2)  # = -2 dL/dd^2
            wb = w * s
            wa = w - wb
            ga = torch.stack([(wa * eu).sum(-2), (wa * ev).sum(-2)], -1)  # (..., E, 2)
            gb = torch.stack([(wb * eu).sum(-2), (wb * ev).sum(-2)], -1)
        if ctx.needs_input_grad[2]:
            gs = ((gf * (eu**2 + ev**2)).sum() / sigma**3).expand_as(sigma)
        return ga, gb, gs, None


def normalise(joints: torch.Tensor) -> torch.Tensor:
    """(B, T, J, 3) -> centred on the sequence's bounding-box centre, divided by its diagonal (|x| <= 0.5)."""
    lo, hi = joints.amin((1, 2), keepdim=True), joints.amax((1, 2), keepdim=True)  # (B, 1, 1, 3)
    return (joints - (lo + hi) / 2) / (hi - lo).norm(dim=-1, keepdim=True).clamp(min=1e-6)


class DrAction(nn.Module):
    def __init__(self, tile: int, trail: int, keyframes: int = 4):
        super().__init__()
        self.tile, self.trail, self.k = tile, trail, keyframes
        self.camera = nn.Parameter(torch.tensor([0.4, 0.2]))  # yaw, pitch (radians)
        self.log_sigma = nn.Parameter(torch.tensor([math.log(0.05)]))
        self.colour = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))
        self.centres = nn.Parameter(torch.logit((torch.arange(keyframes) + 0.5) / keyframes))  # (K,) keyframe times
        self.log_width = nn.Parameter(torch.tensor([math.log(0.5 / keyframes)]))

    def forward(self, joints: torch.Tensor, bones: torch.Tensor, desc: torch.Tensor) -> torch.Tensor:
        """joints (B, T, J, 3), bones (E, 2), descriptors (J, 6) -> image (B, 3, 2 tile, 2 tile)."""
        x = normalise(joints)
        yaw, pitch = self.camera[0], self.camera[1]
        cy, sy, cp, sp = torch.cos(yaw), torch.sin(yaw), torch.cos(pitch), torch.sin(pitch)
        u = cy * x[..., 0] + sy * x[..., 2]  # (B, T, J): rotate about y, then about x, drop depth
        v = -(cp * x[..., 1] - sp * (-sy * x[..., 0] + cy * x[..., 2]))  # image v grows downwards
        uv = torch.stack([u, v], -1)  # (B, T, J, 2)
        t = (torch.arange(x.shape[1], dtype=x.dtype) + 0.5) / x.shape[1]  # (T,)
        gap = 1.5 / x.shape[1]
        centres = torch.sigmoid(self.centres)[:, None] - gap * torch.arange(self.trail + 1)  # (K, S) trail times
        attn = torch.softmax(-(t - centres[..., None]) ** 2 / (2 * self.log_width.exp() ** 2), -1)  # (K, S, T)
        poses = torch.einsum("kst,btjc->bksjc", attn, uv)  # (B, K, S, J, 2)
        field = segment_field(poses[..., bones[:, 0], :], poses[..., bones[:, 1], :], self.log_sigma.exp(),
                              self.tile)  # (B, K, S, HW, E)
        fade = 0.5 ** torch.arange(self.trail + 1, dtype=x.dtype)  # (S,) older copies fainter
        colour = torch.sigmoid(self.colour(torch.cat([desc[bones[:, 0]], desc[bones[:, 1]]], -1)))  # (E, 3)
        tiles = torch.tanh((field * fade[:, None, None]).sum(2) @ colour).transpose(2, 3)  # (B, K, 3, HW)
        b, s = x.shape[0], self.tile
        tiles = tiles.reshape(b, 2, 2, 3, s, s)  # keyframes k = 2 row + col
        return tiles.permute(0, 3, 1, 4, 2, 5).reshape(b, 3, 2 * s, 2 * s)


# ---- the tiny MLLM and the baselines' encoders ------------------------------------------------------------------
class TinyViT(nn.Module):
    def __init__(self, size: int, patch: int, d: int, layers: int, heads: int):
        super().__init__()
        self.patch, n = patch, (size // patch) ** 2
        self.embed = nn.Linear(3 * patch * patch, d)
        self.pos = nn.Parameter(torch.randn(1, n, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)

    def forward(self, img: torch.Tensor) -> torch.Tensor:  # (B, 3, S, S) -> (B, (S/p)^2, d)
        p = self.patch
        x = img.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)  # (B, N, 3pp)
        return self.norm(self.blocks(self.embed(x) + self.pos))


class PrefixLM(nn.Module):
    """TinyLM reading a prefix of embeddings (visual or motion tokens) before the text ids."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.lm = TinyLM(vocab, d, layers, heads, max_len)

    def forward(self, prefix: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """prefix (B, P, d), ids (B, L) -> logits (B, L, V): row i predicts ids[:, i] (from prefix and ids[:, :i])."""
        body, n = self.lm.body, prefix.shape[1] + ids.shape[1]
        h = torch.cat([prefix, body.tok(ids)], 1) + body.pos(torch.arange(n))  # (B, P+L, d)
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        h = body.norm(body.blocks(h, mask=mask, is_causal=True))
        return h[:, prefix.shape[1] - 1 : n - 1] @ body.tok.weight.T  # (B, L, V)

    def token_logp(self, prefix: torch.Tensor, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Summed log-likelihood (B,) of the target positions of ids."""
        n = int((ids != 0).any(0).nonzero().max()) + 1  # drop the all-padding tail: cost grows with length
        ids, target = ids[:, :n], target[:, :n]
        logp = self(prefix, ids).log_softmax(-1).gather(-1, ids[..., None])[..., 0]  # (B, L)
        return (logp * target).sum(-1)

    def loss(self, prefix: torch.Tensor, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return -self.token_logp(prefix, ids, target).sum() / target.sum().clamp(min=1)


class VisualArm(nn.Module):
    """DrAction -> TinyViT -> linear projector -> PrefixLM (SkeletonLLM; also its ablations and snapshots)."""

    def __init__(self, p: Params, vocab: int, max_len: int, frozen: bool = False):
        super().__init__()
        self.frozen = frozen
        self.render = DrAction(p.tile, p.trail)
        self.vit = TinyViT(2 * p.tile, p.patch, p.d_model, p.layers, p.heads)
        self.proj = nn.Linear(p.d_model, p.d_model)
        self.dec = PrefixLM(vocab, p.d_model, p.layers, p.heads, max_len)

    def image_prefix(self, img: torch.Tensor) -> torch.Tensor:
        return self.proj(self.vit(img))  # (B, 16, d)

    def prefix(self, joints: torch.Tensor, poses: torch.Tensor, fmt: tuple) -> torch.Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):  # frozen: no renderer gradients
            img = self.render(joints, *fmt)
        return self.image_prefix(img)


class FeatureArm(nn.Module):
    """Feature-vector alignment: temporal convolutions over the joints in their name slots -> 4 prefix tokens."""

    def __init__(self, p: Params, vocab: int, max_len: int, in_dim: int):
        super().__init__()
        d = p.d_model
        self.enc = nn.Sequential(nn.Conv1d(in_dim, d, 3, padding=1), nn.GELU(), nn.Conv1d(d, d, 3, padding=1),
                                 nn.GELU(), nn.AdaptiveAvgPool1d(4))
        self.proj = nn.Linear(d, d)
        self.dec = PrefixLM(vocab, d, p.layers, p.heads, max_len)

    def prefix(self, joints: torch.Tensor, poses: torch.Tensor, fmt: tuple) -> torch.Tensor:
        return self.proj(self.enc(poses.transpose(1, 2)).transpose(1, 2))  # (B, T, D) -> (B, 4, d)


class VQArm(nn.Module):
    """Discrete motion tokens: a per-frame VQ-VAE whose codes are extra vocabulary entries of the decoder."""

    def __init__(self, p: Params, vocab: int, max_len: int, in_dim: int, n_words: int):
        super().__init__()
        self.n_words, h = n_words, p.d_model
        self.enc = nn.Sequential(nn.Linear(in_dim, h), nn.GELU(), nn.Linear(h, 16))
        self.codebook = nn.Parameter(torch.randn(p.n_codes, 16) * 0.5)
        self.dec_pose = nn.Sequential(nn.Linear(16, h), nn.GELU(), nn.Linear(h, in_dim))
        self.dec = PrefixLM(vocab, p.d_model, p.layers, p.heads, max_len)

    def quantise(self, poses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.enc(poses)  # (B, T, 16)
        codes = torch.cdist(z.flatten(0, 1), self.codebook).argmin(-1).view(z.shape[:2])  # (B, T)
        return z, codes

    def vq_loss(self, poses: torch.Tensor) -> torch.Tensor:
        """VQ-VAE: reconstruction (straight-through) + codebook + 0.25 commitment (van den Oord et al.)."""
        z, codes = self.quantise(poses)
        q = self.codebook[codes]  # (B, T, 16)
        recon = self.dec_pose(z + (q - z).detach())
        return F.mse_loss(recon, poses) + F.mse_loss(q, z.detach()) + 0.25 * F.mse_loss(z, q.detach())

    def prefix(self, joints: torch.Tensor, poses: torch.Tensor, fmt: tuple) -> torch.Tensor:
        with torch.no_grad():  # the tokenizer is frozen after stage 0
            codes = self.quantise(poses)[1]
        return self.dec.lm.body.tok(codes + self.n_words)  # (B, T, d)


# ---- losses and the training schedule ---------------------------------------------------------------------------
def dft_loss(dec: PrefixLM, prefix: torch.Tensor, cand_ids: torch.Tensor, cand_target: torch.Tensor,
             cand_valid: torch.Tensor) -> torch.Tensor:
    """Softmax CE over sequence log-likelihoods of the candidates (B, C, L); candidate 0 is the correct label."""
    b, c, length = cand_ids.shape
    logp = dec.token_logp(prefix.repeat_interleave(c, 0), cand_ids.flatten(0, 1), cand_target.flatten(0, 1))
    logits = logp.view(b, c).masked_fill(~cand_valid, -torch.inf)  # (B, C)
    return F.cross_entropy(logits, torch.zeros(b, dtype=torch.long))


def _encode(vocab: WordVocab, texts: list[str], max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N, L) and target mask (N, L): the tokens after ':' (answer and <eos>)."""
    ids = vocab.encode(texts, max_len)
    colon = (ids == vocab.stoi[":"]).long().cumsum(1) - (ids == vocab.stoi[":"]).long()
    return ids, ((colon > 0) & (ids != 0)).float()


def why_texts(rationale: str, answer: str) -> tuple[str, str]:
    """The "why" prompt's two targets from the same teacher statements: CRD's causal chain (statements, then the
    answer: "why : f1 ; f2 ; so a") and the no-CRD arm's post-hoc order (the answer, then the same statements:
    "why : a ; because f1 ; f2"). Same prompt, same words, same number of target tokens; only the order differs."""
    crd = f"why : {rationale + ' ;' if rationale else ''} so {answer} <eos>"
    post = f"why : {answer}{' ; because ' + rationale if rationale else ''} <eos>"
    return crd, post


# the feature and VQ baselines' input: one slot per joint name over all formats, so a joint sits in the same slot
# in every format (a slot the format lacks is zero) and what a baseline learns on A can transfer to B and C
JOINT_SLOTS = list(dict.fromkeys(name for joints in FORMATS.values() for name, _ in joints))


def by_name(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """(N, T, J, 3) joints of format `fmt` -> (N, T, len(JOINT_SLOTS) * 3), each joint in its name's slot."""
    out = x.new_zeros(*x.shape[:2], len(JOINT_SLOTS), 3)
    out[:, :, [JOINT_SLOTS.index(name) for name, _ in FORMATS[fmt]]] = x
    return out.flatten(2)


def load(data_dir: Path, p: Params) -> dict:
    sk, tx, dr = (read_table(data_dir / f"{n}.parquet") for n in ("skeletons", "text", "drawings"))
    d = {"joints": {}, "fmt": {}}
    for f in dict.fromkeys(sk["format"]):
        sel = sk["format"] == f
        n_seq, n_j = len(set(sk["seq_id"][sel])), len(FORMATS[f])
        d["joints"][f] = torch.from_numpy(np.stack([sk[c][sel] for c in "xyz"], -1).astype(np.float32)).view(
            n_seq, p.frames, n_j, 3)
        d["fmt"][f] = format_table(f)
        if "split" not in d:
            d["split"] = sk["split"][sel][:: p.frames * n_j]
            labels = sk["action"][sel][:: p.frames * n_j]
    d["pad"] = len(JOINT_SLOTS) * 3
    d["poses"] = {f: by_name(normalise(x), f) for f, x in d["joints"].items()}
    tasks = {t: tx["task"] == t for t in ("recognise", "caption", "reason")}
    seq = lambda t, c: list(tx[c][tasks[t]])  # noqa: E731
    rec = [f"what action : {a} <eos>" for a in seq("recognise", "answer")]
    cap = [f"describe : {a} <eos>" for a in seq("caption", "answer")]
    crd, post = zip(*map(why_texts, seq("reason", "rationale"), seq("reason", "answer")), strict=True)
    crd, post = list(crd), list(post)
    draw = [f"drawing : {c} <eos>" for c in dr["caption"]]
    d["vocab"] = WordVocab(rec + cap + crd + post + draw)
    d["n_words"], d["max_text"] = len(d["vocab"]), max(len(s.split()) for s in rec + cap + crd + post + draw)
    for name, texts in (("rec", rec), ("cap", cap), ("crd", crd), ("post", post), ("draw", draw)):
        d[name] = _encode(d["vocab"], texts, d["max_text"])
    classes = list(dict.fromkeys(sorted(labels)))
    answers = dict(zip(labels, seq("recognise", "answer"), strict=True))
    d["labels"] = torch.tensor([classes.index(a) for a in labels])
    d["classes"], d["answers"], d["facts"] = classes, answers, seq("reason", "rationale")
    d["cand"] = _encode(d["vocab"], [f"what action : {answers[c]} <eos>" for c in classes], d["max_text"])
    d["partner"] = torch.tensor([classes.index(PARTNER[c]) if PARTNER.get(c) in classes else i
                                 for i, c in enumerate(classes)])  # no partner: itself (masked out in DFT)
    d["images"] = torch.from_numpy(dr["pixels"].astype(np.float32)).view(len(draw), 3, 2 * p.tile, 2 * p.tile)
    d["captions"] = seq("caption", "answer")
    return d


def build(p: Params, d: dict, snapshots: tuple[str, ...] = ()) -> nn.ModuleDict:
    n_visual = (2 * p.tile // p.patch) ** 2
    vocab, max_len = d["n_words"] + p.n_codes, max(n_visual, p.frames, 4) + d["max_text"] + 4
    arms = {a: VisualArm(p, vocab, max_len, frozen=a == "frozen") for a in VISUAL + snapshots}
    arms["feature"] = FeatureArm(p, vocab, max_len, d["pad"])
    arms["vq"] = VQArm(p, vocab, max_len, d["pad"], d["n_words"])
    return nn.ModuleDict(arms)


def branch(arms: nn.ModuleDict, src: str, dst: str, part: str = "") -> None:
    """Copy an arm (or one part of it) into another in place, so the engine's optimizer keeps its parameters."""
    with torch.no_grad():
        s, t = (arms[src], arms[dst]) if not part else (getattr(arms[src], part), getattr(arms[dst], part))
        for a, b in zip(s.parameters(), t.parameters(), strict=True):
            b.copy_(a)


# phase -> arms whose losses it computes, and the parameters it trains (the others get requires_grad False: no
# gradient, no all-reduce, no AdamW update, so a branch stays exactly as it was copied)
TRAINABLE = {"stage0": ("skel.vit.", "skel.proj.", "skel.dec.", "vq.enc.", "vq.codebook", "vq.dec_pose."),
             "tune": ("skel.", "frozen.vit.", "frozen.proj.", "frozen.dec.", "feature.", "vq.dec."),
             "crd": ("skel.", "feature.", "vq.dec.", "nocrd."), "dft": ("skel.", "feature.", "vq.dec.", "nocrd.",
                                                                       "nodft.")}
PHASES = tuple(TRAINABLE)  # the training phases, in order
SCHEDULE = {"tune": ("skel", "frozen", "feature", "vq"), "crd": ("skel", "feature", "vq", "nocrd"),
            "dft": ("skel", "feature", "vq", "nocrd", "nodft")}
# phase -> next-token tasks (CRD and DFT replay the earlier tasks: cooperative training). The ablations train the
# same steps on the same prompts: no-CRD reads the "why" statements in post-hoc order ("post"), no-DFT trains the
# DFT phase's tasks without the candidate loss
TASKS = {"tune": ("rec", "cap"), "crd": ("crd", "rec", "cap"), "dft": ("crd", "rec", "cap")}
ARM_TASKS = {("crd", "nocrd"): ("post", "rec", "cap"), ("dft", "nocrd"): ("post", "rec", "cap")}
DFT_ARMS = ("skel", "feature", "vq", "nocrd")  # arms whose DFT phase adds the candidate loss


def phase_lr(p: Params, phase: str) -> float:
    """The constant AdamW rate of a phase: `dft_lr` for DFT (every arm), `lr` otherwise."""
    return p.dft_lr if phase == "dft" and p.dft_lr is not None else p.lr


def train(ctx) -> None:
    p: Params = ctx.params
    d = load(ctx.data_dir, p)
    torch.manual_seed(p.seed)
    arms = build(p, d)
    engine = ctx.engine(arms, p.lr, arms=arms)
    train_idx = torch.from_numpy(np.flatnonzero(d["split"] == "train"))
    fmt = next(iter(d["fmt"].values()))  # the training format (A for synthetic data)
    joints, poses = next(iter(d["joints"].values())), next(iter(d["poses"].values()))  # the training format

    def batches(offset: int):
        def batch_fn(step: int) -> dict[str, torch.Tensor]:
            g = torch.Generator().manual_seed(p.seed * 1_000_003 + offset * 100_003 + step)
            return {"idx": train_idx[torch.randint(len(train_idx), (p.batch_size,), generator=g)],
                    "draw": torch.randint(len(d["images"]), (p.batch_size,), generator=g)}
        return batch_fn

    cache = {}  # the frozen renderer's images, rendered once (it has no parameters to learn)

    def step_fn(phase: str):
        def fn(engine, batch, step):
            i, arms, losses = batch["idx"], engine.module, {}
            if phase == "stage0":
                j = batch["draw"]
                pre = arms["skel"].image_prefix(d["images"][j])  # (B, 16, d)
                losses["skel"] = arms["skel"].dec.loss(pre, *(x[j] for x in d["draw"]))
                losses["vq"] = arms["vq"].vq_loss(poses[i])
            for name in SCHEDULE.get(phase, ()):
                arm = arms[name]
                pre = arm.image_prefix(cache["frozen"][i]) if name == "frozen" else arm.prefix(joints[i], poses[i], fmt)
                tasks = ARM_TASKS.get((phase, name), TASKS[phase])
                ids, tgt = (torch.cat([d[t][k][i] for t in tasks]) for k in (0, 1))
                losses[name] = arm.dec.loss(pre.repeat(len(tasks), 1, 1), ids, tgt)  # next-token CE
                if phase == "dft" and name in DFT_ARMS:  # over {label, confusion partner}
                    y = d["labels"][i]
                    cands = torch.stack([y, d["partner"][y]], 1)  # (B, 2)
                    valid = torch.stack([torch.ones_like(y, dtype=torch.bool), d["partner"][y] != y], 1)
                    losses[name] = losses[name] + dft_loss(arm.dec, pre, *(c[cands] for c in d["cand"]), valid)
            return sum(losses.values()), {f"{k}_loss": float(v) for k, v in losses.items()}
        return fn

    steps = {phase: getattr(p, f"{phase}_steps") for phase in PHASES}
    copies = {"tune": [("skel", "frozen", ""), ("skel", "feature", "dec"), ("skel", "vq", "dec")],
              "crd": [("skel", "nocrd", "")], "dft": [("skel", "nodft", "")]}
    for k, phase in enumerate(steps):
        for src, dst, part in copies.get(phase, []):  # branch from the previous phase's (committed) weights
            branch(arms, src, dst, part)
        for name, q in arms.named_parameters():
            q.requires_grad_(name.startswith(TRAINABLE[phase]))
        with torch.no_grad():
            if phase == "stage0":  # codebook initialised from encoded frames: avoids a collapsed codebook
                frames = poses[train_idx].flatten(0, 1)  # (N T, D)
                pick = torch.randint(len(frames), (p.n_codes,), generator=torch.Generator().manual_seed(p.seed))
                arms["vq"].codebook.copy_(arms["vq"].enc(frames[pick]))
            if phase == "tune":
                cache["frozen"] = torch.cat([arms["frozen"].render(joints[c], *fmt) for c in
                                             torch.arange(len(joints)).split(64)])  # (N, 3, 2 tile, 2 tile)
        optim = getattr(engine.optimizer, "optimizer", engine.optimizer)
        optim.state.clear()  # a fresh AdamW per stage, at the stage's rate (the same for every arm it trains)
        for group in optim.param_groups:
            group["lr"] = phase_lr(p, phase)
        ctx.progress(f"phase {phase}: arms {SCHEDULE.get(phase, ('skel', 'vq'))}")
        ctx.fit(phase, engine, step_fn(phase), batches(k), steps[phase])


# ---- evaluation -------------------------------------------------------------------------------------------------
def bleu4(hyps: list[list[str]], refs: list[list[str]]) -> float:
    """Corpus BLEU-4 (Papineni et al.), one reference each, with add-epsilon smoothing of empty n-gram matches."""
    match, total = np.zeros(4), np.zeros(4)
    for h, r in zip(hyps, refs, strict=True):
        for n in range(1, 5):
            hc, rc = (Counter(tuple(w[i : i + n]) for i in range(len(w) - n + 1)) for w in (h, r))
            match[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
            total[n - 1] += max(len(h) - n + 1, 0)
    hl, rl = sum(map(len, hyps)), sum(map(len, refs))
    bp = 1.0 if hl > rl else math.exp(1 - rl / max(hl, 1))
    return float(bp * np.exp(np.mean(np.log(np.maximum(match, 0.1) / np.maximum(total, 1)))))


def reasoning(generated: str, facts: str) -> float:
    """Fraction of rationale statements matching the generator's facts: |gen & true| / max(|gen|, |true|). The
    statements are read in either order why_texts trains: before " so <answer>", or after "<answer> ; because"."""
    text = f" {generated} "
    stated = text.split(" because ", 1)[1] if " because " in text else text.split(" so ")[0]
    gen = {s.strip() for s in stated.split(";") if s.strip() and s.strip() != "so"}
    true = {s.strip() for s in facts.split(";") if s.strip()}
    return len(gen & true) / max(len(gen), len(true), 1)


@torch.no_grad()
def generate(dec: PrefixLM, prefix: torch.Tensor, prompt: torch.Tensor, vocab: WordVocab, n_new: int) -> list[str]:
    ids = prompt  # (B, L0) greedy decoding over the words (not the motion codes), one token at a time
    eos = vocab.stoi["<eos>"]
    for _ in range(n_new):
        nxt = torch.cat([ids, torch.zeros_like(ids[:, :1])], 1)
        ids = torch.cat([ids, dec(prefix, nxt)[:, -1, : len(vocab)].argmax(-1, keepdim=True)], 1)  # words only
        if (ids[:, prompt.shape[1] :] == eos).any(1).all():
            break
    out = []
    for row in ids[:, prompt.shape[1] :].tolist():
        words = [vocab.itos[t] for t in row]
        out.append(" ".join(words[: words.index("<eos>")] if "<eos>" in words else words))
    return out


@torch.no_grad()
def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    d = load(ctx.data_dir, p)
    arms = ctx.network(PHASES[-1])
    arms["tuned"] = ctx.network("tune")["skel"]  # SkeletonLLM after tuning, against the frozen renderer
    test = torch.from_numpy(np.flatnonzero(d["split"] == "test"))
    y, fmts = d["labels"][test], list(d["joints"])
    n_c, vocab = len(d["classes"]), d["vocab"]
    cand_ids, cand_tgt = d["cand"]
    out, table = {}, {}
    for arm_name, prefix_name in EVAL_ARMS.items():
        arm, acc = arms[arm_name], {}
        for f in fmts:
            pre = arm.prefix(d["joints"][f][test], d["poses"][f][test], d["fmt"][f])  # (N, P, d)
            n = len(test)
            logp = arm.dec.token_logp(pre.repeat_interleave(n_c, 0), cand_ids.repeat(n, 1),
                                      cand_tgt.repeat(n, 1)).view(n, n_c)  # (N, C)
            acc[f] = float((logp.argmax(-1) == y).float().mean())
            if f == fmts[0]:
                partner = d["partner"][y]
                conf = logp.gather(1, y[:, None])[:, 0] > logp.gather(1, partner[:, None])[:, 0]
                has = partner != y
                m = {"acc": acc[f], "confusable_acc": float(conf[has].float().mean()) if has.any() else acc[f]}
                caps = generate(arm.dec, pre, vocab.encode(["describe :"] * n, 2), vocab, d["max_text"])
                m["bleu4"] = bleu4([c.split() for c in caps], [d["captions"][s].split() for s in test.tolist()])
                why = generate(arm.dec, pre, vocab.encode(["why :"] * n, 2), vocab, d["max_text"])
                m["reasoning_acc"] = float(np.mean([reasoning(w, d["facts"][s]) for w, s in zip(why, test.tolist(),
                                                                                               strict=True)]))
        m["xformat_acc"] = float(np.mean([acc[f] for f in fmts[1:]])) if len(fmts) > 1 else acc[fmts[0]]
        out |= {f"{prefix_name}/{k}": v for k, v in m.items()}
        out |= {f"detail/{arm_name}/acc_{f}": v for f, v in acc.items()}
        table[arm_name] = m
    lines = ["| arm | acc | xformat | confusable | BLEU-4 | reasoning |", "|---|---|---|---|---|---|"]
    lines += [f"| {a} | " + " | ".join(f"{m[k]:.3f}" for k in ("acc", "xformat_acc", "confusable_acc", "bleu4",
                                                                 "reasoning_acc")) + " |" for a, m in table.items()]
    (ctx.out_dir / "skeleton_llm_table.md").write_text("\n".join(lines) + "\n")
    _plots(ctx.plots_dir, arms, d, test, table)
    return out


def _plots(plots: Path, arms: nn.ModuleDict, d: dict, test: torch.Tensor, table: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fmts, s = list(d["joints"]), test[:3]
    rows = torch.cat([arms[a].render(d["joints"][f][s], *d["fmt"][f]) for a in ("frozen", "skel") for f in fmts],
                     3)  # (3 sequences, 3, H, W x 2 x formats): frozen renderer's images, then the tuned one's
    montage = torch.cat(list(rows), 1).permute(1, 2, 0).clamp(0, 1).numpy()  # sequences stacked vertically
    fig, ax = plt.subplots(figsize=(1.4 * 2 * len(fmts), 1.4 * len(s) + 0.6))
    ax.imshow(montage)
    ax.set_axis_off()
    ax.set_title(f"DrAction 2x2 keyframes with trails; columns: frozen {'/'.join(fmts)}, tuned {'/'.join(fmts)}; "
                 f"rows: {', '.join(d['classes'][d['labels'][i]] for i in s)}", fontsize=6)
    fig.savefig(plots / "draction_renderings.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    keys, names = ("acc", "xformat_acc", "confusable_acc", "bleu4", "reasoning_acc"), list(table)
    for i, a in enumerate(names):
        ax.bar(np.arange(len(keys)) + i * 0.8 / len(names), [table[a][k] for k in keys], 0.8 / len(names), label=a)
    ax.set_xticks(np.arange(len(keys)) + 0.4, keys, fontsize=8)
    ax.set(ylabel="score", title="SkeletonLLM vs baselines and ablations (test)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(plots / "metrics.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="skeleton_llm",
    title="SkeletonLLM: universal skeleton understanding through a differentiable renderer",
    seed="003_9a806cafa3d919df.txt, abstract 1",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/acc", "max"),
    claim=Claim(premises=(  # every arm the parts compare learned recognition on the source format
        Compare("method/acc", ">=", ACC_BAR, name="method_recognises"),
        Compare("baseline/feature/acc", ">=", BASELINE_BAR, name="feature_learns"),
        Compare("baseline/vq/acc", ">=", BASELINE_BAR, name="vq_learns"),
        Compare("baseline/frozen/acc", ">=", BASELINE_BAR, name="frozen_learns"),
    ), all_of=(
        Compare("method/xformat_acc", ">", ("baseline/feature/xformat_acc", "baseline/vq/xformat_acc")),
        Compare("method/acc", ">=", ("baseline/feature/acc", "baseline/vq/acc")),
        Compare("detail/differentiable_tuned/acc", ">", "baseline/frozen/acc"),
        Compare("method/confusable_acc", ">", "baseline/no_dft/confusable_acc"),
        Compare("method/reasoning_acc", ">", "baseline/no_crd/reasoning_acc"),
    ), note="inputs differ by design: the feature and VQ baselines read the 3-D joints in named slots (left and "
            "right explicit), SkeletonLLM infers sides from 2-D renderings under +-camera_jitter heading; its "
            "'native visual modality' is stage 0's captioning steps on line drawings, not a pretrained MLLM; every "
            "arm's DFT phase runs at dft_lr, chosen on a held-out world (seed 100), not on the replicates' test sets",
        summary="DrAction rendering beats feature and VQ alignment (in and across formats); the differentiable "
                "renderer beats a frozen one; DFT helps confusable pairs; CRD helps reasoning"),
)
