"""Training: the torch side, the only modules that import torch: the loader (`loader`), the varlen
attention kernels (`attention`) and the guard that accepts a model for packed rows (`guard`)."""

import importlib.util

# Whichever training module is imported first: from then on, a model loaded from a checkpoint that prepare()
# marked refuses packed rows until it is prepared again (prepared.py). Without torch there is no model to watch,
# and `decode` (the row kernel, numpy) still imports: a build-only install asks which decoder it has.
if importlib.util.find_spec("torch") is not None:
    from . import prepared  # noqa: F401
