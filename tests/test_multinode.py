"""Multi-node for real, on one machine: two launchers ("nodes") on loopback, `--nnodes 2`, `--node_rank`, one
rendezvous; the same training bitwise as the same world size on one node. And the Kubernetes form of it."""

from __future__ import annotations

import pytest
import torch

from models import registry
from models.registry import ConfigError
from tasks.train import TrainJob, launch, launcher_command
from tests.conftest import PROJECT


def _train(tmp_path, name: str, nodes: int, monkeypatch) -> dict:
    params = registry.resolve("sei", "test", {"ranks": 2}, PROJECT / "params.yaml")
    data_dir = tmp_path / "data"
    if not data_dir.exists():
        data_dir.mkdir()
        registry.get("sei").prepare(params, data_dir)
    out_dir = tmp_path / name
    monkeypatch.setenv("PAPERLINE_NODES", str(nodes))
    launch(TrainJob("sei", params, data_dir, out_dir, run_id=None, tracking_uri=None))
    return {p.name: torch.load(p, weights_only=False)["module"].state_dict()
            for p in sorted(out_dir.glob("network.*.pt"))}


@pytest.mark.e2e
def test_two_nodes_on_loopback_train_bitwise_like_one(tmp_path, monkeypatch):
    one = _train(tmp_path, "one-node", 1, monkeypatch)
    two = _train(tmp_path, "two-nodes", 2, monkeypatch)
    assert "[launcher] new job across 2 nodes" in (tmp_path / "two-nodes" / "train.log").read_text()
    assert (tmp_path / "two-nodes" / "train.node1.log").exists()
    assert one.keys() == two.keys() and one  # every phase's trained network
    for phase in one:
        assert one[phase].keys() == two[phase].keys()
        for key in one[phase]:
            assert torch.equal(one[phase][key], two[phase][key]), (phase, key)


def test_launcher_command_per_node(tmp_path):
    spec = tmp_path / "spec.json"
    node1 = launcher_command(4, spec, None, nodes=2, node_rank=1, master_port=29555, master_addr="trainer-0.svc")
    assert "--nnodes=2" in node1 and "--node_rank=1" in node1 and "--nproc_per_node=2" in node1
    assert "--master_addr=trainer-0.svc" in node1 and "--master_port=29555" in node1
    with pytest.raises(ConfigError, match="split evenly"):
        launcher_command(3, spec, None, nodes=2)


def test_kubernetes_indexed_job_rendezvouses_like_the_loopback_nodes():
    """infra/k8s/multinode-job.yaml rendered: every placeholder filled, pods named for the rendezvous, the same
    launcher command as on one machine with the pod's completion index as node rank, the project volume of the
    worker manifest."""
    import yaml

    from tasks.train import k8s_multinode_job

    spec = "/opt/paperline/runs/sei/r1/worker_spec.json"
    service, job = k8s_multinode_job("sei-r1", ranks=8, nodes=2, spec_path=spec)
    assert "{{" not in yaml.safe_dump_all([service, job])
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 2 and job["spec"]["backoffLimit"] == 0
    pod = job["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["subdomain"] == service["metadata"]["name"] == "sei-r1"
    (container,) = pod["spec"]["containers"]
    expected = launcher_command(8, PROJECT / "x", None, 2, 0, 29500, master_addr="sei-r1-0.sei-r1")
    command = container["command"]
    assert command[0] == "python" and command[-1] == spec
    assert command[1:-1] == [a if a != "--node_rank=0" else "--node_rank=$(NODE_RANK)" for a in expected[1:-1]]
    (node_rank,) = [e for e in container["env"] if e["name"] == "NODE_RANK"]
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4  # ranks per node
    assert container["ports"][0]["containerPort"] == service["spec"]["ports"][0]["port"] == 29500
    worker = {m["kind"]: m for m in yaml.safe_load_all((PROJECT / "infra" / "k8s" / "worker.yaml").read_text())}
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {worker["PersistentVolumeClaim"]["metadata"]["name"]}
    assert {service["metadata"]["namespace"], job["metadata"]["namespace"]} == {"paperline"}
    # the worker's service account may create and watch these (a Service too, for the rendezvous names)
    rules = worker["Role"]["rules"]
    assert any("jobs" in r["resources"] for r in rules) and any("services" in r["resources"] for r in rules)
