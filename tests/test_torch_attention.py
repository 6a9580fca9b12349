"""The capstone's PyTorch attention (kernels/torch_attention.py) against the float64 oracle,
against the chapters' launchers it wraps, and against PyTorch's SDPA on a GPU.

float32 is held to the fp32 rule (each of O, dQ, dK, dV within 2x the error of plain float32
NumPy of the float64 oracle, plus the floors), with the model's layout: q, k, v made as
(B, N, H, d) and viewed (B, H, N, d) by transpose (not contiguous), grouped-query heads,
causal, ragged N. float16 and bfloat16 must give exactly what chapters 8 and 12 give for the
same inputs (their own tests hold them to the oracle), cast to the input type. Also: the
SDPA-shaped call's refusals, bad input named, the caller's stream and allocator on a GPU.
"""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from kernels import reference as ref                                              # noqa: E402
from kernels.base.masks import BlockMask                                          # noqa: E402
from kernels.base.runtime import on_simulator                                     # noqa: E402
from kernels.base.testing import (gpu_examples, assert_close, attention_floors, case_with,  # noqa: E402
                                  gradient_floor_scales, grouped_attention_cases, over_group)
from kernels.flash_backward import flash_attention_backward                       # noqa: E402
from kernels.flash_forward import flash_attention                                 # noqa: E402
from kernels.tiny_gpt import CharTokens, GPTConfig, corpus_text, train            # noqa: E402
from kernels.torch_attention import (FlashAttention, as_tensor_like, assert_fp32_rule, attention,  # noqa: E402
                                     check_attention_function, check_attention_function_case, kernel_array,
                                     scaled_dot_product_attention)

SIM = on_simulator()
DEVICE = "cpu" if SIM or not torch.cuda.is_available() else "cuda"
MAX_N = 17 if SIM else 300
HEAD_DIMS = [4, 8] if SIM else [8, 20, 64, 128]


def as_model_layout(x, requires_grad=True, dtype=torch.float32):
    """A (B, H, N, d) array as a model makes it: a (B, N, H, d) tensor viewed by transpose."""
    t = torch.from_numpy(np.ascontiguousarray(np.asarray(x).transpose(0, 2, 1, 3))).to(DEVICE, dtype)
    t = t.transpose(1, 2)
    return t.requires_grad_(requires_grad)


def numpy64(t):
    return t.detach().cpu().double().numpy()


def run(case, seed=1, dtype=torch.float32, call=None):
    """o and (dq, dk, dv) through the autograd function for a case, dO drawn."""
    q, k, v = (as_model_layout(x, dtype=dtype) for x in (case.q, case.k, case.v))
    assert not q.is_contiguous() or q.shape[1] == 1 or q.shape[2] <= 1, "the model's layout is a strided view"
    do = torch.from_numpy(np.random.default_rng(seed).standard_normal(case.q.shape).astype(np.float32))
    do = do.to(DEVICE, dtype)
    call = call or (lambda q, k, v: attention(q, k, v, causal=case.causal, scale=case.scale))
    o = call(q, k, v)
    o.backward(do)
    return o, (q.grad, k.grad, v.grad), (q, k, v, do)


def cases():
    return grouped_attention_cases(max_n=MAX_N, head_dims=HEAD_DIMS, small=SIM, dtype=np.float32)


def pinned(q_shape, k_shape, **kw):
    return case_with(q_shape, k_shape, dtype=np.float32, **kw)


