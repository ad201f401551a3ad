"""The registry: a plain dict of every `models/<id>.py` that exposes `PAPER`, and typed params from `params.yaml`.

`params.yaml` holds `papers.<id>.<profile>` for the profiles `test`, `smoke` and `full`, each the complete
parameter set of that paper (no inheritance between profiles: what a profile runs is what it says).
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

import models
from models.contract import Paper, PaperParams

PROFILES = ("test", "smoke", "full")
DEFAULT_PROFILE = "smoke"  # what `paperline run` runs; its data is the hand-written `prepare@<id>` DVC stage
SUITE_OVERRIDES = ("replicates",)  # the one override that means the same for every paper (`run --all --set`)
_NOT_PAPERS = {"contract", "registry", "common", "verdicts", "inputs"}  # the framework, not papers


class ConfigError(ValueError):
    """Bad user input (paper id, profile, parameter, params.yaml): raised before any work starts."""


# libyaml when present: params.yaml grows with every paper, and the pure-Python parser costs ~0.3 s on it
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_ID = re.compile(r"[a-z][a-z0-9_]*")


def paper_ids() -> list[str]:
    """Every `models/<id>.py` that may hold a paper, without importing any of them."""
    return sorted(info.name for info in pkgutil.iter_modules(models.__path__)
                  if info.name not in _NOT_PAPERS and not info.name.startswith("_"))


def module_file(paper_id: str) -> Path:
    """`models/<id>.py` of a known id; the id is checked before it touches the file system (no path escapes)."""
    if not isinstance(paper_id, str) or not _ID.fullmatch(paper_id) or paper_id not in paper_ids():
        raise ConfigError(f"unknown paper id {paper_id!r}; known ids: {', '.join(paper_ids())}")
    return Path(models.__path__[0]) / f"{paper_id}.py"


@cache
def _load(paper_id: str) -> Paper:
    module = importlib.import_module(f"models.{paper_id}")
    paper = getattr(module, "PAPER", None)
    if not isinstance(paper, Paper):
        raise TypeError(f"models/{paper_id}.py has no PAPER = Paper(...)")
    if paper.id != paper_id:
        raise TypeError(f"models/{paper_id}.py declares id {paper.id!r}; the id must equal the file name")
    return paper


def papers() -> dict[str, Paper]:
    """Every registered paper (imports them all: seconds; `get` imports only the one asked for)."""
    return {pid: _load(pid) for pid in paper_ids()}


def get(paper_id: str) -> Paper:
    module_file(paper_id)
    return _load(paper_id)


def load_params_file(path: Path, require_papers: bool = True) -> dict[str, Any]:
    try:
        data = yaml.load(path.read_text(), Loader=_YAML_LOADER)
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


def raw_params(paper_id: str, profile: str, overrides: Mapping[str, Any] | None, params_file: Path) -> dict[str, Any]:
    """The profile's section of params.yaml with the overrides on top, not yet validated (no paper import)."""
    module_file(paper_id)
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}; profiles: {', '.join(PROFILES)}")
    section = load_params_file(params_file)["papers"].get(paper_id)
    if not isinstance(section, dict) or not isinstance(section.get(profile), dict):
        raise ConfigError(f"{params_file}: missing section papers.{paper_id}.{profile}")
    return {**section[profile], **dict(overrides or {})}


def resolve(paper_id: str, profile: str, overrides: Mapping[str, Any] | None, params_file: Path) -> PaperParams:
    """Validated params of one paper run. Raises ConfigError naming the culprit; reads nothing but params.yaml."""
    return ask(paper_id, profile, overrides, params_file).validated()


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


@dataclass(frozen=True)
class Replicate:
    """One replicate of a run: the params as given with seed `seed + index` (and without `replicates`, which
    says how many there are, not what one of them does), validated."""

    index: int
    raw: dict[str, Any]
    params: PaperParams
    is_default: bool  # its data is the hand-written `prepare@<id>` stage (replicate 0 of a default run)


@dataclass(frozen=True)
class RawRequest:
    """One run as asked for, before validation: the ids, profile and keys checked, no paper imported. What the
    CLI's cached-rerun check needs; `resolve()` turns it into the `RunRequest` every flow takes."""

    paper: str
    profile: str
    overrides: dict[str, Any]
    raw: dict[str, Any]   # the profile section + overrides as given: the cache key's params
    params_file: Path

    @property
    def replicates(self) -> int:
        return replicate_count(self.raw)

    @property
    def is_default(self) -> bool:
        return is_default_run(self.profile, self.overrides)

    def replicate_raw(self, index: int) -> dict[str, Any]:
        return replicate_raw(self.raw, index)

    def validated(self) -> PaperParams:
        """The params, validated (imports the paper; ConfigError naming each bad key)."""
        return validate(get(self.paper), self.raw, where=f"papers.{self.paper}.{self.profile}")

    def resolve(self) -> RunRequest:
        """The run request: params validated and the profile's real inputs present, before any work."""
        params = self.validated()
        from models.inputs import require_present  # a profile's real data must be on disk before any work

        require_present(self.paper, params)
        return RunRequest(self.paper, self.profile, self.overrides, self.raw, params)


@dataclass(frozen=True)
class RunRequest:
    """One run as asked for, resolved once (by the CLI, a deployment or the suite) and handed down as a value."""

    paper: str
    profile: str
    overrides: dict[str, Any]
    raw: dict[str, Any]   # the profile section + overrides as given: the cache key's params
    params: PaperParams   # validated
    premises_only: bool = False  # show and record only the premises (`paperline run <id> --premises-only`)

    @property
    def replicates(self) -> int:
        return self.params.replicates

    @property
    def is_default(self) -> bool:
        return is_default_run(self.profile, self.overrides)

    def replicate(self, index: int) -> Replicate:
        seed = self.params.seed + index
        params = self.params.model_copy(update={"seed": seed, "replicates": 1})
        return Replicate(index, replicate_raw(self.raw, index), params, self.is_default and index == 0)


def is_default_run(profile: str, overrides: Mapping[str, Any] | None) -> bool:
    """The run `paperline run <id>` makes: its first replicate's data is the hand-written `prepare@<id>` stage.
    `replicates` says how many replicates, not what one does: `--set replicates=5` is still the default run, so its
    first three replicates are those of the 3-replicate run."""
    return profile == DEFAULT_PROFILE and not set(overrides or {}) - {"replicates"}


def replicate_raw(raw: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Replicate `index`'s params as given (no validation: the CLI's cached-rerun check uses it before any import)."""
    seed = raw.get("seed", 0)
    return {**{k: v for k, v in raw.items() if k != "replicates"},
            "seed": seed + index if isinstance(seed, int) else seed}


def replicate_count(raw: Mapping[str, Any]) -> int:
    count = raw.get("replicates", 1)
    return count if isinstance(count, int) and count >= 1 else 1


def ask(paper_id: str, profile: str, overrides: Mapping[str, Any] | list[str] | None,
        params_file: Path) -> RawRequest:
    """The one resolver: a run as asked for (overrides as `--set` gives them or as a dict), its id, profile and
    keys checked, no paper imported. ConfigError names what is wrong."""
    overrides = parse_overrides(overrides)
    return RawRequest(paper_id, profile, overrides, raw_params(paper_id, profile, overrides, params_file),
                      params_file)


def request(paper_id: str, profile: str, overrides: Mapping[str, Any] | None, params_file: Path) -> RunRequest:
    """Resolve a run request: every id, profile, key and value checked before any work (ConfigError otherwise)."""
    return ask(paper_id, profile, overrides, params_file).resolve()
