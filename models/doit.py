"""DOIT: Doob-oriented inference-time transformation of a pretrained diffusion model to a black-box reward.

Seed: 003_9a806cafa3d919df.txt, abstract 9. Spec: ../shared/papers/doit.md.

What it implements (function names in brackets):
- target p*(x) proportional to p(x) exp(r(x) / alpha); h_t(x_t) = E_p[exp(r(x_0) / alpha) | x_t]; the Doob kernel
  p(x_{t-1} | x_t) h_{t-1}(x_{t-1}) / h_t(x_t) [the docstrings of `doob_sample`];
- the Doob correction shared by both variants: M candidates x^(m) = mu_theta(x_t) + sigma_t z_m, weights
  w_m ~ h_hat_{t-1}(x^(m)), v = sum_m w_m z_m / sigma_t (likelihood-ratio estimate of grad log h at mu), the Doob
  gradient g_t = (d mu_theta / d x_t)^T v by one vector-Jacobian product through the denoiser, and
  eps <- eps - gamma sqrt(1 - abar_t) g_t before the DDPM step; the reward is never differentiated [doob_sample];
- DOIT-Proto: h_hat from L full stochastic rollouts of the pretrained sampler per candidate [proto_log_h];
  DOIT-Practical: one-jump x0_hat(x^(m)) reusing the current eps, self-normalised weights
  softmax((r - mean r) / (std r tau)), correction on every step but the last [practical_log_h];
- offline RL: a diffusion behaviour policy pi_beta(a | s) (MLP denoiser, DDPM) and an IQL critic (expectile
  regression), trained in one engine with the toy model, each network its own arm with its own gradient clip
  [EnvNets, iql_losses, train, network_arms]; the reward r(s, a) = Q(s, a) or its quantised r = round(Q / q) q,
  both called under no_grad [make_reward];
- baselines: the pretrained policy, Best-of-N resampling (N matched to DOIT-Practical's network evaluations),
  DPS-style gradient guidance with grad_a Q (Q reward only), SVDD soft value decoding; Best-of-N and SVDD draw the
  kept sample with DOIT-Practical's standardised weights [ddpm_sample, best_of_n, gradient_guided, svdd_sample,
  standardised];
- convergence toy: a 2-D Gaussian-mixture diffusion model, r(x) = 1[x in box], the exact target by self-normalised
  importance weighting of pretrained samples, sliced W2 (POT) of DOIT-Proto at each (M, L) [evaluate_toy].

Deviations from the paper (choices the abstract left open):
- The algorithm is the spec's derivation (the abstract gives none): likelihood-ratio Doob gradient, eps correction
  with the classifier-guidance scale sqrt(1 - abar_t) and gamma = 1 by default.
- "Wall-clock per action" is replaced by counted FLOPs per action (denoiser and critic forward passes counted on the
  actual calls, a vector-Jacobian product as twice a forward pass): the house rule keeps wall time out of metrics.
  Network evaluations per action are reported beside it.
- The DDPM schedule is the VP schedule of diffusion policies (Diffusion-QL, IDQL) rather than a diffusers one: with
  20 steps diffusers' linear schedule ends at abar ~ 0.8 (far from noise) and its cosine one at beta = 0.999.
  Actions are scaled to [-1, 1]; rewards by `reward_scale` before IQL.
- Best-of-N and SVDD draw the kept sample from softmax((r - mean r) / (std r tau)) over their N (M) candidates, the
  same scale-free weights DOIT-Practical uses, instead of IDQL's and SVDD's softmax(r / alpha) on raw Q: a fixed
  alpha on raw Q is greedy or uniform depending on the critic's scale, which differs by task and by training run,
  so with it the comparison measured the temperature, not the method. Best-of-N's N is matched to DOIT-Practical's
  network evaluations; SVDD with DOIT's M spends more (an extra denoiser pass per candidate), not fewer. The
  quantised-reward gradient baseline is absent (n/a, not differentiable).
- Premises (the arms learned, else the comparison ranks untrained samplers): behaviour_policy_learned, the
  pretrained behaviour diffusion's normalised score >= 25 (a quarter of the way from the random policy to the clean
  controller; the data are mostly noisy-controller episodes, so a clone of them sits well above it); and
  critic_ranks_actions, the IQL critic prefers the clean controller's action (D4RL: the dataset's action) to a
  uniform random one at >= 60 % of dataset states (0.5 is a critic blind to the action, which gives Best-of-N,
  SVDD and DOIT nothing to select by) [critic_rank_acc].
- "Efficiency preserved" (counted FLOPs per action at most 2x Best-of-N's) is context, not a part: Best-of-N's N is
  set from DOIT-Practical's network evaluations, so the ratio is fixed by the parameters and cannot fail.
- The "each environment" claim is the mean score over environments plus `method/min_env_margin > 0` (the smallest
  per-environment gap to the best baseline).
- Full profile: D4RL's MuJoCo medium sets (v2 data) evaluated in gymnasium's v5 tasks (same observation and action
  spaces; the `mujoco` package simulates offline), normalised with D4RL's reference returns.
- Smoke trains 3,000 steps of batch 512 at width 128 (the spec's sketch: 800 steps; earlier profiles 1,200 of
  1,024 at width 256): the behaviour diffusion's pretrained score climbs with the number of updates and varies
  between training seeds at a fixed count; width 128 halves the cost of an update of the five IQL networks, which
  dominate it, so the same budget buys more updates.
- Smoke evaluates 64 episodes of 100 steps per method (the spec's sketch: 4), stepped as one batch, every arm
  alike: a Pendulum episode's 100-step score depends mostly on how long its start state takes to swing up, so with
  few episodes the scores rest on a handful of start states and their spread swamps the gaps between samplers.
  Smoke runs the samplers on the Q reward only (`quantised: false`): no claim part reads the quantised-reward
  scores (the spec reports them beside), and their evaluation pays for the extra episodes.
- Smoke uses gamma 0.9 and a Polyak rate 0.05 for IQL (full: 0.99 / 0.005): with gamma 0.99, 800 steps left Q flat
  across actions (std 0.02 per state), so every reward-guided method only saw noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from models.common.rl import env_dims, reference_controller, run_episodes
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

# D4RL's reference returns (random, expert) that its normalised score uses, by gymnasium task family
D4RL_REFS = {"hopper": (-20.272305, 3234.3), "halfcheetah": (-280.178953, 12135.0), "walker2d": (1.629008, 4592.3)}


class Params(PaperParams):
    envs: list[str] = Field(["Pendulum-v1"], min_length=1, description="gymnasium tasks, offline data generated.")
    d4rl: dict[str, str] = Field({}, description="Full: gymnasium env id -> D4RL HDF5 file, loaded instead.")
    n_transitions: int = Field(20000, ge=10, description="Offline transitions per task.")
    random_share: float = Field(0.2, ge=0, le=1, description="Share of episodes from the uniform random policy.")
    action_noise: float = Field(0.5, ge=0, description="Gaussian action noise std of the energy controller.")
    diffusion_steps: int = Field(20, ge=2, description="DDPM steps K of the behaviour policy and the toy model.")
    hidden: int = Field(256, ge=8, description="Hidden width of the denoisers and critics (3 layers).")
    steps: int = Field(800, ge=1, description="Training steps (diffusion, IQL and toy model in lock-step).")
    batch_size: int = Field(256, ge=2, description="Global batch per network per step.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    gamma: float = Field(0.99, gt=0, lt=1, description="Discount of the IQL critic.")
    expectile: float = Field(0.7, gt=0, lt=1, description="IQL expectile of the value regression.")
    polyak: float = Field(0.005, gt=0, le=1, description="Polyak rate of the target critics.")
    reward_scale: float = Field(0.1, gt=0, description="Rewards are multiplied by this before IQL.")
    candidates: int = Field(8, ge=2, description="M: Doob candidates per step (also SVDD's candidates).")
    alpha: float = Field(0.1, gt=0, description="Tilt temperature: target p exp(Q / alpha) (DPS, DOIT-Proto).")
    tau: float = Field(1.0, gt=0, description="Temperature of the standardised weights (DOIT-Practical, BoN, SVDD).")
    guidance: float = Field(1.0, gt=0, description="gamma: scale of the Doob correction of eps.")
    quant_step: float = Field(0.5, gt=0, description="Quantised reward r = round(Q / q) q.")
    quantised: bool = Field(True, description="Also run Best-of-N, SVDD and DOIT on the quantised reward (reported "
                            "beside the scores; no claim part reads them).")
    eval_episodes: int = Field(4, ge=1, description="Evaluation episodes per task, stepped as one batch.")
    eval_horizon: int = Field(200, ge=1, description="Steps per evaluation episode (also for the reference returns).")
    critic_checks: int = Field(2048, ge=1, description="Dataset states of the critic-ranking premise.")
    ref_episodes: int = Field(10, ge=1, description="Episodes of the random policy and controller in prepare.")
    toy_train: int = Field(20000, ge=16, description="Training points of the 2-D Gaussian mixture.")
    toy_hidden: int = Field(128, ge=8, description="Hidden width of the toy denoiser.")
    toy_exact: int = Field(20000, ge=16, description="Pretrained samples importance-weighted into the exact target.")
    toy_draws: int = Field(128, ge=2, description="DOIT-Proto samples per (M, L).")
    toy_ml: list[tuple[int, int]] = Field([(4, 2), (16, 8)], min_length=2, description="(M, L) pairs, small first.")
    toy_alpha: float = Field(0.5, gt=0, description="Tilt temperature of the toy target.")
    toy_box: tuple[float, float, float, float] = Field((0.5, 2.5, 0.5, 2.5), description="Reward box x0,x1,y0,y1.")


# ---- data -----------------------------------------------------------------------------------------------------
def load_d4rl(path: str | Path) -> dict[str, np.ndarray]:
    """A D4RL HDF5 file (observations, actions, rewards, terminals, timeouts) -> transitions with episode ids."""
    import h5py

    with h5py.File(path, "r") as f:
        obs, act, rew = (np.asarray(f[k], np.float32) for k in ("observations", "actions", "rewards"))
        term, timeout = np.asarray(f["terminals"], bool), np.asarray(f["timeouts"], bool)
    end = term | timeout
    episode = np.concatenate([[0], np.cumsum(end)[:-1]])
    t = np.concatenate([[0], np.where(end[:-1], 0, 1)]).astype(np.int64)
    for i in range(1, len(t)):  # time index within the episode
        t[i] = 0 if end[i - 1] else t[i - 1] + 1
    keep = ~timeout[:-1] & (episode[1:] == episode[:-1])  # s2 is the next row of the same episode
    keep = np.append(keep, False) | term  # terminal rows keep s2 = s (never bootstrapped)
    nxt = np.append(obs[1:], obs[-1:], 0)
    nxt[term] = obs[term]
    return {"episode": episode[keep], "t": t[keep], "s": obs[keep], "a": act[keep], "r": rew[keep],
            "s2": nxt[keep], "done": term[keep]}


def _generate(env_id: str, p: Params, k: int) -> dict[str, np.ndarray]:
    """Noisy-controller episodes plus a random-policy share, stepped side by side."""
    _, act_dim, high = env_dims(env_id)
    horizon = 200 if env_id.startswith("Pendulum") else 999
    n_ep = max(1, math.ceil(p.n_transitions / horizon))
    is_random = np.zeros(n_ep, bool)  # exactly the parameter's share of episodes, which ones drawn
    is_random[np.random.default_rng([p.seed, k, 1]).permutation(n_ep)[: round(p.random_share * n_ep)]] = True

    def policy(obs: np.ndarray, t: int) -> np.ndarray:
        rng = np.random.default_rng([p.seed, k, 2, t])
        noisy = reference_controller(env_id, obs) + p.action_noise * rng.standard_normal((len(obs), act_dim))
        return np.clip(np.where(is_random[:, None], rng.uniform(-high, high, (len(obs), act_dim)), noisy),
                       -high, high)

    seeds = [int(s) for s in np.random.default_rng([p.seed, k, 3]).integers(0, 2**31, n_ep)]
    ep = run_episodes(env_id, policy, seeds, horizon)
    alive = ep["alive"]
    rows = np.argwhere(alive)[: p.n_transitions]  # (N, 2): episode, t
    e, t = rows[:, 0], rows[:, 1]
    return {"episode": e, "t": t, "s": ep["s"][e, t], "a": ep["a"][e, t], "r": ep["r"][e, t],
            "s2": ep["s2"][e, t], "done": ep["terminal"][e, t] > 0}


def toy_mixture(n: int, seed: int) -> np.ndarray:
    """8 Gaussians (std 0.25) on the circle of radius 2 -> (n, 2)."""
    rng = np.random.default_rng(seed)
    angle = 2 * np.pi * rng.integers(0, 8, n) / 8
    return (2 * np.stack([np.cos(angle), np.sin(angle)], 1) + 0.25 * rng.standard_normal((n, 2))).astype(np.float32)


def prepare(p: Params, out_dir: Path) -> None:
    cols: dict[str, list] = {}
    refs: dict[str, list] = {"env": [], "obs_dim": [], "act_dim": [], "random_return": [], "expert_return": []}
    datasets = {e: load_d4rl(input_path(p.d4rl[e])) if e in p.d4rl else _generate(e, p, k)
                for k, e in enumerate([*p.envs, *p.d4rl])}
    # per-dimension columns s_0.., zero-padded to the widest task (refs holds each task's own dimensions)
    width_s, width_a = (max(d[key].shape[1] for d in datasets.values()) for key in "sa")
    for env_id, data in datasets.items():
        n = len(data["r"])
        part = {"env": [env_id] * n, "episode": data["episode"], "t": data["t"]}
        for key, width in (("s", width_s), ("a", width_a), ("s2", width_s)):
            for j in range(width):
                x = data[key]
                part[f"{key}_{j}"] = x[:, j] if j < x.shape[1] else np.zeros(n, np.float32)
        part |= {"r": data["r"].astype(np.float32), "done": data["done"].astype(bool)}
        for c, v in part.items():
            cols.setdefault(c, []).extend(list(v))
        refs["env"].append(env_id)
        refs["obs_dim"].append(data["s"].shape[1])
        refs["act_dim"].append(data["a"].shape[1])
        family = env_id.split("-")[0].lower()
        if env_id in p.d4rl and family in D4RL_REFS:
            lo, hi = D4RL_REFS[family]
        else:
            _, act_dim, high = env_dims(env_id)
            seeds = [10_000 + s for s in range(p.ref_episodes)]
            rand = lambda o, t, a=act_dim, h=high: np.random.default_rng([p.seed, t]).uniform(-h, h, (len(o), a))  # noqa: E731
            lo = float(run_episodes(env_id, rand, seeds, p.eval_horizon)["returns"].mean())
            hi = float(run_episodes(env_id, lambda o, t, e=env_id: reference_controller(e, o), seeds,
                                    p.eval_horizon)["returns"].mean())
        refs["random_return"].append(lo)
        refs["expert_return"].append(hi)
    write_table(out_dir / "transitions.parquet", cols)
    write_table(out_dir / "refs.parquet", refs)
    write_table(out_dir / "toy.parquet", {"x": toy_mixture(p.toy_train, p.seed)})


def load_env(data_dir: Path, env_id: str) -> dict[str, torch.Tensor]:
    t, refs = read_table(data_dir / "transitions.parquet"), read_table(data_dir / "refs.parquet")
    sel = t["env"] == env_id
    k = list(refs["env"]).index(env_id)
    obs_dim, act_dim = int(refs["obs_dim"][k]), int(refs["act_dim"][k])
    stack = lambda key, d: torch.from_numpy(np.stack([t[f"{key}_{j}"][sel] for j in range(d)], 1).astype(np.float32))  # noqa: E731
    return {"s": stack("s", obs_dim), "a": stack("a", act_dim), "s2": stack("s2", obs_dim),
            "r": torch.from_numpy(t["r"][sel].astype(np.float32)), "done": torch.from_numpy(t["done"][sel]).float()}


# ---- networks ---------------------------------------------------------------------------------------------------
def mlp(d_in: int, hidden: int, d_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d_in, hidden), nn.SiLU(), nn.Linear(hidden, hidden), nn.SiLU(),
                         nn.Linear(hidden, hidden), nn.SiLU(), nn.Linear(hidden, d_out))


def forward_flops(net: nn.Module) -> int:
    """Multiply-adds x 2 of one forward pass for one sample (the linear layers)."""
    return sum(2 * m.weight.numel() for m in net.modules() if isinstance(m, nn.Linear))


class EpsNet(nn.Module):
    """eps_theta(x_t, t, c): an MLP on [x_t, c, Fourier features of t / K]."""

    def __init__(self, x_dim: int, cond_dim: int, hidden: int, num_steps: int):
        super().__init__()
        self.num_steps = num_steps
        self.register_buffer("freqs", math.pi * 2.0 ** torch.arange(6))  # (6,)
        self.net = mlp(x_dim + cond_dim + 12, hidden, x_dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        ang = (t.float()[:, None] / self.num_steps) * self.freqs  # (B, 6)
        parts = [x, ang.sin(), ang.cos()] + ([cond] if cond is not None else [])
        return self.net(torch.cat(parts, -1))  # (B, x_dim)


class EnvNets(nn.Module):
    """One task's behaviour policy, IQL critics and state normaliser."""

    def __init__(self, obs_dim: int, act_dim: int, high: float, p: Params):
        super().__init__()
        self.policy = EpsNet(act_dim, obs_dim, p.hidden, p.diffusion_steps)
        self.q1, self.q2 = mlp(obs_dim + act_dim, p.hidden, 1), mlp(obs_dim + act_dim, p.hidden, 1)
        self.q1_t, self.q2_t = mlp(obs_dim + act_dim, p.hidden, 1), mlp(obs_dim + act_dim, p.hidden, 1)
        for target, source in ((self.q1_t, self.q1), (self.q2_t, self.q2)):
            target.load_state_dict(source.state_dict())
            target.requires_grad_(False)
        self.v = mlp(obs_dim, p.hidden, 1)
        self.register_buffer("s_mean", torch.zeros(obs_dim))
        self.register_buffer("s_std", torch.ones(obs_dim))
        self.high = high

    def norm(self, s: torch.Tensor) -> torch.Tensor:
        return (s - self.s_mean) / self.s_std

    def q(self, s: torch.Tensor, a: torch.Tensor, target: bool = False) -> torch.Tensor:
        """min of the twin critics at (normalised s, a in [-1, 1]) -> (B,)."""
        x = torch.cat([self.norm(s), a], -1)
        q1, q2 = (self.q1_t, self.q2_t) if target else (self.q1, self.q2)
        return torch.min(q1(x), q2(x))[:, 0]


