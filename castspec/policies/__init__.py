"""Tree policies: chain, EAGLE-2 and CAST. Pure functions from drafter scores (and, for CAST, a cost table) to
which nodes to grow and verify; no model code, testable without a model."""
