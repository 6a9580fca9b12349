"""The capstone: the course's kernels as a drop-in attention for PyTorch.

A model calls attention as ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` and
trusts autograd for the gradients. This module gives it the same thing built from the
chapters' kernels:

    FlashAttention.apply(q, k, v, causal, scale, block_mask)   the autograd function:
        forward  = a fused forward (O and the row logsumexp L; nothing N x N is stored)
        backward = the recomputing backward from Q, K, V, O, L and dO (chapter 5's algebra)
    attention(q, k, v, causal=..., scale=..., block_mask=...)   the course's own call
    scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False)   SDPA's

Which kernels run (the dtype decides, as a library would):

    float32            forward: chapter 4's launcher (3xTF32 tensor cores on a GPU, chapter
                       11; the FMA kernel in the simulator); backward: chapter 5's launcher
                       (chapter 11's 3xTF32 backward on a GPU, grouped-query heads native)
    float16, bfloat16  forward: chapter 8 (mma.sync, fp32 accumulators; O written in the
                       input type, rounded once in the kernel); backward: chapter 12 (mma.sync, grouped-query heads native)
    block_mask=        chapter 6's block-sparse forward and backward, in float32

A library's manners:

    * outputs come from the caller's allocator (PyTorch's caching allocator, no cudaMalloc a
      call), and every launch goes on the caller's current stream (``on_stream``);
    * a call autograd will not differentiate (``torch.no_grad()``, inference, or no input that
      requires grad) runs the forward alone, as SDPA does: no graph node, nothing saved;
    * a call shape's first call is recorded as its plan (``kernels.base.plans``): the launches
      the launcher made and where their arrays came from; later calls of that shape replay it,
      with no check or decision made again (the plan's key names all that they read); a
      strided input is copied first, and a misaligned one declines the plan (the long way);
    * the layout models have, (B, N, H, d) viewed as (B, H, N, d) by ``transpose(1, 2)``, is
      not contiguous: the kernels read rows of d contiguous values at a fixed head stride,
      so such a view is copied once, in the forward (``contiguous``: one read and one write
      of q, k and v, (B*H*Nq + 2*B*Hkv*Nk) * d * itemsize bytes each way), and the copies
      are what the backward reads (dO, if strided, is copied there too);
    * grouped-query heads (k, v with Hkv < H heads) run natively in the forwards of chapters
      8 and 11 and the backwards of chapters 11 and 12; chapters 4 and 5's float32 kernels
      (where there are no TF32 tensor cores: the simulator, GPUs before sm_80) and the
      block-sparse ones read k and v repeated to H heads (a copy of B*H*Nk*d elements each);
    * CPU tensors run through NumPy (on the GPU, or on the simulator without one), so a
      model trains on a laptop, slowly, with the same code.

Causal masks here are bottom-right aligned (the course's convention, FlashAttention >= 2.1).
PyTorch's ``is_causal`` is top-left aligned, which differs only when Nq != Nk: the SDPA-shaped
function refuses that case instead of answering differently.
"""

from __future__ import annotations

import threading

import numpy as np

from kernels.base.fused import MAX_GRID_Y
from kernels.base.masks import BlockMask
from kernels.base.plans import Plans
from kernels.base.runtime import ArrayKind, check_flag, check_scale, current_context, has_tf32_tensor_cores, \
    on_simulator, on_stream

try:
    import torch
except ImportError as error:                       # pragma: no cover - torch is in requirements.txt
    raise ImportError("kernels.torch_attention needs PyTorch (pip install -r requirements.txt)") from error