@given(case=cases(), seed=st.integers(0, 2**16))
@settings(max_examples=2 if SIM else gpu_examples(60))
@example(case=pinned((1, 2, 9, 8), (1, 1, 9, 8), causal=True), seed=0)        # GQA, causal, the model's layout
@example(case=pinned((1, 1, 7, 4), (1, 1, 3, 4), causal=True), seed=1)        # Nq > Nk: rows that see no key
@example(case=pinned((1, 1, 1, 8), (1, 1, 1, 8)), seed=2)                     # N = 1
def test_fp32_gradients_match_the_oracle(case, seed):
    """The autograd function end to end under the fp32 rule: forward (chapter 4's launcher),
    backward (chapter 5's, or chapter 11's for grouped heads on a GPU), GQA's dK, dV summed
    over each group, strided (B, N, H, d) inputs."""
    o, grads, (_, _, _, do) = run(case, seed)
    assert_fp32_rule(case, o, grads, do)
    if case.causal and case.q.shape[2] > case.k.shape[2]:
        dead = case.q.shape[2] - case.k.shape[2]
        assert (o[..., :dead, :] == 0).all() and (grads[0][..., :dead, :] == 0).all(), "rows that see no key"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_16bit_is_what_chapters_8_and_12_compute(dtype, causal):
    """fp16 and bf16: O from chapter 8's forward and the gradients from chapter 12's backward
    (grouped heads native), cast to the input type: the wrapper adds nothing of its own."""
    from kernels.flash_tensor_cores import flash_attention_tc
    from kernels.tensor_core_backward import flash_attention_backward_tc

    case = pinned((1, 2, 11, 8), (1, 1, 13, 8), causal=causal, seed=5)
    o, grads, (q, k, v, do) = run(case, seed=6, dtype=dtype)
    bf16 = dtype == torch.bfloat16
    kw = dict(causal=causal, bf16=bf16)

    def arrays(*ts):
        if DEVICE == "cuda":
            return [t.detach().contiguous() for t in ts]
        return [t.detach().contiguous().view(torch.int16).numpy().view(np.uint16) if bf16
                else t.detach().contiguous().numpy() for t in ts]

    kr, vr = (x.detach().repeat_interleave(2, dim=1) for x in (k, v))
    o_want, lse = flash_attention_tc(*arrays(q, kr, vr), **kw)
    o_want = torch.as_tensor(o_want, device=DEVICE).to(dtype)
    assert o.dtype == dtype and torch.equal(o.detach(), o_want), "O: chapter 8's, cast to the input type"
    want = flash_attention_backward_tc(*arrays(q, k, v, o_want), torch.as_tensor(lse).numpy()
                                       if DEVICE == "cpu" else lse, *arrays(do), **kw)
    for name, g, w in zip(("dQ", "dK", "dV"), grads, want):
        w = torch.as_tensor(w, device=DEVICE)
        assert g.dtype == dtype and g.shape == w.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        # dQ's float32 atomic adds may land in another order on a GPU: a last-bit difference
        # of float32 can round to the neighbouring 16-bit value.
        one_ulp = (w.abs().max().item() or 1.0) * (2.0 ** -7 if bf16 else 2.0 ** -10)
        assert (g.float() - w.to(dtype).float()).abs().max().item() <= (one_ulp if name == "dQ" else 0.0), name


def test_block_mask_follows_chapter_6():
    """A block mask: O and gradients under the fp32 rule against the masked oracle."""
    case = pinned((1, 1, 12, 8), (1, 1, 12, 8), seed=7)
    flags = np.array([[True, False, True], [False, True, False], [True, True, True]])
    mask = BlockMask(flags, 4, 4)
    q, k, v = (as_model_layout(x) for x in (case.q, case.k, case.v))
    o = attention(q, k, v, block_mask=mask)
    do = torch.ones_like(o)
    o.backward(do)
    q32, k32, v32 = case.q, case.k, case.v
    o64, l64 = ref.attention(q32, k32, v32, block_mask=mask)
    o32, _ = ref.attention(q32, k32, v32, block_mask=mask, dtype=np.float32)
    assert_close(numpy64(o), o64, o32, name="O", floor_scale=attention_floors(q32, k32, v32, block_mask=mask).o)
    args = (q32, k32, v32, o64.astype(np.float32), l64.astype(np.float32), np.ones_like(q32))
    exact = ref.attention_backward(*args, block_mask=mask)
    base = ref.attention_backward(*args, block_mask=mask, dtype=np.float32)
    floors = gradient_floor_scales(*args, block_mask=mask)
    for name, g, e, b, f in zip(("dQ", "dK", "dV"), (q.grad, k.grad, v.grad), exact, base, floors):
        assert_close(numpy64(g), e, b, name=name, floor_scale=f)


