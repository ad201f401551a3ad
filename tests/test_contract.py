"""The contract, the registry, params validation and the CLI's handling of bad input."""

from __future__ import annotations

import math

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from models import registry
from models.contract import Claim, Compare, Paper
from tests.conftest import PROJECT


def test_registry_matches_model_files_and_params():
    ids = set(registry.papers())
    framework = {"__init__", "contract", "registry", "verdicts", "inputs"}
    files = {p.stem for p in (PROJECT / "models").glob("*.py")} - framework
    assert ids == files
    params = yaml.safe_load((PROJECT / "params.yaml").read_text())["papers"]
    assert set(params) == ids, "every registered paper needs a params.yaml section (and the DVC foreach uses it)"
    for pid, paper in registry.papers().items():
        assert isinstance(paper, Paper) and paper.id == pid
        for profile in registry.PROFILES:
            p = registry.resolve(pid, profile, None, PROJECT / "params.yaml")
            assert isinstance(p.seed, int)


def test_dvc_stage_is_one_foreach_over_papers():
    stage = yaml.safe_load((PROJECT / "dvc.yaml").read_text())["stages"]["prepare"]
    assert stage["foreach"] == "${papers}"
    assert stage["do"]["outs"] == ["data/${key}"]
    assert "models/${key}.py" in stage["do"]["deps"]


@pytest.mark.parametrize(("overrides", "culprit"), [
    ({"no_such_key": 1}, "papers.sei.smoke.no_such_key: unknown key"),
    ({"epochs": "many"}, "papers.sei.smoke.epochs"),
    ({"epochs": 0}, "papers.sei.smoke.epochs"),
    ({"settings": [{"type": "diagonal", "eta": 0.1}]}, "papers.sei.smoke.settings.0.type"),
])
def test_bad_params_name_the_key(overrides, culprit):
    with pytest.raises(registry.ConfigError, match=culprit.replace(".", r"\.")):
        registry.resolve("sei", "smoke", overrides, PROJECT / "params.yaml")


def test_bad_id_and_profile():
    with pytest.raises(registry.ConfigError, match="unknown paper id 'nope'.*sei"):
        registry.get("nope")
    with pytest.raises(registry.ConfigError, match="unknown profile 'huge'"):
        registry.resolve("sei", "huge", None, PROJECT / "params.yaml")


def test_overrides_parse_as_yaml_scalars():
    assert registry.parse_overrides(["eta=0.3", "epochs=5", "name=x"]) == {"eta": 0.3, "epochs": 5, "name": "x"}
    with pytest.raises(registry.ConfigError, match="key=value"):
        registry.parse_overrides(["epochs"])


@pytest.mark.parametrize("args", [["run", "nope"], ["run", "sei", "--set", "epochs=-1"],
                                  ["run", "sei", "--profile", "huge"], ["run", "sei", "--set", "bogus=1"],
                                  ["run", "sei", "ldka", "--parallel", "0"]])
def test_cli_bad_input_exits_2_and_writes_nothing(workspace, args):
    before = sorted(p.relative_to(workspace) for p in workspace.rglob("*"))
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "error:" in result.output
    assert sorted(p.relative_to(workspace) for p in workspace.rglob("*")) == before


def test_claim_needs_its_metrics():
    claim = Claim(all_of=(Compare("method/a", ">", ("baseline/x/a", "baseline/y/a")), Compare("method/l", "<", "b/l")))
    with pytest.raises(KeyError, match="baseline/y/a"):
        claim.evaluate({"method/a": 1.0, "baseline/x/a": 0.0, "method/l": 0.0, "b/l": math.inf})
    threshold = Claim(all_of=(Compare("method/slope", ">=", 0.3), Compare("method/slope", "<=", 0.7)))
    assert threshold.text() == "method/slope >= 0.3 and method/slope <= 0.7"


def test_a_run_request_is_resolved_once_with_its_replicates():
    req = registry.request("sei", "smoke", {"seed": 5}, PROJECT / "params.yaml")
    assert req.replicates == 3 and req.params.seed == 5 and not req.is_default
    reps = [req.replicate(i) for i in range(req.replicates)]
    assert [r.params.seed for r in reps] == [5, 6, 7] and [r.raw["seed"] for r in reps] == [5, 6, 7]
    assert all("replicates" not in r.raw and r.params.replicates == 1 for r in reps)
    default = registry.request("sei", "smoke", None, PROJECT / "params.yaml")
    assert default.is_default and [default.replicate(i).is_default for i in range(3)] == [True, False, False]
    with pytest.raises(registry.ConfigError, match="replicates"):
        registry.request("sei", "smoke", {"replicates": 0}, PROJECT / "params.yaml")


