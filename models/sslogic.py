"""SSLogic: agentic meta-synthesis of verifiable task families (Generate-Validate-Refine) for RLVR.

Seed: 003_9a806cafa3d919df.txt, abstract 4. Spec: ../shared/papers/sslogic.md.

What it implements (function names in brackets):
- a DSL over integer lists: list operators (sort, reverse, rotate, filters, maps, ...), reducers (len, sum mod 10,
  parity, max, ...), predicates and conditionals; a program is a nested tuple [run, show]; an independent
  interpreter of the spec text, written separately from `run` [interpret_spec];
- a task family = program + knobs (list length, value range, constraints, answer format); Generator(seed,
  difficulty) -> {prompt, answer} where the prompt is 3 solved examples and a query ("314>8;27>9;55>0;43>"), and
  Validator(instance, answer) -> bool recomputes the answer from the prompt's query [generate, validate];
- programmatic authors: rule composition (f after g), conditional rules (if p then A else B) and a new difficulty
  gradient (a knob exposed), chosen by a Beta-Bernoulli Thompson bandit on past acceptance [author, evolve];
- the Generate-Validate-Refine loop: a gate failure picks a Refine (constrain inputs, answer format mod 10, distinct
  values / longer lists, widen ranges), at most `max_refine` times, then the family is discarded [evolve];
- the Multi-Gate Validation Protocol [gate1, gate2, gate3]: Gate 1 executability + determinism + the validator
  rejects perturbed answers; Gate 2 consensus of the reference solver, a brute force over the answer space checked by
  the validator, and the spec-text interpreter on >= 95% of 20 instances; Gate 3 Adversarial Blind Review: a solver
  that sees only the prompt (3 solved examples + query) enumerates DSL programs up to a depth and at most
  `review_budget` programs (each chain of list operators computed once, for all lists at once [BlindReviewer]);
  an instance is ambiguous when a program fits the examples but answers the query differently; the family is
  rejected as ill-posed (too many ambiguous instances) or trivial (answer entropy < 1 bit);
- the RLVR policy: a char-level TinyLM; SFT on seed-family instances [answer_targets], then GRPO (group size 8, KL
  0.02 to the SFT policy, validator 0/1 reward) for 5 arms in lock-step in one DeepSpeed engine [grpo_loss, train];
- evaluation on held-out suites built by their own sampler (SynLogic analogue: depth-2/3 and conditional families;
  KORBench analogue: logic and operation), every 20 steps, step- and token-matched [evaluate].

Deviations from the paper (choices the abstract left open):
- Answers are single digits (one token), so a GRPO rollout is one sampled token per prompt; the prompt is few-shot
  (3 solved examples + a query), which is what makes Gate 3's blind review well defined.
- Gate 3 rejects a family when more than `max_ambiguous` of its reviewed instances are ambiguous (a strict "any"
  rejects nearly every family: with thousands of programs some fit 3 single-digit examples by chance).
- Seed-only arm: seed families at new seeds and difficulties; evolved arm: seed + accepted evolved families; no-gate
  arm: seed + every candidate that passed Gate 1; pools have equal instance counts.
- The policy's prompts state the family's rule (`state_rule`, our choice): its spec in one character per DSL word
  opens the prompt ("Mse:e1>a1;e2>a2;e3>a3;q>"), so the policy executes a stated rule on the held-out suites
  instead of inducing an unseen program from 3 single-digit examples. The gates review the examples alone.
- SFT (on a pool of fresh seed-family instances, `sft_pool`) is supervised on every answer of a prompt, the solved
  examples' too: with the rule stated first, each is that rule's output on the list before it.
- GRPO runs at the spec's KL weight 0.02; the smoke profile's learning rate was chosen on the arms' own training
  pools (greedy accuracy after the GRPO steps, the same rate for every arm), never on the held-out suites (there is
  no validation split to tune on).
- Premises: the SFT policy beats the answer prior (each held-out category's most frequent answer, always), and
  every GRPO arm ends above its SFT start on the held-out suites; where one fails, the data-source comparison is
  inconclusive.
- Size-controlled arm: external_plus_evolved replaces half of the external pool's instances with instances of the
  accepted evolved families (not the seeds).
"""

from __future__ import annotations

import ast
import copy
import json
import re
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from models.common.lm import TinyLM
from models.common.tables import read_table, write_table
from models.contract import Claim, Compare, Paper, PaperParams
from models.inputs import input_path

ARMS = ("evolved", "seed_only", "no_gate", "external_only", "external_plus_evolved")
OPERATORS = ("compose", "conditional", "gradient")
CATEGORIES = ("synlogic", "logic", "operation")
CHARS = "0123456789>;"  # the policy's alphabet after [PAD]: token id = 1 + index


class Params(PaperParams):
    dataset: Literal["synthetic", "jsonl"] = Field("synthetic", description="Held-out / external suites: built "
                                                   "here, or SynLogic/Enigmata + KORBench-style JSONL files.")
    eval_path: str = Field("", description="jsonl: eval file, rows {prompt, answer, category, difficulty}.")
    external_path: str = Field("", description="jsonl: external family instances {family_id, prompt, answer}.")
    n_seed: int = Field(24, ge=2, description="Seed families.")
    rounds: int = Field(1, ge=1, description="Evolution rounds.")
    candidates: int = Field(48, ge=1, description="Author proposals per round.", json_schema_extra={"data": True})
    max_refine: int = Field(3, ge=0, description="Refinements before a failing candidate is discarded.")
    gate2_instances: int = Field(20, ge=1, description="Gate 2: instances the three solvers must agree on.")
    gate2_agree: float = Field(0.95, gt=0, le=1, description="Gate 2: minimum agreement rate.")
    review_depth: int = Field(2, ge=0, description="Gate 3: list operators before the reducer in searched programs.")
    review_budget: int = Field(2000, ge=1, description="Gate 3: most programs the blind reviewer executes.")
    review_instances: int = Field(5, ge=1, description="Gate 3: instances reviewed per family.")
    max_ambiguous: float = Field(0.4, ge=0, le=1, description="Gate 3: largest share of ambiguous instances.")
    min_entropy: float = Field(1.0, ge=0, description="Gate 3: answer entropy (bits) below which a family is trivial.")
    n_external: int = Field(24, ge=1, description="External (Enigmata-analogue) families.")
    n_eval_families: int = Field(8, ge=1, description="Held-out families per eval category.")
    eval_per_family: int = Field(8, ge=1, description="Held-out instances per eval family.")
    pool_size: int = Field(400, ge=8, description="Training instances per arm's pool (equal across arms).")
    layers: int = Field(2, ge=1)
    d_model: int = Field(64, ge=8, description="Policy width (4 heads when divisible, else 1).")
    max_prompt: int = Field(80, ge=16, description="Longest prompt in characters.")
    sft_steps: int = Field(80, ge=1)
    sft_batch: int = Field(64, ge=1)
    sft_lr: float = Field(3e-3, gt=0)
    sft_warmup: int = Field(0, ge=0, description="SFT: linear warm-up steps.")
    sft_decay: Literal["constant", "cosine"] = Field("constant", description="SFT: learning-rate decay after warm-up.")
    sft_pool: int = Field(400, ge=8, description="SFT instances of the seed families (fresh seeds; no GRPO arm "
                          "reads them).", json_schema_extra={"data": True})
    grpo_steps: int = Field(100, ge=1)
    prompts_per_step: int = Field(16, ge=1, description="GRPO prompts per step and arm.")
    group: int = Field(8, ge=2, description="GRPO group size (samples per prompt).")
    kl: float = Field(0.02, ge=0, description="KL coefficient to the SFT policy.")
    grpo_lr: float = Field(1e-3, gt=0)
    eval_every: int = Field(20, ge=1, description="GRPO steps between held-out evaluations.")
    state_rule: bool = Field(True, description="Training and held-out prompts state the family's rule (its spec in "
                             "one character per DSL word) before the query: the policy executes a rule instead of "
                             "inducing it from 3 examples. The gates always review the examples alone.")


