"""Rollouts and a replay buffer for off-policy RL papers, shaped for `ctx.fit`.

`Replay` collects gymnasium transitions into NaN-initialised tensors that a paper hands to `ctx.fit(state=...)`, so
the buffer is checkpointed with the networks, merged across ranks (every rank collects the same transitions: same
weights, same seeds) and restored on resume. Collection is exact under resume: episode `e` is reset with a seed
derived from (seed, e), the action of row `i` is drawn from a generator seeded by (seed, i), and when a resumed
process continues a half-finished episode it restores the simulator's state from the last stored row. Only
classic-control environments (whose `unwrapped.state` is the whole simulator state) are supported for that.

`run_episodes` plays independent episodes side by side with one batched policy call per time step (evaluation,
validation rollouts, reference returns). `reference_controller` is the hand-written controller the RL papers compare
against and collect demonstrations with.
"""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import numpy as np
import torch

# act(obs (obs_dim,) float32, row, generator) -> action (act_dim,) float32
ActFn = Callable[[np.ndarray, int, torch.Generator], np.ndarray]


def reference_controller(env_id: str, obs: np.ndarray) -> np.ndarray:
    """Energy pumping, then a PD hold at the top (Pendulum); bang-bang on velocity (MountainCar). obs (B, obs_dim)
    -> actions (B, act_dim)."""
    if env_id.startswith("Pendulum"):
        c, s, w = obs[:, 0], obs[:, 1], obs[:, 2]
        energy = 0.5 * w**2 + 15 * c  # conserved by the unforced dynamics (thdd = 15 sin th); 15 at rest upright
        swing = np.clip(0.3 * (15 - energy) * np.sign(w + 1e-6), -2, 2)
        hold = np.clip(-(10 * np.arctan2(s, c) + 3 * w), -2, 2)
        return np.where((c > 0.9) & (np.abs(w) < 3), hold, swing)[:, None]
    if env_id.startswith("MountainCar"):
        return np.where(obs[:, 1:2] >= 0, 1.0, -1.0)
    raise ValueError(f"no reference controller for {env_id}")


def make_env(env_id: str):
    """The raw environment (no wrappers): time limits are handled here, so the simulator state is all there is."""
    env = gym.make(env_id)
    return env.unwrapped, env.spec.max_episode_steps


def env_dims(env_id: str) -> tuple[int, int, float]:
    env, _ = make_env(env_id)
    return env.observation_space.shape[0], env.action_space.shape[0], float(env.action_space.high[0])


