"""The FlashAttention workbook's kernels: one module a chapter, plus the NumPy oracle
(``reference``), a small runtime (``runtime``) and the bench (``python -m kernels``).

Importing this package decides, once and before Numba is imported, whether kernels run
on the GPU or in the Numba CUDA simulator (see ``kernels.base.runtime``).
"""

import sys

if sys.argv[:1] == ["-m"]:       # ``python -m kernels ...``: first use installs what is missing
    from kernels._bootstrap import ensure

    ensure()

from kernels.base import runtime as runtime  # noqa: F401,E402  (selects GPU or simulator first)

DEVICE = runtime.DEVICE
