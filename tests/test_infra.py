"""infra/ files agree with the code, the hostfile is validated, and a DVC remote round trip restores the data."""

from __future__ import annotations

import inspect
import json
import shutil
import subprocess
import sys

import pytest
import yaml
from prefect.utilities.schema_tools.validation import validate
from prefect.utilities.templating import apply_values, find_placeholders

from flows import deployed, serve
from models import registry
from tasks.train import launcher_command, read_hostfile
from tests.conftest import PROJECT


def test_deployments_run_the_pipeline_flows_by_name():
    """A deployment's flow takes names and resolves them when it runs; under the same flow name as the pipeline's
    own (deployments stay `paper-pipeline/<id>` and `suite/nightly`), with every name the resolver reads."""
    from flows import pipeline

    assert deployed.paper.name == pipeline.paper_pipeline.name == "paper-pipeline"
    assert deployed.nightly.name == pipeline.suite.name == "suite"
    assert list(inspect.signature(pipeline.paper_pipeline.fn).parameters) == ["request", "force"]
    assert list(inspect.signature(pipeline.suite.fn).parameters) == ["requests", "force", "parallel"]


def test_prefect_yaml_matches_the_flows():
    config = yaml.safe_load((PROJECT / "prefect.yaml").read_text())
    by_name = {d["name"]: d for d in config["deployments"]}
    for deployment in by_name.values():
        module, func = deployment["entrypoint"].split(":")
        assert module == "flows/deployed.py"  # the flows that take names and resolve them at run time
        flow = getattr(deployed, func)
        assert set(deployment["parameters"]) <= set(inspect.signature(flow.fn).parameters)
        pool = deployment["work_pool"]
        if pool["name"] == "paperline-process":
            assert not pool.get("job_variables")
        else:  # container pools: the deployment's job variables are ones the pool's template declares, well typed
            variables = _pool_template(pool["name"])["variables"]
            assert set(pool["job_variables"]) <= set(variables["properties"]), deployment["name"]
            assert not validate(pool["job_variables"], variables, ignore_required=True), deployment["name"]
    assert by_name["nightly"]["schedules"][0]["cron"] == serve.DEFAULT_CRON
    assert by_name["on-demand"]["parameters"]["paper"] in registry.papers()


POOL_TEMPLATES = {"paperline-docker": "docker.json", "paperline-k8s": "kubernetes.json"}


def _pool_template(pool: str) -> dict:
    return json.loads((PROJECT / "infra" / "pools" / POOL_TEMPLATES[pool]).read_text())


def _render(pool: str, job_variables: dict) -> dict:
    """What a worker of that pool builds for a flow run: the template's defaults, overridden by the deployment's."""
    template = _pool_template(pool)
    values = {name: spec["default"] for name, spec in template["variables"]["properties"].items()
              if spec.get("default") is not None}
    return apply_values(template["job_configuration"], {**values, **job_variables})


@pytest.mark.parametrize("pool", sorted(POOL_TEMPLATES))
def test_pool_templates_use_only_declared_variables(pool):
    template = _pool_template(pool)
    used = {p.name for p in find_placeholders(template["job_configuration"])}
    assert used <= set(template["variables"]["properties"]), used - set(template["variables"]["properties"])


def test_full_gpu_deployment_renders_a_kubernetes_job_with_gpus_and_the_project_volume():
    config = yaml.safe_load((PROJECT / "prefect.yaml").read_text())
    (deployment,) = [d for d in config["deployments"] if d["name"] == "full-gpu"]
    full = registry.resolve(deployment["parameters"]["paper"], "full", None, PROJECT / "params.yaml")
    # the GPUs are not fixed in the deployment: a run passes its plan's (`paperline plan <id> --gpus`, one per rank)
    assert "gpus" not in deployment["work_pool"]["job_variables"]
    job = _render("paperline-k8s", {**deployment["work_pool"]["job_variables"], "gpus": full.ranks})["job_manifest"]
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == full.ranks
    assert container["image"] == "paperline:latest" and container["workingDir"] == "/opt/paperline"
    assert job["metadata"]["namespace"] == "paperline"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    secrets = {e["secretRef"]["name"] for e in container["envFrom"]}
    # ... and the worker manifest creates that claim and that secret's consumer, for that pool, with rights to Jobs
    manifests = list(yaml.safe_load_all((PROJECT / "infra" / "k8s" / "worker.yaml").read_text()))
    kinds = {m["kind"]: m for m in manifests}
    assert claims == {kinds["PersistentVolumeClaim"]["metadata"]["name"]}
    worker = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert worker["command"][worker["command"].index("--pool") + 1] == "paperline-k8s"
    assert secrets == {e["secretRef"]["name"] for e in worker["envFrom"]}
    (jobs_rule,) = [r for r in kinds["Role"]["rules"] if "jobs" in r["resources"]]
    assert {"create", "delete", "watch"} <= set(jobs_rule["verbs"])
    assert {m["metadata"]["namespace"] for m in manifests} == {"paperline"}


def test_dockerfile_installs_the_locked_versions():
    text = (PROJECT / "infra" / "Dockerfile").read_text()
    torch_pin = next(d for d in _project_dependencies() if d.startswith("torch=="))
    assert torch_pin in text and "-c constraints.txt -e ." in text


def _project_dependencies() -> list[str]:
    import tomllib

    return tomllib.loads((PROJECT / "pyproject.toml").read_text())["project"]["dependencies"]


def test_compose_services_bind_loopback_and_take_secrets_from_env():
    compose = yaml.safe_load((PROJECT / "infra" / "compose.yaml").read_text())
    assert {"postgres", "minio", "mlflow", "prefect-server", "prefect-worker"} <= set(compose["services"])
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)
    text = (PROJECT / "infra" / "compose.yaml").read_text()
    assert "--app-name basic-auth" in text and "PASSWORD: ${" in text
    # the init script creates every database the services connect to
    databases = compose["services"]["postgres"]["environment"]["POSTGRES_MULTIPLE_DATABASES"].split(",")
    assert {"mlflow", "prefect"} <= set(databases)
    assert "@postgres:5432/mlflow" in text and "@postgres:5432/prefect" in text
    script = PROJECT / "infra" / "initdb" / "create-databases.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


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
