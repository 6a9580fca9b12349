"""The figures of slides/11_tensor_cores_fp32.md, drawn from kernels.tf32_error's own functions.

    python slides/img/make_11_figures.py      # writes slides/img/11_*.png

No GPU needed: the tensor core's arithmetic is modelled in NumPy (float64 for exact products).
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)


from kernels.tf32_error import draw_dot_errors, draw_error_terms  # noqa: E402

plt.rcParams.update({"font.size": 13, "axes.titlesize": 14})



def main():
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    draw_error_terms(axes[0])
    draw_dot_errors(axes[1], d=64)
    fig.tight_layout()
    save(fig, "11_tf32_errors.png")


if __name__ == "__main__":
    main()