__all__ = ["FlashAttention", "attention", "scaled_dot_product_attention", "SUPPORTED_DTYPES", "assert_fp32_rule",
           "check_attention_function", "check_attention_function_case", "kernel_array", "as_tensor_like"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- checks

def _check_inputs(q, k, v, names=("q", "k", "v")):
    """Shapes (B, H, Nq, d), (B, Hkv, Nk, d) with H a multiple of Hkv, one dtype and device."""
    for x, name in zip((q, k, v), names):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"{name}: expected 4 dimensions (B, H, N, d), got shape {tuple(x.shape)}")
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name}: expected dtype float32, float16 or bfloat16, got {x.dtype}")
    qn, kn, vn = names
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{qn}, {kn}, {vn}: expected one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{qn}, {kn}, {vn}: expected one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"{vn}: expected the shape of {kn} {tuple(k.shape)}, got {tuple(v.shape)}")
    B, H, _, d = q.shape
    if k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"{kn}: expected (B, Hkv, Nk, d) with B = {B} and d = {d} like {qn}, got {tuple(k.shape)}")
    hkv = k.shape[1]
    if hkv == 0 or H % hkv:
        raise ValueError(f"{kn}: expected a number of heads dividing {qn}'s {H} (grouped-query), got {hkv}")
    if not 1 <= d <= 128:
        raise ValueError(f"{qn}: expected head dim d in 1..128, got {d}")
    if q.shape[0] * H > MAX_GRID_Y:
        raise ValueError(f"{qn}: expected B*H <= {MAX_GRID_Y} (one grid row a head), got {tuple(q.shape)}")
    if q.is_cuda and on_simulator():
        raise ValueError(f"{qn}: a CUDA tensor, but the kernels run on the simulator here (pass CPU tensors)")
    if q.is_cuda:
        _check_device(q, qn)


_devices_agree = threading.local()     # (PyTorch's current device, the current CUDA context) last found to agree


def _check_device(q, name):
    """q is on the current device, and PyTorch's and Numba's current devices are one (asked
    of Numba again only when PyTorch's device or the thread's CUDA context changed)."""
    from numba import cuda

    seen = (torch.cuda.current_device(), current_context())
    if getattr(_devices_agree, "seen", None) != seen:
        numba_device = cuda.get_current_device().id
        if numba_device != seen[0]:
            raise ValueError(f"{name}: the current device is cuda:{seen[0]} for PyTorch and cuda:{numba_device} for "
                             "Numba: the kernels run on one device, the current one of both")
        _devices_agree.seen = seen
    if q.device.index not in (None, seen[0]):
        raise ValueError(f"{name}: on {q.device}, but the current device is cuda:{seen[0]}: the kernels run on the "
                         "current device")


def _check_block_mask(block_mask):
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a kernels.base.masks.BlockMask, got {type(block_mask).__name__}")


# --------------------------------------------------------------------------- arrays across the seam

def _host_array(x):
    """A CPU tensor as the NumPy array the launchers take (bfloat16 as its uint16 bits)."""
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(np.uint16)
    return x.numpy()


def kernel_array(x):
    """What a launcher takes: the tensor itself on the GPU (zero-copy, contiguous), NumPy on the CPU."""
    return x.detach().contiguous() if x.is_cuda else _host_array(x)


def as_tensor_like(x, like):
    """A launcher's result (a CUDA tensor, or NumPy for CPU callers) as a tensor on ``like``'s device."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.from_numpy(np.ascontiguousarray(x)).to(like.device)


def _repeat_heads(x, group: int):
    """k or v with each of its Hkv heads repeated ``group`` times (grouped-query attention)."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _sum_groups(dx, group: int):
    """The gradient of ``_repeat_heads``: each KV head's gradient summed over its group."""
    if group == 1:
        return dx
    B, H, N, d = dx.shape
    return dx.view(B, H // group, group, N, d).sum(dim=2)


def _launching(x):
    """``on_stream`` of the caller's current CUDA stream (the legacy default one, 0, for CPU
    tensors). PyTorch's raw handle where it offers it: a ``torch.cuda.Stream`` object costs
    microseconds to make, at every call."""
    if not x.is_cuda:
        return on_stream(0)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return on_stream(raw(x.device.index) if raw is not None else torch.cuda.current_stream(x.device).cuda_stream)


def _checked_entries(q, block_mask) -> bool:
    """Whether the call goes straight to the launchers' checked entries (``forward_checked``,
    ``backward_checked``): CUDA tensors, a GPU with the tensor-core kernels (sm_80 on), no
    block mask. Our checks (``_check_inputs``) cover what the launchers' would; skipping
    theirs and the array interfaces they read is most of a small call's host time."""
    return q.is_cuda and block_mask is None and has_tf32_tensor_cores()


# --------------------------------------------------------------------------- plans

# A call shape's launches, recorded at its first call and replayed after (``kernels.base.plans``):
# on the GPU a small call is its host time, most of it checks and decisions the shape fixes.
_forward_plans, _backward_plans = Plans(), Plans()


def _plan_key(q, k, v, causal, scale, block_mask):
    """A forward's plan key: all that its checks and the launchers' decisions read (shapes,
    dtypes, devices, the flags, the current device and CUDA context); None for a call that is
    not planned (CPU tensors, a block mask, a tensor subclass, a flag or scale of another type)."""
    if (block_mask is not None or type(q) is not torch.Tensor or type(k) is not torch.Tensor
            or type(v) is not torch.Tensor or type(causal) is not bool or type(scale) not in (float, int, type(None))
            or not q.is_cuda):
        return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, causal, scale,
            torch.cuda.current_device(), current_context())


