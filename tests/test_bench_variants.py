"""Chapter 11's variant benches (``python -m kernels.bench.flash_tf32 --variants`` and
``python -m kernels.bench.tf32_backward --variants``), which the tour does not run: a row a
variant, each with its errors checked and its speed-up over the first, the peers' rows after
(on a GPU), and the cells a user names parsed or refused by name."""

import pytest

from kernels.bench import flash_tf32, tf32_backward
from kernels.bench.harness import Context

# (bench, a cell, the error columns each variant's row carries: the forward's O, the backward's gradients)
BENCHES = {"forward": (flash_tf32, (1, 2, 9, 8, True), ("max_error",)),
           "backward": (tf32_backward, (1, 1, 9, 8, True), ("max_error_dQ", "max_error_dK", "max_error_dV"))}


@pytest.mark.parametrize("which", BENCHES)
def test_each_variant_gets_a_row_with_its_errors_and_its_speed_up(which):
    bench, cell, errors = BENCHES[which]
    ctx = Context(quick=True, warmup=0, repeat=1, progress=lambda *a: None)
    rows = bench.variant_sweep(ctx, cells=[cell])
    peers = rows[len(bench.VARIANTS):]                   # on a GPU: SDPA's and plain PyTorch's, after
    rows = rows[:len(bench.VARIANTS)]
    assert [r.extra["variant"] for r in rows] == [label for label, _ in bench.VARIANTS]
    assert all(r.kernel.startswith("peer: ") and "variant" not in r.extra for r in peers)
    first = bench.VARIANTS[0][0]
    b, h, n, d, causal = cell
    for r, (label, kw) in zip(rows, bench.VARIANTS):
        assert r.config == f"B={b} H={h} N={n} d={d} fp32 causal={causal}" and r.median_ms > 0
        assert all(r.extra[k] == v for k, v in kw.items())
        for name in errors:                              # under the sweep's own check, and not zero
            assert 0 < r.extra[name] < 1e-4
        assert r.extra[f"speedup over {first}"] > 0
    assert rows[0].extra[f"speedup over {first}"] == 1.0


@pytest.mark.parametrize("which", BENCHES)
def test_named_cells_are_parsed_and_bad_ones_refused(which, capsys):
    bench = BENCHES[which][0]
    with pytest.raises(SystemExit):
        bench.main(["--variants", "--cells", "1x1x5"])
    assert "--cells: expected BxHxNxd with an optional c (causal), got ['1x1x5']" in capsys.readouterr().err
    assert bench.main([]) == 2                           # no --variants: the usage