def test_sdpa_signature_matches_attention():
    """The SDPA-shaped call (is_causal, scale, enable_gqa, 3-D inputs) gives what attention() does."""
    case = pinned((1, 2, 6, 4), (1, 1, 6, 4), causal=True, seed=9)
    q, k, v = (torch.from_numpy(x).to(DEVICE) for x in (case.q, case.k, case.v))
    a = attention(q, k, v, causal=True, scale=0.3)
    b = scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    assert torch.equal(a, b)
    c = scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True, scale=0.3, enable_gqa=True)
    assert c.shape == q[0].shape and torch.equal(c, a[0])


def test_a_call_autograd_will_not_differentiate_makes_no_graph():
    """Under no_grad, or with no input that requires grad, attention() and the SDPA-shaped call
    run the forward alone: the same O as the autograd function's, no graph node; with an input
    that requires grad the output carries FlashAttention's backward."""
    case = pinned((1, 2, 6, 4), (1, 1, 6, 4), causal=True, seed=5)
    q, k, v = (torch.from_numpy(x).to(DEVICE) for x in (case.q, case.k, case.v))
    tracked = attention(q.requires_grad_(), k, v, causal=True)
    assert type(tracked.grad_fn).__name__ == "FlashAttentionBackward"
    q = q.detach()
    with torch.no_grad():
        untracked = attention(q.clone().requires_grad_(), k, v, causal=True)
    plain = attention(q, k, v, causal=True)
    sdpa = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for o in (untracked, plain, sdpa):
        assert o.grad_fn is None and not o.requires_grad
        assert torch.equal(o, tracked.detach())
    with torch.no_grad(), pytest.raises(TypeError, match="^query: expected dtype"):
        scaled_dot_product_attention(q.double(), k, v)


def test_not_twice_differentiable():
    """The kernels' gradients are not differentiable themselves: a second derivative is
    refused, not silently zero."""
    q, k, v = (torch.randn(1, 1, 5, 4, device=DEVICE, requires_grad=True) for _ in range(3))
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(attention(q, k, v).sum(), (q,), create_graph=True)


def test_empty_sequences_give_zeros():
    q = torch.zeros(1, 1, 0, 4, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 1, 3, 4, device=DEVICE, requires_grad=True)
    v = torch.randn(1, 1, 3, 4, device=DEVICE, requires_grad=True)
    o = attention(q, k, v)
    o.sum().backward()
    assert o.shape == (1, 1, 0, 4) and (k.grad == 0).all() and (v.grad == 0).all()


# --------------------------------------------------------------------------- a model trains with it (CI: the simulator)

def test_tiny_gpt_trains_with_the_kernels():
    """Three steps of a one-layer TinyGPT with our attention and with SDPA from the same
    seed: the same losses (float32, to a few ulps of the loss), then the trained models'
    validation losses too. In the simulator this is the capstone's training loop, end to end."""
    vocab = CharTokens(corpus_text()).vocab_size
    config = GPTConfig(vocab, block_size=16, n_layer=1, n_head=2, n_embd=16, n_kv_head=1)
    runs = [train(config, attn, steps=3, batch=2, seed=3, device=DEVICE, log_every=0, eval_batches=1)
            for attn in (scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)]
    ours, sdpa = runs
    assert ours["losses"][0] > ours["losses"][-1] - 0.5, "three steps of training move the loss little"
    np.testing.assert_allclose(ours["losses"], sdpa["losses"], rtol=2e-5)
    np.testing.assert_allclose(ours["val_loss"], sdpa["val_loss"], rtol=2e-5)


# --------------------------------------------------------------------------- the exercise

