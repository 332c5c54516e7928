"""kvrc benchmarks: each writes machine-readable results to benchmarks/results/."""
