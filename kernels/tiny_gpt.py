"""Capstone: a small character-level GPT whose attention is pluggable.

The model is a plain decoder-only transformer (GPT-2 shape, scaled down):

    x = token embedding + position embedding
    n_layer times:   x = x + Attention(LayerNorm(x))      (pre-LayerNorm, causal)
                     x = x + MLP(LayerNorm(x))            (Linear 4C, GELU, Linear C)
    logits = LayerNorm(x) @ Wteᵀ                          (output head tied to the embedding)

The one thing that is not fixed is attention itself. ``TinyGPT(config, attention)`` takes
any callable with the signature of ``torch.nn.functional.scaled_dot_product_attention``:

    o = attention(q, k, v, is_causal=True, enable_gqa=(Hkv != H))
    q: (B, H, T, d)    k, v: (B, Hkv, T, d)    o: (B, H, T, d)

q, k and v reach it as the non-contiguous views real models make (one projection, split,
viewed as (B, T, H, d), then transposed), so a drop-in attention must cope with strides.
Hkv < H is grouped-query attention: query head h reads key/value head h // (H / Hkv).

``train`` fits the model on the course's own text (README and slides, shipped with the
repository, nothing downloaded). The same seed gives the same initial weights and the same
batches, so two attentions can be compared loss for loss, step by step. It also reports
tokens per second and peak GPU memory, which is what the capstone compares.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[1]


# --- the data -------------------------------------------------------------------------

def corpus_text() -> str:
    """The course's own text: README.md, then slides/*.md in sorted order."""
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "slides").glob("*.md"))]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


class CharTokens:
    """One token per distinct character of ``text`` (ids in sorted character order)."""

    def __init__(self, text: str):
        if not isinstance(text, str) or not text:
            raise ValueError("text must be a non-empty str")
        self.chars = sorted(set(text))
        self.vocab_size = len(self.chars)
        self._id = {c: i for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - self._id.keys())
        if unknown:
            raise ValueError(f"text has characters outside the vocabulary: {unknown[:10]!r}")
        return torch.tensor([self._id[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids must lie in [0, {self.vocab_size}), got {bad[:10]}")
        return "".join(self.chars[i] for i in ids)


def batches(data: torch.Tensor, *, batch: int, block: int, generator: torch.Generator,
            device):
    """Endless random batches (x, y) of shape (batch, block); y is x shifted by one."""
    _positive_int("batch", batch)
    _positive_int("block", block)
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        raise ValueError("data must be a 1-D tensor of token ids")
    if block > len(data) - 1:
        raise ValueError(f"block ({block}) must be at most len(data) - 1 ({len(data) - 1})")
    while True:
        # start offsets i in [0, len - block - 1]: y = data[i+1 : i+block+1] stays in range
        starts = torch.randint(len(data) - block, (batch,), generator=generator)
        x = torch.stack([data[i:i + block] for i in starts.tolist()])
        y = torch.stack([data[i + 1:i + block + 1] for i in starts.tolist()])
        yield x.to(device), y.to(device)


# --- the model ------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int = 256       # longest context, in characters
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256           # C; head dim d = C / n_head
    n_kv_head: int | None = None    # grouped-query attention when < n_head; None = n_head

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            _positive_int(name, getattr(self, name))
        if self.n_kv_head is not None:
            _positive_int("n_kv_head", self.n_kv_head)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"n_kv_head ({self.n_kv_head}) must divide "
                                 f"n_head ({self.n_head})")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by "
                             f"n_head ({self.n_head})")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, attention):
        super().__init__()
        self.H, self.Hkv, self.d = config.n_head, config.kv_heads, config.head_dim
        # one projection for q (H heads) and k, v (Hkv heads each)
        self.qkv = nn.Linear(config.n_embd, (self.H + 2 * self.Hkv) * self.d, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.attention = attention

    def forward(self, x):
        B, T, C = x.shape
        H, Hkv, d = self.H, self.Hkv, self.d
        q, k, v = self.qkv(x).split([H * d, Hkv * d, Hkv * d], dim=2)
        # (B, T, heads, d) -> (B, heads, T, d): strided views, as in real models
        q = q.view(B, T, H, d).transpose(1, 2)
        k = k.view(B, T, Hkv, d).transpose(1, 2)
        v = v.view(B, T, Hkv, d).transpose(1, 2)
        o = self.attention(q, k, v, is_causal=True, enable_gqa=(Hkv != H))
        if tuple(o.shape) != (B, H, T, d):
            raise ValueError(f"attention returned shape {tuple(o.shape)}, "
                             f"expected {(B, H, T, d)}")
        return self.proj(o.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, attention)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, config: GPTConfig, attention):
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        if not callable(attention):
            raise TypeError("attention must be callable like "
                            "torch.nn.functional.scaled_dot_product_attention")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.head.weight = self.wte.weight          # tied output head
        self.apply(self._init_weights)
        # GPT-2: shrink the residual projections so the residual stream starts small
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        """idx (B, T) token ids -> logits (B, T, vocab), and the mean cross-entropy loss
        against targets (B, T) when given (else None)."""
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2:
            raise ValueError("idx must be a (B, T) tensor of token ids")
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"idx has T = {T} positions, more than "
                             f"block_size = {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T))
        return logits, loss


