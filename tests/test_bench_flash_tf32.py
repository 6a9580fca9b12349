"""Chapter 11's forward variant bench (``python -m kernels.bench.flash_tf32 --variants``), which
the tour does not run: a row a variant, each with its error checked, and the cells a user
names parsed or refused by name."""

import pytest

from kernels.bench import flash_tf32 as bench
from kernels.bench.harness import Context


def test_each_variant_gets_a_row_with_its_error_and_its_speed_up():
    ctx = Context(quick=True, warmup=0, repeat=1, progress=lambda *a: None)
    rows = bench.variant_sweep(ctx, cells=[(1, 2, 9, 8, True)])
    peers = rows[len(bench.VARIANTS):]                   # on a GPU: SDPA's and plain PyTorch's, after
    rows = rows[:len(bench.VARIANTS)]
    assert [r.extra["variant"] for r in rows] == [label for label, _ in bench.VARIANTS]
    assert all(r.kernel.startswith("peer: ") and "variant" not in r.extra for r in peers)
    first = bench.VARIANTS[0][0]
    for r, (label, kw) in zip(rows, bench.VARIANTS):
        assert r.config == "B=1 H=2 N=9 d=8 fp32 causal=True" and r.median_ms > 0
        assert all(r.extra[k] == v for k, v in kw.items())
        assert 0 < r.extra["max_error"] < 1e-5 and r.extra["error_vs_float32"] > 0    # checked, not zero
        assert r.extra[f"speedup over {first}"] > 0
    assert rows[0].extra[f"speedup over {first}"] == 1.0


def test_named_cells_are_parsed_and_bad_ones_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--variants", "--cells", "1x1x5"])
    assert "--cells: expected BxHxNxd with an optional c (causal), got ['1x1x5']" in capsys.readouterr().err
    assert bench.main([]) == 2                           # no --variants: the usage