# ---- the DSL ---------------------------------------------------------------------------------------------------
LIST_OPS = {
    "sort": sorted, "rev": lambda x: x[::-1], "rot": lambda x: x[1:] + x[:1], "tail": lambda x: x[1:],
    "even": lambda x: [v for v in x if v % 2 == 0], "odd": lambda x: [v for v in x if v % 2],
    "big": lambda x: [v for v in x if v > 4], "inc": lambda x: [(v + 1) % 10 for v in x],
    "dbl": lambda x: [2 * v % 10 for v in x], "uniq": lambda x: list(dict.fromkeys(x)),
}
REDUCERS = {
    "len": len, "sum": sum, "par": lambda x: sum(x) % 2, "max": max, "min": min, "first": lambda x: x[0],
    "last": lambda x: x[-1], "ceven": lambda x: sum(v % 2 == 0 for v in x), "sum10": lambda x: sum(x) % 10,
}
PREDICATES = {"sumeven": lambda x: sum(x) % 2 == 0, "desc": lambda x: x[0] > x[-1], "long": lambda x: len(x) > 4}


def run(prog: tuple, x: list[int]) -> int:
    """("r", reducer, ops) = reducer(ops[-1](...ops[0](x))); ("if", predicate, A, B)."""
    if prog[0] == "if":
        return run(prog[2] if PREDICATES[prog[1]](x) else prog[3], x)
    for op in prog[2]:
        x = LIST_OPS[op](x)
    return int(REDUCERS[prog[1]](x))


def show(prog: tuple) -> str:
    if prog[0] == "if":
        return f"if {prog[1]}(x) then {show(prog[2])} else {show(prog[3])}"
    inner = "x"
    for op in prog[2]:
        inner = f"{op}({inner})"
    return f"{prog[1]}({inner})"


_SPEC_OPS = {  # Gate 2's independent interpreter: its own numpy implementations, read from the spec text
    "sort": np.sort, "rev": lambda a: a[::-1], "rot": lambda a: np.roll(a, -1), "tail": lambda a: a[1:],
    "even": lambda a: a[a % 2 == 0], "odd": lambda a: a[a % 2 == 1], "big": lambda a: a[a >= 5],
    "inc": lambda a: (a + 1) % 10, "dbl": lambda a: (a * 2) % 10, "uniq": lambda a: a[np.sort(np.unique(a, True)[1])],
    "len": lambda a: a.size, "sum": np.sum, "par": lambda a: np.sum(a) & 1, "max": np.max, "min": np.min,
    "first": lambda a: a[0], "last": lambda a: a[-1], "ceven": lambda a: np.count_nonzero(a % 2 == 0),
    "sum10": lambda a: np.sum(a) % 10, "mod10": lambda a: a % 10,
    "sumeven": lambda a: np.sum(a) % 2 == 0, "desc": lambda a: a[0] > a[-1], "long": lambda a: a.size > 4,
}


def interpret_spec(spec: str, x: list[int]) -> int:
    """Evaluate a family's spec text ("mod10(max(even(x)))", "if p(x) then A else B", A and B specs themselves,
    conditionals nested in either branch) without touching `run`; only the branch taken is evaluated."""
    tree, end = _spec_tree(spec.split(" "), 0)
    if end != len(spec.split(" ")):
        raise ValueError(f"trailing text in spec {spec!r}")
    return _spec_value(tree, x)


def _spec_tree(words: list[str], i: int) -> tuple[str | tuple, int]:
    """Words from position i -> (a chain's text, or (predicate, then-tree, else-tree)) and the next position."""
    word = lambda k: words[k] if k < len(words) else ""  # noqa: E731 - past the end: no word
    if word(i) != "if":
        if not word(i):
            raise ValueError(f"spec ends early: {' '.join(words)!r}")
        return words[i], i + 1
    m = re.fullmatch(r"(\w+)\(x\)", word(i + 1))
    if not m or word(i + 2) != "then":
        raise ValueError(f"not a conditional spec: {' '.join(words[i:])!r}")
    then, i = _spec_tree(words, i + 3)
    if word(i) != "else":
        raise ValueError(f"conditional spec without its else: {' '.join(words)!r}")
    other, i = _spec_tree(words, i + 1)
    return (m[1], then, other), i


def _spec_value(tree: str | tuple, x: list[int]) -> int:
    if isinstance(tree, tuple):
        return _spec_value(tree[1] if _SPEC_OPS[tree[0]](np.array(x)) else tree[2], x)
    value = np.array(x, dtype=np.int64)
    for name in reversed(re.findall(r"(\w+)\(", tree)):
        value = _SPEC_OPS[name](value)
    return int(value)


# ---- task families: generator, validator --------------------------------------------------------------------------
def family(prog: tuple, fid: str, **kw) -> dict:
    fam = {"id": fid, "prog": prog, "lo": 3, "hi": 5, "vmax": 9, "fmt": "raw", "constrain": False,
           "distinct": False, "knob": "", "round": 0, "parents": "", "operator": "seed", "refine": 0}
    return fam | kw


RULE_CODE = {  # the spec's words, one character each (the policy's alphabet is read from the data)
    "sort": "s", "rev": "r", "rot": "o", "tail": "t", "even": "e", "odd": "d", "big": "b", "inc": "i", "dbl": "x",
    "uniq": "u", "len": "L", "sum": "S", "par": "P", "max": "M", "min": "N", "first": "F", "last": "Z",
    "ceven": "C", "sum10": "T", "sumeven": "V", "desc": "W", "long": "G",
}


def rule_code(fam: dict) -> str:
    """The family's rule in prefix form, one character a word: "Mse" = max(sort(even(x))), "?GA|B" = if long(x)
    then A else B. The mod-10 answer format is stated where it can change an answer: sum mod 10 is sum10 ("T"),
    a count (len, ceven) mod 10 is "%L", "%C" where the family's lists can reach 10 elements; every other reducer
    returns a digit already."""
    counts_wrap = fam["hi"] + (2 if fam["knob"] == "len" else 0) >= 10  # the longest list _draw can make

    def code(prog: tuple) -> str:
        if prog[0] == "if":
            return f"?{RULE_CODE[prog[1]]}{code(prog[2])}|{code(prog[3])}"
        red = prog[1]
        if fam["fmt"] == "mod10" and (red == "sum" or (red in ("len", "ceven") and counts_wrap)):
            red = "sum10" if red == "sum" else red
            head = ("" if red == "sum10" else "%") + RULE_CODE[red]
        else:
            head = RULE_CODE[red]
        return head + "".join(RULE_CODE[op] for op in reversed(prog[2]))
    return code(fam["prog"])


def answer_of(fam: dict, x: list[int]) -> int:
    a = run(fam["prog"], x)
    return a % 10 if fam["fmt"] == "mod10" else a