def build(p: Params, dims: dict[str, tuple[int, int, float]]) -> nn.ModuleDict:
    torch.manual_seed(p.seed)
    nets = {tag(e): EnvNets(*dims[e], p) for e in dims}
    return nn.ModuleDict({**nets, "toy": EpsNet(2, 0, p.toy_hidden, p.diffusion_steps)})


def tag(env_id: str) -> str:
    return env_id.split("-")[0].lower()


# ---- losses -----------------------------------------------------------------------------------------------------
class Schedule:
    """DDPM quantities of the VP schedule of diffusion policies (Diffusion-QL, IDQL): beta_t = 1 - exp(-b_min / K
    - (b_max - b_min)(2t + 1) / (2 K^2)), b_min = 0.1, b_max = 10, so abar_{K-1} ~ 0.006 and every beta < 0.4."""

    def __init__(self, num_steps: int, b_min: float = 0.1, b_max: float = 10.0):
        t = torch.arange(num_steps, dtype=torch.float64)
        beta = 1 - torch.exp(-b_min / num_steps - (b_max - b_min) * (2 * t + 1) / (2 * num_steps**2))  # (K,)
        ab = torch.cumprod(1 - beta, 0)
        self.K, self.abar, self.beta = num_steps, ab.float(), beta.float()
        self.abar_prev = torch.cat([torch.ones(1), self.abar[:-1]])
        self.sigma = (self.beta * (1 - self.abar_prev) / (1 - self.abar)).sqrt()  # posterior std; 0 at t = 0

    def mean(self, x: torch.Tensor, eps: torch.Tensor, t: int) -> torch.Tensor:
        """mu_theta(x_t) of the DDPM reverse step."""
        return (x - self.beta[t] / (1 - self.abar[t]).sqrt() * eps) / (1 - self.beta[t]).sqrt()

    def x0(self, x: torch.Tensor, eps: torch.Tensor, t: int) -> torch.Tensor:
        return (x - (1 - self.abar[t]).sqrt() * eps) / self.abar[t].sqrt()