def learners_function(backward_causal=True, backward_scale=True):
    """An autograd function as the notebook's exercise asks for (chapter 4's forward, chapter
    5's backward), or with a planted mistake: the backward's causal or scale forgotten."""
    class MyAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale):
            o, lse = flash_attention(kernel_array(q), kernel_array(k), kernel_array(v), causal=causal, scale=scale)
            o, lse = as_tensor_like(o, q), as_tensor_like(lse, q)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.causal, ctx.scale = causal, scale
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, o, lse = ctx.saved_tensors
            grads = flash_attention_backward(*(kernel_array(x) for x in (q, k, v, o, lse, do)),
                                             causal=ctx.causal if backward_causal else False,
                                             scale=ctx.scale if backward_scale else None)
            return (*(as_tensor_like(g, q) for g in grads), None, None)

    return MyAttention.apply


def test_exercise_checker_passes_a_right_function(capsys):
    assert check_attention_function(learners_function(), max_examples=2 if SIM else 20)
    assert "passed" in capsys.readouterr().out


@pytest.mark.parametrize("mistake", ["backward_causal", "backward_scale"])
def test_exercise_checker_catches_mistakes(mistake):
    """The checker's property fails on a causal case with scale 0.3 (not 1/sqrt(d)) when the backward forgets
    either (and passes the right function on the same case)."""
    case = pinned((1, 1, 9, 4), (1, 1, 9, 4), causal=True, scale=0.3, seed=4)
    check_attention_function_case(learners_function(), case)
    with pytest.raises(AssertionError, match="^d[QKV]"):
        check_attention_function_case(learners_function(**{mistake: False}), case)


# --------------------------------------------------------------------------- refusals and bad input

def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(attn_mask=_t(4, 4)), ValueError, "attn_mask"),
    (dict(dropout_p=0.1), ValueError, "dropout_p"),
    (dict(is_causal=True, key=_t(1, 2, 5, 8), value=_t(1, 2, 5, 8)), ValueError, "is_causal"),
    (dict(key=_t(1, 1, 4, 8), value=_t(1, 1, 4, 8)), ValueError, "enable_gqa"),
    (dict(query=_t(1, 2, 4, 8, dtype=torch.float64)), TypeError, "query"),
    (dict(query=_t(2, 4, 8, 1, 1)), ValueError, "query"),
    (dict(key=_t(1, 2, 4, 8, dtype=torch.float16)), TypeError, "query, key, value"),
    (dict(value=_t(1, 2, 5, 8)), ValueError, "value"),
    (dict(key=_t(1, 3, 4, 8), value=_t(1, 3, 4, 8), enable_gqa=True), ValueError, "key"),
    (dict(query=_t(1, 2, 4, 136), key=_t(1, 2, 4, 136), value=_t(1, 2, 4, 136)), ValueError, "query"),
    (dict(query=np.zeros((1, 2, 4, 8), np.float32)), TypeError, "query"),
    (dict(block_mask=np.ones((1, 1), bool)), TypeError, "block_mask"),
    (dict(query=_t(2, 32768, 0, 8), key=_t(2, 32768, 4, 8), value=_t(2, 32768, 4, 8)), ValueError, "query.*B\\*H"),
    (dict(scale=-1.0), ValueError, "scale"),
    (dict(is_causal="no"), TypeError, "is_causal"),          # bool("no") is True: refused, not read as a mask
    (dict(is_causal=None), TypeError, "is_causal"),
    (dict(enable_gqa=1), TypeError, "enable_gqa"),
])
def test_bad_input_is_named(kwargs, error, words):
    args = dict(query=_t(1, 2, 4, 8), key=_t(1, 2, 4, 8), value=_t(1, 2, 4, 8))
    args.update(kwargs)
    with pytest.raises(error, match=words):
        scaled_dot_product_attention(**args)


@pytest.mark.parametrize("causal", ["no", None, 1, 0.0])
def test_attention_refuses_a_causal_that_is_not_a_flag(causal):
    """``causal`` is True or False (NumPy's bool too): anything else is refused by name before any launch,
    where ``bool()`` would have turned "no" into a causal mask and None into none."""
    with pytest.raises(TypeError, match="^causal: expected True or False"):
        attention(_t(1, 1, 4, 8), _t(1, 1, 4, 8), _t(1, 1, 4, 8), causal=causal)
    assert attention(_t(1, 1, 4, 8), _t(1, 1, 4, 8), _t(1, 1, 4, 8), causal=np.bool_(True)).shape == (1, 1, 4, 8)