class Replay:
    """A fixed-capacity transition table filled row by row from one environment chain (episodes back to back).

    The table lives in NumPy arrays (`rows`) that `state` views as tensors (shared memory): a row is written by the
    simulator's own NumPy values without a tensor op per field, and a checkpoint restored into `state` in place is
    what the arrays read."""

    def __init__(self, env_id: str, capacity: int, seed: int, horizon: int | None = None):
        self.env, default_horizon = make_env(env_id)
        self.horizon = horizon or default_horizon
        self.seed = seed
        obs_dim, act_dim = self.env.observation_space.shape[0], self.env.action_space.shape[0]
        sim_dim = len(self._sim_state_after_reset())
        nan = lambda *shape: np.full(shape, np.nan, np.float32)  # noqa: E731
        self.rows = {
            "s": nan(capacity, obs_dim), "a": nan(capacity, act_dim), "r": nan(capacity), "s2": nan(capacity, obs_dim),
            "terminal": nan(capacity),  # true termination (no bootstrap); time-limit ends are not terminal
            "end": nan(capacity),  # the episode ended after this row (terminal or time limit)
            "t": nan(capacity),  # time step within the episode after this row
            "episode": nan(capacity),
            # simulator state after this row, to resume mid-episode (float64: the simulator's own precision)
            "sim": np.full((capacity, sim_dim), np.nan, np.float64),
        }
        self.state = {k: torch.from_numpy(v) for k, v in self.rows.items()}
        self._synced_row = -1  # the row the live environment is positioned to collect next
        self._obs = None

    def _sim_state_after_reset(self) -> np.ndarray:
        self.env.reset(seed=0)
        return np.asarray(self.env.state, dtype=np.float64)

    def filled(self) -> int:
        """Number of leading rows already collected (after a resume, those restored from the checkpoint)."""
        empty = np.flatnonzero(np.isnan(self.rows["r"]))
        return int(empty[0]) if len(empty) else len(self.rows["r"])

    def _position(self, row: int) -> None:
        """Put the environment where row `row` starts: a seeded reset, or the stored state after row - 1."""
        st = self.rows
        if row == 0 or st["end"][row - 1] > 0:
            episode = 0 if row == 0 else int(st["episode"][row - 1]) + 1
            self._obs, _ = self.env.reset(seed=int(np.random.SeedSequence([self.seed, episode]).generate_state(1)[0]))
            self._t, self._episode = 0, episode
        else:
            self.env.state = st["sim"][row - 1].copy()
            self._obs = st["s2"][row - 1].astype(np.float32)
            self._t, self._episode = int(st["t"][row - 1]), int(st["episode"][row - 1])
        self._synced_row = row

    def collect(self, upto: int, act: ActFn) -> None:
        """Fill rows [filled(), upto) by acting with `act` (each row's randomness seeded by the row)."""
        st = self.rows
        for row in range(self.filled(), min(upto, len(st["r"]))):
            if self._synced_row != row:
                self._position(row)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + row)
            action = np.asarray(act(np.asarray(self._obs, np.float32), row, g), np.float32)
            obs2, reward, terminated, truncated, _ = self.env.step(action)
            self._t += 1
            end = terminated or truncated or self._t >= self.horizon
            st["s"][row] = np.asarray(self._obs, np.float32)
            st["a"][row] = action
            st["r"][row] = float(reward)
            st["s2"][row] = np.asarray(obs2, np.float32)
            st["terminal"][row] = float(terminated)
            st["end"][row] = float(end)
            st["t"][row] = float(self._t)
            st["episode"][row] = float(self._episode)
            st["sim"][row] = np.asarray(self.env.state, np.float64)
            if end:
                self._synced_row = -1  # the next row starts with a seeded reset
            else:
                self._obs, self._synced_row = obs2, row + 1

    def sample(self, rows: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
        """A uniform batch (with replacement) from the first `rows` rows."""
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, rows, (batch_size,), generator=g)
        return {k: self.state[k][idx] for k in ("s", "a", "r", "s2", "terminal")}

    def episode_returns(self) -> tuple[np.ndarray, np.ndarray]:
        """(env step at which each finished episode ended, its undiscounted return)."""
        n = self.filled()
        r, end, ep = (self.rows[k][:n] for k in ("r", "end", "episode"))
        done = np.flatnonzero(end > 0)
        returns = np.array([r[ep == ep[i]].sum() for i in done])
        return done + 1, returns


def run_episodes(env_id: str, policy: Callable[[np.ndarray, int], np.ndarray], seeds: list[int],
                 horizon: int | None = None) -> dict[str, np.ndarray]:
    """Play one episode per seed side by side; `policy(obs (E, obs_dim), t) -> actions (E, act_dim)`.

    Returns the per-episode `returns` (E,) and the transitions as (E, T, ...) arrays with an `alive` mask."""
    envs = [make_env(env_id)[0] for _ in seeds]
    horizon = horizon or make_env(env_id)[1]
    obs = np.stack([np.asarray(e.reset(seed=int(s))[0], np.float32) for e, s in zip(envs, seeds, strict=True)])
    n, obs_dim, act_dim = len(seeds), obs.shape[1], envs[0].action_space.shape[0]
    out = {"s": np.zeros((n, horizon, obs_dim), np.float32), "a": np.zeros((n, horizon, act_dim), np.float32),
           "r": np.zeros((n, horizon), np.float32), "s2": np.zeros((n, horizon, obs_dim), np.float32),
           "terminal": np.zeros((n, horizon), np.float32), "alive": np.zeros((n, horizon), bool)}
    alive = np.ones(n, bool)
    for t in range(horizon):
        actions = np.asarray(policy(obs, t), np.float32).reshape(n, act_dim)
        for i in np.flatnonzero(alive):
            obs2, reward, terminated, _, _ = envs[i].step(actions[i])
            out["s"][i, t], out["a"][i, t], out["r"][i, t] = obs[i], actions[i], reward
            out["s2"][i, t], out["terminal"][i, t], out["alive"][i, t] = obs2, float(terminated), True
            obs[i] = obs2
            alive[i] = not terminated
        if not alive.any():
            break
    out["returns"] = (out["r"] * out["alive"]).sum(1)
    return out
