"""Who touched which element: memory-access pictures of a kernel, from the CUDA simulator.

A traced launch runs a kernel in the Numba CUDA simulator, where every GPU thread is a
Python thread, and records which thread (block, thread) read or wrote which element of
which array: the kernel's global arrays (its array arguments) and its shared-memory
arrays (``cuda.shared.array``). The kernel is written and launched as usual::

    from kernels.base.trace import trace, tracing

    t = trace(kernel, grid, block, x, out)     # runs kernel[grid, block](x, out), traced
    print(t.table())                           # reads, writes, bytes a array; global vs shared
    t["out"].by_thread[(0, 3)]                 # Counts(reads, writes) of block 0, thread 3
    t["buf"].elements("read", block=0, thread=3)   # the elements that thread read
    t.draw(highlight=(0, 3))                   # a matplotlib figure, one row a array

    with tracing() as launches:                # every launch inside, by any launcher
        gpu_basics.block_sums(x, threads=8)
    launches[0].draw("buf")

What counts as an access: one element read (``v = a[i, j]``) or written (``a[i] = v``);
``a[i] += v`` is a read and a write; an atomic (``cuda.atomic.add``) is one read and one
write. Registers and ``cuda.local.array`` are not memory traffic here and are not
recorded. A row taken as a view (``row = a[i]``) is still traced, element by element.
Bytes are accesses times the element size, as the threads issue them: caches and the
coalescing of a warp's loads into 128-byte transactions are not modelled (a picture
shows the pattern: a warp's 32 threads on 32 neighbouring elements is one transaction).

Each thread also counts the barriers (``cuda.syncthreads()``) it has passed: its
*phase*. ``phase=k`` in ``draw`` and ``elements`` keeps the accesses made between the
k-th and the (k+1)-th barrier: one step of a tiled loop.

Each block has its own copy of a shared array; a drawing of one shows one block (the
first, or the one asked for). Counts are exact however long the kernel runs; the list
of individual accesses (who touched which element: what the drawings and ``elements``
use) keeps the first ``max_events`` (``MAX_EVENTS``), so a kernel of a few thousand
accesses stays fast and a long one says what it left out.

With a GPU present the traced kernel still runs in the simulator, from its Python source
(device arrays are copied to the host and back): a trace is a picture, not a measurement.
"""

from __future__ import annotations

import inspect
import linecache
import math
import re
import sys
import threading
from collections import namedtuple
from contextlib import contextmanager

import numpy as np

from kernels.base.testing import CountingArray

MAX_EVENTS = 50_000          # individual accesses kept a launch (counts are always exact)
WARP = 32
AUTO_GROUPS = 16             # color_by="auto": the finest grouping with at most this many colours
MAX_STRIPES = 4              # a cell touched by more thread groups than this is drawn grey
READ, WRITE = 0, 1
_KINDS = {"read": READ, "reads": READ, "r": READ, "write": WRITE, "writes": WRITE, "w": WRITE}
_INTS = (int, np.integer)

Counts = namedtuple("Counts", "reads writes")
Access = namedtuple("Access", "kind block thread index phase")
# GPU-Puzzles' score: what one thread does, global and shared memory apart.
Score = namedtuple("Score", "global_reads global_writes shared_reads shared_writes")


def _kind(kind) -> int:
    try:
        return _KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"kind: expected 'read' or 'write', got {kind!r}") from None


def _whoami():
    """((block x, y, z), (thread x, y, z)) and the barriers passed, of the simulated
    thread running now; None outside a kernel (host code looking at an array)."""
    me = threading.current_thread()
    who = getattr(me, "_trace_who", None)
    if who is None:
        block = getattr(me, "blockIdx", None)
        if block is None:
            return None
        t = me.threadIdx
        who = me._trace_who = ((block.x, block.y, block.z), (t.x, t.y, t.z))
    return who, getattr(me, "_trace_phase", 0)


# --------------------------------------------------------------------------- what the kernel sees

