"""Variants of one kernel timed taking turns: what the variant benches share.

A variant bench asks which of a kernel's ways is faster, at a few cells, by a few percent: a
slow stretch of the GPU or the host falling on one variant could decide it. So each variant
runs ``rounds`` rounds of back-to-back calls (CUDA events around ``target_ms`` worth of calls),
the variants taking turns and the first alternating, and a variant's speed-up is the median
over rounds of the first variant's time over its own in the same round. In the simulator one
call a variant, timed by the host clock.
"""

from __future__ import annotations

from kernels.base.runtime import Timing, time_fn

__all__ = ["take_turns", "turn_summary", "variant_row", "variants_main"]


def take_turns(calls: dict, inputs, simulator: bool, rounds: int = 9, target_ms: float = 100.0) -> dict:
    """{label: [ms a call, a round]} for ``calls`` {label: fn(*inputs[i])}: after one warm-up
    call each and three timed, ``rounds`` rounds, each a run of back-to-back calls of every
    variant in turn (the order reversed every other round)."""
    from kernels.bench.capstone_floor import _back_to_back

    samples = {label: [] for label in calls}
    if simulator:
        for label, fn in calls.items():
            samples[label].append(time_fn(fn, inputs, warmup=1, repeat=1).median_ms)
        return samples
    first = {label: time_fn(fn, inputs, warmup=1, repeat=3).median_ms for label, fn in calls.items()}
    runs = {label: max(1, min(200, int(target_ms / max(t, 1e-3)))) for label, t in first.items()}
    order = list(calls)
    for r in range(rounds):
        for label in (order if r % 2 == 0 else order[::-1]):
            samples[label].append(_back_to_back(calls[label], inputs, runs[label]))
    return samples


def turn_summary(samples: dict, label, first_label, simulator: bool) -> tuple[Timing, dict]:
    """(Timing, extras) of one variant: its median round, p10 and p90 the second fastest and
    second slowest; extras: its speed-up over ``first_label`` (the median of the rounds'
    ratios) and the rounds' ratios' p10 and p90."""
    x = sorted(samples[label])
    timing = Timing(x[len(x) // 2], x[min(1, len(x) - 1)], x[max(-2, -len(x))], len(x),
                    "host clock (simulator)" if simulator else "cuda events, rounds taking turns")
    ratios = sorted(a / c for a, c in zip(samples[first_label], samples[label]))
    return timing, {f"speedup over {first_label}": round(ratios[len(ratios) // 2], 4),
                    "round ratios p10": round(ratios[min(1, len(ratios) - 1)], 4),
                    "round ratios p90": round(ratios[max(-2, -len(ratios))], 4)}


def variant_row(chapter, label, config, timing, turns, flops, model_bytes, note, extra):
    """A variant's Result: "bare, <label>", its rounds' timing, TFLOP/s, and ``extra`` with the
    speed-up and the rounds' ratios (``turn_summary``'s ``turns``) added."""
    from kernels.bench.harness import Result

    seconds = timing.median_ms / 1e3
    nan = float("nan")
    return Result(chapter, f"bare, {label}", config, timing.median_ms, timing.p10_ms, timing.p90_ms, flops,
                  model_bytes, flops / seconds / 1e12 if seconds > 0 else nan, nan, nan, nan, False, note,
                  dict(extra, variant=label, **turns))


def variants_main(argv, *, prog: str, description: str, sweep, csv_name: str) -> int:
    """A variant bench's command line: ``--variants`` runs ``sweep(ctx, cells)`` (``--cells``
    BxHxNxd[c] ..., by default the sweep's own) and writes ``csv_name`` into ``--out``; no
    ``--variants``: the usage, exit status 2."""
    import argparse
    import sys

    from kernels.bench import harness

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--variants", action="store_true", help=f"the variants -> {csv_name}")
    parser.add_argument("--cells", nargs="+", metavar="BxHxNxd[c]", default=None,
                        help="the cells (c: causal), e.g. 32x16x256x128 4x16x4096x128c")
    parser.add_argument("--out", default=None, help="results folder (default: workbook/results on a GPU, "
                                                    "bench-out in the simulator)")
    args = parser.parse_args(argv)
    cells = None
    if args.cells:
        try:
            cells = [tuple(int(x) for x in c.rstrip("c").split("x")) + (c.endswith("c"),) for c in args.cells]
        except ValueError:
            cells = []
        if not cells or any(len(c) != 5 or min(c[:4]) < 1 for c in cells):
            parser.error(f"--cells: expected BxHxNxd with an optional c (causal), got {args.cells}")
    if not args.variants:
        parser.print_help(sys.stderr)
        return 2
    ctx = harness.Context(quick=False, warmup=1, repeat=5)
    results = sweep(ctx, cells)
    harness.write_csv(harness.results_folder(args.out) / csv_name, results, harness.environment())
    print(harness.format_table(results, simulator=ctx.simulator))
    return 0
