"""packer: pack fine-tuning data once, offline, into Arrow shards that train without padding or collation.

Importing packer does not import torch: the torch side (``PackedDataset``, ``make_dataloader``,
``prepare``) lives in ``packer.loader`` and ``packer.attention`` and is imported on first use.
"""

__version__ = "0.1.0"

from .build import BuildResult, build
from .config import BuildConfig
from .errors import (
    ConfigError,
    OutputError,
    PackerError,
    RecordError,
    ShardFormatError,
    SourceError,
    TokenizerError,
)
from .plan import Plan

_TORCH_SIDE = {
    "PackedDataset": "loader",
    "PackedDataLoader": "loader",
    "make_dataloader": "loader",
    "prepare": "attention",
}


def __getattr__(name: str):
    if name in _TORCH_SIDE:
        import importlib

        return getattr(importlib.import_module(f".{_TORCH_SIDE[name]}", __name__), name)
    raise AttributeError(f"module 'packer' has no attribute {name!r}")


__all__ = [
    "BuildConfig",
    "BuildResult",
    "ConfigError",
    "OutputError",
    "PackedDataLoader",
    "PackedDataset",
    "PackerError",
    "Plan",
    "RecordError",
    "ShardFormatError",
    "SourceError",
    "TokenizerError",
    "__version__",
    "build",
    "make_dataloader",
    "prepare",
]
