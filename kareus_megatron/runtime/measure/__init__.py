"""The measurement path: per-iteration time and energy per rank, per-instruction times."""
