"""The cached-rerun check's data status (`data.current_hashes`) answers exactly as `dvc status` does, stage by
stage, while it parses each dvc.yaml and params file once."""

from __future__ import annotations

from contextlib import chdir

import pytest
import yaml
from dvc.repo import Repo

from models import registry
from tasks import data, settings

pytestmark = pytest.mark.e2e


def _dvc_answer(stages: list[data.DataStage]) -> dict[str, str | None]:
    """What DVC's own status says, one target at a time (what current_hashes did before it read files once)."""
    with chdir(settings.root()), Repo(str(settings.root())) as repo:
        return {s.target: None if repo.status(targets=[s.target]) else data.locked_hash(s) for s in stages}


def test_current_hashes_agree_with_dvc_status(workspace):
    root_stages = [data.stage_location(pid, "smoke", {}, is_default=True) for pid in ("qubo_relax", "pacer")]
    raw = registry.ask("sei", "test", {}, settings.params_file()).raw
    variant = data.stage_for(registry.get("sei"), "test", registry.resolve("sei", "test", {}, settings.params_file()),
                             raw, is_default=False)
    stages = [*root_stages, variant]
    for stage in stages:
        data.reproduce(stage)
    fresh = data.current_hashes(stages)
    assert all(fresh.values()) and fresh == _dvc_answer(stages)

    # one paper's params edited in the shared params.yaml: its stage only is out of date
    params_file = settings.params_file()
    params = yaml.safe_load(params_file.read_text())
    params["papers"]["pacer"]["smoke"]["seed"] += 1
    params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    edited = data.current_hashes(stages)
    assert edited == _dvc_answer(stages)
    assert edited[root_stages[1].target] is None and edited[root_stages[0].target] == fresh[root_stages[0].target]

    # a data file of the variant changed on disk: out of date
    next(p for p in sorted(variant.out_dir.rglob("*")) if p.is_file()).write_bytes(b"changed")
    changed = data.current_hashes(stages)
    assert changed == _dvc_answer(stages) and changed[variant.target] is None
    assert changed[root_stages[0].target] == fresh[root_stages[0].target]
