import math

import pytest

from infinigen import ConfigError, InfiniGenConfig


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": -0.1},
        {"alpha": float("nan")},
        {"partial_ratio": 0.0},
        {"partial_ratio": 1.5},
        {"budget": 0.0},
        {"budget": 1.01},
        {"budget_tokens": 0},
        {"min_tokens": 0},
        {"dense_layers": 0},
        {"aggregation": "mean"},
        {"policy": "h2o-typo"},
        {"kv_dtype": "int8"},
        {"calibration_tokens": 4},
        {"sinks": -1},
        {"recent_ratio": 1.5},
        {"page_tokens": 0},
        {"layer_alpha": {3: -1.0}},
        {"layer_alpha": {"3": 1.0}},
        {"policy": "int4", "tier": "disk"},
        {"policy": "h2o", "host_capacity": 0.5},
    ],
)
def test_bad_values_are_refused(kwargs):
    with pytest.raises(ConfigError):
        InfiniGenConfig(**kwargs)


def test_edges_are_accepted():
    cfg = InfiniGenConfig(alpha=math.inf, partial_ratio=1.0, budget=1.0)
    assert cfg.to_dict()["alpha"] == "inf"
    assert InfiniGenConfig(alpha=0.0, partial_ratio=0.01, budget=1e-3).alpha == 0.0
