"""Shared TAG machinery: SBM homophily, rewiring, positional encodings against references, ego-graphs, loader."""

from __future__ import annotations

import networkx as nx
import numpy as np
import torch

from models.common import graphs as G


def test_sbm_probs_hit_the_target_homophily_and_degree():
    sizes = [200, 200, 200]
    labels, edges = G.sbm_graph(sizes, G.sbm_probs(sizes, 0.8, 8.0), seed=0)
    intra = (labels[edges[:, 0]] == labels[edges[:, 1]]).mean()
    assert abs(intra - 0.8) < 0.03 and abs(2 * len(edges) / 600 - 8.0) < 0.5
    assert (edges[:, 0] < edges[:, 1]).all()


def test_rewire_changes_exactly_the_requested_share():
    _, edges = G.sbm_graph([50, 50], G.sbm_probs([50, 50], 0.9, 6.0), seed=1)
    new, is_noise = G.rewire_edges(edges, 100, 0.25, np.random.default_rng(0))
    assert is_noise.sum() == round(0.25 * len(edges)) and (new[~is_noise] == edges[~is_noise]).all()
    assert len({tuple(e) for e in new.tolist()}) == len(new)  # no duplicate edges


def test_random_walk_pe_known_values_on_a_cycle():
    ei = G.edge_index(np.asarray(list(nx.cycle_graph(12).edges())), 12)
    pe = G.random_walk_pe(ei, 12, 4)  # return probabilities of a walk on a long cycle: 0, 1/2, 0, 3/8
    assert torch.allclose(pe, torch.tensor([0.0, 0.5, 0.0, 0.375]).expand(12, -1), atol=1e-6)


def test_laplacian_pe_are_eigenvectors_of_networkx_normalised_laplacian():
    g = nx.connected_watts_strogatz_graph(40, 4, 0.3, seed=0)
    edges = np.asarray(sorted(g.edges()))
    pe = G.laplacian_pe(edges, 40, 5)
    lap = nx.normalized_laplacian_matrix(g, nodelist=range(40)).toarray()
    lam = np.linalg.eigvalsh(lap)[1:6]
    assert np.allclose(lap @ pe, pe * lam[None, :], atol=1e-6)
    assert np.allclose(pe.T @ pe, np.eye(5), atol=1e-5)
    assert (pe[np.abs(pe).argmax(0), np.arange(5)] > 0).all()  # the fixed sign
    assert G.laplacian_pe(np.array([[0, 1], [1, 2]]), 3, 5).shape == (3, 5)  # padded when n <= k


def test_ego_nodes_are_within_hops_centre_first():
    g = nx.barabasi_albert_graph(80, 2, seed=0)
    adj = G.adjacency_lists(np.asarray(g.edges()), 80)
    nodes = G.ego_nodes(adj, 5, 2, 30, np.random.default_rng(0))
    dist = nx.single_source_shortest_path_length(g, 5, cutoff=2)
    assert nodes[0] == 5 and len(nodes) == min(30, len(dist)) and set(nodes) <= set(dist)
    assert [dist[v] for v in nodes] == sorted(dist[v] for v in nodes)  # rings in order
    local = G.induced_edges(adj, nodes)
    assert all(g.has_edge(nodes[a], nodes[b]) for a, b in local.tolist())


def test_gnn_kinds_and_layer_outputs():
    ei = G.edge_index(np.asarray(list(nx.path_graph(6).edges())), 6)
    for kind in ("gcn", "gin", "gat"):
        outs = G.GNN(kind, 5, 8, 3, layers=2)(torch.randn(6, 5), ei, all_layers=True)
        assert [o.shape for o in outs] == [(6, 8), (6, 3)]


def test_texts_embeddings_and_tag_folder(tmp_path):
    rng = np.random.default_rng(0)
    texts = G.node_texts(np.array([0, 1]), [G.TOPICS["music"], G.TOPICS["law"]], 6, rng, topic_share=1.0)
    assert all(w in G.TOPICS["music"] for w in texts[0].split())
    vec = G.word_vectors(["drum", "court"], "hashed")
    assert np.allclose(vec["drum"], G.word_vectors(["drum"], "hashed")["drum"])
    emb = G.mean_text_embedding(["drum court"], vec)
    assert np.isclose(np.linalg.norm(emb), 1.0)
    G.write_tag_fixture(tmp_path, n=10)
    tag = G.load_tag_folder(tmp_path)
    assert len(tag.text) == 10 and tag.label_names == ["law", "music"] and len(tag.edges) == 20
    assert set(tag.split) == {"train", "val", "test"}
