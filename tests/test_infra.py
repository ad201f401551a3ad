"""infra/ files agree with the code, the hostfile is validated, and a DVC remote round trip restores the data."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys

import pytest
import yaml

from flows import pipeline, serve
from models import registry
from tasks.train import launcher_command, read_hostfile
from tests.conftest import PROJECT


def test_prefect_yaml_matches_the_flows():
    config = yaml.safe_load((PROJECT / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in config["deployments"]}
    for deployment in by_name.values():
        module, func = deployment["entrypoint"].split(":")
        assert module == "flows/pipeline.py"
        flow = getattr(pipeline, func)
        assert set(deployment["parameters"]) <= set(inspect.signature(flow.fn).parameters)
        assert deployment["work_pool"]["name"] == "paperline-process"
    assert by_name["nightly"]["schedules"][0]["cron"] == serve.DEFAULT_CRON
    assert by_name["on-demand"]["parameters"]["paper"] in registry.papers()


def test_compose_services_bind_loopback_and_take_secrets_from_env():
    compose = yaml.safe_load((PROJECT / "infra" / "compose.yaml").read_text())
    assert {"postgres", "minio", "mlflow", "prefect-server", "prefect-worker"} <= set(compose["services"])
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    text = (PROJECT / "infra" / "compose.yaml").read_text()
    assert "--app-name basic-auth" in text and "PASSWORD: ${" in text


def test_hostfile_validation_and_launcher(tmp_path):
    good = tmp_path / "hosts"
    good.write_text("# two machines\nnode-a slots=8\nnode-b slots=4  # smaller\n")
    assert read_hostfile(good) == {"node-a": 8, "node-b": 4}
    command = launcher_command(12, tmp_path / "spec.json", str(good))
    assert command[2] == "deepspeed.launcher.runner" and f"--hostfile={good}" in command
    assert launcher_command(2, tmp_path / "spec.json", None)[2] == "torch.distributed.run"
    for text, message in (("# nothing\n", "names no hosts"), ("node-a 8\n", "line 1"), ("n slots=0\n", "line 1")):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(registry.ConfigError, match=message):
            read_hostfile(bad)
    with pytest.raises(registry.ConfigError, match="does not exist"):
        read_hostfile(tmp_path / "missing")


def test_dvc_push_pull_round_trip_to_a_folder_remote(workspace, tmp_path):
    def dvc(*args):
        out = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=workspace, capture_output=True, text=True)
        assert out.returncode == 0, f"dvc {' '.join(args)}:\n{out.stdout}\n{out.stderr}"

    dvc("repro", "prepare@sei")
    table = workspace / "data" / "sei" / "samples.parquet"
    original = table.read_bytes()
    dvc("remote", "add", "-d", "shared", str(tmp_path / "remote"))
    dvc("push", "prepare@sei")
    shutil.rmtree(workspace / ".dvc" / "cache")
    shutil.rmtree(workspace / "data" / "sei")
    dvc("pull", "prepare@sei")
    assert table.read_bytes() == original


def test_cli_rejects_an_empty_hostfile_with_exit_2(workspace, tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    empty = tmp_path / "hostfile"
    empty.write_text("# nobody\n")
    result = CliRunner().invoke(app, ["run", "sei", "--hostfile", str(empty)])
    assert result.exit_code == 2 and "names no hosts" in result.output
    assert not (workspace / "runs").exists()
