"""packer: pack fine-tuning data once, offline, into Arrow shards that train without padding or collation.

Importing packer imports nothing heavy: every name below is loaded on first use (PEP 562), so the
``packer`` command can take Ctrl-C from its first moment (see ``packer/__main__.py``) and
``import packer`` never imports torch: the torch side (``PackedDataset``, ``make_dataloader``,
``prepare``) lives in ``packer.training`` (``loader``, ``attention``: the kernels, ``guard``).
"""

import importlib

__version__ = "0.1.0"

_WHERE = {
    "BuildConfig": "contract.config",
    "BuildResult": "building.pipeline",
    "build": "building.pipeline",
    "Plan": "planning.plan",
    "ConfigError": "errors",
    "OutputError": "errors",
    "PackerError": "errors",
    "RecordError": "errors",
    "ShardFormatError": "errors",
    "SourceError": "errors",
    "TokenizerError": "errors",
    "PackedDataset": "training.loader",
    "PackedDataLoader": "training.loader",
    "make_dataloader": "training.loader",
    "prepare": "training.guard",
    "read_manifest": "contract.schema",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'packer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = ["__version__", *sorted(_WHERE)]