# --- training -------------------------------------------------------------------------

def train(config: GPTConfig, attention, *, steps: int, batch: int, lr: float = 3e-4,
          seed: int = 0, device="cpu", dtype=torch.float32, text: str | None = None,
          log_every: int = 1, eval_batches: int = 4) -> dict:
    """Train TinyGPT(config, attention) with AdamW on ``text`` (default: the course's own
    text) and return what the capstone compares:

        losses              training loss of every step (floats)
        val_loss            mean loss over ``eval_batches`` held-out batches (last 10 %)
        tokens_per_s        training throughput after the first step (None when steps = 1)
        peak_memory_bytes   torch.cuda.max_memory_allocated on CUDA, None on CPU
        steps, config, model, tokens

    The same seed gives the same initial weights and the same batches. float32 runs with
    no autocast; bfloat16 or float16 (CUDA only) run the forward under torch.autocast
    with float32 weights (float16 also scales the loss). ``log_every`` prints the loss
    every that many steps (0: silent).
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    _positive_int("steps", steps)
    _positive_int("batch", batch)
    _positive_int("eval_batches", eval_batches)
    if not isinstance(log_every, int) or isinstance(log_every, bool) or log_every < 0:
        raise ValueError(f"log_every must be an int >= 0, got {log_every!r}")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    device = torch.device(device)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, bfloat16 or float16, got {dtype}")
    if device.type != "cuda" and dtype != torch.float32:
        raise ValueError(f"dtype {dtype} needs a CUDA device; on {device.type} use float32")
    on_cuda = device.type == "cuda"

    # data: 90 % train, 10 % validation
    text = corpus_text() if text is None else text
    tokens = CharTokens(text)
    if config.vocab_size < tokens.vocab_size:
        raise ValueError(f"vocab_size ({config.vocab_size}) is smaller than the text's "
                         f"{tokens.vocab_size} characters")
    data = tokens.encode(text)
    n_train = int(0.9 * len(data))
    train_data, val_data = data[:n_train], data[n_train:]
    if config.block_size > len(val_data) - 1:
        raise ValueError(f"block_size ({config.block_size}) must be at most "
                         f"len(data) - 1 of the validation split ({len(val_data) - 1}); "
                         "use a longer text or a shorter block")

    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(seed)                 # same seed -> same initial weights
    model = TinyGPT(config, attention).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    scaler = torch.amp.GradScaler("cuda", enabled=(dtype == torch.float16))
    gen = torch.Generator().manual_seed(seed)     # same seed -> same batches
    stream = batches(train_data, batch=batch, block=config.block_size, generator=gen,
                     device=device)

    def autocast():
        return torch.autocast(device_type="cuda", dtype=dtype,
                              enabled=on_cuda and dtype != torch.float32)

    def sync():
        if on_cuda:
            torch.cuda.synchronize(device)

    model.train()
    losses = []                 # kept on the device: no sync a step unless we print
    t0 = None
    for step in range(steps):
        x, y = next(stream)
        with autocast():
            _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}  loss {loss.item():.4f}")
        if step == 0:           # time from the end of the first step (warm-up, compiles)
            sync()
            t0 = time.perf_counter()
    sync()
    elapsed = time.perf_counter() - t0
    tokens_per_s = (steps - 1) * batch * config.block_size / elapsed if steps > 1 else None

    # validation loss, no gradients
    model.eval()
    val_gen = torch.Generator().manual_seed(seed + 1)
    val_stream = batches(val_data, batch=batch, block=config.block_size, generator=val_gen,
                         device=device)
    with torch.no_grad(), autocast():
        val = [model(*next(val_stream))[1].float() for _ in range(eval_batches)]
    return dict(
        losses=torch.stack(losses).float().tolist(),
        val_loss=torch.stack(val).mean().item(),
        tokens_per_s=tokens_per_s,
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if on_cuda else None,
        steps=steps,
        config=config,
        model=model,
        tokens=tokens,
    )


@torch.no_grad()
def sample(model: TinyGPT, tokens: CharTokens, prompt: str, n: int, *, seed=0,
           temperature: float = 1.0) -> str:
    """Continue ``prompt`` by ``n`` characters. temperature 0 picks the most likely
    character (greedy); otherwise characters are drawn from softmax(logits / temperature)."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty str")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    idx = tokens.encode(prompt)[None].to(device)
    was_training = model.training
    model.eval()
    for _ in range(n):
        logits, _ = model(idx[:, -model.config.block_size:])   # crop to the context
        last = logits[0, -1].float().cpu()
        if temperature == 0:
            nxt = last.argmax()
        else:
            nxt = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen)[0]
        idx = torch.cat([idx, nxt.view(1, 1).to(device)], dim=1)
    model.train(was_training)
    return tokens.decode(idx[0])


def _positive_int(name, value):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
