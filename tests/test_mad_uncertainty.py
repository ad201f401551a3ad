"""mad_uncertainty's mechanism on tiny inputs: the uncertainty decomposition, the debate protocol, the rewards, the
group advantage, the policy-gradient step, and the corrupted views."""

from __future__ import annotations

import math

import numpy as np
import torch

from models import mad_uncertainty as mad
from models.common.tables import read_table


def test_decomposition_limits_and_jensen():
    same = torch.tensor([0.7, 0.2, 0.1] + [0.0] * 7).expand(3, 10)  # three agents, identical beliefs
    d = mad.decompose(same)
    assert abs(float(d["eu"])) < 1e-6 and torch.isclose(d["au"], mad.entropy(same[0]))
    sure_but_split = torch.eye(10)[:3]  # each agent certain, all different
    d = mad.decompose(sure_but_split)
    assert abs(float(d["au"])) < 1e-6 and math.isclose(float(d["eu"]), math.log(3), rel_tol=1e-5)
    probs = torch.rand(50, 3, 10).softmax(-1)
    assert (mad.decompose(probs)["eu"] >= -1e-6).all()  # TU >= AU: entropy is concave


def test_majority_breaks_ties_to_the_smallest_digit():
    answers = torch.tensor([[3, 3, 1], [4, 2, 7], [9, 9, 9]])
    assert mad.majority(answers).tolist() == [3, 2, 9]


class Fixed(torch.nn.Module):
    """An 'agent' whose answer distribution depends on the peers' answers in the prompt (it copies peer A1)."""

    def forward(self, tokens):
        out = torch.full((tokens.shape[0], 10), -5.0)
        for k, row in enumerate(tokens):
            text = "".join(chr(c) for c in row.tolist() if c)
            out[k, int(text.split("A1:")[1][0]) if "A1:" in text else int(text[0])] = 5.0
        return out


def test_debate_passes_previous_round_answers_to_peers():
    out = mad.debate([Fixed(), Fixed(), Fixed()], ["3+4", "7*2"], rounds=2, length=16, greedy=True)
    # round 1: each answers the first operand; round 2: each copies its first peer's round-1 answer
    assert out["answers"][:, :, 0].tolist() == [[3, 3, 3], [7, 7, 7]]
    text = "".join(chr(c) for c in out["tokens"][0, 0, 1].tolist() if c)
    assert text == "3+4|A1:3;A2:3="
    assert out["probs"].shape == (2, 3, 2, 10)


class Constant(torch.nn.Module):
    """An 'agent' that always answers `digit`."""

    def __init__(self, digit: int):
        super().__init__()
        self.digit = digit

    def forward(self, tokens):
        return 10.0 * torch.nn.functional.one_hot(torch.full((tokens.shape[0],), self.digit), 10).float()


def test_each_agent_sees_its_peers_answers_not_its_own():
    out = mad.debate([Constant(1), Constant(2), Constant(5)], ["3+4", "6*6"], rounds=2, length=20, greedy=True)
    texts = ["".join(chr(c) for c in out["tokens"][1, i, 1].tolist() if c) for i in range(3)]
    assert texts == ["6*6|A1:2;A2:5=", "6*6|A1:1;A2:5=", "6*6|A1:1;A2:2="]


def test_encode_left_pads_keeps_the_end_and_clamps_to_ascii():
    x = mad.encode(["3+4=", "12345678", "\u00e9="], 6)
    assert x.dtype == torch.long and x.shape == (3, 6)
    assert x.tolist() == [[0, 0, *map(ord, "3+4=")], list(map(ord, "345678")), [0, 0, 0, 0, 127, ord("=")]]
    assert mad.encode([], 6).shape == (0, 6)


def test_rewards_match_hand_computation():
    probs = torch.zeros(1, 3, 2, 10)
    probs[0, :, 0] = torch.eye(10)[[1, 2, 3]]  # round 1: confident and split -> EU_1 = ln 3
    probs[0, :, 1] = torch.eye(10)[[7, 7, 7]]  # round 2: agreement -> EU_R = 0, AU = 0
    probs[0, 2, 1] = torch.tensor([0.5] + [0.0] * 6 + [0.5, 0.0, 0.0])  # agent 3 hedges in round 2
    answers = torch.tensor([[[1, 7], [2, 7], [3, 0]]])
    r = mad.rewards({"probs": probs, "answers": answers}, torch.tensor([7]), alpha=0.1, beta=0.5)
    eu_last = float(mad.decompose(probs[0, :, 1])["eu"])
    bonus = 0.5 * (math.log(3) - eu_last)  # majority (7) is correct
    expected = torch.tensor([[1 + bonus, 1 + bonus, 0 - 0.1 * math.log(2) + bonus]])
    assert torch.allclose(r, expected, atol=1e-5)