def diffusion_loss(net: EpsNet, x0: torch.Tensor, cond: torch.Tensor | None, sched: Schedule,
                   g: torch.Generator) -> torch.Tensor:
    t = torch.randint(0, sched.K, (len(x0),), generator=g)
    eps = torch.randn(x0.shape, generator=g)
    ab = sched.abar[t][:, None]  # (B, 1)
    return F.mse_loss(net(ab.sqrt() * x0 + (1 - ab).sqrt() * eps, t, cond), eps)


def iql_losses(nets: EnvNets, b: dict[str, torch.Tensor], p: Params) -> tuple[torch.Tensor, dict[str, float]]:
    """IQL: expectile regression of V on min Q_target, and Q on r + gamma V(s')."""
    s, a, s2 = nets.norm(b["s"]), b["a"], nets.norm(b["s2"])
    with torch.no_grad():
        q_t = nets.q(b["s"], a, target=True)  # (B,)
        y = b["r"] * p.reward_scale + p.gamma * (1 - b["done"]) * nets.v(s2)[:, 0]
    diff = q_t - nets.v(s)[:, 0]
    weight = torch.where(diff > 0, p.expectile, 1 - p.expectile)
    loss_v = (weight * diff**2).mean()
    x = torch.cat([s, a], -1)
    loss_q = F.mse_loss(nets.q1(x)[:, 0], y) + F.mse_loss(nets.q2(x)[:, 0], y)
    return loss_v + loss_q, {"v_loss": float(loss_v.detach()), "q_loss": float(loss_q.detach())}


