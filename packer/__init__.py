"""packer: pack fine-tuning data once, offline, into Arrow shards that train without padding or collation.

Importing packer does not import torch; the torch side lives in ``packer.loader`` and
``packer.attention``.
"""

__version__ = "0.1.0"

from .build import BuildResult, build  # noqa: E402
from .config import BuildConfig  # noqa: E402
from .errors import (  # noqa: E402
    ConfigError,
    OutputError,
    PackerError,
    RecordError,
    ShardFormatError,
    SourceError,
    TokenizerError,
)
from .plan import Plan  # noqa: E402

__all__ = [
    "BuildConfig",
    "BuildResult",
    "ConfigError",
    "OutputError",
    "PackerError",
    "Plan",
    "RecordError",
    "ShardFormatError",
    "SourceError",
    "TokenizerError",
    "__version__",
    "build",
]
