"""SSLogic's mechanism on tiny inputs: the DSL against its independent spec interpreter, Generator/Validator, each
gate catching the failure it exists for and the Refine that fixes it, the evolution loop, and GRPO's loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models import sslogic as ss


def _p(**kw) -> ss.Params:
    return ss.Params(**({"review_depth": 1, "review_instances": 5, "gate2_instances": 10} | kw))


def test_run_and_spec_interpreter_agree_on_random_programs():
    rng = np.random.default_rng(0)
    for i in range(300):
        prog = ss._rule(rng, list(ss.REDUCERS), list(ss.LIST_OPS), int(rng.integers(0, 4)))
        if i % 3 == 0:
            prog = ("if", str(rng.choice(list(ss.PREDICATES))), prog, ss._rule(rng, list(ss.REDUCERS),
                                                                                  list(ss.LIST_OPS), 1))
        x = [int(v) for v in rng.integers(0, 10, int(rng.integers(1, 7)))]
        try:
            expected = ss.run(prog, x)
        except (ValueError, IndexError):
            with pytest.raises((ValueError, IndexError)):
                ss.interpret_spec(ss.show(prog), x)
            continue
        assert ss.interpret_spec(ss.show(prog), x) == expected, (ss.show(prog), x)
    assert ss.run(("r", "sum10", ("inc", "sort")), [9, 1, 2]) == (0 + 2 + 3) % 10
    assert ss.show(("r", "max", ("even", "rev"))) == "max(rev(even(x)))"


def test_spec_interpreter_reads_conditionals_nested_in_either_branch():
    """Round 2's conditional authors nest conditionals (a parent may be one): `if p then A else if q then B else C`
    must split at its own `else` (a greedy regex split it at the last one and crashed on a predicate's bool)."""
    rng = np.random.default_rng(1)
    rule = lambda depth: ss._rule(rng, list(ss.REDUCERS), list(ss.LIST_OPS), depth)  # noqa: E731
    cond = lambda a, b: ("if", str(rng.choice(list(ss.PREDICATES))), a, b)  # noqa: E731
    for _ in range(200):
        prog = cond(cond(rule(1), rule(0)), cond(rule(2), cond(rule(1), rule(1))))
        x = [int(v) for v in rng.integers(0, 10, int(rng.integers(1, 8)))]
        try:
            expected = ss.run(prog, x)
        except (ValueError, IndexError):
            continue
        assert ss.interpret_spec(ss.show(prog), x) == expected, (ss.show(prog), x)
    with pytest.raises(ValueError):
        ss.interpret_spec("if long(x) then max(x)", [1, 2])


def test_blind_reviewer_runs_every_program_like_run():
    """The reviewer's batched DSL against `run`, program by program, on digit lists (empty ones included: max, min,
    first and last raise there), for a full depth and for a budget that cuts the last depth short."""
    rng = np.random.default_rng(2)
    lists = [[], [7], [3, 3, 1, 3, 9, 0, 9]] + [[int(v) for v in rng.integers(0, 10, int(rng.integers(0, 11)))]
                                               for _ in range(30)]
    for programs in (ss.review_programs(2, 10**6), ss.review_programs(3, 1500)):
        values, ran = ss.BlindReviewer(programs).outputs(lists)
        for i, prog in enumerate(programs):
            for j, x in enumerate(lists):
                try:
                    expected = ss.run(prog, x)
                except (ValueError, IndexError):
                    expected = None
                assert (values[i, j] if ran[i, j] else None) == expected, (prog, x)


def test_encode_pads_right_and_keeps_the_prompt_tail():
    ids, lens = ss.encode(["12>3;", "9>"], "0123456789>;", 4)
    assert ids.tolist() == [[3, 11, 4, 12], [10, 11, 0, 0]] and lens.tolist() == [4, 2]


def test_generator_is_deterministic_and_validator_checks_the_query():
    fam = ss.family(("r", "max", ("even",)), "f", constrain=True)
    a, b = ss.generate(fam, 7, 1), ss.generate(fam, 7, 1)
    assert a == b and len(a["prompt"]) <= 80
    lists, answers, query = ss.parse(a["prompt"])
    assert len(lists) == 3 and [max(v for v in x if v % 2 == 0) for x in lists] == answers
    assert a["answer"] == str(max(v for v in query if v % 2 == 0))
    assert [d for d in range(10) if ss.validate(fam, a["prompt"], str(d))] == [int(a["answer"])]
    knob = ss.family(("r", "len", ()), "k", knob="len", lo=3, hi=3)
    assert {len(ss.parse(ss.generate(knob, s, 2)["prompt"])[2]) for s in range(30)} == {3, 4, 5}  # difficulty knob


def test_stated_rule_is_the_spec_in_prefix_code_and_the_validator_skips_it():
    """The rule code names every word of the spec once, outermost first, and opens the prompt; the prompt with the
    rule keeps the same examples, query and answer, and parse / validate read past the code."""
    fam = ss.family(("if", "long", ("r", "max", ("even", "sort")), ("r", "sum", ("inc",))), "c", constrain=True,
                    fmt="mod10")
    assert ss.rule_code(fam) == "?GMse|Ti" and len(set(ss.RULE_CODE.values())) == len(ss.RULE_CODE)
    assert not set("".join(ss.RULE_CODE.values())) & set("0123456789>;:%?|")  # never a list, separator or marker
    # mod 10 is stated for a count only where the family's lists can reach 10 elements
    assert ss.rule_code(ss.family(("r", "len", ("even",)), "n", fmt="mod10")) == "Le"  # at most 5: a digit
    assert ss.rule_code(ss.family(("r", "len", ("even",)), "n", fmt="mod10", hi=8, knob="len")) == "%Le"
    assert ss.rule_code(ss.family(("r", "ceven", ()), "n", fmt="mod10", hi=11)) == "%C"
    assert ss.rule_code(ss.family(("r", "max", ()), "m", fmt="mod10")) == "M"  # a digit already
    plain, stated = ss.generate(fam, 5, 2), ss.generate(fam, 5, 2, rule=True)
    assert stated["prompt"] == "?GMse|Ti:" + plain["prompt"]
    assert ss.parse(stated["prompt"]) == ss.parse(plain["prompt"]) and stated["answer"] == plain["answer"]
    assert [d for d in range(10) if ss.validate(fam, stated["prompt"], str(d))] == [int(stated["answer"])]
    alphabet = "".join(sorted(set(stated["prompt"])))
    ids, lens = ss.encode([stated["prompt"]], alphabet, 24)
    kept = ss.cut(stated["prompt"], 24)  # a prompt cut to the policy's length keeps the rule and the query
    assert lens.item() == 24 and kept.startswith("?GMse|Ti:") and kept.endswith(plain["prompt"][-6:])


def test_sft_targets_are_every_answer_of_a_stated_rule():
    """With the rule stated, each solved example's answer is a target at its '>' and the query's at the end;
    without it only the query's (the examples' answers cannot be read off the rule)."""
    alphabet = "0123456789>;:M"
    tgt = ss.answer_targets(["M:12>2;305>5;4>", "12>2;4>"], ["4", "4"], alphabet, 32)
    ids, lens = ss.encode(["M:12>2;305>5;4>", "12>2;4>"], alphabet, 32)
    assert tgt.shape == ids.shape == (2, 15)
    code = {c: 1 + alphabet.index(c) for c in alphabet}
    assert {j: v for j, v in enumerate(tgt[0].tolist()) if v != -100} == {4: code["2"], 10: code["5"], 14: code["4"]}
    assert {j: v for j, v in enumerate(tgt[1].tolist()) if v != -100} == {6: code["4"]}
    assert lens.tolist() == [15, 7]


def test_padding_to_the_batch_changes_no_answer_logit():
    """encode pads to the batch's longest prompt: a causal policy reads the same answer logits as at max_prompt."""
    torch.manual_seed(0)
    net = ss._policy(_p(), 1 + len(ss.CHARS)).eval()
    prompts = ["12>3;45>9;7>", "1>1;2>"]
    ids, lens = ss.encode(prompts, ss.CHARS, 80)
    wide = torch.zeros(2, 80, dtype=torch.long)
    wide[:, : ids.shape[1]] = ids
    assert ids.shape[1] == 12
    torch.testing.assert_close(ss.answer_logits(net, ids, lens), ss.answer_logits(net, wide, lens))


def test_answer_prior_is_each_categorys_most_frequent_answer():
    ev = {"answer": ["3", "3", "1", "7", "2", "2", "2"], "category": ["logic"] * 3 + ["operation"] * 4}
    assert ss.answer_prior(ev).tolist() == [True, True, False, False, True, True, True]


def test_gates_catch_their_failures_and_refine_fixes_them():
    p = _p()
    raises = ss.family(("r", "max", ("big",)), "e", lo=3, hi=3)  # no value > 4 in some lists: max of []
    assert ss.gate1(raises) == "exception"
    assert ss.gate1(ss.refine(raises, "exception")) == ""
    raw_sum = ss.family(("r", "sum", ()), "s", constrain=True)  # two-digit answers: brute force finds none
    assert ss.gate1(raw_sum) == "" and ss.gate2(raw_sum, 10, 0.95) == "format"
    assert ss.gate2(ss.refine(raw_sum, "format"), 10, 0.95) == ""
    trivial = ss.family(("r", "par", ("even",)), "t")  # a sum of even numbers is always even
    assert ss.gate3(trivial, ss.BlindReviewer(ss.review_programs(1, 2000)), p) == "trivial"
    lenient = _p(max_ambiguous=1.0)  # ambiguity has its own test below
    reviewer = ss.BlindReviewer(ss.review_programs(1, 2000))
    assert ss.gate3(ss.family(("r", "max", ()), "m"), reviewer, lenient) == ""


def test_gate3_ambiguity_matches_a_direct_count():
    """Ill-posedness counted directly: instances where some depth-1 program fits the 3 examples but not the query."""
    programs = ss.review_programs(1, 2000)
    for prog in (("r", "len", ("uniq",)), ("r", "first", ("sort",)), ("r", "ceven", ())):
        fam = ss.family(prog, "a", vmax=3)
        p = _p(max_ambiguous=0.0, min_entropy=0.0)
        direct = 0
        for s in range(p.review_instances):
            lists, answers, query = ss.parse(ss.generate(fam, 2000 + s, s % 3)["prompt"])
            truth = ss.answer_of(fam, query)
            for q in programs:
                try:
                    if [ss.run(q, x) % 10 for x in lists] == answers and ss.run(q, query) % 10 != truth:
                        direct += 1
                        break
                except (ValueError, IndexError):
                    pass
        assert (ss.gate3(fam, ss.BlindReviewer(programs), p) == "ambiguous") == (direct > 0)


def test_review_programs_enumerate_shortest_first_within_budget():
    progs = ss.review_programs(2, 10**6)
    n_r, n_o = len(ss.REDUCERS), len(ss.LIST_OPS)
    assert len(progs) == n_r * (1 + n_o + n_o**2) and len(set(progs)) == len(progs)
    assert all(len(pr[2]) == 0 for pr in progs[:n_r]) and ss.review_programs(2, 50) == progs[:50]


def test_evolution_loop_records_gates_and_the_bandit_learns_from_acceptance():
    p = _p(candidates=6, max_refine=2)
    rng = np.random.default_rng(0)
    seeds = ss.seed_families(6, rng)
    assert all(ss.gate1(f) == "" and ss.gate2(f, 10, 0.95) == "" for f in seeds)
    candidates, no_gate = ss.evolve(p, seeds, rng)
    assert len(candidates) == 6 and len(no_gate) >= sum(c["accepted"] for c in candidates)
    for c in candidates:
        assert c["accepted"] == (c["gate1"] and c["gate2"] and c["gate3"])
        assert 0 <= c["refine"] <= p.max_refine and c["operator"] in ss.OPERATORS
        if c["accepted"]:  # an accepted family passes every gate when re-checked
            assert ss.gate1(c) == "" and ss.gate2(c, p.gate2_instances, p.gate2_agree) == ""
    rows = ss._family_rows(candidates, "candidate")
    assert all(json.loads(cfg)["fmt"] in ("raw", "mod10") for cfg in rows["config"])


def test_no_gate_admission_is_the_loop_with_gate1_alone():
    """validate_loop's fourth result is what Generate-Validate-Refine with Gate 1 alone admits."""
    p = _p(max_refine=3)
    rng = np.random.default_rng(3)
    seeds = ss.seed_families(6, rng)
    reviewer = ss.BlindReviewer(ss.review_programs(1, 2000))
    for c in range(12):
        raw = ss.author(ss.OPERATORS[c % 3], seeds, rng, f"c{c}")
        if c % 4 == 0:  # max of the big digits raises on some inputs until a Refine constrains them
            raw = raw | {"prog": ("r", "max", ("big",)), "constrain": False}
        alone = raw
        for attempt in range(p.max_refine + 1):
            alone = alone | {"refine": attempt}
            if ss.gate1(alone) == "":
                break
            alone = ss.refine(alone, "exception")
        else:
            alone = None
        assert ss.validate_loop(raw, reviewer, p)[3] == alone


def test_grpo_loss_gradient_prefers_rewarded_answers():
    logits = torch.zeros(1, 2, 4, requires_grad=True)  # (B, A, V): uniform policies for two arms
    samples = torch.tensor([[[0, 1, 2, 3], [0, 0, 1, 1]]])  # (B, A, G)
    rewards = torch.tensor([[[1.0, 0, 0, 0], [1.0, 1, 0, 0]]])
    loss, kl = ss.grpo_loss(logits, logits.detach(), samples, rewards, kl=0.02)
    assert torch.allclose(kl, torch.zeros(2), atol=1e-6)  # identical to the reference: KL 0
    loss.sum().backward()
    grad = logits.grad[0]
    assert grad[0, 0] < 0 and (grad[0, 1:] > 0).all()  # descent raises the rewarded token's logit
    assert grad[1, 0] < 0 and grad[1, 1] > 0 and grad[1, 2] == pytest.approx(0, abs=1e-7)
    same = torch.ones(1, 1, 4)  # equal rewards: zero advantage, no policy gradient
    zero, _ = ss.grpo_loss(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4), samples[:, :1], same, kl=0.0)
    assert zero.abs().item() < 1e-6