def train(ctx) -> None:
    p: Params = ctx.params
    envs = [*p.envs, *p.d4rl]
    data = {e: load_env(ctx.data_dir, e) for e in envs}
    dims = {e: (d["s"].shape[1], d["a"].shape[1], env_dims(e)[2]) for e, d in data.items()}
    model = build(p, dims)
    for e, d in data.items():
        model[tag(e)].s_mean.copy_(d["s"].mean(0))
        model[tag(e)].s_std.copy_(d["s"].std(0).clamp(min=1e-3))
        d["a"] = (d["a"] / dims[e][2]).clamp(-1, 1)  # actions in [-1, 1]
    toy = torch.from_numpy(read_table(ctx.data_dir / "toy.parquet")["x"].copy())
    sched = Schedule(p.diffusion_steps)

    def batch_fn(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(p.seed * 1_000_003 + step)
        batch = {"toy/x": toy[torch.randint(0, len(toy), (p.batch_size,), generator=g)],
                 "toy/noise_seed": torch.randint(0, 2**31, (p.batch_size,), generator=g)}
        for e, d in data.items():
            idx = torch.randint(0, len(d["r"]), (p.batch_size,), generator=g)
            batch |= {f"{tag(e)}/{k}": v[idx] for k, v in d.items()}
        return batch

    def step_fn(engine, batch, step):
        g = torch.Generator().manual_seed(int(batch["toy/noise_seed"][0]))  # this rank's diffusion noise
        loss_toy = diffusion_loss(model["toy"], batch["toy/x"], None, sched, g)
        total, metrics = loss_toy, {"toy_loss": float(loss_toy.detach())}
        for e in data:
            nets = model[tag(e)]
            with torch.no_grad():
                for target, source in ((nets.q1_t, nets.q1), (nets.q2_t, nets.q2)):
                    for pt, ps in zip(target.parameters(), source.parameters(), strict=True):
                        pt.lerp_(ps, p.polyak)
            b = {k.split("/", 1)[1]: v for k, v in batch.items() if k.startswith(tag(e) + "/")}
            loss_bc = diffusion_loss(nets.policy, b["a"], nets.norm(b["s"]), sched, g)
            loss_iql, stats = iql_losses(nets, b, p)
            total = total + loss_bc + loss_iql
            metrics |= {f"{tag(e)}/bc_loss": float(loss_bc.detach()), **{f"{tag(e)}/{k}": v for k, v in stats.items()}}
        return total, metrics

    ctx.progress(f"behaviour diffusion + IQL on {envs} and the toy model, {p.steps} steps in one engine")
    ctx.fit("all", ctx.engine(model, p.lr, arms=network_arms(model)), step_fn, batch_fn, p.steps)


def network_arms(model: nn.ModuleDict) -> dict[str, nn.Module]:
    """One arm (own AdamW group, own gradient clip) per trained network: each task's behaviour diffusion, twin
    critics and value net, and the toy model. A task's networks in one arm share one clip, so the critics' growing
    gradient norm would scale down the behaviour diffusion's updates (the target critics are frozen copies)."""
    arms: dict[str, nn.Module] = {"toy": model["toy"]}
    for key, nets in model.items():
        if key != "toy":
            arms |= {f"{key}/{part}": getattr(nets, part) for part in ("policy", "q1", "q2", "v")}
    return arms


# ---- samplers: the pretrained model, DOIT and the baselines ------------------------------------------------------
class Counter:
    """Per-sample network evaluations actually made: denoiser forwards, VJPs through it, critic forwards/VJPs."""

    def __init__(self):
        self.fwd = self.vjp = self.q = self.q_vjp = 0


LogH = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]  # (candidates (B, M, D), eps (B, D), t) -> (B, M)


