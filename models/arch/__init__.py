"""The architectures: one module per family, each a decoder (or encoder) built from :mod:`mlx_engine.models.layers`
and chosen by :mod:`mlx_engine.models.registry` from the file's architecture name."""
