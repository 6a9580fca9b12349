"""Plans (kernels/base/plans.py): a call's launches recorded once a call shape and replayed on
new arrays. Here with CPU tensors and a stand-in for the bound launches that keeps the data
pointers each launch was given, so that it runs anywhere: a replay must hand every slot the
pointer the long way would (a given array by its name, an alias of one, scratch at its offset
in a fresh allocation of the recorded size), and must decline, launching nothing, where the
plan does not fit the call. The drop-in's plans on a GPU: tests/test_torch_attention.py."""

import pytest

torch = pytest.importorskip("torch")

from kernels.base.plans import Plans                                               # noqa: E402
from kernels.base.runtime import note_launch                                       # noqa: E402

SHAPE = (1, 2, 8, 16)
ALIGNED = ("q", "k", "v")


class Launches:
    """A stand-in for ``BoundLaunches``: the pointers of each launch, by slot."""

    def __init__(self):
        self.calls = []

    def __call__(self, **pointers):
        self.calls.append(pointers)


def given_arrays(seed, q=None):
    g = torch.Generator().manual_seed(seed)
    arrays = {name: torch.randn(SHAPE, generator=g) for name in ("q", "k", "v", "o")}
    if q is not None:
        arrays["q"] = q
    return arrays


def long_way(launches, given, scratch_of=None, k_flat=True):
    """What a launcher's checked call does on a GPU: allocate its scratch (two row buffers as
    two views of one allocation, a partial of its own), then one ``run_bound`` launch, which
    notes itself for a recording and launches on the data pointers."""
    rows = torch.empty(2, 2 * 8).unbind(0)
    part = torch.empty(3, 2, 8, 16) if scratch_of is None else scratch_of[0]
    arrays = dict(q=given["q"], k=given["k"], v=given["v"], k_flat=given["k"], o=given["o"], delta=rows[0],
                  l2=rows[1], o_part=part)
    if not k_flat:
        del arrays["k_flat"]
    pointers = {name: x.data_ptr() for name, x in arrays.items()}
    aligned = int(all(pointers[name] % 16 == 0 for name in ALIGNED))
    note_launch(launches, arrays, ALIGNED, True, aligned)
    launches(**pointers)
    return arrays


def misaligned_like(shape):
    """A C-contiguous float32 tensor whose data starts 4 bytes past a 16-byte boundary."""
    n = 1
    for s in shape:
        n *= s
    whole = torch.zeros(n + 4)
    start = next(i for i in range(4) if (whole.data_ptr() + 4 * i) % 16 == 4)
    return whole[start:start + n].view(shape)


def recorded(launches, given):
    plans = Plans()
    recorded_arrays = plans.record("key", given, lambda: long_way(launches, given))
    assert "key" in plans and len(launches.calls) == 1
    return plans, recorded_arrays


def test_a_replay_passes_each_slot_what_the_long_way_would():
    launches = Launches()
    first = given_arrays(0)
    plans, at_recording = recorded(launches, first)
    second = given_arrays(1)
    assert plans.replay("key", second) is not None
    assert len(launches.calls) == 2
    got = launches.calls[1]
    for name in ("q", "k", "v", "o"):
        assert got[name] == second[name].data_ptr(), name
    assert got["k_flat"] == second["k"].data_ptr()
    # the scratch: at the recorded offsets within one fresh allocation of the recorded size
    assert got["l2"] - got["delta"] == at_recording["l2"].data_ptr() - at_recording["delta"].data_ptr() == 8 * 2 * 4
    plan = plans.replay("key", second)
    assert plan.scratch_bytes == [2 * 16 * 4, 3 * 2 * 8 * 16 * 4]
    given_spans = [(x.data_ptr(), x.data_ptr() + x.numel() * 4) for x in second.values()]
    for slot in ("delta", "o_part"):
        assert not any(lo <= got[slot] < hi for lo, hi in given_spans), f"{slot}: scratch inside a given array"


def test_a_replay_declines_what_its_plan_does_not_fit():
    launches = Launches()
    plans, _ = recorded(launches, given_arrays(0))
    strided = given_arrays(1)
    strided["v"] = torch.randn(1, 8, 2, 16).transpose(1, 2)
    assert plans.replay("key", strided) is None                       # not C-contiguous
    assert plans.replay("key", given_arrays(2, q=misaligned_like(SHAPE))) is None   # bound for aligned q
    assert plans.replay("other key", given_arrays(3)) is None
    assert len(launches.calls) == 1, "a declined replay launched"
    misaligned = Launches()
    given = given_arrays(4, q=misaligned_like(SHAPE))
    plans.record("misaligned", given, lambda: long_way(misaligned, given))
    assert plans.replay("misaligned", given_arrays(5)) is None        # bound for a misaligned q
    assert plans.replay("misaligned", given_arrays(6, q=misaligned_like(SHAPE))) is not None


def test_aliased_arrays_replay_by_name_and_ambiguous_ones_are_not_recorded():
    launches = Launches()
    plans, _ = recorded(launches, given_arrays(0))
    same = given_arrays(1)
    same["k"] = same["q"]                                  # attention(x, x, v)
    assert plans.replay("key", same) is not None
    got = launches.calls[-1]
    assert got["q"] == got["k"] == got["k_flat"] == same["q"].data_ptr()
    ambiguous = Plans()
    given = given_arrays(2)
    given["k"] = given["q"]      # k_flat is q's array and k's: not known which a replay should read
    ambiguous.record("key", given, lambda: long_way(launches, given))
    assert "key" not in ambiguous
    aliased = Plans()            # recorded on attention(x, x, v), replayed on distinct q and k
    aliased.record("key", given, lambda: long_way(launches, given, k_flat=False))
    distinct = given_arrays(3)
    assert aliased.replay("key", distinct) is not None
    got = launches.calls[-1]
    assert (got["q"], got["k"]) == (distinct["q"].data_ptr(), distinct["k"].data_ptr())


def test_calls_a_plan_cannot_replay_are_not_recorded():
    plans, launches = Plans(), Launches()
    given = given_arrays(0)
    assert plans.record("nothing launched", given, lambda: 42) == 42
    plans.record("scratch inside o", given, lambda: long_way(launches, given, scratch_of=(given["o"][0],)))
    given_cpu_numpy = dict(given, v=given["v"].numpy())
    plans.record("a NumPy array given", given_cpu_numpy, lambda: long_way(launches, given))
    assert len(plans) == 0 and len(launches.calls) == 2


def test_plans_keep_the_most_recently_recorded():
    plans, launches = Plans(size=2), Launches()
    for key in ("a", "b", "c"):
        given = given_arrays(0)
        plans.record(key, given, lambda: long_way(launches, given))
    assert "a" not in plans and "b" in plans and "c" in plans
    plans.clear()
    assert len(plans) == 0