# --------------------------------------------------------------------------- a GPU: SDPA, streams, allocator

gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU (PyTorch CUDA tensors)")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_against_pytorch_sdpa(dtype):
    """Against SDPA on the same tensors: each of O, dQ, dK, dV within 2x SDPA's own error
    against the float64 oracle (plus the floors), B=2 H=8 N=1000 d=64 causal, GQA 8:2."""
    torch.backends.cuda.matmul.allow_tf32 = False
    case = pinned((2, 8, 1000, 64), (2, 2, 1000, 64), causal=True, seed=11)
    ours = run(case, seed=12, dtype=dtype)
    sdpa = run(case, seed=12, dtype=dtype, call=lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True))
    kr, vr = (np.repeat(x, 4, axis=1) for x in (case.k, case.v))
    o64, l64 = ref.attention(case.q, kr, vr, causal=True)
    do = ours[2][3].float().cpu().numpy()
    exact = (o64, *ref.attention_backward(case.q, kr, vr, o64.astype(np.float32), l64.astype(np.float32), do,
                                          causal=True))
    exact = exact[:2] + tuple(over_group(e, 2) for e in exact[2:])
    for i, name in enumerate(("O", "dQ", "dK", "dV")):
        got = numpy64(ours[0] if i == 0 else ours[1][i - 1])
        peer = numpy64(sdpa[0] if i == 0 else sdpa[1][i - 1])
        assert_close(got, exact[i], peer, name=f"{name} vs SDPA's error")


@gpu
def test_launches_on_the_callers_stream():
    """On a side stream (PyTorch's are non-blocking), inputs made there and results used
    there: without the launch on that stream the kernels would race the side stream's
    queued work. A long matmul chain queued first makes a race visible. Twice: the first call
    records the call shape's plan, the second replays it."""
    case = pinned((4, 8, 512, 64), (4, 8, 512, 64), causal=True, seed=13)
    want, _ = ref.attention(case.q, case.k, case.v, causal=True)
    floors = attention_floors(case.q, case.k, case.v, causal=True).o
    o32, _ = ref.attention(case.q, case.k, case.v, causal=True, dtype=np.float32)
    side = torch.cuda.Stream()
    for call in ("first call", "replayed"):
        with torch.cuda.stream(side):
            big = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):
                big = (big @ big / 64.0).clamp_(-1.0, 1.0)  # ~50 ms of work ahead of q on this stream
            q = torch.from_numpy(case.q).to("cuda", non_blocking=True) + 0.0 * big[0, 0]
            k, v = (torch.from_numpy(x).to("cuda") for x in (case.k, case.v))
            o = attention(q, k, v, causal=True)
            o_host = o.to("cpu", non_blocking=False)
        side.synchronize()
        assert_close(o_host.double().numpy(), want, o32, name=f"O on a side stream, {call}", floor_scale=floors)


