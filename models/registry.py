"""The registry: a plain dict of every `models/<id>.py` that exposes `PAPER`, and typed params from `params.yaml`.

`params.yaml` holds `papers.<id>.<profile>` for the profiles `test`, `smoke` and `full`, each the complete
parameter set of that paper (no inheritance between profiles: what a profile runs is what it says).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

import models
from models.contract import Paper, PaperParams

PROFILES = ("test", "smoke", "full")
_NOT_PAPERS = {"contract", "registry", "common"}


class ConfigError(ValueError):
    """Bad user input (paper id, profile, parameter, params.yaml): raised before any work starts."""


@cache
def papers() -> dict[str, Paper]:
    found: dict[str, Paper] = {}
    for info in pkgutil.iter_modules(models.__path__):
        if info.name in _NOT_PAPERS or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"models.{info.name}")
        paper = getattr(module, "PAPER", None)
        if not isinstance(paper, Paper):
            raise TypeError(f"models/{info.name}.py has no PAPER = Paper(...)")
        if paper.id != info.name:
            raise TypeError(f"models/{info.name}.py declares id {paper.id!r}; the id must equal the file name")
        found[paper.id] = paper
    return dict(sorted(found.items()))


def get(paper_id: str) -> Paper:
    known = papers()
    if paper_id not in known:
        raise ConfigError(f"unknown paper id {paper_id!r}; known ids: {', '.join(known)}")
    return known[paper_id]


def load_params_file(path: Path, require_papers: bool = True) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError as e:
        raise ConfigError(f"{path} not found: run from the project root or set PAPERLINE_ROOT") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(data, dict) or (require_papers and not isinstance(data.get("papers"), dict)):
        raise ConfigError(f"{path}: expected a top-level mapping" + (" with a 'papers' key" if require_papers else ""))
    return data


def parse_overrides(pairs: list[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """`["eta=0.3", "epochs=5"]` -> `{"eta": 0.3, "epochs": 5}`; values are parsed as YAML scalars."""
    if pairs is None:
        return {}
    if isinstance(pairs, Mapping):
        return dict(pairs)
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {pair!r} is not of the form key=value")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key.strip()!r}: cannot parse value {value!r}") from e
    return out


def resolve(paper_id: str, profile: str, overrides: Mapping[str, Any] | None, params_file: Path) -> PaperParams:
    """Validated params of one paper run. Raises ConfigError naming the culprit; reads nothing but params.yaml."""
    paper = get(paper_id)
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}; profiles: {', '.join(PROFILES)}")
    section = load_params_file(params_file)["papers"].get(paper_id)
    if not isinstance(section, dict) or not isinstance(section.get(profile), dict):
        raise ConfigError(f"{params_file}: missing section papers.{paper_id}.{profile}")
    raw = {**section[profile], **dict(overrides or {})}
    return validate(paper, raw, where=f"papers.{paper_id}.{profile}")


def validate(paper: Paper, raw: Mapping[str, Any], where: str) -> PaperParams:
    try:
        return paper.Params.model_validate(dict(raw))
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "<root>"
            reason = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
            problems.append(f"{where}.{key}: {reason} (got {err.get('input')!r})")
        raise ConfigError("invalid parameters:\n  " + "\n  ".join(problems)) from None
