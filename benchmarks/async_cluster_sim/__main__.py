"""python -m benchmarks.async_cluster_sim --config FILE [key=value ...] [--docs-image]: the row alone."""

from benchmarks.async_cluster_sim import main

main()
