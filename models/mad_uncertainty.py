"""Bayesian uncertainty analysis of multi-agent debate, and uncertainty-guided MARL that makes debate productive.

Seed: 000_2dd18ae8605fb5c1.txt, abstract 8. Spec: ../shared/papers/mad_uncertainty.md.

What it implements (function names in brackets):
- agents: char-level decoder-only transformers; input "a op b=" in round 1 and "a op b|A1:x;A2:y=" later (the
  peers' answers of the previous round); p_i(y) = softmax over the 10 digit tokens at the answer position [Agent];
- heterogeneous knowledge by supervised pretraining on corrupted views (type A: reliable '+', 40% wrong 'x'; B the
  reverse; C 20% on both) [prepare, pretrain in train];
- debate: R rounds, round 1 independent, round r sees the peers' round r-1 answers [debate];
- uncertainty decomposition per question and round: TU = H(mean_i p_i), AU = mean_i H(p_i), EU = TU - AU
  [decompose];
- uncertainty-guided MARL: GRPO-style policy gradient (G debate rollouts per question, group-normalised advantage,
  every round's answer is an action) with KL 0.05 to the pretrained policy; reward r_i = 1[final answer_i correct]
  - alpha AU_i (own entropy at rounds >= 2) + beta (EU_1 - EU_R) 1[majority correct] [rewards, marl_loss];
- baselines: single agent (round-1 accuracy), round-1 majority vote, vanilla MAD with the pretrained agents,
  correctness-only MARL (alpha = beta = 0, same algorithm and steps). Both MARL arms train in lock-step in one
  DeepSpeed engine, with their rollouts sampled inside `batch_fn` [train]; evaluation debates on the `test` split
  only, with greedy answers [evaluate].

Deviations from the paper (choices the abstract left open; the spec's choices are not repeated):
- '-' questions carry 20% label noise for every agent type (the spec names only '+' and 'x'); a corrupted label is a
  uniformly drawn wrong digit. For three operands a question's noise rate is the largest of its operators'.
- Splits as the spec has them: pretraining views cover every question (each agent memorises its own corrupted
  view, so test questions carry the knowledge debate is meant to combine), RL rewards read true answers of the `rl`
  split only, evaluation debates the `test` split. (Pretraining on the `rl` split only asked 2-layer character
  models to generalise a mod-10 table to unseen questions, which the spec says they cannot: their round-1 test
  accuracy sat at chance while they reproduced their `rl` views; `pretrain_test=False` restores that split.)
  Premises: each pretrained agent of the heterogeneous team reproduces its own view on the test questions
  (round-1 agreement >= 0.8, "most of it"), so the heterogeneous knowledge exists. Whether RL changes round-1
  accuracy is context: with memorised views RL can change whom an agent trusts, not what it knows.
- Pretraining inputs use the round-1 form half of the time and the debate form with uniformly random peer answers
  the other half, so the debate form is in-distribution; the label is the agent's own view, so pretrained agents
  learn to ignore peers (nothing in the supervised data says whom to trust: that is what debate RL has to learn).
- Evaluation decodes greedily (each agent answers argmax p_i); the uncertainty terms use the full p_i. Majority
  ties go to the smallest digit among the tied answers.
- Smoke pretrains 300 steps of 64 per agent, not the spec's 120: at 120 steps a width-64 agent reproduces only a
  small share of its own view's labels (an earlier trial on one core), so the heterogeneous knowledge that debate
  rests on does not exist yet; at 300 steps it reproduces most of them.
- The peers' answers follow the question ("3*4|A1:2;A2:7="); putting them first (question at fixed positions from
  the end) memorised slower at equal steps (an earlier trial at 120 steps).
- Full profile: the LLM agents (Qwen/Llama from local paths) are not wired (no weights here). The jsonl loader
  (GSM8K layout, "#### n") feeds the same char-level agents, with the final answer's last digit as the target.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

NOISE = {"A": {"+": 0.0, "*": 0.4, "-": 0.2}, "B": {"+": 0.4, "*": 0.0, "-": 0.2}, "C": {"+": 0.2, "*": 0.2, "-": 0.2}}
TEAMS = {"homogeneous": ("A0", "A1", "A2"), "heterogeneous": ("A0", "B", "C")}  # pretrained agents
ARMS = ("ug", "co")  # uncertainty-guided MARL, correctness-only MARL


class Params(PaperParams):
    dataset: Literal["synthetic", "jsonl"] = Field("synthetic", description="Modular arithmetic, or a GSM8K jsonl.")
    jsonl_path: str = Field("", description="jsonl with question/answer ('... #### n'); target = last digit of n.")
    n_operands: int = Field(2, ge=2, le=3, description="Operands per question ('a op b' or 'a op b op c').")
    n_questions: int = Field(0, ge=0, description="Questions kept after a seeded shuffle; 0 = all distinct ones.")
    rl_fraction: float = Field(2 / 3, gt=0, lt=1, description="Share of questions in the `rl` split (rest: `test`).")
    width: int = Field(64, ge=8, description="Transformer width.")
    layers: int = Field(2, ge=1, description="Transformer layers.")
    heads: int = Field(4, ge=1, description="Attention heads.")
    pretrain_steps: int = Field(300, ge=1, description="Supervised pretraining steps (all agents in lock-step).")
    pretrain_batch: int = Field(64, ge=2, description="Questions per pretraining step and agent.")
    pretrain_lr: float = Field(3e-3, gt=0, description="Pretraining learning rate.")
    rounds: int = Field(3, ge=2, description="Debate rounds R.")
    rl_steps: int = Field(40, ge=1, description="MARL updates per arm.")
    rl_questions: int = Field(16, ge=1, description="Questions per MARL update.")
    group: int = Field(4, ge=2, description="Debate rollouts G per question (GRPO group).")
    rl_lr: float = Field(1e-3, gt=0, description="MARL learning rate.")
    kl_weight: float = Field(0.05, ge=0, description="Weight of KL(p_i || p_pretrained) at visited inputs.")
    alpha: float = Field(0.1, ge=0, description="Aleatoric cost weight (own entropy at rounds >= 2).")
    beta: float = Field(0.5, ge=0, description="Epistemic utilisation weight ((EU_1 - EU_R) x majority correct).")
    pretrain_test: bool = Field(True, description="Pretraining views cover the test split too (the spec: each agent "
                                "memorises its own view of every question); False: the `rl` split only.")
    n_seeds: int = Field(1, ge=1, description="Independent seeds (agents, pretraining, MARL), trained side by side "
                         "in lock-step on batches of the same shapes; metrics are means (replicas: `paperline plan` "
                         "traces one and scales).", json_schema_extra={"replicas": True})


# ---- data --------------------------------------------------------------------------------------------------
def load_jsonl(path: Path) -> list[tuple[str, int]]:
    """GSM8K layout: {"question": ..., "answer": "... #### 72"} -> (question, 72)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            rows.append((rec["question"], int(float(rec["answer"].split("####")[-1].strip().replace(",", "")))))
    return rows