class TracedArray(CountingArray):
    """What a traced kernel indexes in place of an array: a ``CountingArray`` (``reads``
    and ``writes`` list the element indices in order, up to the trace's cap) that also
    records which simulated thread made each access (``readers``, ``writers``: parallel
    lists of ((block, thread), phase)). A sub-array (``a[i]`` of a 2-D array, a slice) is
    a TracedArray too, whose accesses are recorded against the whole array."""

    def __init__(self, array, record, root=None, index_map=None):
        super().__init__(array)
        self.size = array.size
        self._record = record
        self._root = self if root is None else root
        self._map = index_map          # a view: the root's flat index of each of its elements
        if root is None:
            self.readers, self.writers = [], []

    def __len__(self):
        return len(self.array)

    def __getattr__(self, name):       # strides, itemsize, nbytes, ...: the array's own
        if name.startswith("_") or name == "array":
            raise AttributeError(name)
        return getattr(self.array, name)

    @property
    def T(self):
        return TracedArray(self.array.T, self._record, self._root, self._index_map().T)

    def _index_map(self):
        if self._map is not None:
            return self._map
        root = self._root
        if getattr(root, "_flat_map", None) is None:
            root._flat_map = np.arange(root.size).reshape(root.shape)
        return root._flat_map

    def _locate(self, index):
        """(flat position, index tuple) in the whole array of the element ``index`` names,
        or None when it names a sub-array. Call after the array itself accepted ``index``."""
        if not isinstance(index, tuple):
            index = (index,)
        if len(index) != self.ndim or not all(isinstance(i, _INTS) and not isinstance(i, bool) for i in index):
            return None
        if self._map is not None:
            flat = int(self._map[index])
            return flat, tuple(int(i) for i in np.unravel_index(flat, self._root.shape))
        flat, key = 0, []
        for i, n in zip(index, self.shape):
            i = int(i)
            i = i + n if i < 0 else i
            flat = flat * n + i
            key.append(i)
        return flat, tuple(key)

    def __getitem__(self, index):
        value = self.array[index]      # out of bounds raises here, as in the simulator
        where = self._locate(index)
        if where is None:
            return TracedArray(value, self._record, self._root, self._index_map()[index])
        self._record.access(READ, *where)
        return value

    def __setitem__(self, index, value):
        self.array[index] = value
        where = self._locate(index)
        if where is None:              # a whole slice assigned: each element written
            shape = self._root.shape
            for flat in np.ravel(self._index_map()[index]):
                self._record.access(WRITE, int(flat), tuple(int(i) for i in np.unravel_index(flat, shape)))
        else:
            self._record.access(WRITE, *where)

    def _atomic(self, op, atomics, index, rest):
        old = op(atomics, self.array, index, *rest)   # one read-modify-write of the element
        where = self._locate(index)
        self._record.access(READ, *where)
        self._record.access(WRITE, *where)
        return old


# --------------------------------------------------------------------------- what a launch records

class ArrayTrace:
    """The accesses of one array in one launch.

    ``name``, ``memory`` ("global" or "shared"), ``shape``, ``dtype``; ``n_reads`` and
    ``n_writes`` (every access), ``read_counts`` and ``write_counts`` (accesses a element,
    shaped like the array), ``distinct_reads`` and ``distinct_writes`` (elements touched),
    ``bytes_read`` and ``bytes_written``, ``by_thread`` ({(block, thread): Counts}).
    Blocks and threads are ints for a 1-D launch, tuples for a 2-D or 3-D one."""

    def __init__(self, launch, name, memory, data):
        self.launch, self.name, self.memory = launch, name, memory
        self.shape, self.dtype, self.itemsize = tuple(data.shape), data.dtype, data.dtype.itemsize
        self.traced = TracedArray(data, self)
        self._counts = ([0] * data.size, [0] * data.size)
        self._by_thread = {}

    def access(self, kind, flat, key):
        me = _whoami()
        if me is None:
            return
        who, phase = me
        launch = self.launch
        with launch._lock:
            self._counts[kind][flat] += 1
            per = self._by_thread.get(who)
            if per is None:
                per = self._by_thread[who] = [0, 0]
            per[kind] += 1
            if launch.recorded < launch.max_events:
                launch.recorded += 1
                if kind == WRITE:
                    self.traced.writes.append(key)
                    self.traced.writers.append((who, phase))
                else:
                    self.traced.reads.append(key)
                    self.traced.readers.append((who, phase))
            else:
                launch.dropped += 1

    # ---- counts (exact)
    @property
    def read_counts(self) -> np.ndarray:
        return np.array(self._counts[READ], dtype=np.int64).reshape(self.shape)

    @property
    def write_counts(self) -> np.ndarray:
        return np.array(self._counts[WRITE], dtype=np.int64).reshape(self.shape)

    @property
    def n_reads(self) -> int:
        return sum(self._counts[READ])

    @property
    def n_writes(self) -> int:
        return sum(self._counts[WRITE])

    @property
    def distinct_reads(self) -> int:
        return sum(1 for c in self._counts[READ] if c)

    @property
    def distinct_writes(self) -> int:
        return sum(1 for c in self._counts[WRITE] if c)

    @property
    def bytes_read(self) -> int:
        return self.n_reads * self.itemsize

    @property
    def bytes_written(self) -> int:
        return self.n_writes * self.itemsize

    @property
    def by_thread(self) -> dict:
        show = self.launch._show
        return {show(who): Counts(*per) for who, per in sorted(self._by_thread.items())}

    # ---- who touched what (the recorded accesses)
    def _events(self, kind):
        t = self.traced
        return zip(t.writes, t.writers) if kind == WRITE else zip(t.reads, t.readers)

    def accesses(self, kind=None, *, block=None, thread=None, phase=None) -> list:
        """The recorded accesses, in order, as Access(kind, block, thread, index, phase),
        optionally only one kind, block, thread or phase."""
        launch = self.launch
        blk = None if block is None else launch._full(block, "block")
        thr = None if thread is None else launch._full(thread, "thread")
        kinds = (READ, WRITE) if kind is None else (_kind(kind),)
        out = []
        for k in kinds:
            for key, ((b, t), ph) in self._events(k):
                if (blk is None or b == blk) and (thr is None or t == thr) and (phase is None or ph == phase):
                    out.append(Access("write" if k else "read", launch._show_block(b), launch._show_thread(t),
                                      key[0] if len(key) == 1 else key, ph))
        return out

    def elements(self, kind, *, block=None, thread=None, phase=None) -> list:
        """The distinct elements (ints for a 1-D array, index tuples otherwise) read or
        written, by one block or thread if given, sorted."""
        return sorted({a.index for a in self.accesses(kind, block=block, thread=thread, phase=phase)})

    def threads_of(self, index, kind=None, *, phase=None) -> list:
        """The (block, thread) pairs that read or wrote element ``index``, sorted."""
        key = (index,) if isinstance(index, _INTS) else tuple(index)
        key = key[0] if len(key) == 1 else key
        return sorted({(a.block, a.thread) for a in self.accesses(kind, phase=phase) if a.index == key})

    def __repr__(self):
        return (f"ArrayTrace({self.name}: {self.memory} {self.shape} {self.dtype}, "
                f"{self.n_reads} reads, {self.n_writes} writes)")


