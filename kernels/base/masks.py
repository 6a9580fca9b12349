"""The block mask: chapter 6's input type, one keep-flag per (query tile, key tile).

It lives here, beside the runtime, because both the kernels and the oracle
(``kernels.reference``, which re-exports it) take it as input.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["BlockMask"]


@dataclass(frozen=True)
class BlockMask:
    """One keep-flag per (query tile, key tile), with the tile size it refers to.

    ``flags`` is a boolean array of shape (Tq, Tk), (H, Tq, Tk) or (B, H, Tq, Tk)
    where Tq = ceil(Nq / block_q) and Tk = ceil(Nk / block_k).
    """

    flags: np.ndarray
    block_q: int
    block_k: int

    def __post_init__(self):
        flags = np.asarray(self.flags)
        if flags.dtype != np.bool_:
            raise TypeError(f"BlockMask.flags: expected a boolean array, got dtype {flags.dtype}")
        if flags.ndim not in (2, 3, 4):
            raise ValueError(
                f"BlockMask.flags: expected shape (Tq, Tk), (H, Tq, Tk) or (B, H, Tq, Tk), got {flags.shape}"
            )
        for name in ("block_q", "block_k"):
            size = getattr(self, name)
            if not isinstance(size, (int, np.integer)) or size < 1:
                raise ValueError(f"BlockMask.{name}: expected a positive int, got {size!r}")
        object.__setattr__(self, "flags", flags)

    def tiles_for(self, nq: int, nk: int) -> tuple[int, int]:
        """The (Tq, Tk) this mask must have to cover an Nq x Nk score matrix."""
        return -(-nq // self.block_q), -(-nk // self.block_k)

    @property
    def density(self) -> float:
        """Fraction of tiles kept."""
        return float(self.flags.mean()) if self.flags.size else 0.0
