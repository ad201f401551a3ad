"""Procedural sequences for the video, motion and world-model papers, with the physics each one follows exactly.

Four families, each a pure function of its parameters and a NumPy generator (so `prepare` stays deterministic):
- moving sprites [digit_sprites, background_texture, sprite_walk, render_sprites]: load_digits sprites on a texture,
  moving with integer velocities, reflecting off the walls, optionally turning at random (several plausible futures)
  or driven by given per-frame actions (latent-action world models);
- a bouncing ball under gravity [bouncing_ball]: exact event-driven ballistic motion with a restitution floor, and
  [ballistic_residual], the physical-plausibility measure (distance of a trajectory to the known equations);
- an articulated skeleton [SKELETON, forward_kinematics]: a 16-joint tree with fixed bone lengths, hinge angles;
- a deforming point cloud [articulated_points]: an ellipsoid torso with capsule limbs on hinges, sampled with
  canonical surface coordinates that follow each body point over time.
Sizes are the caller's: the CPU profiles use tiny frames (16x16 to 32x32) and short clips.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from scipy.ndimage import zoom

# ---- moving sprites ------------------------------------------------------------------------------------------
HEADINGS4 = np.array([[1, 1], [1, -1], [-1, 1], [-1, -1]])  # diagonal headings (dy, dx)
HEADINGS8 = np.array([[0, 1], [1, 1], [1, 0], [1, -1], [0, -1], [-1, -1], [-1, 0], [-1, 1]])  # (dy, dx)


@lru_cache(maxsize=8)
def digit_sprites(size: int) -> tuple[np.ndarray, np.ndarray]:
    """load_digits images (8x8, 0..16) resampled to size x size in [0, 1]: (N, size, size) float32, labels (N,)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = d.images / 16.0  # (N, 8, 8)
    if size != 8:
        images = np.clip(zoom(images, (1, size / 8, size / 8), order=1), 0.0, 1.0)
    return images.astype(np.float32), d.target.astype(np.int64)


def background_texture(rng: np.random.Generator, size: int, kind: str, amplitude: float) -> np.ndarray:
    """(size, size) texture in [0, amplitude]: 'stripes' (random angle, frequency), 'checker', or 'noise'."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    if kind == "stripes":
        angle, freq = rng.uniform(0, np.pi), rng.uniform(0.15, 0.6)
        tex = 0.5 + 0.5 * np.sin(freq * (np.cos(angle) * xx + np.sin(angle) * yy) + rng.uniform(0, 2 * np.pi))
    elif kind == "checker":
        cell = int(rng.integers(2, 6))
        tex = ((yy // cell + xx // cell) % 2).astype(np.float32)
    elif kind == "noise":
        tex = zoom(rng.uniform(size=(size // 4, size // 4)), 4, order=1)[:size, :size]
    else:
        raise ValueError(f"unknown texture kind {kind!r}; expected stripes, checker or noise")
    return (amplitude * tex).astype(np.float32)


def sprite_walk(rng: np.random.Generator, n_frames: int, canvas: int, sprite: int, speed: tuple[int, int],
                p_turn: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-left positions (T, 2) of one sprite bouncing in a canvas, its velocities (T, 2) and turn flags (T,).

    Velocity = heading * speed with a diagonal heading; at each frame the sprite turns to a uniformly drawn heading
    with probability p_turn; it reflects off walls (position mirrored at the boundary, velocity component flipped)."""
    hi = canvas - sprite
    pos = rng.integers(0, hi + 1, size=2)
    vel = HEADINGS4[rng.integers(4)] * rng.integers(speed[0], speed[1] + 1)
    positions, velocities, turns = [pos.copy()], [vel.copy()], [False]
    for _ in range(1, n_frames):
        turned = rng.uniform() < p_turn
        if turned:
            vel = HEADINGS4[rng.integers(4)] * np.abs(vel).max()
        pos, vel = reflect(pos + vel, vel, hi)
        positions.append(pos.copy())
        velocities.append(vel.copy())
        turns.append(turned)
    return np.stack(positions), np.stack(velocities), np.asarray(turns)