class Trace:
    """One traced launch: ``kernel`` (its name), ``grid`` and ``block`` (as launched),
    ``arrays`` (ArrayTrace, the kernel's array arguments then its shared arrays, in the
    order the kernel made them). ``t["name"]`` or ``t[i]`` is one array's.
    ``dropped``: accesses counted but not listed (past ``max_events``)."""

    def __init__(self, kernel, grid_dim, block_dim, max_events=MAX_EVENTS):
        self.kernel = kernel
        self.grid_dim, self.block_dim = tuple(grid_dim), tuple(block_dim)
        self._gdims, self._bdims = _dims(self.grid_dim), _dims(self.block_dim)
        self.grid = self._show_block(self.grid_dim)
        self.block = self._show_thread(self.block_dim)
        self.max_events = max_events
        self.recorded = 0
        self.dropped = 0
        self.arrays: list[ArrayTrace] = []
        self._lock = threading.Lock()
        self._shared_sites = {}

    # ---- naming blocks and threads as the launch did: ints for 1-D, tuples otherwise
    def _show_block(self, b):
        return b[0] if self._gdims == 1 else tuple(b[:self._gdims])

    def _show_thread(self, t):
        return t[0] if self._bdims == 1 else tuple(t[:self._bdims])

    def _show(self, who):
        return self._show_block(who[0]), self._show_thread(who[1])

    @staticmethod
    def _full(value, what):
        if isinstance(value, _INTS):
            return (int(value), 0, 0)
        if isinstance(value, (tuple, list)) and 1 <= len(value) <= 3 and all(isinstance(v, _INTS) for v in value):
            return tuple(int(v) for v in value) + (0,) * (3 - len(value))
        raise TypeError(f"{what}: expected an int or a tuple of 1 to 3 ints, got {value!r}")

    def warp_of(self, thread) -> int:
        """The warp (within its block) of thread ``thread``: 32 consecutive linear ids."""
        x, y, z = self._full(thread, "thread")
        bx, by, _ = self.block_dim
        return (x + bx * (y + by * z)) // WARP

    # ---- arrays
    def _add(self, name, memory, data) -> TracedArray:
        taken = {a.name for a in self.arrays}
        base, n = name, 2
        while name in taken:
            name, n = f"{base}#{n}", n + 1
        record = ArrayTrace(self, name, memory, data)
        self.arrays.append(record)
        return record.traced

    def _shared(self, site, function, data) -> TracedArray:
        with self._lock:
            traced = self._shared_sites.get(site)
            if traced is None:
                traced = self._shared_sites[site] = self._add(_shared_name(site, function), "shared", data)
            return traced

    @property
    def names(self) -> list:
        return [a.name for a in self.arrays]

    def __getitem__(self, which) -> ArrayTrace:
        if isinstance(which, _INTS):
            return self.arrays[which]
        for a in self.arrays:
            if a.name == which:
                return a
        raise KeyError(f"no array {which!r} in this launch of {self.kernel}; it has {', '.join(self.names)}")

    def __iter__(self):
        return iter(self.arrays)

    def __len__(self):
        return len(self.arrays)

    # ---- counts
    @property
    def counts(self) -> dict:
        """{array name: Counts(reads, writes)}, every access."""
        return {a.name: Counts(a.n_reads, a.n_writes) for a in self.arrays}

    @property
    def phases(self) -> int:
        """The most barriers any thread passed (recorded accesses)."""
        return max((ph for a in self.arrays for k in (READ, WRITE) for _, (_, ph) in a._events(k)), default=0)

    def per_thread(self) -> dict:
        """{(block, thread): Score(global_reads, global_writes, shared_reads, shared_writes)}
        for every thread that touched memory."""
        scores = {}
        for a in self.arrays:
            col = 0 if a.memory == "global" else 2
            for who, (r, w) in a._by_thread.items():
                s = scores.setdefault(who, [0, 0, 0, 0])
                s[col] += r
                s[col + 1] += w
        return {self._show(who): Score(*s) for who, s in sorted(scores.items())}

    def max_per_thread(self) -> Score:
        """GPU-Puzzles' score: the most accesses of each kind one thread made."""
        scores = list(self.per_thread().values())
        return Score(*(max((s[i] for s in scores), default=0) for i in range(4)))

    def table(self) -> "AccessTable":
        """Reads and writes a array, global and shared totals, bytes; prints as text,
        shows as HTML in a notebook."""
        rows = []
        for a in self.arrays:
            per = list(a._by_thread.values())
            rows.append([a.name, a.memory, _shape_text(a.shape), str(a.dtype), a.n_reads, a.n_writes,
                         a.distinct_reads, a.distinct_writes, a.bytes_read, a.bytes_written,
                         max((p[0] for p in per), default=0), max((p[1] for p in per), default=0)])
        for memory in ("global", "shared"):
            mine = [r for r, a in zip(rows, self.arrays) if a.memory == memory]
            if mine:
                rows.append([f"all {memory}", memory, "", "", *(sum(r[i] for r in mine) for i in range(4, 10)), "", ""])
        s = self.max_per_thread()
        notes = [f"most by one thread: {s.global_reads} global reads, {s.global_writes} global writes, "
                 f"{s.shared_reads} shared reads, {s.shared_writes} shared writes"]
        if any(a.memory == "shared" for a in self.arrays):
            notes.append("shared arrays: each block has its own copy; counts add up every block's")
        if self.dropped:
            notes.append(f"counts are exact; the first {self.recorded} accesses are listed "
                         f"({self.dropped} more were not)")
        return AccessTable(f"{self.kernel}[grid {self.grid}, block {self.block}]", rows, notes)

    def __repr__(self):
        parts = ", ".join(f"{a.name} ({a.memory}) {a.n_reads}r/{a.n_writes}w" for a in self.arrays)
        return f"Trace({self.kernel}[grid {self.grid}, block {self.block}]: {parts})"

    # ---- the picture
    def draw(self, arrays=None, *, block=None, highlight=None, phase=None, color_by="auto", kinds=("read", "write"),
             annotate=None, row=WARP, title=None):
        """A matplotlib figure, GPU-Puzzles style: for each array (all, or a name, an index,
        or a list of them) a grid of its elements, reads on the left and writes on the
        right, each cell coloured by the thread, warp or block that touched it
        (``color_by``: "thread", "warp", "block", or "auto": the finest with at most 16
        groups); a cell touched by several shows their colours side by side (grey past 4),
        and its count of accesses (``annotate``: default for small arrays).

        ``block``: draw one block's accesses only (shared arrays always show one block:
        this one, the highlighted thread's, or the first). ``highlight=(block, thread)``:
        outline the cells that thread touched and fade the rest. ``phase=k``: only the
        accesses between the k-th and (k+1)-th barrier. A 1-D array is drawn ``row``
        elements a line (32: one warp's coalesced load a line); a 3-D or higher array as
        (all leading axes, last axis)."""
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        chosen = self._choose(arrays)
        if not chosen:
            raise ValueError(f"arrays: this launch of {self.kernel} has no array to draw")
        kinds = [_kind(k) for k in ((kinds,) if isinstance(kinds, str) else kinds)]
        hl = None if highlight is None else self._highlight(highlight)
        blk = None if block is None else self._full(block, "block")
        panels = []
        for a in chosen:
            shown = blk
            if shown is None and a.memory == "shared":
                shown = hl[0] if hl else min((who[0] for who in a._by_thread), default=None)
            for k in kinds:
                events = [(key, who) for key, (who, ph) in a._events(k)
                          if (shown is None or who[0] == shown) and (phase is None or ph == phase)]
                panels.append((a, k, shown, events))

        everyone = {who for *_, events in panels for _, who in events}
        mode = self._colour_mode(color_by, everyone)
        group = _GROUPS[mode](self)
        groups = sorted({group(who) for who in everyone})
        palette = _palette(len(groups))
        colour = {g: palette[i] for i, g in enumerate(groups)}
        several_blocks = len({who[0] for who in everyone}) > 1

        # One cell size for the whole figure (the widest array fits a panel), so that
        # arrays compare at a glance.
        shapes = [_grid_shape(a.shape, row) for a in chosen]
        widest = max(cols for _, cols in shapes)
        cell = min(0.4, 5.0 / widest)
        heights = [min(rows * cell, 7.0) + 0.75 for rows, _ in shapes]
        fig, axes = plt.subplots(len(chosen), len(kinds), squeeze=False, layout="constrained",
                                 figsize=((widest * cell + 0.9) * len(kinds) + 2.2, sum(heights)),
                                 gridspec_kw={"height_ratios": heights})
        grey_used = False
        for (a, k, shown, events), ax in zip(panels, axes.ravel()):
            grey_used |= _draw_panel(ax, a, k, events, lambda who: colour[group(who)], hl, annotate, row, widest)
            where = "" if shown is None else f", block {self._show_block(shown)}"
            n = len(events)
            ax.set_title(f"{a.name} ({a.memory}{where}): {n} {'read' if k == READ else 'write'}{'s' * (n != 1)}",
                         fontsize=10)
            if ax is axes[chosen.index(a)][0]:
                ax.set_ylabel(f"{_shape_text(a.shape)} {a.dtype}", fontsize=8)

        handles = []
        if len(groups) <= 20:
            handles += [Patch(facecolor=colour[g], label=_GROUP_LABEL[mode](self, g, several_blocks)) for g in groups]
        if grey_used:
            handles.append(Patch(facecolor="0.55", label=f"more than {MAX_STRIPES} {mode}s"))
        if hl:
            handles.append(Patch(facecolor="none", edgecolor="black", linewidth=2,
                                 label=f"block {self._show_block(hl[0])} thread {self._show_thread(hl[1])}"))
        if handles:
            fig.legend(handles=handles, loc="outside right upper", fontsize=8, title=f"colour: {mode}",
                       title_fontsize=8, frameon=False)
        notes = []
        if len(groups) > 20:
            notes.append(f"colour: {mode}, {len(groups)} of them, blue (first) to red (last)")
        if phase is not None:
            notes.append(f"after barrier {phase}, before barrier {phase + 1}")
        if self.dropped:
            notes.append(f"the first {self.recorded} accesses drawn; {self.dropped} more counted, not drawn")
        head = title or f"{self.kernel}[grid {self.grid}, block {self.block}]"
        fig.suptitle(head + ("\n" + "; ".join(notes) if notes else ""), fontsize=11)
        return fig

    def _choose(self, arrays):
        if arrays is None:
            return list(self.arrays)
        if isinstance(arrays, (str, *_INTS)):
            arrays = [arrays]
        return [self[a] for a in arrays]

    def _highlight(self, highlight):
        if isinstance(highlight, _INTS):                  # a thread of block 0
            return (0, 0, 0), self._full(highlight, "highlight")
        if isinstance(highlight, (tuple, list)) and len(highlight) == 2:
            return self._full(highlight[0], "highlight's block"), self._full(highlight[1], "highlight's thread")
        raise TypeError(f"highlight: expected (block, thread), got {highlight!r}")

    def _colour_mode(self, color_by, everyone):
        if color_by in ("thread", "warp", "block"):
            return color_by
        if color_by != "auto":
            raise ValueError(f"color_by: expected 'thread', 'warp', 'block' or 'auto', got {color_by!r}")
        for mode in ("thread", "warp"):
            if len({_GROUPS[mode](self)(who) for who in everyone}) <= AUTO_GROUPS:
                return mode
        return "block"