def _expand(cond: torch.Tensor | None, m: int) -> torch.Tensor | None:
    return None if cond is None else cond.repeat_interleave(m, 0)


@torch.no_grad()
def ddpm_sample(net: EpsNet, x: torch.Tensor, sched: Schedule, g: torch.Generator, cond: torch.Tensor | None = None,
                t_start: int | None = None, count: Counter | None = None) -> torch.Tensor:
    """The pretrained stochastic sampler from x at step t_start (default K - 1) down to x_0."""
    for t in range((sched.K - 1) if t_start is None else t_start, -1, -1):
        eps = net(x, torch.full((len(x),), t), cond)
        x = sched.mean(x, eps, t) + sched.sigma[t] * torch.randn(x.shape, generator=g)
        if count is not None:
            count.fwd += len(x)
    return x


def doob_sample(net: EpsNet, x: torch.Tensor, sched: Schedule, log_h: LogH, m: int, gamma: float,
                g: torch.Generator, cond: torch.Tensor | None = None, count: Counter | None = None) -> torch.Tensor:
    """DDPM sampling with the Doob correction: at each step t >= 1, candidates x^(m) = mu + sigma_t z_m, weights
    w = softmax(log h_hat_{t-1}(x^(m))), v = sum_m w_m z_m / sigma_t, g_t = (d mu / d x_t)^T v (one VJP), and
    eps <- eps - gamma sqrt(1 - abar_t) g_t. x: (B, D) noise; returns x_0 (B, D)."""
    for t in range(sched.K - 1, -1, -1):
        xg = x.detach().requires_grad_(t > 0)
        with torch.enable_grad():
            eps = net(xg, torch.full((len(x),), t), cond)  # (B, D)
            mu = sched.mean(xg, eps, t)  # (B, D)
            if t > 0:
                z = torch.randn((len(x), m, x.shape[1]), generator=g)  # (B, M, D)
                cand = mu.detach()[:, None] + sched.sigma[t] * z  # (B, M, D)
                w = log_h(cand, eps.detach(), t - 1).softmax(-1)  # (B, M)
                v = (w[..., None] * z).sum(1) / sched.sigma[t]  # (B, D): likelihood-ratio grad log h at mu
                grad = torch.autograd.grad(mu, xg, v)[0]  # (B, D) = (d mu / d x_t)^T v
        eps = eps.detach()
        if t > 0:
            eps = eps - gamma * (1 - sched.abar[t]).sqrt() * grad
        if count is not None:
            count.fwd += len(x)
            count.vjp += len(x) if t > 0 else 0
        x = sched.mean(x, eps, t) + sched.sigma[t] * torch.randn(x.shape, generator=g)
    return x.detach()


def standardised(r: torch.Tensor, tau: float) -> torch.Tensor:
    """Scale-free log-weights (r - mean r) / (std r tau) over the last axis (the candidates); zeros for one
    candidate. Shared by DOIT-Practical, Best-of-N and SVDD so that every arm weighs the same Q the same way."""
    if r.shape[-1] < 2:
        return torch.zeros_like(r)
    return (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) * tau + 1e-8)


def practical_log_h(reward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], sched: Schedule, tau: float,
                    cond: torch.Tensor | None, count: Counter | None = None) -> LogH:
    """DOIT-Practical: r at the one-jump x0_hat(x^(m)) (the current eps reused), standardised over the M candidates."""
    def log_h(cand: torch.Tensor, eps: torch.Tensor, t: int) -> torch.Tensor:
        b, m, d = cand.shape
        x0 = sched.x0(cand, eps[:, None], t).clamp(-1, 1)  # (B, M, D)
        r = reward(x0.reshape(b * m, d), _expand(cond, m)).reshape(b, m)  # (B, M)
        if count is not None:
            count.q += b * m
        return standardised(r, tau)  # (B, M)
    return log_h