def _questions(p: Params) -> list[tuple[str, int, str]]:
    """(text, answer digit, operators) for every question."""
    if p.dataset == "jsonl":
        return [(q, a % 10, "+") for q, a in load_jsonl(input_path(p.jsonl_path))]
    out = []
    ops = "+*-"
    if p.n_operands == 2:
        combos = [(a, o, b) for a in range(10) for o in ops for b in range(10)]
    else:
        combos = [(a, o1, b, o2, c) for a in range(10) for o1 in ops for b in range(10) for o2 in ops
                  for c in range(10)]
    for combo in combos:
        text = "".join(str(t) for t in combo)
        out.append((text, eval(text) % 10, "".join(combo[1::2])))  # noqa: S307 -- our own digit/operator strings
    return out


def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    qs = _questions(p)
    order = rng.permutation(len(qs))[: p.n_questions or None]
    qs = [qs[i] for i in order]
    n_rl = round(p.rl_fraction * len(qs))
    write_table(out_dir / "questions.parquet", {
        "qid": np.arange(len(qs)), "text": [q[0] for q in qs], "answer": np.array([q[1] for q in qs], np.int64),
        "ops": [q[2] for q in qs], "split": ["rl"] * n_rl + ["test"] * (len(qs) - n_rl)})
    views = {"agent_type": [], "qid": [], "label_seen": [], "corrupted": []}
    for t, rates in NOISE.items():
        g = np.random.default_rng([p.seed, ord(t)])  # a corrupted label is fixed per (agent type, question)
        for qid, (_, answer, ops) in enumerate(qs):
            corrupt = g.random() < max(rates.get(o, 0.2) for o in ops)
            wrong = (answer + g.integers(1, 10)) % 10
            views["agent_type"].append(t), views["qid"].append(qid)
            views["label_seen"].append(int(wrong if corrupt else answer)), views["corrupted"].append(bool(corrupt))
    write_table(out_dir / "agent_views.parquet", views)


