"""Synthetic inputs shared by several test files."""

from __future__ import annotations


def flat_costs():
    """A synthetic table on which extra tokens are cheap, so that CAST grows real trees."""
    from castspec.costs.table import CostGrid, CostTable

    tokens = list(range(1, 65))
    grid = CostGrid([1, 8], [16, 8192], tokens, [[[1.0 + 0.01 * n * b for n in tokens]] * 2 for b in (1, 8)])
    draft = CostGrid([1, 8], [16, 8192], tokens, [[[0.05 + 0.01 * n * b for n in tokens]] * 2 for b in (1, 8)])
    return CostTable({"target": {}}, grid, draft)
