"""The figures of slides/09_tree_attention.md, drawn from kernels.attention_energy's own functions.

    python slides/img/make_09_figures.py      # writes slides/img/09_*.png

No GPU needed: every number drawn here comes from the energy (NumPy float64) and the napkin
model of a decode step, not from a measurement.
"""

from __future__ import annotations

from figures import plt, save  # noqa: E402  (first: the repository on the path, kernels, matplotlib without a display)

import numpy as np  # noqa: E402

from kernels.attention_energy import (energy, energy_grad_zeta, energy_hessian_zeta,  # noqa: E402
                                      plot_decode_model)

plt.rcParams.update({"font.size": 13, "axes.titlesize": 14})



def energy_figure():
    """F along one direction u of zeta: its slope at 0 is u.O, its curvature u^T Cov u; the
    whole F is the logaddexp of two shards' F."""
    rng = np.random.default_rng(9)
    n, d = 24, 8
    q, k, v = rng.standard_normal(d) * 1.5, rng.standard_normal((n, d)), rng.standard_normal((n, 2))
    u = np.array([1.0, 0.0])
    t = np.linspace(-3, 3, 201)
    f = np.array([energy(q, k, v, ti * u) for ti in t])
    f1 = np.array([energy(q, k[:10], v[:10], ti * u) for ti in t])
    f2 = np.array([energy(q, k[10:], v[10:], ti * u) for ti in t])
    f0, o, hess = energy(q, k, v), energy_grad_zeta(q, k, v), energy_hessian_zeta(q, k, v)
    fig, ax = plt.subplots(figsize=(13, 4.5))
    ax.plot(t, f, "C0", lw=3, label="F(t u): all 24 keys")
    ax.plot(t, f1, "C1--", label="F of keys 0-9 (one device)")
    ax.plot(t, f2, "C2--", label="F of keys 10-23 (another)")
    ax.plot(t, np.logaddexp(f1, f2), "k:", lw=1.5, label="logaddexp of the two: the same curve")
    ax.plot(t, f0 + t * (u @ o), "C3", lw=1, label=f"tangent at 0: slope u.O = {u @ o:.3f}")
    ax.plot(t, f0 + t * (u @ o) + 0.5 * t**2 * (u @ hess @ u), "C4", lw=1,
            label=f"+ curvature u^T Cov u = {u @ hess @ u:.3f}")
    ax.set(xlabel="t (zeta = t u)", ylabel="F", ylim=(f.min() - 1, f.max() + 0.5))
    ax.legend(fontsize=10, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    save(energy_figure(), "09_energy.png")
    fig = plt.figure(figsize=(15, 4.6))
    save(plot_decode_model(fig=fig), "09_napkin.png")