def _outputs(q):
    """O (like q) and L (B, H, Nq) float32, from PyTorch's allocator."""
    return torch.empty_like(q), torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)


# --------------------------------------------------------------------------- the two passes

def _forward(q, k, v, causal, scale, block_mask, key=None):
    """(o in q's dtype, lse float32) for q (B, H, Nq, d), k, v (B, Hkv, Nk, d); with a plan
    ``key``, the launchers' call recorded as its plan."""
    if _checked_entries(q, block_mask):                  # grouped-query heads native in both forwards
        o, lse = _outputs(q)             # (O in q's type: 16-bit O rounded in the kernel, no cast after)
        if q.dtype == torch.float32:
            from kernels.flash_tf32 import forward_checked

            def call():
                forward_checked(ArrayKind(q), q, k, v, causal=causal, scale=scale, o=o, lse=lse)
        else:
            from kernels.flash_tensor_cores import forward_checked

            def call():
                forward_checked(ArrayKind(q), q, k, v, causal=causal, scale=scale, bf16=q.dtype == torch.bfloat16,
                                o=o, lse=lse)
        if key is None:
            call()
        else:
            _forward_plans.record(key, dict(q=q, k=k, v=v, o=o, lse=lse), call, info=(causal, scale))
        return o, lse
    if q.dtype != torch.float32 and block_mask is None:   # chapter 8's launcher: grouped heads native
        from kernels.flash_tensor_cores import flash_attention_tc

        o, lse = flash_attention_tc(*(kernel_array(x) for x in (q, k, v)), causal=causal, scale=scale,
                                    bf16=q.dtype == torch.bfloat16)
        return as_tensor_like(o, q).to(q.dtype), as_tensor_like(lse, q)
    group = q.shape[1] // k.shape[1]                     # chapters 4, 6: K and V repeated to H heads
    k, v = _repeat_heads(k, group), _repeat_heads(v, group)
    if block_mask is not None:
        from kernels.block_sparse import block_sparse_attention

        o, lse = block_sparse_attention(*(kernel_array(x.float()) for x in (q, k, v)), block_mask,
                                        causal=causal, scale=scale)
    else:
        from kernels.flash_forward import flash_attention

        o, lse = flash_attention(*(kernel_array(x) for x in (q, k, v)), causal=causal, scale=scale)
    return as_tensor_like(o, q).to(q.dtype), as_tensor_like(lse, q)