def _dims(dim) -> int:
    """How many axes a launch dimension uses: (8, 1, 1) is 1-D, (4, 4, 1) 2-D."""
    return max([1] + [i + 1 for i, n in enumerate(dim) if n > 1])


def _shape_text(shape) -> str:
    return "×".join(str(n) for n in shape) if shape else "scalar"


_GROUPS = {
    "thread": lambda launch: lambda who: who,
    "warp": lambda launch: lambda who: (who[0], launch.warp_of(who[1])),
    "block": lambda launch: lambda who: who[0],
}
_GROUP_LABEL = {
    "thread": lambda launch, g, blocks: (f"b{launch._show_block(g[0])} t" if blocks else "thread ")
    + f"{launch._show_thread(g[1])}",
    "warp": lambda launch, g, blocks: (f"b{launch._show_block(g[0])} " if blocks else "") + f"warp {g[1]}",
    "block": lambda launch, g, blocks: f"block {launch._show_block(g)}",
}


def _palette(n):
    import matplotlib.pyplot as plt

    if n <= 20:   # tab20's strong colours first, then its light ones
        tab = plt.get_cmap("tab20").colors
        return [tab[i][:3] for i in list(range(0, 20, 2)) + list(range(1, 20, 2))][:max(n, 1)]
    return [tuple(c[:3]) for c in plt.get_cmap("turbo")(np.linspace(0.05, 0.95, n))]


