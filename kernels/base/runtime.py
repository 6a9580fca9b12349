"""The small runtime every chapter shares: GPU or simulator, arrays in and out,
input validation, and timing.

GPU or simulator
    ``select_device()`` runs when ``kernels`` is first imported, before Numba is.
    ``WORKBOOK_DEVICE=gpu`` or ``=sim`` forces a choice; otherwise a working CUDA
    driver with at least one device means the GPU, and anything else means the Numba
    CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), which runs every kernel on the CPU,
    slowly, thread by thread (with Python's thread switch interval shortened to 0.1 ms, which
    makes its barriers several times faster). A learner without a GPU can follow the whole course.

Arrays in and out
    NumPy in, NumPy out. CuPy arrays, PyTorch CUDA tensors or anything else with
    ``__cuda_array_interface__`` in: the result stays on the device, as the same kind
    of array when that library is importable (CuPy in -> CuPy out), otherwise as a
    Numba device array.

Streams
    Launches go on the legacy default stream, or, inside ``with on_stream(handle):``, on
    the caller's stream (a ``cudaStream_t`` as an int: PyTorch's
    ``torch.cuda.current_stream().cuda_stream``), so that a framework's work queued on that
    stream before and after the call stays in order without a host-side wait. A caller on a
    non-blocking stream (PyTorch's side streams) must say so with ``on_stream``: PyTorch's
    array interface names no stream (``kernels.torch_attention`` does it for its callers).
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from collections import OrderedDict

import numpy as np

_DEVICE_ENV = "WORKBOOK_DEVICE"


def _cuda_device_count() -> int:
    """Devices the CUDA driver reports, asked through the driver library (no Numba import)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return count.value
        except AttributeError:
            return 0
    return 0


