"""python -m perf.async_cluster_sim --config FILE [key=value ...] [--docs-image]: the row alone."""

from perf.async_cluster_sim import main

main()
