"""The run's configuration: the schema (``schema``: one dataclass per stage section), the gfn
section's asynchronous-mode fields (``asynchronous``: the searchers, Ray, the buffer and weight
publication, which GFNConfig inherits), the rules a field declares for its values (``rules``: a
numeric range, a Literal's names), the loader (``loader``: YAML files, overlays and command-line
overrides, checked field by field) and the codec both the loader and the typed records use
(``codec``: values checked against their annotations)."""