def select_device() -> str:
    """Choose "gpu" or "sim" once, before Numba is imported, and set the simulator switch."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "sim"
    choice = os.environ.get(_DEVICE_ENV, "auto").strip().lower()
    if choice not in ("auto", "gpu", "sim"):
        raise ValueError(f"{_DEVICE_ENV}: expected 'gpu', 'sim' or 'auto', got {choice!r}")
    if choice == "auto":
        choice = "gpu" if _cuda_device_count() > 0 else "sim"
    if choice == "sim":
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    return choice


DEVICE = select_device()
if DEVICE == "sim":
    # Simulated GPU threads are Python threads that meet at every syncthreads(): switching
    # between them more often than Python's default (every 5 ms) makes simulated barriers,
    # and so the simulator, several times faster. (Only here: it changes the whole process.)
    import sys as _sys

    _sys.setswitchinterval(1e-4)

from numba import cuda  # noqa: E402  (must come after the simulator switch)


def _make_simulated_shared_arrays_thread_safe():
    """The simulator gives each ``cuda.shared.array`` line one NumPy array per block, found by
    a look-up-then-create that is not locked: two simulated threads can race and end up with
    different "shared" arrays (seen about once in a few thousand launches). Do it under a lock.
    (It also refuses an ``alignment``, which the GPU honours: accept it here.)"""
    import sys
    import threading

    import numpy as _np
    from numba.core import types
    from numba.np import numpy_support

    try:
        from numba.cuda.simulator.kernelapi import FakeCUDAShared
    except ImportError:  # a simulator layout this fix does not know: leave it alone
        return
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        # (alignment: NumPy's allocations are already aligned to 16 bytes or more, which is
        # what the kernels ask for: 16-byte loads, ldmatrix, cp.async)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        if shape == 0:  # dynamic shared memory: one buffer for the whole block
            count = self._dynshared_size // _np.dtype(dtype).itemsize
            return _np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = _np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    FakeCUDAShared.array = array


if DEVICE == "sim":
    _make_simulated_shared_arrays_thread_safe()


def on_simulator() -> bool:
    """True when kernels run in the Numba CUDA simulator rather than on a GPU."""
    return bool(cuda.simulator_enabled) if hasattr(cuda, "simulator_enabled") else DEVICE == "sim"


def device_name() -> str:
    if on_simulator():
        return "Numba CUDA simulator (CPU)"
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


# --------------------------------------------------------------------------- arrays

def is_device_array(x) -> bool:
    """True for CuPy arrays, PyTorch CUDA tensors, Numba device arrays (and the simulator's)."""
    if isinstance(x, np.ndarray):
        return False
    if type(x).__module__.startswith("torch"):     # (asking a tensor for the interface builds it: µs)
        return bool(getattr(x, "is_cuda", False))
    return hasattr(x, "__cuda_array_interface__") or type(x).__name__ == "FakeCUDAArray"


class ArrayKind:
    """Remembers what kind of arrays a caller passed, to give results back in kind."""

    def __init__(self, example):
        self.on_device = is_device_array(example)
        self.module = type(example).__module__.split(".")[0] if self.on_device else "numpy"

    def empty(self, shape, dtype=np.float32):
        """An uninitialised device array for a result, from the caller's own allocator where
        it has one (PyTorch's and CuPy's cache freed blocks; a Numba allocation is a
        cudaMalloc, and a later free synchronises the device), so that a launcher called in
        a loop does not stall the GPU between calls."""
        if self.on_device and self.module == "torch":
            import torch

            t = torch.empty(tuple(shape), dtype=getattr(torch, np.dtype(dtype).name), device="cuda")
            return cuda_view(t) if t.numel() else device_empty(shape, dtype)
        if self.on_device and self.module == "cupy":
            import cupy

            a = cupy.empty(tuple(shape), dtype=dtype)
            return cuda_view(a) if a.size else device_empty(shape, dtype)
        return device_empty(shape, dtype)

    def new(self, shape, dtype=np.float32):
        """An uninitialised result array of the caller's kind: a PyTorch tensor or a CuPy
        array from the caller's allocator, else a Numba device array (``result`` copies it
        to the host for a NumPy caller)."""
        if self.on_device and self.module == "torch":
            return _torch_empty(shape, dtype)
        if self.on_device and self.module == "cupy":
            import cupy

            return cupy.empty(tuple(shape), dtype=dtype)
        return device_empty(shape, dtype)

    def new_parts(self, count: int, shape, dtype=np.float32) -> tuple:
        """``count`` arrays like ``new(shape, dtype)``, made by one allocation (a PyTorch
        tensor's ``unbind``: one operation for the views, where each allocation is one)."""
        whole = self.new((count, *shape), dtype)
        return whole.unbind(0) if _is_torch(whole) else tuple(whole[i] for i in range(count))

    def result(self, array):
        """An array from ``new``, given back: as it is on the device, copied for a NumPy caller."""
        return array if self.on_device else array.copy_to_host()

    def give_back(self, device_array):
        """A result device array, returned as the kind of array the caller gave."""
        if not self.on_device:
            return device_array.copy_to_host()
        if self.module == "cupy":
            import cupy

            return cupy.asarray(device_array)
        if self.module == "torch":
            import torch

            return torch.as_tensor(device_array, device="cuda")
        return device_array


_TORCH_DTYPES: dict = {}


def _torch_empty(shape, dtype):
    """``torch.empty`` on the current CUDA device, the dtype named as NumPy names it (the
    name looked up once a dtype: a call comes with every launch)."""
    import torch

    torch_dtype = _TORCH_DTYPES.get(dtype)
    if torch_dtype is None:
        torch_dtype = _TORCH_DTYPES[dtype] = getattr(torch, np.dtype(dtype).name)
    return torch.empty(tuple(shape), dtype=torch_dtype, device="cuda")


# Streams whose work every launch of ours (on the legacy default stream) already waits for:
# none given, the legacy default stream (1) and the per-thread default stream (2).
_ORDERED_STREAMS = (None, 1, 2)


# The stream our launches go on, per host thread: 0 (the legacy default stream) unless set.
_launch_on = threading.local()
_external_streams: dict = {}


class on_stream:                                  # noqa: N801  (used as a function: ``with on_stream(h):``)
    """Launch on the stream ``handle`` (a ``cudaStream_t`` as an int; 0 = the legacy default
    stream) inside the ``with`` block. Data the launches read is taken to be ready on that
    stream (``cuda_view`` does not wait for it from the host). (A class, not a generator:
    it is entered at every call of the drop-in attention, and costs less this way.)"""

    __slots__ = ("handle", "before")

    def __init__(self, handle: int):
        self.handle = int(handle)

    def __enter__(self):
        self.before = getattr(_launch_on, "handle", 0)
        _launch_on.handle = self.handle

    def __exit__(self, *exc):
        _launch_on.handle = self.before
        return False


def launch_stream():
    """What a launch takes as its stream: 0, or a Numba stream over the caller's handle
    (``on_stream``), made once a handle. ``kernel[grid, threads, launch_stream(), shared]``."""
    handle = getattr(_launch_on, "handle", 0)
    if not handle or on_simulator():
        return 0
    stream = _external_streams.get(handle)
    if stream is None:
        stream = _external_streams[handle] = cuda.external_stream(handle)
    return stream


def cuda_view(x):
    """A Numba view of a framework's device array (``__cuda_array_interface__``), zero-copy.

    The interface names the stream that produced the data, and Numba's ``as_cuda_array``
    synchronises that stream from the host, so that no kernel reads the data before it is
    written. Our kernels launch on the legacy default stream, which starts nothing before
    the work already queued on the default streams has finished: for data from those
    streams (PyTorch's and CuPy's default) the host-side wait is not needed, and would stall
    every call until the GPU is idle; inside ``on_stream`` data from that stream needs none
    either (``_ordered``). Data from any other stream keeps Numba's wait."""
    stream = x.__cuda_array_interface__.get("stream")
    return cuda.as_cuda_array(x, sync=not _ordered(stream))


def _ordered(stream) -> bool:
    """Whether work on ``stream`` (an array's interface's) is already ordered before ours: no
    stream named (PyTorch's interface names none: its caller orders it), the stream we launch
    on, or, when we launch on the legacy default stream, the default streams (the legacy one
    waits for them; a caller's non-blocking stream does not)."""
    handle = getattr(_launch_on, "handle", 0)
    if stream is None or stream == handle:
        return True
    return handle == 0 and stream in _ORDERED_STREAMS


def to_device(x, name: str):
    """A Numba device view of ``x``: copied if it is a host array, shared if on the device."""
    if is_device_array(x):
        # The simulator's device arrays already are Numba's; real ones are viewed zero-copy.
        arr = x if not hasattr(x, "__cuda_array_interface__") else cuda_view(x)
        if not arr.is_c_contiguous():
            raise ValueError(f"{name}: expected a C-contiguous device array, got strides {arr.strides}")
        return arr
    return cuda.to_device(np.ascontiguousarray(x))



def device_bits16(x, name: str):
    """``to_device(x, name)``, with float16 arrays seen as their 16-bit patterns (uint16),
    as the tensor-core kernels read fp16 and bf16 alike (other dtypes as they are)."""
    dev = to_device(x, name)
    if dev.dtype == np.float16:
        dev = dev.view(np.uint16)
    return dev


def is_bf16_array(x) -> bool:
    """A bfloat16 device array, such as a PyTorch bf16 CUDA tensor. NumPy has no bf16: the
    array interface spells it ``<V2`` (two bytes of "void", the ml_dtypes spelling that
    PyTorch adopted), which NumPy reads as ``|V2``."""
    if isinstance(x, np.ndarray) or not is_device_array(x):
        return False
    if str(getattr(x, "dtype", "")).endswith("bfloat16"):
        return True
    cai = getattr(x, "__cuda_array_interface__", None)
    return cai is not None and np.dtype(cai["typestr"]) == np.dtype("V2")


class Bf16Bits:
    """A bfloat16 device array seen as its 16-bit patterns (uint16), zero-copy: the same
    ``__cuda_array_interface__`` with typestr ``<u2``. Keeps the array alive."""

    def __init__(self, x):
        self.owner = x
        cai = dict(x.__cuda_array_interface__)
        cai["typestr"] = "<u2"
        cai["descr"] = [("", "<u2")]
        self.__cuda_array_interface__ = cai
        self.shape = tuple(cai["shape"])

def as_bits16(x):
    """A bfloat16 device array as ``Bf16Bits`` (what Numba can view); anything else as it is."""
    return Bf16Bits(x) if is_bf16_array(x) else x


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def torch_dtype_as_numpy(dtype) -> np.dtype:
    """A PyTorch dtype as the NumPy dtype its array interface names (bfloat16: ``V2``)."""
    name = str(dtype).rsplit(".", 1)[-1]
    return np.dtype("V2") if name == "bfloat16" else np.dtype(name)


def array_dtype(x) -> np.dtype:
    """An array's NumPy dtype (bfloat16: ``V2``); a PyTorch tensor's read without building its
    array interface (microseconds a call)."""
    if _is_torch(x):
        return torch_dtype_as_numpy(x.dtype)
    cai = getattr(x, "__cuda_array_interface__", None)
    return np.dtype(cai["typestr"]) if cai is not None else np.dtype(x.dtype)


def device_empty(shape, dtype=np.float32):
    return cuda.device_array(shape, dtype=dtype)


def fill(array, value) -> None:
    """Every element of a result array from ``ArrayKind.new`` set to ``value``: a PyTorch
    tensor or CuPy array in place; a Numba device array by a copy from the host (its
    ``[...] = value`` compiles an assignment kernel, and refuses a Python scalar on the GPU)."""
    if hasattr(array, "copy_to_device"):
        if array.size:
            array.copy_to_device(np.full(array.shape, value, array.dtype))
    else:
        array[...] = value


# --------------------------------------------------------------------------- validation

def check_array(x, name: str, *, ndim: int | None = None, dtypes=(np.float32,)):
    """Validate rank and dtype of an array-like, naming it in the error. Returns (shape, dtype)."""
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    on_device = not isinstance(x, np.ndarray) and is_device_array(x)
    if not (isinstance(x, np.ndarray) or on_device):
        raise TypeError(
            f"{name}: expected a NumPy array or a device array (__cuda_array_interface__), got {type(x).__name__}"
        )
    if on_device and _is_torch(x):                 # (the interface would be built anew: µs a call)
        try:
            shape, dtype = tuple(x.shape), torch_dtype_as_numpy(x.dtype)
        except TypeError:
            raise TypeError(f"{name}: a PyTorch tensor of dtype {x.dtype}, which NumPy has no name for") from None
    elif on_device:
        cai = getattr(x, "__cuda_array_interface__", None)
        if cai is not None:
            shape, dtype = tuple(cai["shape"]), np.dtype(cai["typestr"])
        else:
            shape, dtype = tuple(x.shape), np.dtype(x.dtype)
    else:
        shape, dtype = x.shape, x.dtype
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {shape}")
    if dtypes is not None and dtype not in [np.dtype(t) for t in dtypes]:
        allowed = ", ".join(np.dtype(t).name for t in dtypes)
        got = "bfloat16 (typestr <V2)" if dtype == np.dtype("V2") else dtype
        raise TypeError(f"{name}: expected dtype {allowed}, got {got}")
    return tuple(shape), np.dtype(dtype)


def check_qkv(q, k, v, *, dtypes=(np.float32,), max_head_dim: int = 128, grouped: bool = False):
    """Validate attention inputs (B, H, N, d); ``grouped``: k and v may have Hkv heads, Hkv
    dividing H (grouped-query attention). Returns (B, H, Nq, Nk, d, dtype)."""
    qs, qd = check_array(q, "q", ndim=4, dtypes=dtypes)
    ks, kd = check_array(k, "k", ndim=4, dtypes=dtypes)
    vs, vd = check_array(v, "v", ndim=4, dtypes=dtypes)
    if not (qd == kd == vd):
        raise TypeError(f"q, k, v: expected one dtype, got {qd}, {kd}, {vd}")
    if ks != vs:
        raise ValueError(f"v: expected the shape of k {ks}, got {vs}")
    if grouped:
        if qs[0] != ks[0] or qs[3] != ks[3]:
            raise ValueError(f"k: expected (B, Hkv, Nk, d) = ({qs[0]}, Hkv, Nk, {qs[3]}) like q, got {ks}")
        if ks[1] == 0 or qs[1] % ks[1]:
            raise ValueError(f"k: expected a number of heads Hkv dividing q's H = {qs[1]} (grouped-query), "
                             f"got {ks[1]}")
    elif qs[:2] != ks[:2]:
        raise ValueError(f"k: expected batch and heads (B, H) = {qs[:2]} like q, got {ks[:2]}")
    if qs[3] != ks[3]:
        raise ValueError(f"k: expected head dim d = {qs[3]} like q, got {ks[3]}")
    d = qs[3]
    if not 1 <= d <= max_head_dim:
        raise ValueError(f"q: expected head dim d in 1..{max_head_dim}, got {d}")
    return qs[0], qs[1], qs[2], ks[2], d, qd


def given_out(out, shape, name: str):
    """``out``, a float32 device array of ``shape`` a checked entry was given to write a result
    into, returned as it is (its identity kept: ``kernels.base.plans`` tells arrays by it)."""
    if tuple(out.shape) != tuple(shape) or array_dtype(out) != np.float32:
        raise ValueError(f"{name}: expected a float32 array of shape {tuple(shape)}, got {array_dtype(out)} "
                         f"{tuple(out.shape)}")
    return out


def check_out(out, name: str, shape):
    """``out``: None, or a C-contiguous float32 device array of ``shape`` to write a result
    into. Returns its device view (None for None), naming ``name`` in any error."""
    if out is None:
        return None
    if not is_device_array(out):
        raise TypeError(f"{name}: expected a device array (or None), got {type(out).__name__}")
    got_shape, _ = check_array(out, name, ndim=len(shape))
    if tuple(got_shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(got_shape)}")
    return to_device(out, name)


def check_scale(scale, d: int) -> float:
    """The softmax scale: 1/sqrt(d) by default; otherwise a finite positive number."""
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale: expected a number or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale: expected a finite positive number, got {scale}")
    return scale


def check_int(value, name: str, lo: int, hi: int, *, choices=None) -> int:
    """An int in lo..hi (and in ``choices`` if given); TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    value = int(value)
    if choices is not None and value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value}")
    if not lo <= value <= hi:
        raise ValueError(f"{name}: expected an int in {lo}..{hi}, got {value}")
    return value


def check_flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


PRODUCTS = ("auto", "fma", "3xtf32")


def has_tf32_tensor_cores() -> bool:
    """A GPU whose tensor cores take TF32 (mma.sync m16n8k8: compute capability 8.0 on);
    never the simulator."""
    if on_simulator():
        return False
    context = current_context()
    has = _TF32_BY_CONTEXT.get(context)
    if has is None:
        has = _TF32_BY_CONTEXT[context] = tuple(cuda.get_current_device().compute_capability) >= (8, 0)
    return has


_TF32_BY_CONTEXT: dict = {}     # (asked at every call of the launchers that choose their kernel)


def check_products(products, *, float32: bool, fma_only: str | None = None) -> str:
    """The products a launcher takes for its ``products`` argument: "fma" (fp32 on the FMA
    units: the course's teaching kernels) or "3xtf32" (fp32 inputs on tensor cores, three
    TF32 products a product: chapter 11). "auto" is "3xtf32" for float32 inputs on a GPU
    with TF32 tensor cores, unless ``fma_only`` names an argument given that only the FMA
    kernels take; else "fma"."""
    if not isinstance(products, str) or products not in PRODUCTS:
        raise ValueError(f"products: expected one of {PRODUCTS}, got {products!r}")
    if products == "auto":
        return "3xtf32" if float32 and fma_only is None and has_tf32_tensor_cores() else "fma"
    if products == "3xtf32" and not float32:
        raise TypeError("q: products='3xtf32' takes float32 inputs (fp16 and bf16 have chapter 8's kernels)")
    if products == "3xtf32" and fma_only is not None:
        raise ValueError(f"{fma_only}: an argument of the FMA kernels (products='fma'), not of products='3xtf32'")
    return products


def _c_value(param):
    """A kernel parameter as Numba's ``_prepare_args`` gives it (a ctypes scalar, or a Python
    int for an array's pointers, sizes, shape and strides), as a C value to point at."""
    if isinstance(param, ctypes._SimpleCData):
        return param
    if isinstance(param, (bool, np.bool_)):
        return ctypes.c_bool(bool(param))
    if isinstance(param, (int, np.integer)):
        return ctypes.c_int64(int(param))           # (pointer-sized, as Numba passes it)
    if isinstance(param, float):
        return ctypes.c_double(param)
    raise TypeError(f"LaunchTemplate: a kernel parameter of type {type(param).__name__}")


def _three(dims):
    """A grid or block shape as (x, y, z)."""
    dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
    return tuple(int(n) for n in dims) + (1,) * (3 - len(dims))


def _driver_function(handle):
    """What ``cuLaunchKernel`` takes for a compiled kernel's handle (a ``CUkernel``, which the
    launch APIs take as a ``CUfunction``; its dynamic shared memory limit, raised with
    ``cuKernelSetAttribute``, holds for it)."""
    from cuda.bindings import driver as binding

    return binding.CUfunction(int(handle))


_LAUNCH: tuple = ()      # (cuLaunchKernel, CUDA_SUCCESS) from the driver's Python bindings, at the first template


def _driver_launch() -> tuple:
    global _LAUNCH
    if not _LAUNCH:
        from cuda.bindings import driver as binding

        _LAUNCH = (binding.cuLaunchKernel, binding.CUresult.CUDA_SUCCESS)
    return _LAUNCH


class LaunchTemplate:
    """``kernel[grid, threads](*args)`` with everything but the launch itself done once.

    At every ``kernel[grid, threads](*args)`` Numba types each argument, looks up the machine
    code compiled for those types, and turns each array into the parameters the kernel takes
    (data pointer, size, shape, strides): tens of microseconds of Python for a kernel with a
    dozen arrays, longer than a whole decode step over 4k keys takes on the GPU. A template
    does that work once; a call is then one driver launch (on ``launch_stream()``'s stream).
    The parameters are held as C values with an array of pointers to them, as
    ``cuLaunchKernel`` takes them: a call writes its slots' data pointers into their values
    and launches (handing ``cuda.core``'s ``launch`` the list of them instead converts each
    of its ~60 Python values at every call, microseconds each launch).

    ``slots`` ({name: position in args}): the arguments a call passes anew, by name, as
    arrays of the shape and dtype the template was made with (only the data pointer
    changes): on the GPU as device pointers (``device_pointer``), in the simulator as the
    arrays themselves (there a call is the plain launch). The template holds every other
    argument, since its parameters are raw pointers into them, and none of the slots'.
    ``shared_bytes``: dynamic shared memory a block (``kernels.base.shared_memory``)."""

    # Numba passes an array as: meminfo, parent, size, itemsize, data, shape..., strides...
    _DATA = 4

    def __init__(self, kernel, grid, threads, args, slots=None, shared_bytes=0):
        self.slots = dict(slots or {})
        self._shared = int(shared_bytes)          # dynamic shared memory a block (the caller raised its limit)
        taken = set(self.slots.values())
        self._args = [None if i in taken else a for i, a in enumerate(args)]
        # (configured at each call: the simulator's kernel[grid, threads] configures the
        # kernel object itself, so a launch elsewhere with another grid would change ours)
        self._kernel, self._grid, self._threads = kernel, grid, threads
        self._data_at = None
        if on_simulator():
            return
        compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
        names = {i: name for name, i in self.slots.items()}
        params, write_back, data_at = [], [], {}
        for i, (ty, value) in enumerate(zip(compiled.argument_types, args)):
            first = len(params)
            compiled._prepare_args(ty, value, 0, write_back, params)
            if i in names:
                data_at[names[i]] = first + self._DATA
        if write_back:
            raise TypeError("LaunchTemplate: host arrays among the arguments (they would need copies back)")
        self._values = [_c_value(p) for p in params]            # (kept: the pointers below point into them)
        self._pointers = (ctypes.c_void_p * max(1, len(params)))(*(ctypes.addressof(v) for v in self._values))
        self._pointers_at = ctypes.addressof(self._pointers)
        self._data_at = {name: self._values[at] for name, at in data_at.items()}
        self._dims = (*_three(grid), *_three(threads))
        self._function = _driver_function(compiled._codelibrary.get_cufunc().handle)
        self._launch, self._success = _driver_launch()
        self._lock = threading.Lock()          # (two host threads on one template: one writes its slots at a time)

    def __call__(self, **arrays):
        """Launch, with ``arrays[name]`` in each slot (other names are ignored)."""
        if self._data_at is None:                 # the simulator: the plain launch
            args = list(self._args)
            for name, i in self.slots.items():
                args[i] = arrays[name]
            self._kernel[self._grid, self._threads, 0, self._shared](*args)
            return
        stream = getattr(_launch_on, "handle", 0)          # (``launch_stream``'s handle)
        with self._lock:
            for name, value in self._data_at.items():
                value.value = arrays[name]
            error, = self._launch(self._function, *self._dims, self._shared, stream, self._pointers_at, 0)
        if error != self._success:
            raise RuntimeError(f"cuLaunchKernel failed: {error!r}")


class BoundLaunches:
    """Several launches of one call shape, bound once (a ``LaunchTemplate`` each) and made
    in order at each call: ``launches`` as (kernel, grid, threads, args, dynamic shared
    bytes), ``slots`` ({name: position in args}) for each. A call passes the slots' arrays
    by name: views in the simulator, data pointers (``device_pointer``) on a GPU."""

    def __init__(self, launches, slots):
        self.templates = [LaunchTemplate(kernel, grid, threads, args, where, nbytes)
                          for (kernel, grid, threads, args, nbytes), where in zip(launches, slots)]

    def __call__(self, **arrays):
        for launch in self.templates:
            launch(**arrays)


class LaunchCache:
    """A launcher's bound launches by call shape, the ``size`` most recently used kept (one
    host thread at a time changes it)."""

    def __init__(self, size: int = 64):
        self.size, self._bound, self._lock = size, OrderedDict(), threading.Lock()

    def get(self, key, make):
        """The launches bound for ``key``, made by ``make()`` the first time."""
        with self._lock:
            bound = self._bound.get(key)
            if bound is None:
                bound = self._bound[key] = make()
                while len(self._bound) > self.size:
                    self._bound.popitem(last=False)
            self._bound.move_to_end(key)
            return bound

    def __contains__(self, key):
        return key in self._bound

    def clear(self):
        """Forget every bound launch (the next call of each shape binds again)."""
        with self._lock:
            self._bound.clear()


def run_bound(cache: LaunchCache, key, arrays: dict, views_of, make, *, aligned_names=(), aligned_d=True):
    """Run a launcher's bound launches on ``arrays`` ({name: device array}), binding them
    the first time a call shape is seen: ``make(views, aligned)`` with ``views_of(arrays)``
    (Numba views in the kernels' shapes) returns a ``BoundLaunches``. On a GPU a call then
    passes data pointers only (``device_pointer``); ``aligned`` = ``aligned_d`` and the
    arrays of ``aligned_names`` on 16-byte boundaries, part of the key with the device. In
    the simulator every call passes fresh views (the plain launch)."""
    if on_simulator():
        views = views_of(arrays)
        aligned = int(bool(aligned_d))
        launches = cache.get((*key, aligned, 0), lambda: make(views, aligned))
        launches(**views)
        return
    pointers, seen = {}, {}                       # (an array under two names: its pointer read once)
    tensor = torch_tensor_type()
    for name, x in arrays.items():
        if type(x) is tensor:                     # (``device_pointer``'s first case, without its other checks)
            pointers[name] = _tensor_pointer(x, name)
            continue
        at = seen.get(id(x))
        if at is None:
            at = seen[id(x)] = device_pointer(x, name)
        pointers[name] = at
    aligned = int(bool(aligned_d) and all(pointers[n] % 16 == 0 for n in aligned_names))
    key = (*key, aligned, current_context())
    launches = cache.get(key, lambda: make(views_of(arrays), aligned))
    note_launch(launches, arrays, aligned_names, aligned_d, aligned)
    launches(**pointers)


_recorded = threading.local()       # (the launches of a call being recorded, per host thread)


def note_launch(launches, arrays: dict, aligned_names, aligned_d, aligned: int) -> None:
    """A GPU launch ``run_bound`` makes (its bound launches, its arrays by slot name and how
    it worked out ``aligned``), kept where ``recording_launches`` records the thread's calls."""
    steps = getattr(_recorded, "steps", None)
    if steps is not None:
        steps.append((launches, arrays, tuple(aligned_names), bool(aligned_d), int(aligned)))


class recording_launches:                         # noqa: N801  (used as a function, like ``on_stream``)
    """``with recording_launches() as steps:`` collects each ``run_bound`` launch made on a
    GPU in the block, as (bound launches, the arrays by slot name, aligned names, aligned_d,
    aligned): what ``kernels.base.plans`` needs to replay the block's launches."""

    def __enter__(self):
        self.before = getattr(_recorded, "steps", None)
        _recorded.steps = []
        return _recorded.steps

    def __exit__(self, *exc):
        _recorded.steps = self.before
        return False


_TENSOR = None      # torch.Tensor, once PyTorch is imported


def torch_tensor_type():
    """``torch.Tensor`` if PyTorch is imported (by the caller: this module never imports
    it), else a type no array has."""
    global _TENSOR
    if _TENSOR is None:
        torch = sys.modules.get("torch")
        if torch is None:
            return _NoArray
        _TENSOR = torch.Tensor
    return _TENSOR


class _NoArray:
    pass


def current_context() -> int:
    """The handle of the thread's current CUDA context (Numba's: the device's primary
    context, made current if none is), as an int: what a bound launch's compiled function
    belongs to. One driver call (Numba's ``get_current_device`` makes several)."""
    from cuda.bindings import driver as binding

    error, context = binding.cuCtxGetCurrent()
    handle = int(context) if error == binding.CUresult.CUDA_SUCCESS else 0
    if not handle:
        cuda.current_context()
        _, context = binding.cuCtxGetCurrent()
        handle = int(context)
    return handle


def bind_launch(kernel, grid, threads, args):
    """A launch of ``kernel[grid, threads](*args)`` as a function of no arguments
    (``LaunchTemplate`` with no slots: it holds all its arrays)."""
    return LaunchTemplate(kernel, grid, threads, args)


def device_pointer(x, name: str) -> int:
    """The data pointer of a device array (anything with ``__cuda_array_interface__``),
    checked C-contiguous, after the wait ``cuda_view`` explains where one is needed."""
    owner = x.owner if isinstance(x, Bf16Bits) else x
    if _is_torch(owner):                          # PyTorch's interface names no stream: no wait
        return _tensor_pointer(owner, name)
    cai = x.__cuda_array_interface__
    strides = cai.get("strides")
    if strides is not None:
        expected = np.dtype(cai["typestr"]).itemsize
        for n, stride in zip(reversed(cai["shape"]), reversed(strides)):
            if n > 1 and stride != expected:
                raise ValueError(f"{name}: expected a C-contiguous device array, got strides {tuple(strides)}")
            expected *= n
    stream = cai.get("stream")
    if not _ordered(stream):
        cuda.external_stream(stream).synchronize()
    return cai["data"][0]


def _tensor_pointer(x, name: str) -> int:
    """A PyTorch tensor's data pointer, checked C-contiguous."""
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a C-contiguous device array, got strides {tuple(x.stride())}")
    return x.data_ptr()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- timing

@dataclass
class Timing:
    """Median and spread of repeated runs, in milliseconds."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int
    clock: str  # "cuda events" or "host clock (simulator)"

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: how noisy the measurement was."""
        return (self.p90_ms - self.p10_ms) / self.median_ms if self.median_ms > 0 else 0.0


def _quantile(xs, q):
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo, hi = int(math.floor(pos)), int(math.ceil(pos))
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_fn(fn, args_sets, *, warmup: int = 3, repeat: int = 20) -> Timing:
    """Time ``fn(*args)`` cycling through ``args_sets`` (several input sets, so L2 does not
    flatter), with CUDA events on a GPU and the host clock in the simulator."""
    args_sets = list(args_sets)
    for i in range(warmup):
        fn(*args_sets[i % len(args_sets)])
    samples = []
    if on_simulator():
        for i in range(repeat):
            t0 = time.perf_counter()
            fn(*args_sets[i % len(args_sets)])
            samples.append((time.perf_counter() - t0) * 1e3)
        clock = "host clock (simulator)"
    else:
        cuda.synchronize()
        start, stop = cuda.event(), cuda.event()
        for i in range(repeat):
            start.record()
            fn(*args_sets[i % len(args_sets)])
            stop.record()
            stop.synchronize()
            samples.append(cuda.event_elapsed_time(start, stop))
        clock = "cuda events"
    return Timing(statistics.median(samples), _quantile(samples, 0.1), _quantile(samples, 0.9), len(samples), clock)
