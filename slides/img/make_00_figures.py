"""The traced figure of slides/00_gpu_and_simulator.md, drawn by kernels.base.trace.

    python slides/img/make_00_figures.py      # writes slides/img/00_trace_block_sum.png

No GPU needed: the trace runs chapter 0's block sum (kernels.gpu_basics.make_block_sum) in
the Numba CUDA simulator and records which thread read and wrote which element; every
cell drawn is an access it saw. (00_memory_hierarchy.png is the notebook's drawing.)
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)
import matplotlib  # noqa: E402
import matplotlib.text  # noqa: E402

import numpy as np  # noqa: E402

from kernels.base.trace import trace  # noqa: E402
from kernels.gpu_basics import make_block_sum  # noqa: E402

THREADS, BLOCKS = 8, 2            # 16 elements, one a thread: each block sums 8

plt.rcParams.update({"font.size": 12})



def figure_block_sum():
    """Block 0 of the block sum: each thread loads one x into buf, then the tree; thread 1
    outlined (it reads buf[1], buf[3], buf[5] and writes buf[1])."""
    x = np.arange(THREADS * BLOCKS, dtype=np.float32)
    sums = np.zeros(BLOCKS, np.float32)
    t = trace(make_block_sum(THREADS), BLOCKS, THREADS, x, sums)
    assert np.array_equal(sums, x.reshape(BLOCKS, THREADS).sum(axis=1))
    fig = t.draw(["x", "buf", "sums"], block=0, highlight=(0, 1),
                 title=f"block_sum_kernel[grid {BLOCKS}, block {THREADS}], block 0: who read and wrote what")
    for text in fig.findobj(matplotlib.text.Text):   # larger type for a slide
        text.set_fontsize(text.get_fontsize() * 1.35)
    save(fig, "00_trace_block_sum.png")


def main():
    figure_block_sum()


if __name__ == "__main__":
    main()
