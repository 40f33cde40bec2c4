"""Fixtures: two small indexed datasets (a long-tailed one and a short-document one)."""

import numpy as np
import pytest

from tests.integration.indexed_data import write_dataset


@pytest.fixture
def datasets(tmp_path):
    rng = np.random.default_rng(0)
    long_tail = np.minimum(rng.pareto(1.2, 40) * 60 + 8, 900).astype(np.int64)
    short = rng.integers(5, 60, 30)
    return ([write_dataset(str(tmp_path / "long"), long_tail, 0), write_dataset(str(tmp_path / "short"), short, 1)],
            [long_tail, short])