def proto_log_h(net: EpsNet, reward: Callable[[torch.Tensor], torch.Tensor], sched: Schedule, alpha: float,
                rollouts: int, g: torch.Generator, count: Counter | None = None) -> LogH:
    """DOIT-Proto: log (1/L) sum_l exp(r(x_0^(m,l)) / alpha) over L pretrained rollouts from each candidate."""
    def log_h(cand: torch.Tensor, eps: torch.Tensor, t: int) -> torch.Tensor:
        b, m, d = cand.shape
        start = cand.reshape(b * m, 1, d).expand(b * m, rollouts, d).reshape(-1, d)  # (B M L, D)
        x0 = start if t < 0 else ddpm_sample(net, start, sched, g, t_start=t, count=count)
        r = reward(x0).reshape(b, m, rollouts) / alpha  # (B, M, L)
        return torch.logsumexp(r, -1) - math.log(rollouts)
    return log_h


@torch.no_grad()
def best_of_n(net: EpsNet, cond: torch.Tensor, n: int, reward, sched: Schedule, tau: float, g: torch.Generator,
              count: Counter) -> torch.Tensor:
    """IDQL-style: N behaviour samples per state, keep one drawn from softmax(standardised(r)) at DOIT's tau."""
    b, d = len(cond), net.net[-1].out_features
    a = ddpm_sample(net, torch.randn((b * n, d), generator=g), sched, g, _expand(cond, n), count=count).clamp(-1, 1)
    r = reward(a, _expand(cond, n)).reshape(b, n)  # (B, N)
    count.q += b * n
    pick = torch.multinomial(standardised(r, tau).softmax(-1), 1, generator=g)[:, 0]  # (B,)
    return a.reshape(b, n, d)[torch.arange(b), pick]


def gradient_guided(net: EpsNet, nets: EnvNets, cond: torch.Tensor, sched: Schedule, alpha: float, gamma: float,
                    g: torch.Generator, count: Counter) -> torch.Tensor:
    """DPS-style guidance: eps <- eps - gamma sqrt(1 - abar_t) grad_{x_t} Q(s, x0_hat(x_t)) / alpha."""
    x = torch.randn((len(cond), net.net[-1].out_features), generator=g)
    s_raw = cond * nets.s_std + nets.s_mean  # cond is the normalised state, as for every sampler
    for t in range(sched.K - 1, -1, -1):
        xg = x.detach().requires_grad_(True)
        with torch.enable_grad():
            eps = net(xg, torch.full((len(x),), t), cond)
            q = nets.q(s_raw, sched.x0(xg, eps, t).clamp(-1, 1))
            grad = torch.autograd.grad(q.sum(), xg)[0]  # (B, D)
        count.fwd, count.vjp, count.q, count.q_vjp = (count.fwd + len(x), count.vjp + len(x), count.q + len(x),
                                                      count.q_vjp + len(x))
        eps = eps.detach() - gamma * (1 - sched.abar[t]).sqrt() * grad / alpha
        with torch.no_grad():
            x = sched.mean(x, eps, t) + sched.sigma[t] * torch.randn(x.shape, generator=g)
    return x


@torch.no_grad()
def svdd_sample(net: EpsNet, cond: torch.Tensor, m: int, reward, sched: Schedule, tau: float, g: torch.Generator,
                count: Counter) -> torch.Tensor:
    """SVDD (soft value-based decoding): at each step draw M next states, value each by r(x0_hat) with the
    denoiser at the candidate, keep one from softmax(standardised(v)) at DOIT's tau; the kept candidate's eps
    drives the next step."""
    b, d = len(cond), net.net[-1].out_features
    x = torch.randn((b, d), generator=g)
    eps = net(x, torch.full((b,), sched.K - 1), cond)
    count.fwd += b
    for t in range(sched.K - 1, 0, -1):
        cand = sched.mean(x, eps, t)[:, None] + sched.sigma[t] * torch.randn((b, m, d), generator=g)  # (B, M, D)
        flat = cand.reshape(b * m, d)
        eps_c = net(flat, torch.full((b * m,), t - 1), _expand(cond, m))  # (B M, D)
        v = reward(sched.x0(flat, eps_c, t - 1).clamp(-1, 1), _expand(cond, m)).reshape(b, m)
        count.fwd, count.q = count.fwd + b * m, count.q + b * m
        pick = torch.multinomial(standardised(v, tau).softmax(-1), 1, generator=g)[:, 0]
        x, eps = cand[torch.arange(b), pick], eps_c.reshape(b, m, d)[torch.arange(b), pick]
    return sched.mean(x, eps, 0)