@gpu
def test_results_come_from_pytorchs_allocator():
    """O, dQ, dK, dV are PyTorch tensors from its caching allocator (counted by
    torch.cuda.memory_allocated), not cudaMallocs of Numba's."""
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
    before = torch.cuda.memory_allocated()
    o = FlashAttention.apply(q, k, v, True, None, None)
    assert torch.cuda.memory_allocated() - before >= o.numel() * 4
    o.sum().backward()
    assert all(isinstance(g, torch.Tensor) and g.is_cuda for g in (q.grad, k.grad, v.grad))


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_a_call_shape_seen_before_replays_its_plan(dtype, monkeypatch):
    """A call shape's first call records its plan (kernels/base/plans.py) and later calls
    replay it, with the launchers' checked entries out of the way (a replay that called them
    would fail here): O bit for bit what the long way gives on the same new data, the
    gradients to the dtype's tolerance (the backward's atomic adds come in any order), for
    grouped-query causal attention with ragged N; another flag or scale is another plan; an
    input 4 bytes off a 16-byte boundary declines its plan and goes the long way."""
    import kernels.flash_tensor_cores
    import kernels.flash_tf32
    import kernels.tensor_core_backward
    import kernels.tf32_backward
    from kernels import torch_attention

    def draw(seed, offset=0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        shapes = ((2, 4, 100, 64), (2, 2, 130, 64), (2, 2, 130, 64), (2, 4, 100, 64))
        out = []
        for shape in shapes:
            n = int(np.prod(shape))
            whole = torch.randn(n + offset, device="cuda", generator=g).to(dtype)
            out.append(whole[offset:].view(shape))
        return out

    def fwd_bwd(q, k, v, do, causal=True, scale=None):
        q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
        o = attention(q, k, v, causal=causal, scale=scale)
        o.backward(do)
        return o.detach(), q.grad, k.grad, v.grad

    def long_way(*args, **kw):
        torch_attention._forward_plans.clear()
        torch_attention._backward_plans.clear()
        return fwd_bwd(*args, **kw)

    def same(replayed, long, what):
        torch.testing.assert_close(replayed[0], long[0], rtol=0, atol=0, msg=f"O {what}")
        for name, a, b in zip(("dQ", "dK", "dV"), replayed[1:], long[1:]):
            torch.testing.assert_close(a, b, msg=f"{name} {what}")

    first, second = draw(0), draw(1)
    want = long_way(*second)
    long_way(*first)                                             # records both plans
    assert len(torch_attention._forward_plans) == len(torch_attention._backward_plans) == 1

    def refuse(*args, **kw):
        raise AssertionError("the long way ran where the plan should have been replayed")
    for module in (kernels.flash_tf32, kernels.flash_tensor_cores, kernels.tf32_backward,
                   kernels.tensor_core_backward):
        monkeypatch.setattr(module, module.__name__.endswith("backward") and "backward_checked"
                            or "forward_checked", refuse)
    same(fwd_bwd(*second), want, "replayed")
    model_layout = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in second[:3]]   # (B, N, H, d) viewed
    assert not model_layout[0].is_contiguous()
    same(fwd_bwd(*model_layout, second[3]), want, "replayed on the model's layout (copied once)")
    with pytest.raises(AssertionError, match="the long way ran"):
        fwd_bwd(*second, causal=False)                           # another key: no plan yet
    monkeypatch.undo()
    same(fwd_bwd(*second, causal=False, scale=0.3), long_way(*second, causal=False, scale=0.3), "not causal")
    long_way(*first)                                             # the aligned plan, then 4 bytes off
    off = draw(1, offset=4 // torch.tensor([], dtype=dtype).element_size())
    assert all(x.data_ptr() % 16 == 4 for x in off)
    replayed = fwd_bwd(*off)
    same(replayed, long_way(*off), "4 bytes off")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_replayed_forward_with_grad_then_a_first_backward(dtype):
    """The order a benchmark or an evaluation loop makes: a shape's first call under no_grad
    records the forward's plan; the next, with grad, replays it, and the backward binds its
    launches for the first time on the tensors autograd saved (inputs that require grad):
    the gradients against a long way's."""
    import kernels.tensor_core_backward
    import kernels.tf32_backward
    from kernels import torch_attention

    torch_attention._forward_plans.clear()
    torch_attention._backward_plans.clear()
    kernels.tensor_core_backward._launches.clear()
    kernels.tf32_backward._launches.clear()
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, 90, 32, device="cuda", generator=g, dtype=dtype) for _ in range(4))
    with torch.no_grad():
        attention(q, k, v)
    grads = []
    for _ in range(2):
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        attention(qg, kg, vg).backward(do)
        grads.append((qg.grad, kg.grad, vg.grad))
        torch_attention._forward_plans.clear()                   # the second time: the long way
        torch_attention._backward_plans.clear()
    for name, a, b in zip(("dQ", "dK", "dV"), *grads):
        torch.testing.assert_close(a, b, msg=name)
