"""The shared runtime: validation errors name the argument, arrays come back in kind,
timing gives sane medians, and WORKBOOK_DEVICE picks the device."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from numba import cuda

from kernels.base import runtime
from kernels.base.runtime import ArrayKind, cdiv, check_array, check_flag, check_qkv, check_scale, time_fn


def qkv(b=1, h=2, nq=5, nk=7, d=4, dtype=np.float32):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((b, h, nq, d)).astype(dtype), rng.standard_normal((b, h, nk, d)).astype(dtype),
            rng.standard_normal((b, h, nk, d)).astype(dtype))


# --------------------------------------------------------------------------- validation

def test_check_qkv_accepts_good_input():
    q, k, v = qkv()
    assert check_qkv(q, k, v) == (1, 2, 5, 7, 4, np.dtype(np.float32))


@pytest.mark.parametrize("which, make, exc, match", [
    ("q", lambda q: q[0], ValueError, r"^q: expected 4 dimensions"),
    ("k", lambda k: k.astype(np.float64), TypeError, r"^k: expected dtype float32"),
    ("v", lambda v: v[:, :, :3], ValueError, r"^v: expected the shape of k"),
    ("k", lambda k: np.concatenate([k, k], axis=1), ValueError, r"^k: expected batch and heads"),
    ("k", lambda k: k[..., :3], ValueError, r"^k: expected head dim"),
    ("q", lambda q: [[1.0]], TypeError, r"^q: expected a NumPy array"),
    ("v", lambda v: None, TypeError, r"^v: expected an array"),
])
def test_check_qkv_errors_name_the_argument(which, make, exc, match):
    arrays = dict(zip("qkv", qkv()))
    arrays[which] = make(arrays[which])
    if which == "k" and "head dim" in match:
        arrays["v"] = arrays["v"][..., :3]
    if which == "k" and "batch" in match:
        arrays["v"] = np.concatenate([arrays["v"]] * 2, axis=1)
    with pytest.raises(exc, match=match):
        check_qkv(arrays["q"], arrays["k"], arrays["v"])


def test_check_qkv_head_dim_limit_and_mixed_dtypes():
    q, k, v = qkv(d=200)
    with pytest.raises(ValueError, match=r"^q: expected head dim d in 1\.\.128"):
        check_qkv(q, k, v)
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"q, k, v: expected one dtype"):
        check_qkv(q, k.astype(np.float16), v, dtypes=(np.float32, np.float16))


@pytest.mark.parametrize("scale, exc, match", [
    ("0.5", TypeError, r"^scale: expected a number"),
    (True, TypeError, r"^scale: expected a number"),
    (0.0, ValueError, r"^scale: expected a finite positive"),
    (-1.0, ValueError, r"^scale: expected a finite positive"),
    (float("nan"), ValueError, r"^scale: expected a finite positive"),
    (float("inf"), ValueError, r"^scale: expected a finite positive"),
])
def test_check_scale_errors(scale, exc, match):
    with pytest.raises(exc, match=match):
        check_scale(scale, 64)


def test_check_scale_default_and_flag():
    assert check_scale(None, 64) == pytest.approx(0.125)
    assert check_scale(2, 64) == 2.0
    assert check_flag(np.bool_(True), "causal") is True
    with pytest.raises(TypeError, match=r"^causal: expected True or False"):
        check_flag(1, "causal")


def test_check_array_and_cdiv():
    assert check_array(np.ones((2, 3), np.float32), "a", ndim=2) == ((2, 3), np.dtype(np.float32))
    with pytest.raises(ValueError, match=r"^a: expected 2 dimensions"):
        check_array(np.ones(3, np.float32), "a", ndim=2)
    d = cuda.to_device(np.ones((4, 5), np.float32))
    assert check_array(d, "a", ndim=2) == ((4, 5), np.dtype(np.float32))
    assert [cdiv(a, 4) for a in (0, 1, 4, 5)] == [0, 1, 1, 2]


# --------------------------------------------------------------------------- arrays in kind

def test_array_kind_numpy_in_numpy_out():
    x = np.arange(1, 7, dtype=np.float32)
    kind = ArrayKind(x)
    assert not kind.on_device
    back = kind.give_back(runtime.to_device(x, "x"))
    assert isinstance(back, np.ndarray)
    np.testing.assert_array_equal(back, x)


def test_array_kind_device_in_device_out():
    x = np.arange(1, 7, dtype=np.float32)
    d = cuda.to_device(x)
    kind = ArrayKind(d)
    assert kind.on_device
    view = runtime.to_device(d, "x")
    back = kind.give_back(view)
    assert not isinstance(back, np.ndarray) and runtime.is_device_array(back)
    np.testing.assert_array_equal(back.copy_to_host(), x)


@pytest.mark.parametrize("value", [0.0, -np.inf])
def test_fill_sets_every_element_of_a_result_array(value):
    """runtime.fill on what ArrayKind.new gives a NumPy caller and a device caller (Numba
    device arrays; a PyTorch tensor on a GPU), an empty one too."""
    arrays = [ArrayKind(np.zeros(1, np.float32)).new((2, 3, 5)), ArrayKind(cuda.to_device(np.zeros(1))).new((4, 3)),
              runtime.device_empty((0, 3))]
    torch = pytest.importorskip("torch") if not runtime.on_simulator() else None
    if torch is not None and torch.cuda.is_available():
        arrays.append(ArrayKind(torch.zeros(1, device="cuda")).new((3, 2)))
    for a in arrays:
        runtime.fill(a, value)
        host = a.cpu().numpy() if hasattr(a, "cpu") else a.copy_to_host()
        assert host.shape == tuple(a.shape) and (host == value).all(), type(a).__name__


def test_new_parts_are_disjoint_arrays_of_one_allocation():
    """ArrayKind.new_parts: ``count`` C-contiguous arrays of the shape asked, back to back in
    one allocation (a write to one leaves the others as they were)."""
    kinds = [ArrayKind(np.zeros(1, np.float32)), ArrayKind(cuda.to_device(np.zeros(1)))]
    torch = pytest.importorskip("torch") if not runtime.on_simulator() else None
    if torch is not None and torch.cuda.is_available():
        kinds.append(ArrayKind(torch.zeros(1, device="cuda")))
    for kind in kinds:
        parts = kind.new_parts(4, (2, 3), np.uint32)
        assert len(parts) == 4 and all(tuple(p.shape) == (2, 3) for p in parts)
        for i, p in enumerate(parts):
            runtime.fill(p, i + 1)
        for i, p in enumerate(parts):
            host = p.cpu().numpy() if hasattr(p, "cpu") else p.copy_to_host()
            assert (host == i + 1).all(), f"part {i} of {type(p).__name__}"
        if not runtime.on_simulator():                 # (the simulator's arrays have no pointers)
            pointers = [runtime.device_pointer(p, "p") for p in parts]
            assert [b - a for a, b in zip(pointers, pointers[1:])] == [2 * 3 * 4] * 3, "back to back"


def test_to_device_rejects_non_contiguous_device_arrays():
    d = cuda.to_device(np.ones((4, 6), np.float32))
    with pytest.raises(ValueError, match=r"^x: expected a C-contiguous"):
        runtime.to_device(d[:, ::2], "x")


# --------------------------------------------------------------------------- timing

@cuda.jit
def _add_one(x):
    i = cuda.grid(1)
    if i < x.shape[0]:
        x[i] += 1.0


def test_a_bound_launch_runs_and_keeps_its_arrays_alive():
    """bind_launch's parameters are raw pointers into its arrays: it must hold the arrays
    themselves, or an array that nothing else holds is freed before the launch runs."""
    import gc
    import weakref

    x = cuda.to_device(np.zeros(40, np.float32))
    alive = weakref.ref(x)
    launch = runtime.bind_launch(_add_one, 1, 64, (x,))
    del x
    gc.collect()
    assert alive() is not None, "the bound launch let its array be freed"
    launch()
    launch()
    np.testing.assert_array_equal(alive().copy_to_host(), np.full(40, 2.0, np.float32))


def test_time_fn_medians_are_sane():
    calls = []

    def fn(a):
        calls.append(a)
        time.sleep(0.002)

    t = time_fn(fn, [(1,), (2,), (3,)], warmup=2, repeat=9)
    assert len(calls) == 11
    assert set(calls) == {1, 2, 3}          # the input sets rotate
    assert t.runs == 9
    assert t.p10_ms <= t.median_ms <= t.p90_ms
    assert t.spread >= 0
    if runtime.on_simulator():
        assert t.clock == "host clock (simulator)"
        assert 1.5 <= t.median_ms <= 200
    else:
        assert t.clock == "cuda events"
        assert t.median_ms > 0


# --------------------------------------------------------------------------- device selection

def _device_in_subprocess(**env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "WORKBOOK_DEVICE")}
    env.update(env_changes)
    code = "import os, kernels; from kernels.base.runtime import on_simulator; " \
           "print(kernels.DEVICE, on_simulator(), os.environ.get('NUMBA_ENABLE_CUDASIM'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_workbook_device_sim_turns_the_simulator_on():
    proc = _device_in_subprocess(WORKBOOK_DEVICE="sim")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["sim", "True", "1"]


def test_workbook_device_gpu_turns_the_simulator_off():
    # Importing needs no GPU; only a launch would.
    proc = _device_in_subprocess(WORKBOOK_DEVICE="gpu")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["gpu", "False", "None"]


def test_workbook_device_auto_follows_the_driver():
    proc = _device_in_subprocess()
    assert proc.returncode == 0, proc.stderr
    expected = "gpu" if runtime._cuda_device_count() > 0 else "sim"
    assert proc.stdout.split()[0] == expected


def test_workbook_device_rejects_nonsense():
    proc = _device_in_subprocess(WORKBOOK_DEVICE="tpu")
    assert proc.returncode != 0
    assert "WORKBOOK_DEVICE: expected 'gpu', 'sim' or 'auto'" in proc.stderr


def test_a_launch_template_keeps_its_grid_when_the_kernel_runs_elsewhere():
    """A template's grid is its own: another launch of the same kernel with another grid
    (the simulator's kernel[grid, block] configures the kernel object itself) changes nothing."""
    from kernels.base.runtime import LaunchTemplate, device_pointer, on_simulator

    @cuda.jit
    def mark(out):
        out[cuda.blockIdx.x] = cuda.blockIdx.x + 1

    first = cuda.to_device(np.zeros(4, np.float32))
    template = LaunchTemplate(mark, 2, 1, (first,), slots={"out": 0})
    mark[4, 1](cuda.to_device(np.zeros(4, np.float32)))          # the same kernel, another grid
    out = cuda.to_device(np.zeros(4, np.float32))
    template(out=out if on_simulator() else device_pointer(out, "out"))
    cuda.synchronize()
    assert out.copy_to_host().tolist() == [1, 2, 0, 0]


def test_a_launch_template_passes_every_parameter_as_the_kernel_declares_it():
    """What a template holds and what a call writes reach the kernel intact: scalars of
    three widths (float32, int32, uint16), a held array (its shape and strides too), two
    slots, a 2-D grid, on the stream of ``on_stream``; and a second call with other arrays
    writes those."""
    from kernels.base.runtime import LaunchTemplate, device_pointer, on_simulator, on_stream

    @cuda.jit
    def fill(held, out, other, scale, offset, bits):
        i, j = cuda.blockIdx.x, cuda.blockIdx.y
        out[i, j] = held[j, i] * scale + offset + bits + held.shape[0] * 1000
        other[j] = offset

    held = cuda.to_device(np.arange(6, dtype=np.float32).reshape(2, 3))     # (2, 3), read transposed
    args = (held, cuda.to_device(np.zeros((3, 2), np.float32)), cuda.to_device(np.zeros(2, np.int32)),
            np.float32(0.5), np.int32(-7), np.uint16(40000))
    template = LaunchTemplate(fill, (3, 2), 1, args, slots={"out": 1, "other": 2})

    def call(out, other):
        if on_simulator():
            template(out=out, other=other)
        else:
            template(out=device_pointer(out, "out"), other=device_pointer(other, "other"))

    stream = cuda.stream()
    for _ in range(2):
        out, other = cuda.to_device(np.full((3, 2), -1, np.float32)), cuda.to_device(np.zeros(2, np.int32))
        with on_stream(0 if on_simulator() else int(stream.handle)):
            call(out, other)
        stream.synchronize()
        cuda.synchronize()
        expected = np.arange(6, dtype=np.float32).reshape(2, 3).T * 0.5 - 7 + 40000 + 2000
        np.testing.assert_array_equal(out.copy_to_host(), expected)
        assert other.copy_to_host().tolist() == [-7, -7]


def test_python_dash_m_kernels_chooses_the_device_before_numba_is_imported():
    """``python -m kernels`` first checks what is installed (kernels/_bootstrap.py): that
    check must not import Numba, or the simulator switch comes too late."""
    code = ("import sys; sys.argv[:1] = ['-m']; import kernels; from numba.core import config; "
            "print(kernels.DEVICE, config.ENABLE_CUDASIM)")
    env = dict(os.environ, WORKBOOK_DEVICE="sim")
    env.pop("NUMBA_ENABLE_CUDASIM", None)           # (this process's own choice, inherited)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "1", out.stdout
