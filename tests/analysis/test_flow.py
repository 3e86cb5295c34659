"""Exact attention flow (Abnar & Zuidema 2020) against networkx and hand-computed max-flows."""

import numpy as np
import pytest

from headscope.analysis.flow import attention_flow, attention_flow_all, flow_reference_networkx
from headscope.analysis.rollout import augmented_attention


def random_causal(rng, n_layers, n_heads, n, alpha=1.0, sink=0.0):
    """Dirichlet rows; ``sink`` adds that much mass on key 0 (as real models do) before renormalising."""
    a = np.zeros((n_layers, n_heads, n, n))
    for i in range(n):
        a[:, :, i, : i + 1] = rng.dirichlet(np.full(i + 1, alpha), size=(n_layers, n_heads))
    a[:, :, :, 0] += sink
    return a / a.sum(axis=-1, keepdims=True)


def assert_flows_equal(got, expected):
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)


# Three layers, one head, three tokens; residual 0 so the capacities are these numbers.
#   layer 1: row 1 = [.6, .4],   row 2 = [0, .2, .8]
#   layer 2: row 1 = [0, 1],     row 2 = [0, .45, .55]
#   layer 3: the identity.
CHAIN = np.array(
    [
        [[[1.0, 0, 0], [0.6, 0.4, 0], [0, 0.2, 0.8]]],
        [[[1.0, 0, 0], [0, 1.0, 0], [0, 0.45, 0.55]]],
        [np.eye(3)],
    ]
)


def test_single_path_gives_its_bottleneck():
    flow = attention_flow(CHAIN, 2, residual=0.0)
    # Input 0 reaches output 2 by one path only: (0,0) -.6-> (1,1) -.45-> (2,2) -1-> (3,2).
    assert flow[0] == pytest.approx(0.45, abs=1e-15)
    # Input 1: (0,1) -.4-> (1,1) -.45-> (2,2) carries .4, (0,1) -.2-> (1,2) -.55-> (2,2) carries .2.
    assert flow[1] == pytest.approx(0.6, abs=1e-15)
    # Input 2: (0,2) -.8-> (1,2) -.55-> (2,2) -1-> (3,2).
    assert flow[2] == pytest.approx(0.55, abs=1e-15)
    assert_flows_equal(flow, flow_reference_networkx(CHAIN, 2, residual=0.0))


def test_one_layer_is_the_edge_capacity():
    patterns = random_causal(np.random.default_rng(5), 1, 3, 7)
    caps = augmented_attention(patterns)[0]
    np.testing.assert_allclose(attention_flow_all(patterns), caps, atol=1e-15)


@pytest.mark.parametrize("seed", range(8))
def test_equals_networkx_on_random_small_graphs(seed):
    rng = np.random.default_rng(seed)
    n_layers, n_heads, n = int(rng.integers(2, 6)), int(rng.integers(1, 4)), int(rng.integers(2, 9))
    patterns = random_causal(rng, n_layers, n_heads, n, alpha=[0.1, 1.0, 5.0][seed % 3], sink=seed % 2)
    options = [
        {},
        {"residual": 0.0},
        {"residual": 0.3, "fusion": "max"},
        {"fusion": "min", "discard_ratio": 0.5},
        {"drop_sinks": (0,)},
    ][seed % 5]
    flows = attention_flow_all(patterns, **options)
    assert np.all(np.triu(flows, k=1) == 0)
    for target in range(n):
        assert_flows_equal(flows[target], flow_reference_networkx(patterns, target, **options))


@pytest.mark.parametrize(
    ("options", "sources"),
    [({}, [0, 1, 7, 16, 23]), ({"fusion": "max", "drop_sinks": (0,)}, [1, 12])],
)
def test_equals_networkx_on_model_sized_graph(options, sources):
    # SmolLM2-135M's shape (30 layers, 9 heads) at 24 tokens, with sink-heavy heads.
    patterns = random_causal(np.random.default_rng(11), 30, 9, 24, alpha=0.3, sink=2.0).astype(np.float16)
    got = attention_flow(patterns, **options)
    expected = flow_reference_networkx(patterns, sources=sources, **options)
    assert_flows_equal(got[sources], expected[sources])


def test_all_rows_equal_single_targets_and_normalise():
    patterns = random_causal(np.random.default_rng(4), 5, 2, 9, alpha=0.5)
    flows = attention_flow_all(patterns)
    for target in (0, 4, 8):
        assert_flows_equal(flows[target], attention_flow(patterns, target))
    assert_flows_equal(attention_flow(patterns, -2), flows[7])
    normalised = attention_flow_all(patterns, normalize=True)
    np.testing.assert_allclose(normalised.sum(axis=1), 1.0, atol=1e-12)
    assert_flows_equal(normalised[8], flows[8] / flows[8].sum())


def test_flow_is_bounded_by_the_inputs_and_outputs_capacity():
    patterns = random_causal(np.random.default_rng(6), 6, 3, 12, alpha=0.2)
    caps = augmented_attention(patterns)
    flow = attention_flow(patterns)
    # No more than leaves the input in layer 1, nor more than enters the output in the last layer.
    assert np.all(flow <= caps[0].sum(axis=0) + 1e-12)
    assert np.all(flow <= caps[-1][-1].sum() + 1e-12)
    assert flow[-1] > 0


def test_pure_residual_keeps_each_token_to_itself():
    patterns = random_causal(np.random.default_rng(7), 4, 2, 5)
    np.testing.assert_allclose(attention_flow_all(patterns, residual=1.0), np.eye(5), atol=1e-15)


def test_progress_and_target_validation():
    patterns = random_causal(np.random.default_rng(8), 3, 2, 6)
    seen = []
    attention_flow_all(patterns, progress=seen.append)
    assert seen == sorted(seen) and seen[-1] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="target must be an output position"):
        attention_flow(patterns, 6)
    with pytest.raises(ValueError, match="fusion must be one of"):
        attention_flow(patterns, fusion="sum")


def test_sources_subset_and_single_token():
    patterns = random_causal(np.random.default_rng(9), 4, 2, 7)
    subset = attention_flow(patterns, 5, sources=[1, 3, 6])
    full = attention_flow(patterns, 5)
    assert_flows_equal(subset[[1, 3]], full[[1, 3]])
    assert subset[6] == 0 and np.isnan(subset[[0, 2, 4]]).all()
    with pytest.raises(ValueError, match="normalize=True needs"):
        attention_flow(patterns, sources=[1], normalize=True)
    with pytest.raises(ValueError, match="outside the sequence"):
        attention_flow(patterns, sources=[7])
    np.testing.assert_allclose(attention_flow(np.ones((3, 2, 1, 1))), [1.0])
