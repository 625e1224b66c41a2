"""Training: the torch side, the only modules that import torch: the loader (`loader`), the varlen
attention kernels (`attention`) and the guard that accepts a model for packed rows (`guard`)."""

# Whichever training module is imported first: from then on, a model loaded from a checkpoint that prepare()
# marked refuses packed rows until it is prepared again (prepared.py).
from . import prepared  # noqa: F401