def test_an_ask_is_what_the_cache_check_and_the_flows_both_read():
    """The CLI's cached-rerun check reads the unvalidated ask; the flows read the request it resolves to: the same
    raw params and the same replicates, from one resolver."""
    ask = registry.ask("sei", "smoke", ["seed=5", "replicates=2"], PROJECT / "params.yaml")
    req = ask.resolve()
    assert req.raw == ask.raw and req.replicates == ask.replicates == 2 and req.is_default == ask.is_default
    assert [ask.replicate_raw(i) for i in range(2)] == [req.replicate(i).raw for i in range(2)]
    assert req == registry.request("sei", "smoke", {"seed": 5, "replicates": 2}, PROJECT / "params.yaml")
    unknown = registry.ask("sei", "smoke", {"no_such_key": 1}, PROJECT / "params.yaml")  # checked on validation
    with pytest.raises(registry.ConfigError, match="papers.sei.smoke.no_such_key: unknown key"):
        unknown.resolve()
    with pytest.raises(registry.ConfigError, match="unknown profile"):
        registry.ask("sei", "huge", None, PROJECT / "params.yaml")


def test_malformed_params_yaml_is_a_config_error(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("papers: [unclosed\n")
    with pytest.raises(registry.ConfigError, match="not valid YAML"):
        registry.resolve("sei", "smoke", None, bad)
    bad.write_text("papers:\n  sei:\n    test: {}\n")
    with pytest.raises(registry.ConfigError, match="missing section papers.sei.smoke"):
        registry.resolve("sei", "smoke", None, bad)


@pytest.mark.parametrize("paper_id", list(registry.papers()))
def test_params_models_reject_any_unknown_key_and_accept_their_profiles(paper_id):
    """Property test: any key a paper does not declare is rejected, by name; the declared profiles validate."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    paper = registry.get(paper_id)
    smoke = yaml.safe_load((PROJECT / "params.yaml").read_text())["papers"][paper_id]["smoke"]
    known = set(paper.Params.model_fields)

    @settings(max_examples=40, deadline=None)
    @given(key=st.from_regex(r"[a-z_]{1,12}", fullmatch=True).filter(lambda k: k not in known),
           value=st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=5), st.booleans()))
    def check(key, value):
        with pytest.raises(registry.ConfigError, match=rf"\.{key}: unknown key"):
            registry.validate(paper, {**smoke, key: value}, where=f"papers.{paper_id}.smoke")

    check()


def test_papers_persist_through_the_context_only():
    """One persistence path: `fit` saves each phase's network (`ctx.save_network` one train chose itself), and
    `ctx.save_record` what else evaluate needs; evaluate reads them with `ctx.network` / `ctx.record`. A paper that
    wrote its own files with torch.save would bypass the registered model and the record's atomic write."""
    import ast

    offenders = []
    for path in sorted((PROJECT / "models").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("torch.save", "torch.load"):
                reads_user_file = ast.unparse(node.func) == "torch.load" and "out_dir" not in ast.unparse(node)
                if not reads_user_file:  # torch.load of a path the user gave (an input checkpoint) is allowed
                    offenders.append(f"{path.relative_to(PROJECT)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, offenders


def test_save_record_and_network_round_trip(tmp_path):
    import torch

    from tasks.context import EvalContext, TrainContext

    params = registry.resolve("sei", "test", None, PROJECT / "params.yaml")
    net = torch.nn.Linear(3, 2)
    train = TrainContext(params, tmp_path, tmp_path)
    train.save_network("chosen", net)
    train.save_record("stats", {"steps": 7, "curve": torch.arange(3.0)})
    TrainContext(params, tmp_path, tmp_path / "other", rank=1).save_record("stats", {"steps": 0})  # rank 1: nothing
    ctx = EvalContext(params, tmp_path, tmp_path, tmp_path)
    loaded = ctx.network("chosen")
    assert not loaded.training and all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                                          net.state_dict().values(), strict=True))
    record = ctx.record("stats")
    assert record["steps"] == 7 and torch.equal(record["curve"], torch.arange(3.0))
    assert ctx.records() == ["stats"] and not (tmp_path / "other").exists()
    with pytest.raises(FileNotFoundError, match="saved: \\['record.stats.pt'\\]"):
        ctx.record("missing")