def encode(texts: list[str], length: int) -> torch.Tensor:
    """ASCII codes, left-padded with 0 so the answer position is always the last -> (B, length). Built in NumPy
    and made a tensor once (a tensor per row cost more than the row)."""
    codes = np.array([[ord(c) for c in t[-length:].rjust(length, "\0")] for t in texts], np.int64)
    return torch.from_numpy(np.minimum(codes.reshape(len(texts), length), 127))


def prompt(question: str, peers: list[int] | None) -> str:
    if peers is None:
        return f"{question}="
    return f"{question}|" + ";".join(f"A{j + 1}:{a}" for j, a in enumerate(peers)) + "="


# ---- the agent ---------------------------------------------------------------------------------------------
class Agent(nn.Module):
    """Char-level decoder-only transformer; logits over the 10 digit tokens at the last (answer) position."""

    def __init__(self, width: int, layers: int, heads: int, max_len: int):
        super().__init__()
        self.tok = nn.Embedding(128, width)
        self.pos = nn.Parameter(0.02 * torch.randn(max_len, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(max_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, 10)
        length = tokens.shape[1]
        x = self.tok(tokens) + self.pos[:length]  # (B, L, W)
        x = self.blocks(x, mask=self.causal[:length, :length], is_causal=True)
        return self.head(self.norm(x[:, -1]))  # (B, 10)


# ---- uncertainty decomposition and debate --------------------------------------------------------------------
def entropy(p: torch.Tensor) -> torch.Tensor:
    return -(p * p.clamp_min(1e-12).log()).sum(-1)


def decompose(probs: torch.Tensor) -> dict[str, torch.Tensor]:
    """probs (..., N agents, 10) -> TU = H(mean_i p_i), AU = mean_i H(p_i), EU = TU - AU, each (...)."""
    tu = entropy(probs.mean(-2))
    au = entropy(probs).mean(-1)
    return {"tu": tu, "au": au, "eu": tu - au}


def debate(agents: list[nn.Module], questions: list[str], rounds: int, length: int, greedy: bool,
           generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Run an R-round debate for every question. Returns tokens (Q, N, R, L), probs (Q, N, R, 10), answers (Q, N, R)."""
    n = len(agents)
    tokens = torch.zeros(len(questions), n, rounds, length, dtype=torch.long)
    probs = torch.zeros(len(questions), n, rounds, 10)
    answers = torch.zeros(len(questions), n, rounds, dtype=torch.long)
    with torch.no_grad():
        for r in range(rounds):
            prev = answers[:, :, r - 1].tolist() if r else None  # (Q, N) as Python ints, read once per round
            for i, agent in enumerate(agents):
                texts = [prompt(q, None if r == 0 else [a for j, a in enumerate(prev[k]) if j != i])
                         for k, q in enumerate(questions)]
                tokens[:, i, r] = encode(texts, length)
                probs[:, i, r] = agent(tokens[:, i, r]).softmax(-1)
                answers[:, i, r] = probs[:, i, r].argmax(-1) if greedy else \
                    torch.multinomial(probs[:, i, r], 1, generator=generator)[:, 0]
    return {"tokens": tokens, "probs": probs, "answers": answers}


def majority(answers: torch.Tensor) -> torch.Tensor:
    """Majority answer over the agent axis -1 (ties: the smallest digit among the tied) -> (...)."""
    counts = F.one_hot(answers, 10).sum(-2)  # (..., 10)
    return counts.argmax(-1)  # argmax returns the first maximal index: the smallest tied digit


def rewards(out: dict[str, torch.Tensor], truth: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """r_i = 1[final_i correct] - alpha AU_i + beta (EU_1 - EU_R) 1[majority correct] -> (Q, N)."""
    final = out["answers"][:, :, -1]  # (Q, N)
    correct = (final == truth[:, None]).float()
    own_au = entropy(out["probs"][:, :, 1:]).mean(-1)  # (Q, N): own entropy at rounds >= 2
    eu = decompose(out["probs"].transpose(1, 2))["eu"]  # (Q, R)
    maj_ok = (majority(final) == truth).float()  # (Q,)
    return correct - alpha * own_au + beta * ((eu[:, 0] - eu[:, -1]) * maj_ok)[:, None]


def group_advantage(r: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps), groups are consecutive blocks of `group` rows; r (Q G, N)."""
    g = r.view(-1, group, r.shape[-1])
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view_as(r)


def marl_loss(agent: nn.Module, ref: nn.Module, tokens: torch.Tensor, actions: torch.Tensor, adv: torch.Tensor,
              kl_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy gradient over every round's answer with the rollout's advantage, + KL to the pretrained policy.

    tokens (B, R, L), actions (B, R), adv (B,) -> (loss, mean KL)."""
    b, r, length = tokens.shape
    logp = agent(tokens.reshape(b * r, length)).log_softmax(-1)  # (B R, 10)
    with torch.no_grad():
        ref_logp = ref(tokens.reshape(b * r, length)).log_softmax(-1)
    chosen = logp.gather(1, actions.reshape(-1, 1))[:, 0].view(b, r)
    kl = (logp.exp() * (logp - ref_logp)).sum(-1).mean()
    return -(adv[:, None] * chosen).mean() + kl_weight * kl, kl.detach()


# ---- training: supervised pretraining of every agent, then both MARL arms, each phase in lock-step ------------
def _load(data_dir: Path) -> dict:
    q = read_table(data_dir / "questions.parquet")
    v = read_table(data_dir / "agent_views.parquet")
    labels = {t: torch.from_numpy(v["label_seen"][v["agent_type"] == t][np.argsort(v["qid"][v["agent_type"] == t])]
                                  .astype(np.int64)) for t in NOISE}
    return {"text": list(q["text"]), "answer": torch.from_numpy(q["answer"].copy()), "split": q["split"],
            "labels": labels}


def max_len(d: dict, p: Params) -> int:
    return max(len(prompt(t, [9] * 2)) for t in d["text"]) if p.dataset == "synthetic" else \
        max(len(prompt(t, [9] * 2)) for t in d["text"][:1000])


def pretrain_pool(split: np.ndarray, with_test: bool) -> torch.Tensor:
    """Question ids pretraining draws from: the `rl` split (test questions unseen), or every question."""
    return torch.from_numpy(np.arange(len(split)) if with_test else np.flatnonzero(split == "rl"))


def _agent_names(p: Params) -> list[str]:
    return [f"s{s}_{a}" for s in range(p.n_seeds) for a in ("A0", "A1", "A2", "B", "C")]


def build_pretrained(p: Params, length: int) -> nn.ModuleDict:
    nets = {}
    for name in _agent_names(p):
        torch.manual_seed(p.seed * 1_000 + len(nets))  # every agent its own initialisation
        nets[name] = Agent(p.width, p.layers, p.heads, length)
    return nn.ModuleDict(nets)


def build_arms(p: Params, length: int, pretrained: nn.ModuleDict) -> nn.ModuleDict:
    """Both MARL arms, each a copy of every seed's heterogeneous team."""
    arms = nn.ModuleDict()
    for arm in ARMS:
        for s in range(p.n_seeds):
            for a in TEAMS["heterogeneous"]:
                net = Agent(p.width, p.layers, p.heads, length)
                net.load_state_dict(pretrained[f"s{s}_{a}"].state_dict())
                arms[f"{arm}_s{s}_{a}"] = net
    return arms


def train(ctx) -> None:
    p: Params = ctx.params
    d = _load(ctx.data_dir)
    length = max_len(d, p)
    pool = pretrain_pool(d["split"], p.pretrain_test)
    names = _agent_names(p)
    pretrained = build_pretrained(p, length)

    def pre_batch(step: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(p.seed * 100_003 + step)
        batch = {}
        for k, name in enumerate(names):
            idx = pool[torch.randint(0, len(pool), (p.pretrain_batch,), generator=g)]
            debate_form = torch.rand(p.pretrain_batch, generator=g) < 0.5
            peers = torch.randint(0, 10, (p.pretrain_batch, 2), generator=g)
            texts = [prompt(d["text"][i], pe if form else None)
                     for i, form, pe in zip(idx.tolist(), debate_form.tolist(), peers.tolist(), strict=True)]
            batch[f"x{k}"] = encode(texts, length)  # (B, L)
            batch[f"y{k}"] = d["labels"][name.split("_")[1][0]][idx]  # the agent type's own view
        return batch

    def pre_step(engine, batch, step):
        losses = [F.cross_entropy(engine.module[name](batch[f"x{k}"]), batch[f"y{k}"]) for k, name in enumerate(names)]
        return sum(losses), {"mean_ce": float(sum(losses).detach()) / len(losses)}

    ctx.progress(f"phase pretrain: {len(names)} agents in lock-step, {p.pretrain_steps} steps of {p.pretrain_batch}")
    ctx.fit("pretrain", ctx.engine(pretrained, p.pretrain_lr, arms=pretrained), pre_step, pre_batch, p.pretrain_steps)

    arms = build_arms(p, length, pretrained)
    rl_qids = np.flatnonzero(d["split"] == "rl")
    team = TEAMS["heterogeneous"]
    weights = {"ug": (p.alpha, p.beta), "co": (0.0, 0.0)}

    def rl_batch(step: int) -> dict[str, torch.Tensor]:
        """Sample G debates per question with the current policies of each arm and seed; advantages per group."""
        g = torch.Generator().manual_seed(p.seed * 100_003 + 7 + step)
        chosen = torch.from_numpy(rl_qids)[torch.randperm(len(rl_qids), generator=g)[: p.rl_questions]]
        qids = chosen.repeat_interleave(p.group)  # (Q G,): consecutive rows form a group
        texts, truth = [d["text"][i] for i in qids.tolist()], d["answer"][qids]
        batch = {}
        for arm in ARMS:
            for s in range(p.n_seeds):
                agents = [arms[f"{arm}_s{s}_{a}"] for a in team]
                out = debate(agents, texts, p.rounds, length, greedy=False, generator=g)
                r = rewards(out, truth, *weights[arm])  # (Q G, N)
                batch[f"{arm}_s{s}_tokens"] = out["tokens"]  # (Q G, N, R, L)
                batch[f"{arm}_s{s}_actions"] = out["answers"]  # (Q G, N, R)
                batch[f"{arm}_s{s}_adv"] = group_advantage(r, p.group)  # (Q G, N)
                batch[f"{arm}_s{s}_reward"] = r.mean(1)  # (Q G,)
                batch[f"{arm}_s{s}_acc"] = (out["answers"][:, :, -1] == truth[:, None]).float().mean(1)
        return batch

    def rl_step(engine, batch, step):
        total, metrics = 0.0, {}
        for arm in ARMS:
            for s in range(p.n_seeds):
                key = f"{arm}_s{s}"
                for i, a in enumerate(team):
                    loss, kl = marl_loss(engine.module[f"{key}_{a}"], pretrained[f"s{s}_{a}"],
                                         batch[f"{key}_tokens"][:, i], batch[f"{key}_actions"][:, i],
                                         batch[f"{key}_adv"][:, i], p.kl_weight)
                    total = total + loss
                    metrics[f"{key}/kl_{a}"] = float(kl)
                metrics |= {f"{key}/reward": float(batch[f"{key}_reward"].mean()),
                            f"{key}/final_acc": float(batch[f"{key}_acc"].mean())}
        return total, metrics

    pretrained.requires_grad_(False)  # the KL reference; trained above, frozen from here
    ctx.progress(f"phase marl: 2 arms x {p.n_seeds} seed(s) x 3 agents in lock-step, {p.rl_steps} updates of "
                 f"{p.rl_questions} questions x {p.group} debates")
    ctx.fit("marl", ctx.engine(arms, p.rl_lr, arms=arms), rl_step, rl_batch, p.rl_steps)


# ---- evaluation: every team and arm debates the test split ------------------------------------------------
def team_metrics(out: dict[str, torch.Tensor], truth: torch.Tensor,
                 views: torch.Tensor | None = None) -> dict[str, float]:
    """Accuracies, uncertainty terms and productivity of one team's debates; `views` (Q, N): each agent's own
    pretraining label, for round-1 agreement with it (`round1_view_agent<i>`)."""
    ans, probs = out["answers"], out["probs"]  # (Q, N, R), (Q, N, R, 10)
    correct = (ans == truth[:, None, None]).float()  # (Q, N, R)
    unc = decompose(probs.transpose(1, 2))  # each (Q, R)
    first, last = correct[:, :, 0], correct[:, :, -1]
    m = {"final_acc": float(last.mean()), "round1_acc": float(first.mean()),
         **{f"round1_acc_agent{i}": float(first[:, i].mean()) for i in range(first.shape[1])},
         "majority_acc": float((majority(ans[:, :, -1]) == truth).float().mean()),
         "majority_round1_acc": float((majority(ans[:, :, 0]) == truth).float().mean()),
         "productivity": float(((first == 0) & (last == 1)).float().mean()
                               - ((first == 1) & (last == 0)).float().mean()),
         "au_late": float(unc["au"][:, 1:].mean()), "debate_gain": float(last.mean() - first.mean())}
    if views is not None:
        m |= {f"round1_view_agent{i}": float((ans[:, i, 0] == views[:, i]).float().mean()) for i in range(ans.shape[1])}
    for r in range(ans.shape[2]):
        m[f"eu_r{r + 1}"], m[f"au_r{r + 1}"] = float(unc["eu"][:, r].mean()), float(unc["au"][:, r].mean())
    ent, ok = entropy(probs).reshape(-1).numpy(), correct.reshape(-1).numpy()
    m["entropy_acc_corr"] = float(np.corrcoef(ent, ok)[0, 1]) if ent.std() > 0 and ok.std() > 0 else 0.0
    return m


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    d = _load(ctx.data_dir)
    length = max_len(d, p)
    pretrained, arms = ctx.network("pretrain"), ctx.network("marl")
    test = np.flatnonzero(d["split"] == "test")
    texts, truth = [d["text"][i] for i in test], d["answer"][test]
    configs: dict[str, list[dict[str, float]]] = {}
    outs: dict[str, dict] = {}
    for s in range(p.n_seeds):
        teams = {"homogeneous": [pretrained[f"s{s}_{a}"] for a in TEAMS["homogeneous"]],
                 "vanilla_mad": [pretrained[f"s{s}_{a}"] for a in TEAMS["heterogeneous"]],
                 **{f"marl_{arm}": [arms[f"{arm}_s{s}_{a}"] for a in TEAMS["heterogeneous"]] for arm in ARMS}}
        types = {n: TEAMS["homogeneous" if n == "homogeneous" else "heterogeneous"] for n in teams}
        for name, agents in teams.items():  # train mode on purpose (no dropout): eval mode's CPU fast path is slow
            out = debate(agents, texts, p.rounds, length, greedy=True)
            views = torch.stack([d["labels"][a[0]][test] for a in types[name]], 1)  # (Q, N): each agent's own view
            configs.setdefault(name, []).append(team_metrics(out, truth, views))
            outs.setdefault(name, out)
    mean = {name: {k: float(np.mean([m[k] for m in ms])) for k in ms[0]} for name, ms in configs.items()}
    ug, co, van = mean["marl_ug"], mean["marl_co"], mean["vanilla_mad"]
    metrics = {f"method/{k}": v for k, v in ug.items()}
    metrics |= {f"baseline/marl_correctness/{k}": v for k, v in co.items()}
    metrics |= {f"baseline/vanilla_mad/{k}": v for k, v in van.items()}
    metrics |= {"baseline/single_agent/final_acc": van["round1_acc"],
                "baseline/majority_round1/final_acc": van["majority_round1_acc"]}
    metrics |= {f"detail/homogeneous/{k}": v for k, v in mean["homogeneous"].items()}
    # reported only: across team configurations, debate gain against round-1 EU and late AU
    gain = np.array([m["debate_gain"] for m in mean.values()])
    for key, col in (("eu_r1", "gain_vs_eu1_corr"), ("au_late", "gain_vs_au_late_corr")):
        x = np.array([m[key] for m in mean.values()])
        metrics[f"detail/{col}"] = float(np.corrcoef(gain, x)[0, 1]) if gain.std() > 0 and x.std() > 0 else 0.0
    _plot_uncertainty(ctx.plots_dir / "uncertainty_by_round.png", mean, p.rounds)
    _plot_accuracy(ctx.plots_dir / "accuracy.png", mean)
    return metrics


def _plot_uncertainty(path: Path, mean: dict[str, dict[str, float]], rounds: int) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5), sharex=True)
    r = np.arange(1, rounds + 1)
    for name, m in mean.items():
        axes[0].plot(r, [m[f"eu_r{k}"] for k in r], "o-", label=name)
        axes[1].plot(r, [m[f"au_r{k}"] for k in r], "o-", label=name)
    axes[0].set(xlabel="debate round", ylabel="epistemic EU (nats)", title="Epistemic: disagreement")
    axes[1].set(xlabel="debate round", ylabel="aleatoric AU (nats)", title="Aleatoric: own entropy")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_accuracy(path: Path, mean: dict[str, dict[str, float]]) -> None:
    import matplotlib.pyplot as plt

    names = list(mean)
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(x - 0.27, [mean[n]["round1_acc"] for n in names], 0.27, label="round 1 (single agent)")
    ax.bar(x, [mean[n]["final_acc"] for n in names], 0.27, label="final round, per agent")
    ax.bar(x + 0.27, [mean[n]["majority_acc"] for n in names], 0.27, label="final majority vote")
    ax.set_xticks(x, names, fontsize=8)
    ax.set(ylabel="test accuracy", title="Debate on held-out questions")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="mad_uncertainty",
    title="Bayesian uncertainty analysis and uncertainty-guided MARL for multi-agent debate",
    seed="000_2dd18ae8605fb5c1.txt, abstract 8",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/final_acc", "max"),
    claim=Claim(premises=(
        # each pretrained agent of the heterogeneous team reproduces most of its own view of the test questions:
        # the heterogeneous knowledge debate is to combine exists
        *(Compare(f"baseline/vanilla_mad/round1_view_agent{i}", ">=", 0.8, name=f"agent{i}_reproduces_view")
          for i in range(3)),
    ), all_of=(
        Compare("method/final_acc", ">", ("baseline/marl_correctness/final_acc", "baseline/vanilla_mad/final_acc")),
        Compare("method/au_late", "<", "baseline/marl_correctness/au_late"),
    ), context=(  # a diagnostic: with memorised views RL changes whom an agent trusts, not necessarily what it knows
        Compare("method/round1_acc", ">", "baseline/vanilla_mad/round1_acc", name="rl_changes_round1"),
    ), summary="uncertainty-guided MARL beats correctness-only MARL and vanilla MAD at lower aleatoric cost"),
)