def spec_of(fam: dict) -> str:
    return f"mod10({show(fam['prog'])})" if fam["fmt"] == "mod10" and fam["prog"][0] == "r" else show(fam["prog"])


def _draw(fam: dict, rng: np.random.Generator, difficulty: int) -> list[int]:
    hi = fam["hi"] + (difficulty if fam["knob"] == "len" else 0)
    vmax = min(9, fam["vmax"] + (2 * difficulty if fam["knob"] == "vmax" else 0))
    n = int(rng.integers(fam["lo"], hi + 1))
    if fam["distinct"]:
        return rng.choice(vmax + 1, min(n, vmax + 1), replace=False).tolist()
    return rng.integers(0, vmax + 1, n).tolist()


def generate(fam: dict, seed: int, difficulty: int, rule: bool = False) -> dict:
    """Generator(seed, difficulty) -> prompt "e1>a1;e2>a2;e3>a3;q>" (3 solved examples and a query) and answer;
    `rule`: the rule's code opens the prompt ("Mse:e1>a1;e2>a2;e3>a3;q>"), so every answer in it, the examples'
    too, is the stated rule run on the list before it."""
    rng = np.random.default_rng([seed, difficulty, *fam["id"].encode()])
    lists, answers = [], []
    for _ in range(4):
        for _ in range(20 if fam["constrain"] else 1):  # constraint: redraw inputs the rule cannot run on
            x = _draw(fam, rng, difficulty)
            try:
                answers.append(answer_of(fam, x))
                break
            except (ValueError, IndexError):
                if not fam["constrain"]:
                    raise
        else:
            raise ValueError("no valid input after 20 draws")
        lists.append(x)
    enc = ["".join(map(str, x)) for x in lists]
    prompt = ";".join(f"{e}>{a}" for e, a in zip(enc[:3], answers[:3], strict=True)) + f";{enc[3]}>"
    prompt = f"{rule_code(fam)}:{prompt}" if rule else prompt
    return {"prompt": prompt, "answer": str(answers[3]), "lists": lists, "answers": answers}


def parse(prompt: str) -> tuple[list[list[int]], list[int], list[int]]:
    """Prompt -> (example lists, example answers, query list); a stated rule is skipped."""
    parts = prompt.split(":")[-1].rstrip(">").split(";")
    ex = [p.split(">") for p in parts[:-1]]
    return [[int(c) for c in e] for e, _ in ex], [int(a) for _, a in ex], [int(c) for c in parts[-1]]


def validate(fam: dict, prompt: str, answer: str) -> bool:
    """Validator: recompute the query's answer from the prompt with the family's rule."""
    try:
        return answer == str(answer_of(fam, parse(prompt)[2]))
    except (ValueError, IndexError):
        return False


# ---- the Multi-Gate Validation Protocol ---------------------------------------------------------------------------
def gate1(fam: dict) -> str:
    """Executability and determinism: '' when passed, else the failure type."""
    for s in range(5):
        try:
            a, b = generate(fam, s, s % 3), generate(fam, s, s % 3)
        except (ValueError, IndexError):
            return "exception"
        if a["prompt"] != b["prompt"] or not validate(fam, a["prompt"], a["answer"]):
            return "exception"
        if validate(fam, a["prompt"], str(int(a["answer"]) + 1)):
            return "exception"
    return ""


def gate2(fam: dict, n: int, agree: float) -> str:
    """Consensus of the reference solver, brute force over single-digit answers checked by the validator, and the
    spec-text interpreter; brute force finds no answer when the answer is not one digit (degenerate format)."""
    ok = fmt_ok = 0
    spec = spec_of(fam)
    for s in range(n):
        try:
            inst = generate(fam, 1000 + s, s % 3)
        except (ValueError, IndexError):  # Gate 1 saw 5 seeds; a rare failure can surface here
            return "exception"
        query = parse(inst["prompt"])[2]
        brute = [str(d) for d in range(10) if validate(fam, inst["prompt"], str(d))]
        fmt_ok += len(brute) == 1
        ok += brute == [inst["answer"]] and str(interpret_spec(spec, query)) == inst["answer"]
    return "" if ok >= agree * n else ("format" if fmt_ok < agree * n else "ambiguous")


def review_programs(depth: int, budget: int) -> list[tuple]:
    """The blind reviewer's search space: reducers after up to `depth` list operators, shortest first."""
    chains: list[tuple] = [()]
    for d in range(1, depth + 1):
        chains += [c + (op,) for c in chains if len(c) == d - 1 for op in LIST_OPS]
    return [("r", r, c) for c in chains for r in REDUCERS][:budget]


# Gate 3's reviewer runs every program on many lists at once. A batch of digit lists is v (L, ...) (int8, position
# first: reductions over it are elementwise over whole arrays) with each list in its first n (...) positions; the
# padding after it is read by no operator, so each list operator and reducer is a few array operations over all
# (chain, list) pairs, with the results of `run`, list by list.
def _pos(v: np.ndarray) -> np.ndarray:
    return np.arange(len(v)).reshape(-1, *[1] * (v.ndim - 1))


def _front(v: np.ndarray, n: np.ndarray) -> np.ndarray:
    return _pos(v) < n