def _backward(q, k, v, o, lse, do, causal, scale, block_mask):
    """(dq, dk, dv) in the inputs' dtype; dk, dv with k's Hkv heads."""
    group = q.shape[1] // k.shape[1]
    dtype = q.dtype
    if _checked_entries(q, block_mask):                  # grouped heads native in both backwards
        do = do.detach().to(dtype).contiguous()
        # dQ, dK, dV in one float32 buffer (each from a 16-byte boundary), so that one cast
        # gives all three in the inputs' type; each part one view (as_strided: a slice and a
        # view are two operations, microseconds each at every call)
        starts = [0]
        for x in (q, k):
            starts.append(starts[-1] + -(-x.numel() // 4) * 4)
        flat = torch.empty(starts[-1] + v.numel(), dtype=torch.float32, device=q.device)

        def parts(buffer):
            return tuple(buffer.as_strided(x.shape, x.stride(), at) for at, x in zip(starts, (q, k, v)))

        grads = parts(flat)
        given = dict(q=q, k=k, v=v, o=o, lse=lse, do=do, dq=grads[0], dk=grads[1], dv=grads[2])
        key = (q.shape, k.shape, dtype, causal, scale, q.device, current_context())   # (o, do: q's shape and dtype)
        if _backward_plans.replay(key, given) is None:
            if dtype == torch.float32:
                from kernels.tf32_backward import backward_checked

                def call():
                    backward_checked(ArrayKind(q), q, k, v, o, lse, do, causal=causal, scale=scale, out=grads)
            else:
                from kernels.tensor_core_backward import backward_checked

                def call():
                    backward_checked(ArrayKind(q), q, k, v, o, lse, do, causal=causal, scale=scale,
                                     bf16=dtype == torch.bfloat16, out=grads)
            _backward_plans.record(key, given, call)
        return grads if dtype == torch.float32 else parts(flat.to(dtype))
    if block_mask is not None:
        from kernels.block_sparse_backward import block_sparse_attention_backward

        kk, vv = _repeat_heads(k, group), _repeat_heads(v, group)
        args = (kernel_array(x.float()) for x in (q, kk, vv, o, lse, do))
        grads = block_sparse_attention_backward(*args, block_mask, causal=causal, scale=scale)
    elif dtype == torch.float32 and group > 1 and has_tf32_tensor_cores():
        from kernels.tf32_backward import flash_attention_backward_tf32     # grouped heads native

        grads = flash_attention_backward_tf32(*(kernel_array(x) for x in (q, k, v, o, lse, do)),
                                              causal=causal, scale=scale)
        group = 1
    elif dtype == torch.float32:
        from kernels.flash_backward import flash_attention_backward

        kk, vv = _repeat_heads(k, group), _repeat_heads(v, group)
        grads = flash_attention_backward(*(kernel_array(x) for x in (q, kk, vv, o, lse, do)),
                                         causal=causal, scale=scale)
    else:
        from kernels.tensor_core_backward import flash_attention_backward_tc   # grouped heads native

        grads = flash_attention_backward_tc(*(kernel_array(x) for x in (q, k, v, o, lse)),
                                            kernel_array(do.to(dtype)), causal=causal, scale=scale,
                                            bf16=dtype == torch.bfloat16)
        group = 1
    dq, dk, dv = (as_tensor_like(g, q) for g in grads)
    return dq.to(dtype), _sum_groups(dk, group).to(dtype), _sum_groups(dv, group).to(dtype)


def _checked_forward(q, k, v, causal, scale, block_mask, names=("q", "k", "v")):
    """The forward after the checks: (q, k, v as the kernels read them, o, lse, causal, scale).
    A call shape seen before replays its plan: its checks passed at its first call, and
    everything they read is in the plan's key."""
    key = _plan_key(q, k, v, causal, scale, block_mask)
    if key is not None and key in _forward_plans:
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            q, k, v = (x.detach().contiguous() for x in (q, k, v))      # (the copy the long way makes)
        o, lse = _outputs(q)
        with _launching(q):
            plan = _forward_plans.replay(key, dict(q=q, k=k, v=v, o=o, lse=lse))
        if plan is not None:
            return q, k, v, o, lse, *plan.info
    _check_inputs(q, k, v, names)
    _check_block_mask(block_mask)
    causal = check_flag(causal, "causal")     # (bool("no") is True: a flag is a bool or nothing)
    scale = check_scale(scale, q.shape[3])
    q, k, v = (x.detach().contiguous() for x in (q, k, v))    # a model's strided views: copied once, here
    with _launching(q):
        o, lse = _forward(q, k, v, causal, scale, block_mask, key)
    return q, k, v, o, lse, causal, scale


def _attend(q, k, v, causal, scale, block_mask, names=("q", "k", "v")):
    """``FlashAttention.apply`` where autograd will want the gradients; where it will not
    (``torch.no_grad()``, inference, or no input that requires grad) the forward alone: no
    graph node, nothing saved, and a few microseconds of the autograd function's own less."""
    if torch.is_grad_enabled() and (getattr(q, "requires_grad", False) or getattr(k, "requires_grad", False)
                                    or getattr(v, "requires_grad", False)):
        return FlashAttention.apply(q, k, v, causal, scale, block_mask)
    return _checked_forward(q, k, v, causal, scale, block_mask, names)[3]


class FlashAttention(torch.autograd.Function):
    """O = softmax(scale * Q K^T + mask) V with the chapters' kernels, forward and backward.

    ``FlashAttention.apply(q, k, v, causal, scale, block_mask)``: q (B, H, Nq, d), k and v
    (B, Hkv, Nk, d), H a multiple of Hkv; float32, float16 or bfloat16, CUDA or CPU; causal
    bottom-right aligned; scale None for 1/sqrt(d); block_mask a ``BlockMask`` or None.
    Saves q, k, v (contiguous: a strided view is copied once, in the forward), O and L (B*H*Nq
    floats) for the backward, never the N x N matrix P. Not twice differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None, block_mask=None):
        q, k, v, o, lse, causal, scale = _checked_forward(q, k, v, causal, scale, block_mask)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.options = (causal, scale, block_mask)
        return o

    @staticmethod
    def backward(ctx, do):
        if torch.is_grad_enabled():      # create_graph=True: a second derivative would come out as zero
            raise RuntimeError("FlashAttention: the kernels' gradients are not differentiable themselves "
                               "(backward with create_graph=True)")
        # (q, k, v are the inputs themselves where the forward replayed a plan, o an output:
        # both come back needing grad, which a first binding's array interface refuses)
        q, k, v, o, lse = ctx.saved_tensors
        q, k, v, o = q.detach(), k.detach(), v.detach(), o.detach()
        causal, scale, block_mask = ctx.options
        with _launching(q):
            dq, dk, dv = _backward(q, k, v, o, lse, do, causal, scale, block_mask)
        return dq, dk, dv, None, None, None


def attention(q, k, v, *, causal=False, scale=None, block_mask=None):
    """Attention with the course's kernels, differentiable: o (B, H, Nq, d) in q's dtype.

    q (B, H, Nq, d), k and v (B, Hkv, Nk, d) with H a multiple of Hkv; ``causal``
    bottom-right aligned (query i sees key j <= i + Nk - Nq); ``scale`` defaults to
    1/sqrt(d); ``block_mask`` a ``BlockMask`` (chapter 6) or None."""
    return _attend(q, k, v, causal, scale, block_mask)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, block_mask=None):
    """``torch.nn.functional.scaled_dot_product_attention``'s call, on the course's kernels.

    Takes what the kernels compute and refuses the rest by name: a dense ``attn_mask``
    (use ``block_mask=``, a ``BlockMask``, or ``is_causal``), ``dropout_p`` > 0, and
    ``is_causal`` with Nq != Nk (PyTorch aligns that mask top-left, the kernels bottom-right;
    ``attention(..., causal=True)`` gives the bottom-right one). 3-D inputs (H, N, d) are
    taken as B = 1."""
    if attn_mask is not None:
        raise ValueError("attn_mask: dense masks are not supported; pass is_causal=True or block_mask= "
                         "(a kernels.base.masks.BlockMask)")
    if dropout_p != 0.0:
        raise ValueError(f"dropout_p: expected 0.0 (no dropout), got {dropout_p!r}")
    is_causal, enable_gqa = check_flag(is_causal, "is_causal"), check_flag(enable_gqa, "enable_gqa")
    three_d = isinstance(query, torch.Tensor) and query.dim() == 3
    if three_d:
        query, key, value = (x.unsqueeze(0) if isinstance(x, torch.Tensor) else x for x in (query, key, value))
    _check_inputs(query, key, value, names=("query", "key", "value"))
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"key: {key.shape[1]} heads against query's {query.shape[1]}: pass enable_gqa=True "
                         "for grouped-query attention")
    if is_causal and query.shape[2] != key.shape[2]:
        raise ValueError(f"is_causal: with Nq = {query.shape[2]} != Nk = {key.shape[2]} PyTorch aligns the mask "
                         "top-left and the kernels bottom-right; use attention(..., causal=True) for bottom-right")
    out = _attend(query, key, value, is_causal, scale, block_mask, names=("query", "key", "value"))
    return out.squeeze(0) if three_d else out


# --------------------------------------------------------------------------- the fp32 rule, and the exercise
# The notebook's exercise: write the autograd function yourself (forward: chapter 4's launcher,
# saving what the backward needs; backward: chapter 5's). ``check_attention_function`` grades
# it on drawn cases under the fp32 rule, as tests/test_torch_attention.py grades ours.

def assert_fp32_rule(case, o, grads, do):
    """O and (dQ, dK, dV) of a ``kernels.base.testing.AttentionCase`` (k, v with Hkv heads)
    under the fp32 rule: each within 2x the error of plain float32 NumPy of the float64
    oracle, plus the floors; for grouped heads the oracle sees K and V repeated and dK, dV
    (and their floors) are summed over each group. ``do``: the upstream gradient (a tensor)."""
    from kernels import reference as ref
    from kernels.base.testing import Floor, assert_close, attention_floors, gradient_floor_scales, over_group

    def as64(t):
        return t.detach().cpu().double().numpy()

    hkv, group = case.k.shape[1], case.q.shape[1] // case.k.shape[1]
    q = case.q.astype(np.float32)
    k, v = (np.repeat(x.astype(np.float32), group, axis=1) for x in (case.k, case.v))
    kw = dict(causal=case.causal, scale=case.scale)
    o64, l64 = ref.attention(q, k, v, **kw)
    o32, _ = ref.attention(q, k, v, dtype=np.float32, **kw)
    assert isinstance(o, torch.Tensor) and o.dtype == torch.float32, f"O: expected a float32 tensor, got {o!r:.80}"
    assert tuple(o.shape) == case.q.shape, f"O: shape {tuple(o.shape)}, expected {case.q.shape}"
    assert_close(as64(o), o64, o32, name="O", floor_scale=attention_floors(q, k, v, **kw).o)
    args = (q, k, v, o64.astype(np.float32), l64.astype(np.float32), do.detach().cpu().float().numpy())
    exact = ref.attention_backward(*args, **kw)
    baseline = ref.attention_backward(*args, dtype=np.float32, **kw)
    floors = gradient_floor_scales(*args, **kw)
    for i, name in enumerate(("dQ", "dK", "dV")):
        e, b, f = exact[i], baseline[i], floors[i]
        if i:
            e, b, f = over_group(e, hkv), over_group(b, hkv), Floor(over_group(f.value, hkv), f.why)
        g = grads[i]
        assert g is not None, f"{name}: no gradient (did backward return it in the input's place?)"
        assert g.dtype == torch.float32 and tuple(g.shape) == e.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        assert_close(as64(g), e, b, name=name, floor_scale=f)


def check_attention_function_case(apply, case, seed=0):
    """The property: ``o = apply(q, k, v, causal, scale)`` and its gradients for a drawn dO
    meet the fp32 rule (``assert_fp32_rule``), q, k, v float32 tensors (B, H, N, d)."""
    device = "cuda" if torch.cuda.is_available() and not on_simulator() else "cpu"
    q, k, v = (torch.from_numpy(x).to(device).requires_grad_(True) for x in (case.q, case.k, case.v))
    o = apply(q, k, v, case.causal, case.scale)
    do = torch.from_numpy(np.random.default_rng(seed).standard_normal(case.q.shape).astype(np.float32)).to(device)
    o.backward(do)
    assert_fp32_rule(case, o, (q.grad, k.grad, v.grad), do)


def check_attention_function(apply, max_examples=None):
    """Exercise: write an autograd function (``MyAttention.apply(q, k, v, causal, scale)``)
    over chapter 4's forward and chapter 5's backward. Prints "passed" or the smallest
    failing case."""
    from hypothesis import strategies as st

    from kernels.base.testing import attention_cases, check_exercise

    sim = on_simulator()
    cases = attention_cases(max_n=10 if sim else 200, head_dims=[4, 8] if sim else [16, 64], dtypes=(np.float32,))
    return check_exercise(lambda drawn: check_attention_function_case(apply, *drawn),
                          st.tuples(cases, st.integers(0, 2**16)), max_examples=max_examples)
