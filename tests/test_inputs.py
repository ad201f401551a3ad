"""Declared inputs (issue 26): every full profile names the real data it reads or says why it reads none; a missing
input stops a run before any work with the commands that bring it in; `paperline data` shows them; a variant's
prepare stage depends on them. Reads params.yaml only: no paper runs here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows import data_inputs
from models import registry
from models.contract import InputSpec
from models.inputs import PARTLY_SYNTHETIC, SYNTHETIC, how_to_get, input_path, require_present, statuses
from tasks.fixtures import REAL_FORMAT, real_format

PROJECT = Path(__file__).resolve().parents[1]
PAPERS = yaml.safe_load((PROJECT / "params.yaml").read_text())["papers"]
# params naming a file or folder a loader opens: each must be a declared input of its profile
PATH_KEYS = ("dataset_dir", "jsonl_path", "qqp_path", "amass_dir", "body_model", "dt4d_dir", "train_dir", "test_dirs",
             "folders", "sdf_path", "vg_dir", "data_root", "mmcif_dir", "clip_dir", "dataset_path", "passages_path",
             "eval_path", "external_path", "tsp_file", "minelib_file", "d4rl", "victim_path", "backbone_weights",
             "checkpoint_path")


def _spec(path: str, url: str = "https://example.org/x.h5") -> dict:
    return {"path": path, "format": "hdf5", "url": url, "license": "CC BY 4.0"}


@pytest.mark.parametrize("paper_id", sorted(PAPERS))
def test_full_profile_names_its_inputs_or_says_why_none(paper_id):
    declared = PAPERS[paper_id]["full"].get("inputs") or {}
    for spec in declared.values():
        InputSpec.model_validate(spec)
    assert bool(declared) != (paper_id in SYNTHETIC), \
        f"{paper_id}: declare the full profile's inputs in params.yaml, or say in models/inputs.SYNTHETIC why none"
    if paper_id in SYNTHETIC:
        assert SYNTHETIC[paper_id].strip()
    for profile in ("test", "smoke"):  # they run anywhere, CI included: nothing to bring in
        assert not PAPERS[paper_id][profile].get("inputs"), f"{paper_id}.{profile} must read no external data"


@pytest.mark.parametrize("paper_id", sorted(PAPERS))
def test_every_path_a_full_profile_reads_is_declared(paper_id):
    full = PAPERS[paper_id]["full"]
    paths = {spec["path"].rstrip("/") for spec in (full.get("inputs") or {}).values()}
    for key in PATH_KEYS:
        value = full.get(key)
        for path in value if isinstance(value, list) else value.values() if isinstance(value, dict) else [value]:
            if path:
                assert str(path).rstrip("/") in paths, f"{paper_id}.full.{key}={path!r} is not a declared input"
                assert not Path(path).is_absolute(), "inputs live under data/external/ (dvc import-url / dvc add)"


def test_synthetic_names_only_papers():
    assert set(SYNTHETIC) <= set(PAPERS)
    for pid in PARTLY_SYNTHETIC:  # a note on a profile that reads inputs
        assert PAPERS[pid]["full"].get("inputs") and pid not in SYNTHETIC


def test_how_to_get_a_direct_file_an_archive_and_a_landing_page():
    assert how_to_get("a", InputSpec(**_spec("data/external/a.h5"))) == \
        ["dvc import-url https://example.org/x.h5 data/external/a.h5"]
    archive = how_to_get("c", InputSpec(**_spec("data/external/c", "https://example.org/c.tar.gz")))
    assert "unpack" in archive[0] and archive[-1] == "dvc add data/external/c"
    page = how_to_get("v", InputSpec(**_spec("data/external/v", "https://example.org/datasets")))
    assert page == ["get v from https://example.org/datasets so that data/external/v holds it (hdf5)",
                    "dvc add data/external/v"]


def test_input_paths_are_relative_to_the_project_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PAPERLINE_ROOT", str(tmp_path))
    monkeypatch.chdir(PROJECT)  # not the current directory: a variant's prepare runs inside variants/
    assert input_path("data/external/x") == tmp_path / "data" / "external" / "x"
    assert input_path("/abs/x") == Path("/abs/x")


def test_missing_input_is_a_config_error_naming_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PAPERLINE_ROOT", str(tmp_path))
    raw = {"inputs": {"vg150": _spec("data/external/vg150", "https://example.org/vg"),
                      "qm9": _spec("data/external/qm9.sdf", "https://example.org/qm9.sdf")}}
    with pytest.raises(registry.ConfigError) as err:
        require_present("ds_net", raw)
    text = str(err.value)
    assert "vg150: data/external/vg150" in text and "dvc add data/external/vg150" in text
    assert "dvc import-url https://example.org/qm9.sdf data/external/qm9.sdf" in text
    (tmp_path / "data" / "external" / "vg150").mkdir(parents=True)  # an empty folder is not the data
    with pytest.raises(registry.ConfigError):
        require_present("ds_net", raw)
    (tmp_path / "data" / "external" / "vg150" / "VG-SGG-with-attri.h5").write_bytes(b"x")
    (tmp_path / "data" / "external" / "qm9.sdf").write_text("x")
    require_present("ds_net", raw)  # everything there: no error
    assert all(s.present and not s.tracked for s in statuses(raw))
    require_present("sei", {})  # test / smoke profiles declare nothing


def test_validated_params_work_too(tmp_path, monkeypatch):
    monkeypatch.setenv("PAPERLINE_ROOT", str(tmp_path))
    params = registry.resolve("quantile_mia", "full", None, PROJECT / "params.yaml")
    assert [s.name for s in statuses(params)] == ["cifar10"]
    with pytest.raises(registry.ConfigError, match="cifar-10-python.tar.gz"):
        require_present("quantile_mia", params)


def test_variant_prepare_stage_depends_on_the_inputs(tmp_path, monkeypatch):
    from tasks.data import stage_for

    monkeypatch.setenv("PAPERLINE_ROOT", str(tmp_path))
    (tmp_path / "data" / "external" / "vg150").mkdir(parents=True)
    paper = registry.get("ds_net")
    raw = {**PAPERS["ds_net"]["full"], "inputs": {"vg150": _spec("data/external/vg150"),
                                                  "abs": _spec("/srv/vg.h5")}}
    params = registry.validate(paper, raw, where="papers.ds_net.full")
    stage = stage_for(paper, "full", params, raw, is_default=False)
    deps = yaml.safe_load(stage.dvc_file.read_text())["stages"]["prepare"]["deps"]
    assert "../../../data/external/vg150" in deps and "/srv/vg.h5" in deps


def test_cli_data_lists_inputs_and_all_writes_the_table(tmp_path, monkeypatch):
    from flows.cli import app

    monkeypatch.setenv("PAPERLINE_ROOT", str(tmp_path))
    (tmp_path / "params.yaml").write_text((PROJECT / "params.yaml").read_text())
    one = CliRunner().invoke(app, ["data", "ds_net", "pacer"])
    assert one.exit_code == 0, one.output
    assert "vg150: data/external/vg150" in one.output and "MISSING" in one.output
    assert f"pacer (full): no inputs: {SYNTHETIC['pacer']}" in one.output
    table = CliRunner().invoke(app, ["data", "--all"])
    assert table.exit_code == 0, table.output
    assert "| paper | input | path (format) | present | how to get it |" in table.output
    report = (tmp_path / "reports" / "data.md").read_text()
    for pid in PAPERS:
        assert f"| {pid} |" in report
    smoke = CliRunner().invoke(app, ["data", "--all", "--profile", "smoke"])
    assert smoke.exit_code == 0 and "| ds_net | - | - | - | reads no file from disk |" in smoke.output
    assert (tmp_path / "reports" / "data.md").read_text() == report  # the committed table stays the full one
    bad = CliRunner().invoke(app, ["data", "no_such_paper"])
    assert bad.exit_code == 2 and "unknown paper id" in bad.output
    assert CliRunner().invoke(app, ["data"]).exit_code == 2


def test_committed_report_matches_params():
    """reports/data.md is generated: regenerate it (`paperline data --all`) when params.yaml changes."""
    committed = (PROJECT / "reports" / "data.md").read_text()
    fresh = data_inputs.table(PROJECT / "params.yaml")

    def without_present(row: str) -> list[str]:  # "present" is the view of the machine that wrote the file
        cells = re.split(r"(?<!\\)\|", row)
        return cells[:4] + cells[5:]

    assert [without_present(r) for r in committed.splitlines() if r.startswith("|")] == \
        [without_present(r) for r in fresh.splitlines()]


@pytest.mark.parametrize("paper_id", sorted(REAL_FORMAT))
def test_full_profile_data_settings_prepare_a_fixture_in_the_real_format(paper_id, tmp_path):
    """The full profile's own data settings (test-profile sizes), on a fixture in the format its inputs name
    (tasks/fixtures.py: the same fixtures the planner prepares a full profile on)."""
    _, path_key, _ = REAL_FORMAT[paper_id]
    full = PAPERS[paper_id]["full"]
    assert full.get("inputs") and full.get(path_key)
    raw = {**PAPERS[paper_id]["test"], **real_format(paper_id, full, tmp_path / "fixture")}
    paper = registry.get(paper_id)
    (tmp_path / "out").mkdir()
    paper.prepare(registry.validate(paper, raw, where=f"{paper_id}.test+full data"), tmp_path / "out")
    assert list((tmp_path / "out").glob("*.parquet"))
