"""The procedural sequence generators follow their equations exactly: walls, gravity, bones, canonical points."""

from __future__ import annotations

import numpy as np

from models.common import sequences as seq


def test_sprite_walk_stays_inside_and_moves_by_its_velocity():
    rng = np.random.default_rng(0)
    pos, vel, turns = seq.sprite_walk(rng, 40, 32, 12, (1, 3), p_turn=0.3)
    assert pos.min() >= 0 and pos.max() <= 20
    assert turns.any() and not turns[0]
    step = np.abs(np.diff(pos, axis=0))
    assert (step <= np.abs(vel[1:])).all()  # a reflection only shortens the step
    assert (np.abs(vel).max(1) <= 3).all() and (np.abs(vel).min(1) >= 1).all()
    none = seq.sprite_walk(np.random.default_rng(1), 10, 64, 4, (1, 1), p_turn=0.0)[2]
    assert not none.any()


def test_reflection_mirrors_position_and_flips_velocity():
    pos, vel = seq.reflect(np.array([-2, 23]), np.array([-3, 4]), hi=20)
    assert pos.tolist() == [2, 17] and vel.tolist() == [3, -4]


def test_render_alpha_blends_and_labels_covered_pixels():
    bg = np.full((8, 8), 0.2, np.float32)
    sprite = np.zeros((2, 2), np.float32)
    sprite[0, 0] = 1.0
    sprite[1, 1] = 0.5
    frame, mask = seq.render_sprites(bg, [sprite], [np.array([3, 4])], labels=[7], background_label=10)
    assert frame[3, 4] == 1.0 and np.isclose(frame[4, 5], 0.5 * 0.2 + 0.5) and frame[0, 0] == np.float32(0.2)
    assert mask[3, 4] == 7 and mask[4, 5] == 7 and (mask == 7).sum() == 2


def test_bouncing_ball_is_exact_ballistic_flight_between_impacts():
    traj, bounced = seq.bouncing_ball(y0=2.0, vy0=0.5, x0=3.0, vx=0.2, g=0.3, e=0.8, floor=14.0, n_frames=30)
    assert bounced.sum() >= 2 and traj[:, 1].max() <= 14.0
    # first frames: y = y0 + v t + g t^2 / 2 in closed form
    t = np.arange(5.0)
    assert np.allclose(traj[:5, 1], 2.0 + 0.5 * t + 0.15 * t**2)
    assert np.allclose(np.diff(traj[:, 0]), 0.2)
    assert seq.ballistic_residual(traj, 0.3, bounced) < 1e-9
    noisy = traj + np.random.default_rng(0).normal(0, 0.1, traj.shape)
    assert seq.ballistic_residual(noisy, 0.3, bounced) > 0.1
    assert seq.ballistic_residual(traj, 0.5, bounced) > 0.19  # wrong gravity is detected
    # energy: the apex after each impact is lower by the factor e^2 (speed at impact scaled by e)
    first = np.flatnonzero(bounced)[0]
    apex = traj[first:, 1].min()
    drop = 14.0 - 2.0 + 0.5**2 / (2 * 0.3)  # height fallen from the first apex
    assert 14.0 - apex <= 0.8**2 * drop + 1e-9


def test_skeleton_keeps_bone_lengths_under_any_pose():
    rng = np.random.default_rng(0)
    angles = rng.uniform(-np.pi, np.pi, (6, len(seq.SKELETON)))
    root = rng.standard_normal((6, 3))
    joints = seq.forward_kinematics(root, angles)
    assert joints.shape == (6, 16, 3) and np.allclose(joints[:, 0], root)
    lengths = seq.bone_lengths(joints)
    rest = np.array([np.linalg.norm(o) for _, p, o, _ in seq.SKELETON if p >= 0])
    assert np.allclose(lengths, rest[None])


def test_articulated_points_keep_canonical_identity_and_rigid_limbs():
    pts, u = seq.articulated_points(np.random.default_rng(0), n_frames=5, n_limbs=3, n_points=120, amplitude=0.8)
    assert pts.shape[1] == u.shape[0]
    # torso points only translate: their pairwise distances are those of the canonical pose in every frame
    torso = 60
    d0 = np.linalg.norm(u[:torso, None] - u[None, :torso], axis=-1)
    for f in range(5):
        df = np.linalg.norm(pts[f, :torso, None] - pts[f, None, :torso], axis=-1)
        assert np.allclose(df, d0, atol=1e-5)
    assert not np.allclose(pts[0, torso:], pts[2, torso:] - (pts[2, 0] - pts[0, 0]))  # the limbs move