def test_group_advantage_is_centred_per_group():
    r = torch.tensor([[1.0, 0.0], [0.0, 0.0], [2.0, 1.0], [4.0, 3.0]])
    adv = mad.group_advantage(r, 2)
    assert torch.allclose(adv.view(2, 2, 2).mean(1), torch.zeros(2, 2), atol=1e-6)
    assert adv[0, 0] > 0 > adv[1, 0] and adv[0, 1] == 0  # a group with no spread gives no signal


def test_policy_gradient_step_raises_rewarded_answers_and_kl_starts_at_zero():
    torch.manual_seed(0)
    agent = mad.Agent(16, 1, 2, 16)
    ref = mad.Agent(16, 1, 2, 16)
    ref.load_state_dict(agent.state_dict())
    tokens = mad.encode(["3+4="] * 2, 16)[:, None]  # (B=2, R=1, L)
    actions = torch.tensor([[7], [2]])
    adv = torch.tensor([1.0, -1.0])
    loss, kl = mad.marl_loss(agent, ref, tokens, actions, adv, kl_weight=0.05)
    assert abs(float(kl)) < 1e-6
    before = agent(tokens[:, 0]).log_softmax(-1)[0]
    loss.backward()
    with torch.no_grad():
        for q in agent.parameters():
            q -= 0.05 * q.grad
    after = agent(tokens[:, 0]).log_softmax(-1)[0]
    assert after[7] > before[7] and after[2] < before[2]


def test_prepare_views_follow_the_corruption_pattern(tmp_path):
    p = mad.Params(seed=0)
    mad.prepare(p, tmp_path)
    q, v = read_table(tmp_path / "questions.parquet"), read_table(tmp_path / "agent_views.parquet")
    assert len(q["qid"]) == 300 and (q["split"] == "rl").sum() == 200
    assert all(eval(t) % 10 == a for t, a in zip(q["text"], q["answer"], strict=True))  # noqa: S307
    for t, op, rate in (("A", "+", 0.0), ("A", "*", 0.4), ("B", "+", 0.4), ("B", "*", 0.0)):
        sel = v["agent_type"] == t
        on_op = np.isin(v["qid"][sel], q["qid"][q["ops"] == op])
        assert abs(v["corrupted"][sel][on_op].mean() - rate) < 0.12
        seen, truth = v["label_seen"][sel], q["answer"][v["qid"][sel]]
        assert np.array_equal(seen != truth, v["corrupted"][sel])  # a corrupted label is always wrong


def test_gsm8k_jsonl_loader_on_a_three_line_fixture(tmp_path):
    """Full profile: GSM8K's jsonl (question, answer ending '#### n', thousands separators allowed)."""
    import json

    rows = [{"question": "Ann has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"question": "A farm has 1,200 hens ...", "answer": "...\n#### 1,250"},
            {"question": "Half of 5?", "answer": "#### 2.5"}]
    (tmp_path / "test.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert mad.load_jsonl(tmp_path / "test.jsonl") == [(rows[0]["question"], 7), (rows[1]["question"], 1250),
                                                        (rows[2]["question"], 2)]
    p = mad.Params(dataset="jsonl", jsonl_path=str(tmp_path / "test.jsonl"))
    assert [a for _, a, _ in mad._questions(p)] == [7, 0, 2]  # the target is the answer's last digit


def test_pretraining_covers_every_question_by_default_as_the_spec_says():
    assert mad.Params().pretrain_test  # each agent memorises its own view of every question
    split = np.array(["rl", "test", "rl", "test", "rl"])
    assert mad.pretrain_pool(split, with_test=False).tolist() == [0, 2, 4]
    assert mad.pretrain_pool(split, with_test=True).tolist() == [0, 1, 2, 3, 4]


def test_round1_view_agreement_counts_each_agents_own_view():
    # 2 questions, 3 agents, 2 rounds: agent 0 reproduces both views, agent 1 one, agent 2 none (round 2 ignored)
    answers = torch.tensor([[[3, 0], [5, 0], [7, 0]], [[4, 0], [6, 0], [8, 0]]])
    probs = torch.nn.functional.one_hot(answers, 10).float()
    views = torch.tensor([[3, 5, 1], [4, 1, 1]])
    m = mad.team_metrics({"answers": answers, "probs": probs}, torch.tensor([3, 4]), views)
    assert (m["round1_view_agent0"], m["round1_view_agent1"], m["round1_view_agent2"]) == (1.0, 0.5, 0.0)
    assert m["round1_acc_agent0"] == 1.0 and m["round1_acc_agent2"] == 0.0
