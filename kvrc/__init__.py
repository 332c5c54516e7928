"""kvrc: the KV reuse coordinator. `kvrc.v1` holds the generated wire protocol."""

__version__ = "0.1.0"
