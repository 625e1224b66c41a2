"""The exception types the CLI turns into one-line messages (exit code 2).

The library raises these with a message that says what is wrong, where, and how to fix it; only the
CLI prints and exits.
"""


class PackerError(Exception):
    """Base class: a problem the user can fix, reported in one line."""


class ConfigError(PackerError):
    """Bad or contradictory options."""


class SourceError(PackerError):
    """An input that cannot be read: missing file, unreachable Hub id, malformed record."""


class RecordError(SourceError):
    """One record that cannot be formatted: missing field, wrong type, empty text.

    ``reason`` is a short key (``empty_text``, ``wrong_type``, ...) under which ``--on-error skip``
    counts the record in the manifest.
    """

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason

    def __reduce__(self):  # pickles whole, so a worker process can hand it to the parent
        return type(self), (str(self), self.reason)


class TokenizerError(PackerError):
    """A tokenizer that cannot be loaded or lacks what packer needs (EOS, chat template)."""


class OutputError(PackerError):
    """An output folder that cannot be written, or holds another build."""


class ShardFormatError(PackerError):
    """A shard folder that is incomplete, corrupted, or not of a known format version."""


class WorkerError(PackerError):
    """A worker process of a parallel build died without reporting (killed, out of memory)."""


class RemoteError(PackerError):
    """A remote build that cannot be read or written: a server that keeps failing, a shard that is no
    longer the one its manifest records. The message names the file and its URL, never credentials."""