def test_jsonl_loaders_on_fixtures(tmp_path):
    rows = [{"prompt": "12>3;45>9;7>", "answer": "7", "category": "logic", "difficulty": 1},
            {"prompt": "x>", "answer": "10", "category": "operation"}]
    (tmp_path / "eval.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "ext.jsonl").write_text(json.dumps({"family_id": "enig1", "prompt": "3>3;", "answer": "3"}) + "\n")
    ev, ext = ss.load_jsonl_suites(tmp_path / "eval.jsonl", tmp_path / "ext.jsonl")
    assert ev["prompt"] == ["12>3;45>9;7>"] and ev["difficulty"] == [1]  # the two-char answer is skipped
    assert ext["family_id"] == ["enig1"] and ext["pool"] == ["external_only"]


def test_grpo_raises_the_rewarded_answer_and_kl_holds_it_near_the_reference():
    """A one-token bandit: answer 3 is rewarded. GRPO steps raise its probability; a larger KL weight keeps the
    policy closer to the reference (the SFT policy)."""
    def run(kl: float) -> tuple[float, float]:
        torch.manual_seed(0)
        logits = torch.zeros(4, 1, 6, requires_grad=True)  # (B, A, V)
        ref = torch.zeros(4, 1, 6)
        opt = torch.optim.SGD([logits], lr=0.5)
        for _ in range(30):
            samples = torch.multinomial(logits.detach().softmax(-1).reshape(4, 6), 8, True).reshape(4, 1, 8)
            rewards = (samples == 3).float()
            loss, kl_term = ss.grpo_loss(logits, ref, samples, rewards, kl)
            opt.zero_grad()
            loss.sum().backward()
            opt.step()
        return float(logits.softmax(-1)[..., 3].mean()), float(kl_term.sum())

    p_free, kl_free = run(0.0)
    p_tied, kl_tied = run(1.0)
    assert p_free > 0.5 and p_tied > 1 / 6
    assert kl_tied < kl_free