def _take(v: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return np.take_along_axis(v, np.broadcast_to(idx, v.shape), 0)


def _keep(v: np.ndarray, n: np.ndarray, cond: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The list's elements where `cond`, in order, moved to the front."""
    kept = _front(v, n) & cond
    return _take(v, np.argsort(~kept, axis=0, kind="stable")), kept.sum(0)


def _uniq(v: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """First occurrences, in order (dict.fromkeys)."""
    before = np.tri(len(v), k=-1, dtype=bool).reshape(len(v), len(v), *[1] * (v.ndim - 1))  # [i, j]: j < i
    earlier = (v[:, None] == v[None, :]) & before & _front(v, n)[None, :]
    return _keep(v, n, ~earlier.any(1))


def _moved(v: np.ndarray, n: np.ndarray, to: np.ndarray) -> np.ndarray:
    """Position i of the list reads position to[i] (i < n; the padding stays)."""
    return _take(v, np.where(_front(v, n), to, _pos(v)))


_PAD = 10  # above every digit: sorts after the list
LIST_OPS_BATCH = {
    "sort": lambda v, n: (np.sort(np.where(_front(v, n), v, _PAD), 0), n),
    "rev": lambda v, n: (_moved(v, n, n - 1 - _pos(v)), n),
    "rot": lambda v, n: (_moved(v, n, (_pos(v) + 1) % np.maximum(n, 1)), n),
    "tail": lambda v, n: (np.concatenate([v[1:], v[-1:]]), np.maximum(n - 1, 0)),
    "even": lambda v, n: _keep(v, n, v % 2 == 0), "odd": lambda v, n: _keep(v, n, v % 2 == 1),
    "big": lambda v, n: _keep(v, n, v > 4), "inc": lambda v, n: ((v + 1) % 10, n),
    "dbl": lambda v, n: (2 * v % 10, n), "uniq": _uniq,
}


def reduce_batch(v: np.ndarray, n: np.ndarray) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every reducer on a batch of lists: name -> (values, whether `run` returns one: max, min, first and last
    raise on an empty list)."""
    front, some, every = _front(v, n), n > 0, np.ones(n.shape, dtype=bool)
    total = np.where(front, v, 0).sum(0, dtype=np.int64)
    last = np.take_along_axis(v, np.maximum(n - 1, 0)[None], 0)[0]
    return {"len": (n, every), "sum": (total, every), "par": (total % 2, every),
            "max": (np.where(front, v, -1).max(0), some), "min": (np.where(front, v, _PAD).min(0), some),
            "first": (v[0], some), "last": (last, some), "ceven": ((front & (v % 2 == 0)).sum(0), every),
            "sum10": (total % 10, every)}


class BlindReviewer:
    """Gate 3's solver over ("r", reducer, chain) programs on digit lists. `table(lists)` runs every reducer after
    every chain the programs use, each chain computed once from its parent (one operator fewer) for all lists
    together; `member` marks the (reducer, chain) pairs that are programs (the budget may cut a depth short)."""

    def __init__(self, programs: list[tuple]):
        self.programs = programs
        chains = sorted({pr[2][:k] for pr in programs for k in range(len(pr[2]) + 1)} | {()}, key=len)
        at = {c: i for i, c in enumerate(chains)}
        self.n_chains = len(chains)
        self.steps = []  # (operator, chains it makes, their parent chains), parents before children
        for d in range(1, len(chains[-1]) + 1):
            for op in LIST_OPS:
                made = [c for c in chains if len(c) == d and c[-1] == op]
                if made:
                    self.steps.append((op, np.array([at[c] for c in made]), np.array([at[c[:-1]] for c in made])))
        self.reducers = list(REDUCERS)
        self.prog_reducer = np.array([self.reducers.index(pr[1]) for pr in programs], dtype=np.int64)
        self.prog_chain = np.array([at[pr[2]] for pr in programs], dtype=np.int64)
        self.member = np.zeros((len(self.reducers), self.n_chains), dtype=bool)
        self.member[self.prog_reducer, self.prog_chain] = True

    def table(self, lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(values, ran), each (lists, reducers, chains): the reducer after the chain on the list, and whether `run`
        returns a value (False where it raises, and for pairs that are not programs)."""
        if any(not 0 <= d <= 9 for x in lists for d in x):
            raise ValueError("the reviewer reads lists of digits")
        v = np.zeros((max([1, *map(len, lists)]), self.n_chains, len(lists)), dtype=np.int8)  # (L, chains, lists)
        n = np.zeros((self.n_chains, len(lists)), dtype=np.int64)
        for j, x in enumerate(lists):
            v[: len(x), 0, j], n[0, j] = x, len(x)
        for op, made, parents in self.steps:
            v[:, made], n[made] = LIST_OPS_BATCH[op](v[:, parents], n[parents])
        values = np.empty((len(lists), len(self.reducers), self.n_chains), dtype=np.int64)
        ran = np.empty(values.shape, dtype=bool)
        out = reduce_batch(v, n)  # name -> (chains, lists) each
        for k, r in enumerate(self.reducers):
            values[:, k], ran[:, k] = out[r][0].T, out[r][1].T
        return values, ran & self.member

    def outputs(self, lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(values, ran), each (programs, lists): run(program, list), and False where `run` raises."""
        values, ran = self.table(lists)
        return values[:, self.prog_reducer, self.prog_chain].T, ran[:, self.prog_reducer, self.prog_chain].T


def gate3(fam: dict, reviewer: BlindReviewer, p: Params) -> str:
    """Adversarial Blind Review from the prompt alone: ill-posed if too many instances admit a program that fits the
    3 examples but answers the query differently; trivial if the answer entropy is below `min_entropy` bits."""
    try:
        insts = [generate(fam, 2000 + s, s % 3) for s in range(p.review_instances)]
        answers20 = [generate(fam, 3000 + s, s % 3)["answer"] for s in range(20)]
    except (ValueError, IndexError):
        return "exception"
    seen = [parse(inst["prompt"]) for inst in insts]  # (example lists, their answers, query) per instance
    values, ran = reviewer.table([x for lists, _, query in seen for x in (*lists, query)])
    digits = values % 10  # (lists, reducers, chains): the reviewer's answers
    ambiguous, col = 0, 0
    for (lists, answers, _), inst in zip(seen, insts, strict=True):
        fits = ran[col + len(lists)] & (digits[col + len(lists)] != int(inst["answer"]))  # answers the query otherwise
        for j, a in enumerate(answers):  # ... and every solved example as shown
            fits &= ran[col + j] & (digits[col + j] == a)
        ambiguous += bool(fits.any())
        col += len(lists) + 1
    if ambiguous > p.max_ambiguous * p.review_instances:
        return "ambiguous"
    counts = np.unique(answers20, return_counts=True)[1]
    entropy = float(-(counts / 20 * np.log2(counts / 20)).sum())
    return "trivial" if entropy < p.min_entropy else ""


def refine(fam: dict, failure: str) -> dict:
    """Refine operator for a gate failure: constrain inputs, answer format, uniqueness (distinct values, then
    longer lists), or widen ranges for a trivial family."""
    if failure == "exception":
        return fam | {"constrain": True}
    if failure == "format":
        return fam | {"fmt": "mod10"}
    if failure == "ambiguous":
        return fam | ({"hi": fam["hi"] + 2} if fam["distinct"] else {"distinct": True, "lo": max(fam["lo"], 4)})
    return fam | {"vmax": 9, "hi": fam["hi"] + 2, "knob": fam["knob"] or "len"}


def validate_loop(fam: dict, reviewer: BlindReviewer, p: Params) -> tuple[dict, list[bool], bool, dict | None]:
    """Generate-Validate-Refine: returns (final family, [gate1, gate2, gate3] passed, accepted, the no-gate arm's
    admission). The last is the family where Gate 1 first passed (None: never): until then every failure was Gate
    1's and so every Refine the one it picks, which is the loop with Gate 1 alone."""
    gate1_pass = None
    for attempt in range(p.max_refine + 1):
        fam = fam | {"refine": attempt}
        checks = [lambda f: gate1(f), lambda f: gate2(f, p.gate2_instances, p.gate2_agree),
                  lambda f: gate3(f, reviewer, p)]
        passed = []
        for check in checks:
            failure = check(fam)
            passed.append(not failure)
            if failure:
                break
        if gate1_pass is None and passed[0]:
            gate1_pass = fam
        if all(passed):
            return fam, passed, True, gate1_pass
        if attempt < p.max_refine:
            fam = refine(fam, failure)
    return fam, passed + [False] * (3 - len(passed)), False, gate1_pass


# ---- programmatic authors and the evolution loop ------------------------------------------------------------------
def author(op: str, pool: list[dict], rng: np.random.Generator, fid: str) -> dict:
    """One proposal: rule composition f(g(x)), a conditional rule, or a new difficulty gradient (an exposed knob)."""
    a, b = (pool[i] for i in rng.choice(len(pool), 2, replace=False))
    meta = {"parents": f"{a['id']} {b['id']}" if op == "conditional" else a["id"], "operator": op}
    if op == "compose":
        g = str(rng.choice(list(LIST_OPS)))
        wrap = lambda pr: ("r", pr[1], (g, *pr[2])) if pr[0] == "r" else ("if", pr[1], wrap(pr[2]), wrap(pr[3]))  # noqa: E731
        return family(wrap(a["prog"]), fid, **{k: a[k] for k in ("lo", "hi", "vmax", "fmt", "knob")}, **meta)
    if op == "conditional":
        pred = str(rng.choice(list(PREDICATES)))
        fmt = "mod10" if "mod10" in (a["fmt"], b["fmt"]) else "raw"
        return family(("if", pred, a["prog"], b["prog"]), fid, hi=max(a["hi"], b["hi"]), fmt=fmt, **meta)
    knob = "vmax" if a["knob"] == "len" else "len"
    return family(a["prog"], fid, **{k: a[k] for k in ("lo", "hi", "fmt")}, vmax=5 if knob == "vmax" else a["vmax"],
                  knob=knob, **meta)


def seed_families(n: int, rng: np.random.Generator) -> list[dict]:
    """Depth-0 reducers and random depth-1 rules, each well formed (constrained inputs, mod-10 sums)."""
    progs = [("r", r, ()) for r in REDUCERS if r != "sum"]
    while len(progs) < n:
        prog = ("r", str(rng.choice(list(REDUCERS))), (str(rng.choice(list(LIST_OPS))),))
        progs += [prog] if prog not in progs else []
    return [family(pr, f"seed{i}", constrain=True, fmt="mod10" if pr[1] == "sum" else "raw")
            for i, pr in enumerate(progs[:n])]


def evolve(p: Params, seeds: list[dict], rng: np.random.Generator) -> tuple[list[dict], list[dict]]:
    """Rounds of author proposals through Generate-Validate-Refine; the bandit picks operators by acceptance.
    Returns every candidate (with gate results) and the no-gate admissions (Gate 1 only)."""
    reviewer = BlindReviewer(review_programs(p.review_depth, p.review_budget))
    accepted = list(seeds)
    wins, trials = np.ones(len(OPERATORS)), np.full(len(OPERATORS), 2.0)  # Beta(1, 1) priors
    candidates, no_gate = [], []
    for r in range(1, p.rounds + 1):
        pool = list(accepted)
        for c in range(p.candidates):
            k = int(np.argmax(rng.beta(wins, trials - wins)))  # Thompson sampling on acceptance rate
            raw = author(OPERATORS[k], pool, rng, f"r{r}c{c}") | {"round": r}
            fam, gates, ok, admitted = validate_loop(raw, reviewer, p)
            wins[k] += ok
            trials[k] += 1
            candidates.append(fam | {"gate1": gates[0], "gate2": gates[1], "gate3": gates[2], "accepted": ok})
            accepted += [fam] if ok else []
            no_gate += [admitted] if admitted is not None else []
    return candidates, no_gate


# ---- held-out and external suites (their own samplers, not the authors) --------------------------------------------
def _rule(rng: np.random.Generator, reducers: list[str], ops: list[str], depth: int) -> tuple:
    return ("r", str(rng.choice(reducers)), tuple(str(o) for o in rng.choice(ops, depth)))


def suite_families(kind: str, n: int, rng: np.random.Generator, p: Params) -> list[dict]:
    """Held-out (SynLogic analogue: depth 2-3 and conditionals; KORBench logic / operation) or external families,
    each kept only if Gates 1-2 pass and its answers are not trivial."""
    red, ops, out = list(REDUCERS), list(LIST_OPS), []
    for i in range(200 * n):
        if len(out) == n:
            break
        if kind == "synlogic":
            prog = _rule(rng, red, ops, int(rng.integers(2, 4))) if rng.random() < 0.5 else \
                ("if", str(rng.choice(list(PREDICATES))), _rule(rng, red, ops, 1), _rule(rng, red, ops, 1))
        elif kind == "logic":
            prog = _rule(rng, ["par", "ceven", "len"], ["even", "odd", "big", "uniq"], 1) if rng.random() < 0.5 else \
                ("if", str(rng.choice(list(PREDICATES))), _rule(rng, red, ops, 0), _rule(rng, red, ops, 0))
        elif kind == "operation":
            prog = _rule(rng, ["sum10", "max", "min", "sum"], ["inc", "dbl", "sort", "rev"], int(rng.integers(1, 3)))
        else:  # external (Enigmata analogue): depth 1-2 rules, a quarter conditional
            prog = _rule(rng, red, ops, int(rng.integers(1, 3))) if rng.random() < 0.75 else \
                ("if", str(rng.choice(list(PREDICATES))), _rule(rng, red, ops, 1), _rule(rng, red, ops, 0))
        fam = family(prog, f"{kind}{i}", constrain=True, fmt="mod10", operator=kind)
        if any(f["prog"] == prog for f in out) or gate1(fam) or gate2(fam, 10, 0.95):
            continue
        try:
            answers = [generate(fam, 5000 + s, s % 3)["answer"] for s in range(20)]
        except (ValueError, IndexError):
            continue
        if len(set(answers)) > 2:
            out.append(fam)
    return out


def instances(fams: list[dict], n: int, seed: int, pool: str, rule: bool = False) -> dict[str, list]:
    rows: dict[str, list] = {c: [] for c in ("family_id", "instance_id", "difficulty", "prompt", "answer", "pool")}
    for i in range(n * 3):
        if len(rows["prompt"]) == n:
            break
        fam = fams[i % len(fams)]
        try:
            inst = generate(fam, seed + i, i % 3, rule)
        except (ValueError, IndexError):  # a no-gate family may still fail on some seeds
            continue
        for c, v in zip(rows, (fam["id"], len(rows["prompt"]), i % 3, inst["prompt"], inst["answer"], pool),
                        strict=True):
            rows[c].append(v)
    return rows


def _family_rows(fams: list[dict], kind: str) -> dict[str, list]:
    cols = ("family_id", "round", "parent_ids", "operator", "dsl_program", "spec", "gate1", "gate2", "gate3",
            "refine_count", "accepted", "set", "config")
    rows: dict[str, list] = {c: [] for c in cols}
    for f in fams:
        config = {k: f[k] for k in ("lo", "hi", "vmax", "fmt", "constrain", "distinct", "knob")}
        vals = (f["id"], f["round"], f["parents"], f["operator"], repr(f["prog"]), spec_of(f), f.get("gate1", True),
                f.get("gate2", True), f.get("gate3", True), f["refine"], f.get("accepted", True), kind,
                json.dumps(config))
        for c, v in zip(cols, vals, strict=True):
            rows[c].append(v)
    return rows


def _concat(*tables: dict[str, list]) -> dict[str, list]:
    return {c: [v for t in tables for v in t[c]] for c in tables[0]}


def prepare(p: Params, out_dir: Path) -> None:
    rng = np.random.default_rng(p.seed)
    seeds = seed_families(p.n_seed, rng)
    candidates, no_gate = evolve(p, seeds, rng)
    evolved = [f for f in candidates if f["accepted"]]
    no_gate = [f | {"id": f["id"] + "ng", "gate2": False, "gate3": False} for f in no_gate]
    ext_rng, eval_rng = np.random.default_rng([p.seed, 1]), np.random.default_rng([p.seed, 2])
    external = suite_families("external", p.n_external, ext_rng, p)
    held = {c: suite_families(c, p.n_eval_families, eval_rng, p) for c in CATEGORIES}
    rows = _concat(_family_rows(seeds, "seed"), _family_rows(candidates, "candidate"), _family_rows(no_gate, "no_gate"))
    write_table(out_dir / "families.parquet", rows)
    write_table(out_dir / "external.parquet", _family_rows(external, "external"))
    n = p.pool_size
    pools = {"sft": seeds, "evolved": seeds + evolved, "seed_only": seeds, "no_gate": seeds + no_gate,
             "external_only": external}
    # generator seeds: each pool its own range (the SFT pool's 10**6 on, clear of the arms' up to 3 x its size)
    tables = [instances(fams or seeds, p.sft_pool if name == "sft" else n, 10**6 if name == "sft" else 10_000 * (k + 1),
                        name, p.state_rule) for k, (name, fams) in enumerate(pools.items())]
    mix = instances(evolved or seeds, n // 2, 70_000, "external_plus_evolved", p.state_rule)
    ext_half = {c: v[: n - len(mix["prompt"])] for c, v in tables[-1].items()}
    tables.append(_concat(mix, ext_half | {"pool": ["external_plus_evolved"] * len(ext_half["pool"])}))
    write_table(out_dir / "instances.parquet", _concat(*tables))
    ev = {c: [] for c in ("family_id", "category", "difficulty", "prompt", "answer", "dsl_program", "config")}
    for cat, fams in held.items():
        rows = instances(fams, p.n_eval_families * p.eval_per_family, 90_000, cat, p.state_rule)
        by_id = {f["id"]: f for f in fams}
        for fid, dif, pr, ans in zip(rows["family_id"], rows["difficulty"], rows["prompt"], rows["answer"],
                                     strict=True):
            config = {k: by_id[fid][k] for k in ("lo", "hi", "vmax", "fmt", "constrain", "distinct", "knob")}
            for c, v in zip(ev, (fid, cat, dif, pr, ans, repr(by_id[fid]["prog"]), json.dumps(config)), strict=True):
                ev[c].append(v)
    if p.dataset == "jsonl":  # real suites replace the synthetic held-out and external sets
        ev, ext = load_jsonl_suites(input_path(p.eval_path), input_path(p.external_path) if p.external_path else None)
        if ext["prompt"]:
            inst = read_table(out_dir / "instances.parquet")
            keep = {c: [v for v, pool in zip(inst[c], inst["pool"], strict=True) if pool != "external_only"]
                    for c in inst}
            write_table(out_dir / "instances.parquet", _concat(keep, ext))
    write_table(out_dir / "eval.parquet", ev)


def load_jsonl_suites(eval_path: Path, external_path: Path | None) -> tuple[dict, dict]:
    """Full profile: SynLogic/KORBench-style eval rows {prompt, answer, category, difficulty} and Enigmata-style
    external rows {family_id, prompt, answer}; only single-character answers (one policy token) are kept."""
    ev = {c: [] for c in ("family_id", "category", "difficulty", "prompt", "answer", "dsl_program", "config")}
    for line in eval_path.read_text().splitlines():
        row = json.loads(line) if line.strip() else None
        if row and len(str(row["answer"])) == 1:
            vals = (row.get("family_id", row["category"]), row["category"], int(row.get("difficulty", 0)),
                    row["prompt"], str(row["answer"]), "", "")
            for c, v in zip(ev, vals, strict=True):
                ev[c].append(v)
    ext = {c: [] for c in ("family_id", "instance_id", "difficulty", "prompt", "answer", "pool")}
    for line in (external_path.read_text().splitlines() if external_path else []):
        row = json.loads(line) if line.strip() else None
        if row and len(str(row["answer"])) == 1:
            for c, v in zip(ext, (row["family_id"], len(ext["prompt"]), 0, row["prompt"], str(row["answer"]),
                                  "external_only"), strict=True):
                ext[c].append(v)
    return ev, ext


# ---- the policy and GRPO ------------------------------------------------------------------------------------------
def _load(data_dir: Path) -> dict:
    fams = {}
    for name in ("families.parquet", "external.parquet", "eval.parquet"):
        t = read_table(data_dir / name)
        for fid, prog, config in zip(t["family_id"], t["dsl_program"], t["config"], strict=True):
            if prog and fid not in fams:
                fams[fid] = {"id": fid, "prog": ast.literal_eval(prog), **json.loads(config)}
    inst, ev = read_table(data_dir / "instances.parquet"), read_table(data_dir / "eval.parquet")
    alphabet = sorted(set(CHARS) | {c for t in (inst, ev) for s in t["prompt"] for c in s}
                      | {c for t in (inst, ev) for s in t["answer"] for c in s})
    return {"fams": fams, "inst": inst, "eval": ev, "alphabet": "".join(alphabet),
            "pools": {a: np.flatnonzero(inst["pool"] == a) for a in ("sft", *ARMS)}}


def cut(s: str, max_len: int) -> str:
    """A prompt cut to `max_len` characters: its tail, after a stated rule where it has one (the rule and the
    query stay, the oldest examples go)."""
    if len(s) <= max_len:
        return s
    head, sep, body = s.partition(":")
    return head + sep + body[len(body) - (max_len - len(head) - 1):] if sep and len(head) < max_len // 2 else \
        s[-max_len:]


def encode(prompts, alphabet: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded char ids (N, T) (0 = pad; T the longest prompt, at most max_len: with a causal policy the
    padding changes no logit a prompt reads) and lengths (N,); the answer is read at position len - 1."""
    code = {c: 1 + alphabet.index(c) for c in set(alphabet)}
    cuts = [cut(s, max_len) for s in prompts]
    ids = np.zeros((len(prompts), max([1, *map(len, cuts)])), dtype=np.int64)
    lens = np.zeros(len(prompts), dtype=np.int64)
    for i, s in enumerate(cuts):
        ids[i, : len(s)] = [code[c] for c in s]
        lens[i] = len(s)
    return torch.from_numpy(ids), torch.from_numpy(lens)


def answer_targets(prompts, answers, alphabet: str, max_len: int) -> torch.Tensor:
    """(N, T) SFT targets aligned with `encode`: the query's answer at position len - 1 and, where the prompt states
    its rule (every answer in it is then that rule's output), each solved example's answer at its '>'; -100
    (ignored) elsewhere."""
    code = {c: 1 + alphabet.index(c) for c in set(alphabet)}
    cuts = [cut(s, max_len) for s in prompts]
    tgt = np.full((len(prompts), max([1, *map(len, cuts)])), -100, dtype=np.int64)
    for i, (s, a) in enumerate(zip(cuts, answers, strict=True)):
        tgt[i, len(s) - 1] = code[a[0]]
        if ":" in s:
            at = np.flatnonzero(np.frombuffer(s[:-1].encode(), dtype=np.uint8) == ord(">"))
            tgt[i, at] = [code[s[j + 1]] for j in at]
    return torch.from_numpy(tgt)


def _policy(p: Params, vocab: int) -> TinyLM:
    return TinyLM(vocab, p.d_model, p.layers, 4 if p.d_model % 4 == 0 else 1, p.max_prompt)


def answer_logits(net: nn.Module, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """(N, T) -> next-token logits after the prompt's last character (N, V)."""
    logits = net(ids)  # (N, T, V)
    return logits[torch.arange(len(ids)), lens - 1]


class Arms(nn.Module):
    """The five GRPO arms, each its own copy of the SFT policy, run in lock-step in one engine."""

    def __init__(self, nets: list[nn.Module]):
        super().__init__()
        self.nets = nn.ModuleList(nets)

    def forward(self, ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        # ids (B, A, T), lens (B, A) -> answer logits (B, A, V): arm a reads only its own prompts
        return torch.stack([answer_logits(net, ids[:, a], lens[:, a]) for a, net in enumerate(self.nets)], 1)


def grpo_loss(logits: torch.Tensor, ref_logits: torch.Tensor, samples: torch.Tensor, rewards: torch.Tensor,
              kl: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for one-token answers. logits, ref_logits (B, A, V); samples, rewards (B, A, G). Group-normalised
    advantages (on-policy, so the clipped ratio is 1) plus the exact KL(pi || pi_sft); returns per-arm loss (A,)."""
    logp, ref = logits.log_softmax(-1), ref_logits.log_softmax(-1)
    adv = (rewards - rewards.mean(-1, keepdim=True)) / (rewards.std(-1, unbiased=False, keepdim=True) + 1e-4)
    pg = -(adv * logp.gather(-1, samples)).mean((0, 2))  # (A,)
    kl_term = (logp.exp() * (logp - ref)).sum(-1).mean(0)  # (A,)
    return pg + kl * kl_term, kl_term


def _grpo_indices(p: Params, pools: dict, step: int) -> np.ndarray:
    """(P, A) instance rows of one GRPO step, drawn from a generator seeded by the step."""
    rng = np.random.default_rng([p.seed, 3, step])
    return np.stack([pools[a][rng.integers(len(pools[a]), size=p.prompts_per_step)] for a in ARMS], 1)


def _reward(d: dict, row: int, answer: str) -> float:
    """The family's validator (exact match for rows loaded without a program)."""
    fam = d["fams"].get(d["inst"]["family_id"][row])
    prompt = d["inst"]["prompt"][row]
    return float(validate(fam, prompt, answer) if fam else answer == d["inst"]["answer"][row])


@torch.no_grad()
def held_out(nets: list[nn.Module], d: dict, p: Params) -> np.ndarray:
    """Greedy held-out correctness (len(nets), N) on the eval suites."""
    ev = d["eval"]
    ids, lens = encode(ev["prompt"], d["alphabet"], p.max_prompt)
    chars, answers = np.array(["", *d["alphabet"]], dtype=object), np.asarray(ev["answer"], dtype=object)
    preds = [answer_logits(net, ids, lens).argmax(-1).cpu().numpy() for net in nets]  # (N,) token ids each
    return np.array([chars[pred] == answers for pred in preds], dtype=bool)


def _accuracies(correct: np.ndarray, ev: dict) -> np.ndarray:
    """(A, N) correctness -> (A, 1 + categories) accuracy: overall, then each category."""
    cols = [correct.mean(1)] + [correct[:, ev["category"] == c].mean(1) if (ev["category"] == c).any()
                                else np.zeros(len(correct)) for c in CATEGORIES]
    return np.stack(cols, 1)


def train(ctx) -> None:
    p: Params = ctx.params
    d = _load(ctx.data_dir)
    inst, vocab = d["inst"], 1 + len(d["alphabet"])
    policy = _policy(p, vocab)

    def sft_batch(step: int) -> dict[str, torch.Tensor]:
        rng = np.random.default_rng([p.seed, 2, step])
        rows = d["pools"]["sft"][rng.integers(len(d["pools"]["sft"]), size=p.sft_batch)]
        ids, _ = encode(inst["prompt"][rows], d["alphabet"], p.max_prompt)
        return {"ids": ids, "target": answer_targets(inst["prompt"][rows], inst["answer"][rows], d["alphabet"],
                                                     p.max_prompt)}

    def sft_step(engine, batch, step):  # every answer of a stated rule's prompt; the query's alone without one
        logits = engine(batch["ids"])  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), batch["target"].flatten(), ignore_index=-100), {}

    ctx.progress(f"policy: {sum(x.numel() for x in policy.parameters())} parameters; SFT on seed families")
    engine = ctx.engine(policy, p.sft_lr, steps=p.sft_steps, warmup=p.sft_warmup, decay=p.sft_decay)
    ctx.fit("sft", engine, sft_step, sft_batch, p.sft_steps)
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    arms = Arms([copy.deepcopy(policy) for _ in ARMS])
    n_mid = len(range(0, p.grpo_steps, p.eval_every))
    state = {"curve": torch.full((len(ARMS), n_mid, 1 + len(CATEGORIES)), float("nan"))}

    def grpo_batch(step: int) -> dict[str, torch.Tensor]:
        rows = _grpo_indices(p, d["pools"], step)  # (P, A)
        ids, lens = encode(inst["prompt"][rows.reshape(-1)], d["alphabet"], p.max_prompt)
        return {"ids": ids.view(*rows.shape, -1), "lens": lens.view(rows.shape), "rows": torch.from_numpy(rows)}

    def grpo_step(engine, batch, step):
        if step % p.eval_every == 0:  # held-out accuracy before this step's update (step 0 = the SFT policy)
            correct = held_out(list(engine.module.nets), d, p)
            state["curve"][:, step // p.eval_every] = torch.from_numpy(_accuracies(correct, d["eval"]))
        logits = engine(batch["ids"], batch["lens"])  # (B, A, V)
        with torch.no_grad():
            b, a, t = batch["ids"].shape
            ref_logits = answer_logits(ref, batch["ids"].reshape(b * a, t), batch["lens"].reshape(-1)).reshape(b, a, -1)
            g = torch.Generator().manual_seed(p.seed * 1_000_003 + step * 1009 + ctx.rank)
            probs = logits.softmax(-1).reshape(b * a, -1)  # (B*A, V)
            samples = torch.multinomial(probs, p.group, True, generator=g).reshape(b, a, -1)  # (B, A, G)
        chars, rows, drawn = [""] + list(d["alphabet"]), batch["rows"].cpu().numpy(), samples.cpu().numpy()
        rewards = torch.tensor([[[_reward(d, int(rows[i, j]), chars[s]) for s in drawn[i, j]]
                                 for j in range(a)] for i in range(b)])  # (B, A, G)
        loss, kl_term = grpo_loss(logits, ref_logits.to(logits.device), samples, rewards.to(logits.device), p.kl)
        metrics = {f"{arm}/reward": float(rewards[:, k].mean()) for k, arm in enumerate(ARMS)}
        return loss.sum(), metrics | {f"{arm}/kl": float(kl_term[k]) for k, arm in enumerate(ARMS)}

    ctx.progress(f"GRPO: {len(ARMS)} arms x {p.grpo_steps} steps x {p.prompts_per_step} prompts x {p.group}")
    engine = ctx.engine(arms, p.grpo_lr, arms=dict(zip(ARMS, arms.nets, strict=True)))
    ctx.fit("grpo", engine, grpo_step, grpo_batch, p.grpo_steps, state=state)
    ctx.save_record("curve", state["curve"])


# ---- evaluation ---------------------------------------------------------------------------------------------------
def token_counts(p: Params, d: dict) -> np.ndarray:
    """Cumulative training tokens (A, n_evals + 1) at each evaluation step: prompt + answer tokens x group size."""
    lens = np.array([len(s) + 1 for s in d["inst"]["prompt"]])
    per_step = np.stack([lens[_grpo_indices(p, d["pools"], s)].sum(0) * p.group for s in range(p.grpo_steps)], 1)
    cum = np.concatenate([np.zeros((len(ARMS), 1)), np.cumsum(per_step, 1)], 1)  # (A, steps + 1)
    at = [*range(0, p.grpo_steps, p.eval_every), p.grpo_steps]
    return cum[:, at]


def answer_prior(ev: dict) -> np.ndarray:
    """(N,) correctness of the answer prior: each held-out category's most frequent answer, always (the best a
    policy that ignores the prompt can do, read off the held-out answers themselves)."""
    answers, cats = np.asarray(ev["answer"], dtype=object), np.asarray(ev["category"], dtype=object)
    correct = np.zeros(len(answers), dtype=bool)
    for cat in set(cats):
        sel = cats == cat
        values, counts = np.unique(answers[sel].astype(str), return_counts=True)
        correct[sel] = answers[sel] == values[counts.argmax()]
    return correct


def evaluate(ctx) -> dict[str, float]:
    p: Params = ctx.params
    d = _load(ctx.data_dir)
    arms, sft = ctx.network("grpo"), ctx.network("sft")
    correct = held_out([*arms.nets, sft], d, p)  # (A + 1, N)
    final = _accuracies(correct, d["eval"])  # (A + 1, 1 + C)
    n_mid = len(range(0, p.grpo_steps, p.eval_every))  # evaluations inside the loop, then the final one
    curve = np.concatenate([ctx.record("curve").numpy()[:, :n_mid], final[: len(ARMS), None]], 1)  # (A, points, 1 + C)
    tokens = token_counts(p, d)  # (A, n_points)
    m: dict[str, float] = {}
    prior = answer_prior(d["eval"])  # (N,) correct when always answering the category's most frequent answer
    m["baseline/answer_prior/acc"] = float(prior.mean())
    for cat in CATEGORIES:
        sel = d["eval"]["category"] == cat
        m[f"baseline/answer_prior/{cat}_acc"] = float(prior[sel].mean()) if sel.any() else 0.0
    names = {"evolved": "method/", **{a: f"baseline/{a}/" for a in ARMS[1:]}, "sft": "baseline/sft/"}
    for k, arm in enumerate([*ARMS, "sft"]):
        pre = names[arm]
        m[pre + "acc"] = float(final[k, 0])
        for c, cat in enumerate(CATEGORIES):
            m[pre + f"{cat}_acc"] = float(final[k, 1 + c])
        for dif in range(3):
            sel = d["eval"]["difficulty"] == dif
            m[pre + f"solve_rate_d{dif}"] = float(correct[k, sel].mean()) if sel.any() else 0.0
    # token-matched: the largest token count both evolved and seed-only reached; each arm's last eval within it
    ev, so = ARMS.index("evolved"), ARMS.index("seed_only")
    budget = min(tokens[ev, -1], tokens[so, -1])
    for k, pre in ((ev, "method/"), (so, "baseline/seed_only/")):
        m[pre + "acc_token_matched"] = float(curve[k, np.flatnonzero(tokens[k] <= budget).max(), 0])
        m[pre + "tokens"] = float(tokens[k, -1])
    m["method/size_controlled_acc"] = m["baseline/external_plus_evolved/acc"]
    m["baseline/external_only/size_controlled_acc"] = m["baseline/external_only/acc"]
    fam = read_table(ctx.data_dir / "families.parquet")
    cand = fam["set"] == "candidate"
    m["detail/families/seed"] = float((fam["set"] == "seed").sum())
    m["detail/families/candidates"] = float(cand.sum())
    m["detail/families/accepted"] = float(fam["accepted"][cand].sum())
    m["detail/families/no_gate"] = float((fam["set"] == "no_gate").sum())
    m["detail/instances"] = float(len(d["inst"]["prompt"]))
    reached = cand.copy()
    for g in ("gate1", "gate2", "gate3"):  # share of the candidates reaching a gate that it rejected (final state)
        m[f"detail/{g}_reject_rate"] = float(1 - fam[g][reached].mean()) if reached.any() else 0.0
        reached &= fam[g]
    for op in OPERATORS:
        sel = cand & (fam["operator"] == op)
        m[f"detail/bandit/{op}_proposals"] = float(sel.sum())
        m[f"detail/bandit/{op}_accept_rate"] = float(fam["accepted"][sel].mean()) if sel.any() else 0.0
    m["detail/mean_refinements"] = float(fam["refine_count"][cand].mean()) if cand.any() else 0.0
    _plots(ctx.plots_dir, curve, tokens, p, m)
    return m


def _plots(out: Path, curve: np.ndarray, tokens: np.ndarray, p: Params, m: dict) -> None:
    import matplotlib.pyplot as plt

    steps = [*range(0, p.grpo_steps, p.eval_every), p.grpo_steps]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for k, arm in enumerate(ARMS):
        axes[0].plot(steps, curve[k, :, 0], "o-", label=arm, lw=2 if arm == "evolved" else 1)
        axes[1].plot(tokens[k], curve[k, :, 0], "o-", label=arm, lw=2 if arm == "evolved" else 1)
    axes[0].set(xlabel="GRPO step", ylabel="held-out accuracy", title="Step-matched")
    axes[1].set(xlabel="training tokens", ylabel="held-out accuracy", title="Token-matched")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "accuracy_curves.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    keys = ["candidates", "accepted", "no_gate"]
    ax.bar(keys, [m[f"detail/families/{k}"] for k in keys], color=["tab:gray", "tab:green", "tab:orange"])
    ax.set(ylabel="families", title="Generate-Validate-Refine: candidates -> accepted (gates) vs Gate 1 only")
    fig.tight_layout()
    fig.savefig(out / "family_funnel.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    arms = list(ARMS)
    width = 0.25
    for c, cat in enumerate(CATEGORIES):
        vals = [m[("method/" if a == "evolved" else f"baseline/{a}/") + f"{cat}_acc"] for a in arms]
        ax.bar(np.arange(len(arms)) + (c - 1) * width, vals, width, label=cat)
    ax.set_xticks(range(len(arms)), [a.replace("_", "\n") for a in arms], fontsize=7)
    ax.set(ylabel="accuracy", title="Held-out accuracy by suite category")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "category_accuracy.png", dpi=110)
    plt.close(fig)


PAPER = Paper(
    id="sslogic",
    title="SSLogic: agentic meta-synthesis of verifiable task families for RLVR",
    seed="003_9a806cafa3d919df.txt, abstract 4",
    Params=Params,
    prepare=prepare,
    train=train,
    evaluate=evaluate,
    primary=("method/acc", "max"),
    claim=Claim(premises=(  # SFT learned more than the answers' frequencies, and RLVR learned: every GRPO arm ends
        # above its SFT start (held out)
        Compare("baseline/sft/acc", ">", "baseline/answer_prior/acc", name="sft_beats_answer_prior"),
        *(Compare("method/acc" if arm == "evolved" else f"baseline/{arm}/acc", ">", "baseline/sft/acc",
                  name=f"grpo_{arm}_improves_on_sft") for arm in ARMS),
    ), all_of=(
        Compare("method/acc", ">", "baseline/seed_only/acc"),  # step-matched
        Compare("method/acc_token_matched", ">", "baseline/seed_only/acc_token_matched"),
        Compare("method/size_controlled_acc", ">", "baseline/external_only/size_controlled_acc"),
        Compare("method/logic_acc", ">", "baseline/seed_only/logic_acc"),
        Compare("method/operation_acc", ">", "baseline/seed_only/operation_acc"),
        Compare("baseline/no_gate/acc", "<", "method/acc"),
    ), summary="evolved families beat seed-only data step-, token- and size-matched, in both KORBench categories, "
               "and the gates matter (no-gate < evolved)"),
)
