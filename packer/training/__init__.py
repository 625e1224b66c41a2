"""Training: the torch side, the only modules that import torch: the loader (`loader`), the varlen
attention kernels (`attention`) and the guard that accepts a model for packed rows (`guard`)."""