def _grid_shape(shape, row):
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        cols = max(1, min(shape[0], row))
        return max(1, math.ceil(shape[0] / cols)), cols
    return int(np.prod(shape[:-1])), shape[-1]


def _cell(key, shape, cols):
    if len(shape) == 1:
        return divmod(key[0], cols)
    if len(shape) == 2:
        return key
    return int(np.ravel_multi_index(key[:-1], shape[:-1])), key[-1]


def _draw_panel(ax, a, kind, events, colour_of, hl, annotate, row, width):
    """One grid of cells; returns True when some cell had too many groups (grey)."""
    from matplotlib.patches import Rectangle

    rows, cols = _grid_shape(a.shape, row)
    cells = {}                       # (r, c) -> [count, [colours in first-touch order], touched by hl]
    for key, who in events:
        cell = cells.setdefault(_cell(key, a.shape, cols), [0, [], False])
        cell[0] += 1
        c = colour_of(who)
        if c not in cell[1]:
            cell[1].append(c)
        if hl is not None and who == hl:
            cell[2] = True
    S = 12                           # pixels a cell: room for up to 4 stripes
    img = np.ones((rows * S, cols * S, 3))
    grey = False
    for (r, c), (n, colours, mine) in cells.items():
        if len(colours) > MAX_STRIPES:
            colours, grey = [(0.55, 0.55, 0.55)], True
        edges = np.linspace(0, S, len(colours) + 1).round().astype(int)
        for i, col in enumerate(colours):
            col = np.asarray(col)
            if hl is not None and not mine:
                col = 0.3 * col + 0.7      # faded: not the highlighted thread's
            img[r * S:(r + 1) * S, c * S + edges[i]:c * S + edges[i + 1]] = col
    ax.imshow(img, extent=(0, cols, rows, 0), interpolation="nearest", aspect="equal")
    ax.set_xlim(0, width)            # every panel as wide as the widest array: equal cells
    ax.set_ylim(rows, 0)
    ax.set_anchor("W")
    if rows <= 64 and cols <= 64:
        ax.hlines(np.arange(rows + 1), 0, cols, color="0.75", linewidth=0.6)
        ax.vlines(np.arange(cols + 1), 0, rows, color="0.75", linewidth=0.6)
    xstep = 1 if cols <= 16 else (4 if cols <= 64 else max(1, cols // 16))
    ystep = 1 if rows <= 16 else max(1, rows // 16)
    ax.set_xticks(np.arange(0, cols, xstep) + 0.5, [str(i) for i in range(0, cols, xstep)], fontsize=7)
    ystarts = range(0, rows, ystep)
    ax.set_yticks(np.array(list(ystarts)) + 0.5,
                  [str(r * cols) if len(a.shape) == 1 else str(r) for r in ystarts], fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    if annotate is None:
        annotate = rows * cols <= 256
    if annotate:
        size = 7 if cols <= 16 else 5.5
        for (r, c), (n, _, _) in cells.items():
            # white on a dark cell, black on a light one (the pixel at the cell's centre)
            dark = img[r * S + S // 2, c * S + S // 2] @ (0.299, 0.587, 0.114) < 0.5
            ax.text(c + 0.5, r + 0.5, str(n), ha="center", va="center", fontsize=size,
                    color="white" if dark else "black")
    if hl is not None:
        for (r, c), (_, _, mine) in cells.items():
            if mine:
                ax.add_patch(Rectangle((c, r), 1, 1, fill=False, edgecolor="black", linewidth=2.2))
    return grey


class AccessTable:
    """The summary of a launch: one row a array, then global and shared totals. ``rows``
    are lists in the order of ``COLUMNS``; ``notes`` follow the table."""

    COLUMNS = ["array", "memory", "shape", "dtype", "reads", "writes", "elements read", "elements written",
               "bytes read", "bytes written", "max reads/thread", "max writes/thread"]

    def __init__(self, title, rows, notes):
        self.title, self.rows, self.notes = title, rows, notes

    def row(self, name) -> dict:
        """One row as {column: value}."""
        for r in self.rows:
            if r[0] == name:
                return dict(zip(self.COLUMNS, r))
        raise KeyError(name)

    def __str__(self):
        cells = [self.COLUMNS] + [[f"{v:,}" if isinstance(v, int) else str(v) for v in r] for r in self.rows]
        widths = [max(len(r[i]) for r in cells) for i in range(len(self.COLUMNS))]
        lines = [self.title]
        for j, r in enumerate(cells):
            lines.append("  ".join(v.ljust(w) if i < 4 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        return "\n".join(lines + self.notes)

    __repr__ = __str__

    def _repr_html_(self):
        import html

        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(f'{v:,}' if isinstance(v, int) else str(v))}</td>"
                                        for v in r) + "</tr>" for r in self.rows)
        notes = "".join(f"<br>{html.escape(n)}" for n in self.notes)
        return (f"<b>{html.escape(self.title)}</b><table><thead><tr>{head}</tr></thead>"
                f"<tbody>{body}</tbody></table><small>{notes}</small>")


# --------------------------------------------------------------------------- shared arrays' names

_SHARED_RE = re.compile(r"(\w+)\s*(?::[^=]*)?=\s*[\w.]*shared\.array\s*\(")


def _shared_name(site, function) -> str:
    """The variable a ``cuda.shared.array`` call is assigned to, read from the source (the
    call's line, or the line above for a call written over several); else function:line."""
    filename, lineno = site
    for n in (lineno, lineno - 1, lineno - 2):
        line = linecache.getline(filename, n) if n > 0 else ""
        if "shared.array" in line:
            match = _SHARED_RE.search(line)
            if match:
                return match.group(1)
            break
    return f"{function}:{lineno}"


# --------------------------------------------------------------------------- tracing launches

_ACTIVE = None        # the Trace of the launch running now
_SESSION = None       # (launches, max_events) while tracing() is on
_SESSION_LOCK = threading.Lock()


@contextmanager
def tracing(*, max_events: int = MAX_EVENTS):
    """``with tracing() as launches:`` every kernel launched inside (directly, or by any
    launcher) runs traced in the simulator, and its Trace is appended to ``launches``
    (before it runs: a launch that fails leaves what it recorded)."""
    global _SESSION
    if not isinstance(max_events, _INTS) or max_events < 0:
        raise ValueError(f"max_events: expected an int >= 0, got {max_events!r}")
    with _SESSION_LOCK:
        if _SESSION is not None:
            raise RuntimeError("tracing() is already on")
        launches = []
        _SESSION = (launches, int(max_events))
    undo = _install()
    try:
        yield launches
    finally:
        for obj, name, old in reversed(undo):
            setattr(obj, name, old)
        _SESSION = None


def trace(kernel, grid, block, *args, shared_bytes: int = 0, max_events: int = MAX_EVENTS) -> Trace:
    """Launch ``kernel[grid, block](*args)`` traced (``shared_bytes``: dynamic shared
    memory, as the launch's 4th item) and return its Trace."""
    if not (hasattr(kernel, "py_func") or hasattr(kernel, "fn")) or not hasattr(kernel, "__getitem__"):
        raise TypeError(f"kernel: expected a @cuda.jit kernel, got {type(kernel).__name__}")
    if getattr(kernel, "_device", False) or getattr(kernel, "targetoptions", {}).get("device"):
        raise TypeError("kernel: this is a device function (cuda.jit(device=True)); trace the kernel that calls it")
    import warnings

    with tracing(max_events=max_events) as launches, warnings.catch_warnings():
        warnings.simplefilter("ignore")            # the low-occupancy warning of a tiny grid
        launch = kernel[grid, block, 0, shared_bytes] if shared_bytes else kernel[grid, block]
        launch(*args)
    if len(launches) != 1:
        raise RuntimeError(f"kernel: expected one launch, saw {len(launches)}")
    return launches[0]


def _install():
    """Swap the simulator's pieces for traced ones; returns what to put back."""
    from numba.cuda import types
    from numba.cuda.np import numpy_support
    from numba.cuda.simulator import kernel as sim_kernel
    from numba.cuda.simulator import kernelapi

    undo = []

    def swap(obj, name, new):
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, new)

    launch_as_simulated = sim_kernel.FakeCUDAKernel.__call__

    def call(self, *args):
        if self._device or sim_kernel._kernel_context is not None or _SESSION is None:
            return launch_as_simulated(self, *args)
        return _traced_launch(self, args, launch_as_simulated)

    swap(sim_kernel.FakeCUDAKernel, "__call__", call)

    def shared_array(self, shape, dtype, alignment=None):
        # The simulator's own (as kernels.base.runtime makes it: locked, and ``alignment``
        # accepted, NumPy's allocations being aligned already), except that the array is
        # traced: one array a call site (file, line) per launch, as the simulator keys it.
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        site = (caller.f_code.co_filename, caller.f_lineno)
        launch = _ACTIVE
        lock = launch._lock if launch is not None else _SESSION_LOCK
        if shape == 0:     # dynamic shared memory: one buffer behind every such array
            data = np.frombuffer(self._dynshared.data, dtype=dtype, count=self._dynshared_size // dtype.itemsize)
        else:
            with lock:
                data = self._allocations.get(site)
                if data is None:
                    data = self._allocations[site] = np.empty(shape, dtype)
        return data if launch is None else launch._shared(site, caller.f_code.co_name, data)

    swap(kernelapi.FakeCUDAShared, "array", shared_array)

    def traced_atomic(op):
        def atomic(self, array, index, *rest):
            if isinstance(array, TracedArray):
                return array._atomic(op, self, index, rest)
            return op(self, array, index, *rest)
        return atomic

    for name in ("add", "sub", "and_", "or_", "xor", "inc", "dec", "exch", "max", "min", "nanmax", "nanmin", "cas"):
        swap(kernelapi.FakeCUDAAtomic, name, traced_atomic(getattr(kernelapi.FakeCUDAAtomic, name)))

    barrier = sim_kernel.BlockThread.syncthreads

    def syncthreads(self):
        self._trace_phase = getattr(self, "_trace_phase", 0) + 1
        return barrier(self)

    swap(sim_kernel.BlockThread, "syncthreads", syncthreads)

    from kernels.base.runtime import on_simulator

    if not on_simulator():          # real CUDA: run the kernel's Python source in the simulator
        from numba.cuda.dispatcher import CUDADispatcher

        def gpu_call(self, args, launch_config):
            return _simulate_gpu_launch(self, args, launch_config)

        swap(CUDADispatcher, "call", gpu_call)
    return undo


def _param_names(fn, n):
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(n)]


def _traced_launch(fake, args, launch_as_simulated):
    """A simulator launch of ``fake`` (a FakeCUDAKernel with its grid set) on traced arrays."""
    global _ACTIVE
    from numba.cuda.errors import normalize_kernel_dimensions

    launches, max_events = _SESSION
    grid_dim, block_dim = normalize_kernel_dimensions(fake.grid_dim, fake.block_dim)
    launch = Trace(getattr(fake.fn, "__name__", "kernel"), grid_dim, block_dim, max_events)
    wrapped = []
    for name, arg in zip(_param_names(fake.fn, len(args)), args):
        data = getattr(arg, "_ary", arg)            # a simulator device array holds a NumPy one
        if isinstance(data, np.ndarray) and data.ndim > 0 and not isinstance(arg, TracedArray):
            arg = launch._add(name, "global", data)
        wrapped.append(arg)
    launches.append(launch)
    _ACTIVE = launch
    try:
        launch_as_simulated(fake, *wrapped)
    finally:
        _ACTIVE = None
    return None


def _simulate_gpu_launch(dispatcher, args, launch_config):
    """A real-CUDA launch inside tracing(): the kernel's Python function runs in the
    simulator instead, on host copies of device arrays (copied back after)."""
    from numba import cuda
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    fake = FakeCUDAKernel(dispatcher.py_func, device=False)
    fake.grid_dim, fake.block_dim = tuple(launch_config.griddim), tuple(launch_config.blockdim)
    fake.dynshared_size = launch_config.sharedmem
    host, back = [], []
    for arg in args:
        if hasattr(arg, "__cuda_array_interface__") and not isinstance(arg, np.ndarray):
            device = arg if hasattr(arg, "copy_to_host") else cuda.as_cuda_array(arg)
            copy = device.copy_to_host()
            back.append((device, copy))
            arg = copy
        host.append(arg)
    with _simulated_device_functions(dispatcher.py_func):
        fake(*host)
    for device, copy in back:
        device.copy_to_device(copy)


@contextmanager
def _simulated_device_functions(fn):
    """Device functions a real-CUDA kernel calls (through its globals, its closure, or a
    module it names) replaced by simulator ones while it runs, recursively."""
    from numba.cuda.dispatcher import CUDADispatcher
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    undo, seen = [], set()

    def visit(f):
        if id(f) in seen or not hasattr(f, "__code__"):
            return
        seen.add(id(f))
        names = set(f.__code__.co_names)
        for name in names:
            value = f.__globals__.get(name)
            if isinstance(value, CUDADispatcher):
                undo.append((f.__globals__.__setitem__, name, value))
                f.__globals__[name] = FakeCUDAKernel(value.py_func, device=True)
                visit(value.py_func)
            elif inspect.ismodule(value):
                for attr in names:
                    inner = getattr(value, attr, None)
                    if isinstance(inner, CUDADispatcher):
                        undo.append((lambda n, v, m=value: setattr(m, n, v), attr, inner))
                        setattr(value, attr, FakeCUDAKernel(inner.py_func, device=True))
                        visit(inner.py_func)
        for cell in f.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:          # an empty cell
                continue
            if isinstance(value, CUDADispatcher):
                undo.append((lambda _, v, c=cell: setattr(c, "cell_contents", v), None, value))
                cell.cell_contents = FakeCUDAKernel(value.py_func, device=True)
                visit(value.py_func)

    try:
        visit(fn)
        yield
    finally:
        for put, name, value in reversed(undo):
            put(name, value)