def make_reward(nets: EnvNets, quant: float | None):
    """The black-box reward r(a; s) = Q(s, a) (or its quantisation); cond is the normalised state."""
    def reward(a: torch.Tensor, s_norm: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            q = nets.q(s_norm * nets.s_std + nets.s_mean, a)
        return q if quant is None else torch.round(q / quant) * quant
    return reward


# ---- evaluation -------------------------------------------------------------------------------------------------
def critic_rank_acc(nets: EnvNets, env_id: str, s: torch.Tensor, a_data: torch.Tensor, n: int, seed: int) -> float:
    """How often the critic prefers a good action to a uniform random one at the same state: the share of n dataset
    states where min-Q(s, a_good) > min-Q(s, a_random). a_good is the clean controller's action where the task has
    one (Pendulum, mountain car), else the dataset's own action (D4RL); actions in [-1, 1]. 0.5 is a critic blind to
    the action, which no reward-guided sampler can use."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(s), (n,), generator=g)
    states = s[idx]
    try:
        good = torch.from_numpy(reference_controller(env_id, states.numpy()).astype(np.float32)) / nets.high
    except ValueError:  # no reference controller: the behaviour data's own action
        good = a_data[idx]
    rand = torch.rand(good.shape, generator=g) * 2 - 1
    with torch.no_grad():
        return float((nets.q(states, good.clamp(-1, 1)) > nets.q(states, rand)).float().mean())


def nfe_doit(p: Params) -> int:
    """DOIT-Practical's network evaluations per action: K denoiser passes, K - 1 VJPs, M (K - 1) critic calls."""
    k = p.diffusion_steps
    return k + (k - 1) + p.candidates * (k - 1)


def evaluate_env(p: Params, nets: EnvNets, env_id: str, seeds: list[int], ctx=None) -> dict[str, dict[str, float]]:
    """Every method's returns (per reward), network evaluations and counted FLOPs per action on one task."""
    sched, net = Schedule(p.diffusion_steps), nets.policy
    n_bon = max(1, round(nfe_doit(p) / (p.diffusion_steps + 1)))  # BoN's N: K denoiser passes + 1 critic call each
    rewards = {"": make_reward(nets, None)} | ({"_quant": make_reward(nets, p.quant_step)} if p.quantised else {})
    act_dim = net.net[-1].out_features
    runs = {("pretrained", ""): lambda s, g, c: ddpm_sample(net, torch.randn((len(s), act_dim), generator=g), sched,
                                                             g, s, count=c),
            ("gradient", ""): lambda s, g, c: gradient_guided(net, nets, s, sched, p.alpha, p.guidance, g, c)}
    for suffix, r in rewards.items():
        runs[("best_of_n", suffix)] = lambda s, g, c, r=r: best_of_n(net, s, n_bon, r, sched, p.tau, g, c)
        runs[("svdd", suffix)] = lambda s, g, c, r=r: svdd_sample(net, s, p.candidates, r, sched, p.tau, g, c)
        runs[("doit", suffix)] = lambda s, g, c, r=r: doob_sample(
            net, torch.randn((len(s), act_dim), generator=g), sched,
            practical_log_h(r, sched, p.tau, s, c), p.candidates, p.guidance, g, s, c)
    f_d, f_q = forward_flops(net), 2 * forward_flops(nets.q1)  # the critic reward is the min of twin critics
    out: dict[str, dict[str, float]] = {}
    for (name, suffix), fn in runs.items():
        count, actions = Counter(), [0]

        def policy(obs: np.ndarray, t: int, fn=fn, count=count, actions=actions) -> np.ndarray:
            g = torch.Generator().manual_seed(p.seed * 1_000_003 + t)
            s_norm = nets.norm(torch.from_numpy(obs))
            actions[0] += len(obs)
            return (fn(s_norm, g, count).clamp(-1, 1) * nets.high).detach().numpy()

        returns = run_episodes(env_id, policy, seeds, p.eval_horizon)["returns"]
        row = out.setdefault(name, {})
        row[f"return{suffix}"] = float(returns.mean())
        if not suffix:
            n = actions[0]
            row["nfe_per_action"] = (count.fwd + count.vjp + count.q + count.q_vjp) / n
            row["flops_per_action"] = (f_d * (count.fwd + 2 * count.vjp) + f_q * (count.q + 2 * count.q_vjp)) / n
        if ctx is not None:
            ctx.progress(f"{env_id} {name}{suffix}: return {returns.mean():.1f}")
    out["best_of_n"]["n"] = float(n_bon)
    return out


def box_reward(box: tuple[float, float, float, float]):
    def reward(x: torch.Tensor) -> torch.Tensor:
        return ((x[:, 0] >= box[0]) & (x[:, 0] <= box[1]) & (x[:, 1] >= box[2]) & (x[:, 1] <= box[3])).float()
    return reward


def evaluate_toy(p: Params, net: EpsNet) -> dict[str, np.ndarray | float]:
    """DOIT-Proto at each (M, L) against the exact tilted target (SNIS over pretrained samples); sliced W2."""
    import ot

    sched, reward = Schedule(p.diffusion_steps), box_reward(p.toy_box)
    g = torch.Generator().manual_seed(p.seed)
    exact = ddpm_sample(net, torch.randn((p.toy_exact, 2), generator=g), sched, g)  # (N, 2)
    w = torch.softmax(reward(exact) / p.toy_alpha, 0).double().numpy()  # SNIS weights of p exp(r / alpha)
    w /= w.sum()
    sw2 = lambda x: float(ot.sliced_wasserstein_distance(x.numpy(), exact.numpy(), b=w, n_projections=200,  # noqa: E731
                                                         seed=p.seed))
    out: dict[str, np.ndarray | float] = {"exact": exact.numpy(), "weights": w,
                                          "exact_reward": float((reward(exact).numpy() * w).sum())}
    g = torch.Generator().manual_seed(p.seed + 1)
    pre = ddpm_sample(net, torch.randn((p.toy_draws, 2), generator=g), sched, g)
    out |= {"pretrained": pre.numpy(), "pretrained_sw2": sw2(pre), "pretrained_reward": float(reward(pre).mean())}
    for m, n_roll in p.toy_ml:
        g = torch.Generator().manual_seed(p.seed + 2)  # common random numbers across (M, L)
        x = doob_sample(net, torch.randn((p.toy_draws, 2), generator=g), sched,
                        proto_log_h(net, reward, sched, p.toy_alpha, n_roll, g), m, p.guidance, g)
        out |= {f"proto_{m}_{n_roll}": x.numpy(), f"proto_{m}_{n_roll}_sw2": sw2(x),
                f"proto_{m}_{n_roll}_reward": float(reward(x).mean())}
    return out


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    model = ctx.network("all")
    refs = read_table(ctx.data_dir / "refs.parquet")
    metrics: dict[str, float] = {}
    per: dict[str, list[float]] = {}
    margins, results = [], {}
    baselines = ("pretrained", "best_of_n", "gradient", "svdd")
    for k, env_id in enumerate(refs["env"]):
        lo, hi = float(refs["random_return"][k]), float(refs["expert_return"][k])
        seeds = [int(s) for s in np.random.default_rng([p.seed, k, 9]).integers(0, 2**31, p.eval_episodes)]
        res = evaluate_env(p, model[tag(env_id)], env_id, seeds, ctx)
        results[env_id] = res
        for name, row in res.items():
            for key in [key for key in row if key.startswith("return")]:
                row[key.replace("return", "score")] = 100 * (row[key] - lo) / (hi - lo)
            prefix = "method" if name == "doit" else f"baseline/{name}"
            for key, value in row.items():
                per.setdefault(f"{prefix}/{key}", []).append(value)
                metrics[f"detail/{tag(env_id)}/{name}/{key}"] = value
        margins.append(res["doit"]["score"] - max(res[b]["score"] for b in baselines))
        d = load_env(ctx.data_dir, env_id)
        acc = critic_rank_acc(model[tag(env_id)], env_id, d["s"], (d["a"] / model[tag(env_id)].high).clamp(-1, 1),
                              p.critic_checks, p.seed)
        per.setdefault("detail/critic_rank_acc", []).append(acc)
        metrics[f"detail/{tag(env_id)}/critic_rank_acc"] = acc
    metrics |= {k: float(np.mean(v)) for k, v in per.items()}
    metrics["method/min_env_margin"] = float(min(margins))

    toy = evaluate_toy(p, model["toy"])
    (m0, l0), (m1, l1) = p.toy_ml[0], p.toy_ml[-1]
    metrics |= {"method/toy_sw2": toy[f"proto_{m1}_{l1}_sw2"], "method/toy_sw2_small_ml": toy[f"proto_{m0}_{l0}_sw2"],
                "method/toy_reward": toy[f"proto_{m1}_{l1}_reward"],
                "baseline/pretrained/toy_sw2": toy["pretrained_sw2"],
                "baseline/pretrained/toy_reward": toy["pretrained_reward"],
                "detail/toy/exact_reward": toy["exact_reward"]}
    for m, n_roll in p.toy_ml:
        metrics[f"detail/toy/sw2_M{m}_L{n_roll}"] = toy[f"proto_{m}_{n_roll}_sw2"]
    ctx.progress("toy SW2: pretrained {:.3f}, ".format(toy["pretrained_sw2"]) + ", ".join(
        f"(M,L)=({m},{n}) {toy[f'proto_{m}_{n}_sw2']:.3f}" for m, n in p.toy_ml))
    _plot_scores(ctx.plots_dir / "scores.png", results)
    _plot_toy(ctx.plots_dir / "toy.png", toy, p)
    return metrics


def _plot_scores(path: Path, results: dict[str, dict[str, dict[str, float]]]) -> None:
    import matplotlib.pyplot as plt

    names = ("pretrained", "best_of_n", "gradient", "svdd", "doit")
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for ax, (env_id, res) in zip(axes[0], results.items(), strict=True):
        x = np.arange(len(names))
        ax.bar(x - 0.2, [res[n]["score"] for n in names], 0.4, label="r = Q")
        ax.bar(x + 0.2, [res[n].get("score_quant", np.nan) for n in names], 0.4, label="r = round(Q / q) q")
        ax.set_xticks(x, ["pretrained", "Best-of-N", "grad. guid.", "SVDD", "DOIT-Pract."], fontsize=7)
        ax.set(ylabel="normalised score", title=env_id)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_toy(path: Path, toy: dict, p: Params) -> None:
    import matplotlib.pyplot as plt

    rng = np.random.default_rng(p.seed)
    target = toy["exact"][rng.choice(len(toy["exact"]), 2000, p=toy["weights"])]
    panels = [("exact tilted target", target), (f"pretrained (SW2 {toy['pretrained_sw2']:.3f})", toy["pretrained"])]
    panels += [(f"DOIT-Proto M={m}, L={n} (SW2 {toy[f'proto_{m}_{n}_sw2']:.3f})", toy[f"proto_{m}_{n}"])
               for m, n in p.toy_ml]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2))
    x0, x1, y0, y1 = p.toy_box
    for ax, (title, pts) in zip(axes, panels, strict=True):
        ax.scatter(pts[:, 0], pts[:, 1], s=3, alpha=0.5)
        ax.add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, color="red"))
        ax.set(xlim=(-3.2, 3.2), ylim=(-3.2, 3.2), title=title)
        ax.title.set_fontsize(7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="doit",
    title="DOIT: Doob-oriented inference-time transformation of diffusion models",
    seed="003_9a806cafa3d919df.txt, abstract 9",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/score", "max"),
    claim=Claim(premises=(  # the arms learned: the behaviour policy and the critic (bars in the docstring)
        Compare("baseline/pretrained/score", ">=", 25.0, name="behaviour_policy_learned"),
        Compare("detail/critic_rank_acc", ">=", 0.6, name="critic_ranks_actions"),
    ), all_of=(
        Compare("method/score", ">", ("baseline/pretrained/score", "baseline/best_of_n/score",
                                      "baseline/gradient/score", "baseline/svdd/score")),
        Compare("method/min_env_margin", ">", 0.0),  # DOIT-Practical ahead on every task, not only on average
        Compare("method/toy_sw2", "<", "method/toy_sw2_small_ml"),
        Compare("method/toy_sw2", "<", "baseline/pretrained/toy_sw2"),
    ), context=(  # an analytic count: Best-of-N's N is chosen from DOIT's network evaluations, so it holds by design
        Compare("method/flops_per_action", "<=", "baseline/best_of_n/flops_per_action", scale=2.0),
    ), note="with one task (smoke) method/min_env_margin is the score part's own margin, not a second test",
        summary="DOIT-Practical beats every training-free baseline (Best-of-N at matched network evaluations); "
                "DOIT-Proto converges; context: counted FLOPs per action <= 2x Best-of-N's"),
)
