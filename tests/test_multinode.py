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
