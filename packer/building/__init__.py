"""Building: source → format → tokenize → mix → spill → plan → write → commit, end to end in `pipeline`.
Never imports `checking` or `training` (the build never needs torch)."""

import logging


class _TorchAbsentAdvisory(logging.Filter):
    """Without torch, `import transformers` warns "PyTorch was not found. Models won't be available and
    only tokenizers, configuration and file/data utilities can be used": exactly what a build uses (it
    never imports torch), so beside "building never imports torch" the line reads as a fault. Only that
    record is dropped; every other transformers message passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found.")


# on the logger transformers' __init__ warns on, before the build path first imports transformers (also
# in a spawned worker, which imports this package to unpickle its encoder)
logging.getLogger("transformers").addFilter(_TorchAbsentAdvisory())
