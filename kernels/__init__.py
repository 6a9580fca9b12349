"""The FlashAttention workbook's kernels: one module a chapter, plus the NumPy oracle
(``reference``), a small runtime (``runtime``) and the bench (``python -m kernels``).

Importing this package decides, once and before Numba is imported, whether kernels run
on the GPU or in the Numba CUDA simulator (see ``kernels.base.runtime``).
"""

from kernels.base import runtime as runtime  # noqa: F401  (selects GPU or simulator first)

DEVICE = runtime.DEVICE