def reflect(pos: np.ndarray, vel: np.ndarray, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """Elastic reflection off the walls 0 and hi, per axis."""
    pos, vel = pos.copy(), vel.copy()
    for axis in range(pos.shape[-1]):
        if pos[axis] < 0:
            pos[axis], vel[axis] = -pos[axis], -vel[axis]
        elif pos[axis] > hi:
            pos[axis], vel[axis] = 2 * hi - pos[axis], -vel[axis]
    return pos, vel


def render_sprites(background: np.ndarray, sprites: list[np.ndarray], positions: list[np.ndarray],
                   colours: list[np.ndarray] | None = None, labels: list[int] | None = None,
                   threshold: float = 0.3, background_label: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Draw sprites (s x s intensities in [0, 1]) at integer top-left positions over a (H, W) or (H, W, C) background.

    A sprite pixel covers the background in proportion to its intensity (alpha = intensity); later sprites cover
    earlier ones. Returns the frame (same shape as background) and a (H, W) label mask: the sprite's label where its
    intensity exceeds `threshold`, else `background_label`."""
    frame, mask = background.copy(), np.full(background.shape[:2], background_label, dtype=np.int64)
    for i, (sprite, (y, x)) in enumerate(zip(sprites, positions, strict=True)):
        s = sprite.shape[0]
        alpha = sprite if frame.ndim == 2 else sprite[..., None]
        colour = 1.0 if colours is None else colours[i]
        region = frame[y : y + s, x : x + s]
        frame[y : y + s, x : x + s] = (1 - alpha) * region + alpha * colour
        if labels is not None:
            mask[y : y + s, x : x + s][sprite > threshold] = labels[i]
    return frame, mask


# ---- a bouncing ball with known physics -----------------------------------------------------------------------
def bouncing_ball(y0: float, vy0: float, x0: float, vx: float, g: float, e: float, floor: float, n_frames: int,
                  dt: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Exact centroid trajectory (T, 2) as (x, y), y growing downwards, of a ball under gravity g with a floor at
    y = floor and restitution e: between bounces y(t) = y + v t + g t^2 / 2; at impact v -> -e v (event-driven, no
    time-step error; requires g > 0). A rebound slower than 1e-6 leaves the ball resting on the floor.
    Also returns `bounced` (T,): True where an impact happened between frame f-1 and frame f."""
    out, bounced = np.empty((n_frames, 2)), np.zeros(n_frames, dtype=bool)
    y, v, t_now, resting = float(y0), float(vy0), 0.0, False
    for f in range(n_frames):
        target = f * dt
        while not resting and t_now < target:
            remaining = target - t_now
            # time to reach the floor: y + v s + g s^2 / 2 = floor, its positive root
            s_hit = (-v + np.sqrt(max(v * v + 2 * g * (floor - y), 0.0))) / g
            if s_hit >= remaining:
                y, v, t_now = y + v * remaining + 0.5 * g * remaining**2, v + g * remaining, target
            else:
                y, v, t_now = floor, -e * (v + g * s_hit), t_now + s_hit
                resting, bounced[f] = abs(v) < 1e-6, True
        out[f] = (x0 + vx * target, floor if resting else y)
    return out, bounced


def ballistic_residual(traj: np.ndarray, g: float, bounced: np.ndarray, dt: float = 1.0) -> float:
    """Physical plausibility of a (T, 2) centroid trajectory: RMS residual of the discrete equations of motion,
    x'' = 0 and y'' = g (second differences / dt^2), over the frame triples with no impact inside (`bounced` as
    returned by bouncing_ball for the true motion: impacts are impulses). Exactly 0 for true ballistic flight."""
    acc = (traj[2:] - 2 * traj[1:-1] + traj[:-2]) / dt**2  # (T-2, 2)
    free = ~(bounced[1:-1] | bounced[2:])
    if not free.any():
        return 0.0
    res = acc[free] - np.array([0.0, g])
    return float(np.sqrt((res**2).sum(-1).mean()))


# ---- an articulated skeleton ---------------------------------------------------------------------------------
# name, parent index, rest offset from the parent (x right, y up, z forward), hinge axis of the joint's angle
SKELETON: tuple[tuple[str, int, tuple[float, float, float], str], ...] = (
    ("pelvis", -1, (0.0, 0.0, 0.0), "y"), ("spine", 0, (0.0, 0.25, 0.0), "x"), ("neck", 1, (0.0, 0.3, 0.0), "x"),
    ("head", 2, (0.0, 0.15, 0.0), "x"), ("l_shoulder", 2, (0.18, 0.0, 0.0), "z"),
    ("l_elbow", 4, (0.0, -0.28, 0.0), "x"), ("l_wrist", 5, (0.0, -0.25, 0.0), "x"),
    ("r_shoulder", 2, (-0.18, 0.0, 0.0), "z"), ("r_elbow", 7, (0.0, -0.28, 0.0), "x"),
    ("r_wrist", 8, (0.0, -0.25, 0.0), "x"), ("l_hip", 0, (0.1, -0.05, 0.0), "x"),
    ("l_knee", 10, (0.0, -0.42, 0.0), "x"), ("l_ankle", 11, (0.0, -0.4, 0.0), "x"),
    ("r_hip", 0, (-0.1, -0.05, 0.0), "x"), ("r_knee", 13, (0.0, -0.42, 0.0), "x"),
)
# the 16th joint (index 15) is the right ankle; listed apart to keep the table above readable
SKELETON = SKELETON + (("r_ankle", 14, (0.0, -0.4, 0.0), "x"),)


def _axis_rotation(axis: str, angle: np.ndarray) -> np.ndarray:
    """(..., 3, 3) rotation matrices about a coordinate axis."""
    c, s = np.cos(angle), np.sin(angle)
    one, zero = np.ones_like(c), np.zeros_like(c)
    rows = {"x": ((one, zero, zero), (zero, c, -s), (zero, s, c)),
            "y": ((c, zero, s), (zero, one, zero), (-s, zero, c)),
            "z": ((c, -s, zero), (s, c, zero), (zero, zero, one))}[axis]
    return np.stack([np.stack(r, -1) for r in rows], -2)


def forward_kinematics(root: np.ndarray, angles: np.ndarray) -> np.ndarray:
    """Joint positions (T, J, 3) from root positions (T, 3) and per-joint hinge angles (T, J) (the pelvis angle is
    the heading about y). Bone lengths are fixed by SKELETON's offsets, so they are invariant over time."""
    t, j = angles.shape
    if j != len(SKELETON):
        raise ValueError(f"angles has {j} joints, the skeleton {len(SKELETON)}")
    rot, pos = [None] * j, np.zeros((t, j, 3))
    for i, (_, parent, offset, axis) in enumerate(SKELETON):
        local = _axis_rotation(axis, angles[:, i])  # (T, 3, 3)
        if parent < 0:
            rot[i], pos[:, i] = local, root
        else:
            rot[i] = rot[parent] @ local
            pos[:, i] = pos[:, parent] + np.einsum("tab,b->ta", rot[parent], np.asarray(offset))
    return pos


def bone_lengths(joints: np.ndarray) -> np.ndarray:
    """(T, J-1) lengths of every bone (joint to parent) of joint positions (T, J, 3)."""
    return np.stack([np.linalg.norm(joints[:, i] - joints[:, p], axis=-1)
                     for i, (_, p, _, _) in enumerate(SKELETON) if p >= 0], -1)


# ---- a deforming point cloud ---------------------------------------------------------------------------------
def articulated_points(rng: np.random.Generator, n_frames: int, n_limbs: int, n_points: int, amplitude: float,
                       freq: float = 0.15) -> tuple[np.ndarray, np.ndarray]:
    """An ellipsoid torso with capsule limbs on hinges (angles a sin(2 pi f t + phase)), rigidly translated.

    Returns points (T, N, 3) and canonical coordinates u (N, 3): each point's rest-pose position, identical over
    time, so u identifies the same body point in every frame. Torso points and limb points keep their distance to
    their hinge, so every limb deforms rigidly about its hinge."""
    radii = rng.uniform(0.25, 0.5, size=3)
    n_torso = n_points // 2
    n_limb = (n_points - n_torso) // max(n_limbs, 1)
    # torso: points on the ellipsoid surface
    d = rng.standard_normal((n_torso, 3))
    torso = radii * d / np.linalg.norm(d, axis=1, keepdims=True)
    theta = 2 * np.pi * np.arange(n_limbs) / n_limbs  # hinges spread around the torso's equator
    hinges = np.stack([radii[0] * np.cos(theta), np.zeros(n_limbs), radii[2] * np.sin(theta)], 1)  # (L, 3)
    lengths = rng.uniform(0.3, 0.6, size=n_limbs)
    phases = rng.uniform(0, 2 * np.pi, size=n_limbs)
    limb_rest, limb_id = [], []
    for k in range(n_limbs):  # capsule of radius 0.05 pointing down (-y) from its hinge
        s = rng.uniform(0, 1, n_limb)
        ang = rng.uniform(0, 2 * np.pi, n_limb)
        ring = 0.05 * np.stack([np.cos(ang), np.zeros(n_limb), np.sin(ang)], 1)
        limb_rest.append(hinges[k] + ring + np.stack([np.zeros(n_limb), -lengths[k] * s, np.zeros(n_limb)], 1))
        limb_id.append(np.full(n_limb, k))
    limb_rest, limb_id = np.concatenate(limb_rest), np.concatenate(limb_id)
    canonical = np.concatenate([torso, limb_rest]).astype(np.float32)
    velocity = rng.uniform(-0.05, 0.05, size=3)
    frames = []
    for t in range(n_frames):
        angle = amplitude * np.sin(2 * np.pi * freq * t + phases)  # (L,)
        moved = limb_rest.copy()
        for k in range(n_limbs):  # swing about the hinge's x axis
            sel = limb_id == k
            moved[sel] = hinges[k] + (limb_rest[sel] - hinges[k]) @ _axis_rotation("x", angle[k]).T
        frames.append(np.concatenate([torso, moved]) + velocity * t)
    return np.stack(frames).astype(np.float32), canonical
