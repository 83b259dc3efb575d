"""The run's configuration: the schema (``schema``: one dataclass per stage section), the loader
(``loader``: YAML files, overlays and command-line overrides, checked field by field) and the codec
both the loader and the typed records use (``codec``: values checked against their annotations)."""
