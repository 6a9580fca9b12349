"""The FlashAttention-2 forward on tensor cores (fp16 and bf16 in) against the float64 oracle.

The oracle runs on the inputs as rounded to fp16 or bf16. The yardstick is a float32
reference that rounds P to the input type before P V, as the kernel (and FlashAttention-2)
does: the kernel's error is at most 2x that reference's, plus the floor of chapter 4's
exponents (``forward_floor_scales``). Drawn shapes: ragged N, Nq != Nk, d not a multiple
of 16 (padded), causal rows that see no key, grouped-query heads (k, v with H / 2 heads,
read by the kernel with no copy; the oracle sees them repeated), large logits pinned.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from numba import cuda

from kernels import flash_tensor_cores as tensor_cores
from kernels import reference as ref
from kernels.base.mma import a_position, bf16_bits, c_position, words_to_halves
from kernels.base.key_split import choose_splits
from kernels.base.runtime import ArrayKind, on_simulator
from kernels.base.testing import AttentionCase, assert_close, forward_floor_scales, grouped_attention_cases, \
    gpu_examples
from kernels.flash_tensor_cores import flash_attention_tc, forward_checked

SIM = on_simulator()
MAX_N = 20 if SIM else 300
HEAD_DIMS = [4, 16, 24] if SIM else [16, 40, 64, 100, 128]


def to_input(x, bf16):
    """(the kernel's input, its values as float64): fp16 arrays, or bf16 bits as uint16."""
    if bf16:
        bits = bf16_bits(x).astype(np.uint16)
        return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    h = np.asarray(x, np.float32).astype(np.float16)
    return h, h.astype(np.float64)


def round_p(p, bf16):
    if bf16:
        return (bf16_bits(p).astype(np.uint32) << 16).view(np.float32)
    return p.astype(np.float16).astype(np.float32)


def rounded_p_reference(q, k, v, causal, scale, bf16):
    """float32 attention with P = exp(S - rowmax) rounded to the input type before P V."""
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    nq, nk = q.shape[-2], k.shape[-2]
    s = np.float32(scale) * (q @ np.swapaxes(k, -1, -2))
    if causal:
        allowed = np.arange(nk)[None, :] <= np.arange(nq)[:, None] + (nk - nq)
        s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if nk else np.full(s.shape[:-1] + (1,), -np.inf, np.float32)
    seen = np.isfinite(m)
    with np.errstate(invalid="ignore"):
        p = np.where(seen, np.exp(s - np.where(seen, m, 0)), 0).astype(np.float32)
    l_ = p.sum(axis=-1, keepdims=True)
    o = np.where(l_ > 0, (round_p(p, bf16) @ v) / np.where(l_ > 0, l_, 1), 0).astype(np.float32)
    with np.errstate(divide="ignore"):
        lse = np.where(l_ > 0, m + np.log(np.where(l_ > 0, l_, 1)), -np.inf)[..., 0].astype(np.float32)
    return o, lse


def tc_cases():
    """B and Hkv of 1 or 2, one or two query heads a KV head, ragged N to MAX_N, d from HEAD_DIMS."""
    return grouped_attention_cases(max_n=MAX_N, head_dims=HEAD_DIMS, small=False, groups=(1, 2))


def pinned(q_shape, k_shape, *, causal=False, magnitude=1.0, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(q_shape) * magnitude
    k = rng.standard_normal(k_shape) * magnitude
    return AttentionCase(q, k, rng.standard_normal(k_shape), causal, None)


PINNED = [
    pinned((1, 1, 1, 4), (1, 1, 1, 4)),                             # N = 1
    pinned((1, 1, 19, 24), (1, 1, 23, 24), causal=True),            # ragged tiles, d padded to 32
    pinned((2, 1, 11, 8), (2, 1, 5, 8), causal=True),               # Nq > Nk: rows that see no key
    pinned((1, 1, 17, 16), (1, 1, 17, 16), magnitude=12.0),         # logits of several hundred
    pinned((1, 1, 0, 8), (1, 1, 5, 8)),                             # Nq = 0
    pinned((1, 1, 6, 8), (1, 1, 0, 8)),                             # Nk = 0: O = 0, L = -inf
    pinned((2, 3, 9, 24), (2, 1, 11, 24), causal=True),             # grouped-query: 3 query heads a KV head, B = 2
]
PINNED_IDS = ["N=1", "ragged", "Nq>Nk", "large-logits", "Nq=0", "Nk=0", "GQA"]


def run_split(q, k, v, causal, scale, bf16, splits):
    """The launcher's checked entry with the keys split among ``splits`` blocks a query tile
    (chapter 13's answer to a grid too small for the GPU), NumPy in and out."""
    kind = ArrayKind(q)
    d = q.shape[-1]
    o, lse = forward_checked(kind, *(cuda.to_device(x) for x in (q, k, v)), causal=causal,
                             scale=scale if scale is not None else 1 / np.sqrt(d), bf16=bf16, splits=splits)
    return kind.result(o), kind.result(lse)


def check(case, bf16, splits=None):
    q, qx = to_input(case.q, bf16)
    k, kx = to_input(case.k, bf16)
    v, vx = to_input(case.v, bf16)
    if splits is None:
        o, lse = flash_attention_tc(q, k, v, causal=case.causal, scale=case.scale, bf16=bf16)
    else:
        o, lse = run_split(q, k, v, case.causal, case.scale, bf16, splits)
    assert o.dtype == np.float32 and o.shape == case.q.shape and lse.shape == case.q.shape[:3]
    scale = case.scale if case.scale is not None else 1 / np.sqrt(case.q.shape[-1])
    group = case.q.shape[1] // case.k.shape[1]          # query head h reads KV head h // group
    kx, vx = (np.repeat(x, group, axis=1) for x in (kx, vx))
    exact_o, exact_l = ref.attention(qx, kx, vx, causal=case.causal, scale=scale)
    base_o, base_l = rounded_p_reference(qx, kx, vx, case.causal, scale, bf16)
    fs_o, fs_l = forward_floor_scales(qx, kx, vx, scale, causal=case.causal)
    where = "(row [b, h, i] is warp (i % 64) // 16 of block (i // 64, b*H + h); lanes 4 (i % 8) .. +3)"
    assert_close(o, exact_o, base_o, name=f"O {where}", floor_scale=fs_o)
    assert_close(lse, exact_l, base_l, name=f"L {where}", floor_scale=fs_l)


# ---- the two fragment hooks on their own (the chapter's kernel exercises): every lane's
# registers against the PTX mapping, each wrong half named (lane, register, what it holds)

def _guess(got, want):
    """What a misplaced element suggests, from where it came: (row, col) against (row, col)."""
    (gr, gc), (wr, wc) = got, want
    if gc == wc and abs(gr - wr) == 8:
        return " (rows group and group + 8 swapped?)"
    if gr == wr and abs(gc - wc) == 8:
        return " (columns +0 and +8 swapped: for P, tiles 2 kp and 2 kp + 1?)"
    if gr == wr and gc == wc ^ 1:
        return " (the two halves of the register swapped? the lower column goes in the low 16 bits)"
    return ""


def _first_wrong(halves, want, what):
    """halves (32, 8): what each lane's element i holds, as (row, col) or a string; want:
    a_position. The message for the first wrong one, or None."""
    wrong = [(lane, i) for lane in range(32) for i in range(8) if halves[lane][i] != want(lane, i)]
    if not wrong:
        return None
    lane, i = wrong[0]
    got, (r, c) = halves[lane][i], want(lane, i)
    held = f"{what}[{got[0]}, {got[1]}]" if isinstance(got, tuple) else got
    return (f"{len(wrong)} of 256 halves wrong; the first: lane {lane} (group {lane // 4}, t {lane % 4}), register "
            f"a{i // 2}, {'low' if i % 2 == 0 else 'high'} half holds {held}; the mapping puts {what}[{r}, {c}] "
            f"there (element {i}: row group + 8 ((i // 2) % 2) = {r}, col 2 t + i % 2 + 8 (i // 4) = {c})"
            + (_guess(got, (r, c)) if isinstance(got, tuple) else ""))


@pytest.mark.parametrize("row0, col0", [(0, 0), (16, 0), (0, 16), (16, 16)])
def test_load_a_fragment_follows_the_ptx_mapping(row0, col0):
    """Each element of the shared tile holds its own code (row * 64 + col, never 0); the
    16 x 16 block at (row0, col0) must arrive in the lanes as a_position says."""
    rows, cols = tensor_cores.PROBE_TILE
    tile = (np.arange(rows)[:, None] * 64 + np.arange(cols)[None, :] + 1).astype(np.uint16)
    regs = tensor_cores.a_fragment_registers(tile, row0, col0)
    halves = []
    for lane in range(32):
        held = []
        for i in range(8):
            code = (int(regs[lane, i // 2]) >> (16 * (i % 2))) & 0xFFFF
            r, c = (code - 1) // 64, (code - 1) % 64
            if code == 0 or not (0 <= r < rows and c < cols):
                held.append(f"0x{code:04x}, no element of s")
            elif not (0 <= r - row0 < 16 and 0 <= c - col0 < 16):
                held.append(f"s[{r}, {c}], outside the block A = s[{row0}:{row0 + 16}, {col0}:{col0 + 16}]")
            else:
                held.append((r - row0, c - col0))
        halves.append(held)
    problem = _first_wrong(halves, a_position, "A")
    assert problem is None, f"load_a_fragment(s, {row0}, {col0}, lane): {problem}"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_p_to_a_follows_the_ptx_mapping(bf16):
    """Each lane's 8 accumulator floats hold their own position's code, (16 row + col + 1) / 256
    (exact in fp16 and bf16); the packed registers must hold P as a_position says."""
    p = np.zeros((32, 8), np.float32)
    for lane in range(32):
        for i in range(4):
            r, c = c_position(lane, i)
            p[lane, i] = (16 * r + c + 1) / 256              # tile 2 kp: keys 0-7
            p[lane, 4 + i] = (16 * r + c + 8 + 1) / 256      # tile 2 kp + 1: keys 8-15
    values = words_to_halves(tensor_cores.p_to_a_registers(p, bf16), "bf16" if bf16 else "f16").reshape(32, 8)
    halves = []
    for lane in range(32):
        held = []
        for x in values[lane]:
            code = x * 256 - 1
            if code == int(code) and 0 <= code < 256:
                held.append((int(code) // 16, int(code) % 16))
            else:
                held.append(f"{x!r}, no element of P as {'bf16' if bf16 else 'fp16'} "
                            f"(pack_{'bf16' if bf16 else 'f16'} packs two floats as {'bf16' if bf16 else 'fp16'})")
        halves.append(held)
    problem = _first_wrong(halves, a_position, "P")
    assert problem is None, f"p_to_a(c0, c1) with bf16={bf16}: {problem}"


@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
@given(case=tc_cases())
@settings(max_examples=4 if SIM else gpu_examples(150))
def test_matches_oracle(case, bf16):
    check(case, bf16)


@given(case=tc_cases(), splits=st.integers(2, 5))
@settings(max_examples=3 if SIM else gpu_examples(60))
@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_keys_split_among_blocks_meet_the_same_rule(case, splits, bf16):
    """The split forward (``kernels.base.key_split``): S blocks a query tile, each a share of
    the key tiles (some with none: short or causal rows), their partials merged."""
    check(case, bf16, splits)


@pytest.mark.parametrize("case", PINNED, ids=PINNED_IDS)
def test_pinned_cases_split(case):
    check(case, True, splits=3)


@given(case=tc_cases(), splits=st.sampled_from([1, 3]))
@settings(max_examples=3 if SIM else gpu_examples(60))
@pytest.mark.parametrize("bf16", [False, True], ids=["fp16", "bf16"])
def test_o_in_the_inputs_type_is_the_float32_o_rounded(case, splits, bf16):
    """``o=``: the kernel (or, split, the merge) writes O in the inputs' 16-bit type. Each
    value is the float32 O's rounded to nearest even, bit for bit: what a cast after gives."""
    q, k, v = (to_input(x, bf16)[0] for x in (case.q, case.k, case.v))
    scale = case.scale if case.scale is not None else 1 / np.sqrt(case.q.shape[-1])
    kind = ArrayKind(q)
    args = [cuda.to_device(x) for x in (q, k, v)]
    o32, lse32 = forward_checked(kind, *args, causal=case.causal, scale=scale, bf16=bf16, splits=splits)
    o16 = cuda.device_array(q.shape, np.uint16)
    got, lse = forward_checked(kind, *args, causal=case.causal, scale=scale, bf16=bf16, splits=splits, o=o16)
    assert got is o16, "o: the array given is the o returned"
    o32 = o32.copy_to_host()
    want = bf16_bits(o32) if bf16 else o32.astype(np.float16).view(np.uint16)
    np.testing.assert_array_equal(got.copy_to_host(), want.astype(np.uint16), err_msg="O's 16-bit patterns")
    np.testing.assert_array_equal(lse.copy_to_host(), lse32.copy_to_host())


def test_o_of_another_shape_or_type_is_refused():
    q = cuda.to_device(np.zeros((1, 1, 4, 8), np.float16))
    for o in (cuda.device_array((1, 1, 4, 8), np.float32), cuda.device_array((1, 1, 3, 8), np.uint16)):
        with pytest.raises(ValueError, match="o: expected a 16-bit array"):
            forward_checked(ArrayKind(q), q, q, q, causal=False, scale=1.0, bf16=False, o=o)


def test_splits_only_where_the_grid_is_too_small():
    """choose_splits: none once the blocks fill the SMs; else enough to, at least two key
    tiles a split, at most 16."""
    assert choose_splits(132, 1 << 20, 64, sms=132) == 1
    assert choose_splits(32, 4096, 64, sms=132) == 5            # 32 blocks x 5 >= 132
    assert choose_splits(1, 1 << 20, 64, sms=132) == 16         # at most 16
    assert choose_splits(8, 256, 64, sms=132) == 2              # 4 key tiles: 2 splits of 2
    assert choose_splits(8, 128, 64, sms=132) == 1              # 2 key tiles: no split
    # whole waves (chapter 11's one block an SM): 64 blocks x 2 <= 132; 3 would take a second wave
    assert choose_splits(64, 1024, 32, sms=132, whole_waves=True) == 2
    assert choose_splits(100, 1 << 20, 32, sms=132, whole_waves=True) == 1
    assert choose_splits(32, 4096, 64, sms=132, whole_waves=True) == 4


@pytest.mark.parametrize("case", PINNED, ids=PINNED_IDS)
def test_pinned_cases(case):
    check(case, False)


def test_bf16_pinned_causal_case():
    check(PINNED[1], True)


def test_bad_inputs_name_the_argument():
    q = np.zeros((1, 1, 4, 8), np.float16)
    with pytest.raises(TypeError, match="q"):
        flash_attention_tc(q.astype(np.float32), q, q)
    with pytest.raises(TypeError, match="q"):
        flash_attention_tc(q, q, q, bf16=True)            # bf16 wants its bits as uint16
    with pytest.raises(ValueError, match="v"):
        flash_attention_tc(q, q, q[..., :3, :])
    with pytest.raises(ValueError, match="head dim"):
        flash_attention_tc(*(np.zeros((1, 1, 4, 130), np.float16),) * 3)
    kv = np.zeros((1, 2, 4, 8), np.float16)              # 2 KV heads do not divide q's 3 heads
    with pytest.raises(ValueError, match=r"^k: expected a number of heads Hkv dividing q's H = 3"):
        flash_attention_tc(np.zeros((1, 3, 4, 8), np.float16), kv, kv)
    with pytest.raises(ValueError, match=r"^k: expected \(B, Hkv, Nk, d\)"):
        flash_attention_tc(q, np.zeros((2, 1, 4, 8), np.float16), np.zeros((2, 1, 4, 8), np.float16))


class _Bf16Interface:
    """A device array that says bfloat16 the way PyTorch does (typestr <V2); its pointer is
    never read (the error comes first)."""

    __cuda_array_interface__ = {"shape": (1, 1, 4, 8), "typestr": "<V2", "data": (0, False), "version": 3,
                                "strides": None}


def test_bf16_array_without_the_flag_names_it():
    q = np.zeros((1, 1, 4, 8), np.float16)
    with pytest.raises(TypeError, match=r"k: a bfloat16 array: pass bf16=True"):
        flash_attention_tc(q, _Bf16Interface(), q)


def test_torch_bf16_tensors_are_accepted():
    """PyTorch bf16 CUDA tensors in (typestr <V2), the same answer as their bits as uint16."""
    torch = pytest.importorskip("torch")
    if SIM or not torch.cuda.is_available():
        pytest.skip("needs a GPU and PyTorch: the simulator has no CUDA tensors")
    rng = np.random.default_rng(13)
    x = [rng.standard_normal((1, 2, 70, 40)).astype(np.float32) for _ in range(3)]
    tensors = [torch.as_tensor(a, device="cuda").to(torch.bfloat16) for a in x]
    bits = [t.view(torch.int16).cpu().numpy().view(np.uint16) for t in tensors]
    o_t, lse_t = flash_attention_tc(*tensors, causal=True, bf16=True)
    o_b, lse_b = flash_attention_tc(*bits, causal=True, bf16=True)
    assert isinstance(o_t, torch.Tensor) and o_t.is_cuda, "PyTorch tensors in, PyTorch tensors out"
    np.testing.assert_array_equal(o_t.cpu().numpy(), o_b)
    np.testing.assert_array_equal(lse_t.cpu().numpy(), lse_b)
