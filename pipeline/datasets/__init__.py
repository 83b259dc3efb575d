"""Problem sources: rows of a local file checked into ``pipeline.records.Problem`` (``problems``),
the benchmark loaders by name (``loaders``: GSM8K, MATH, SAT-MATH, ...), the structured fields of
their records (``fields``) and the shipped copies under data/benchmarks/ (``copies``)."""
