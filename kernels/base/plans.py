"""Plans: a launcher's call recorded once a call shape, and replayed after.

Once a launch is one driver call (``LaunchTemplate``), what is left of a small call's host
time is the Python that, at every call, checks the arguments and decides the tiles, the
splits, the scratch to allocate and the launches to make: tens of microseconds, more than
the GPU's work at small sizes. All of it follows from the call shape. A plan keeps what a
call of one shape did: the bound launches it made, in order, and where each of their arrays
came from, either one of the call's *given* arrays (its inputs, and the outputs the caller
allocated) by name, or scratch the call allocated, by allocation and offset. Replaying it
allocates that scratch again (from PyTorch's caching allocator: no cudaMalloc), reads the
given arrays' data pointers and launches; nothing is checked or decided again (the way a
library's plan is made once and run many times: cuDNN's execution plans, FlashInfer's
``plan`` and ``run``).

The caller owns the key: it must name everything the call's checks and decisions read
(shapes, dtypes, devices, flags, the scale, the CUDA context), since a replay skips them.
Data pointers are the one thing a key cannot name: the launches were bound for the given
arrays' 16-byte alignment at recording (``run_bound``'s ``aligned``), so a replay whose
arrays are aligned otherwise declines, and the caller makes the call the long way.
PyTorch tensors only: the drop-in attention of chapter 13 is the user, with CUDA tensors
(``run_bound`` notes launches on a GPU only); tests/test_plans.py drives it with CPU tensors
and a stand-in for the launches."""

from __future__ import annotations

import threading
from collections import OrderedDict

from kernels.base.runtime import recording_launches, torch_tensor_type


class Plan:
    """One call shape's launches with their arrays' sources (see the module's docstring);
    ``info``: what the caller stored with it (what its checks worked out, say)."""

    __slots__ = ("steps", "scratch_bytes", "device", "info")

    def __init__(self, steps, scratch_bytes, device, info):
        self.steps = steps      # [(launches, ((slot, source, offset), ...), aligned names, aligned_d, aligned)]
        self.scratch_bytes = scratch_bytes      # (scratch "#i": bytes of allocation i)
        self.device = device
        self.info = info

    @classmethod
    def recorded(cls, steps, given: dict, info=None):
        """The plan of a call that made ``steps`` (``run_bound``'s launches, as
        ``recording_launches`` collected them) on the ``given`` arrays; None where the call
        cannot be replayed: it launched nothing, an array is neither given nor a PyTorch tensor
        of its own allocation on the given arrays' device, or a launch's array is given under
        several names, none of them its slot's (which one a replay should read is not known)."""
        tensor = torch_tensor_type()            # (no array is one where PyTorch is not imported)
        if not steps or not all(type(x) is tensor for x in given.values()):
            return None
        device = next(iter(given.values())).device
        if not all(x.device == device for x in given.values()):
            return None
        named = {}
        for name, x in given.items():
            named.setdefault(id(x), []).append(name)
        given_storages = {x.untyped_storage().data_ptr() for x in given.values()}
        allocations, planned = {}, []
        for launches, arrays, aligned_names, aligned_d, aligned in steps:
            sources = []                        # (slot, source, byte offset): a given name, or scratch "#i"
            for slot, x in arrays.items():
                names = named.get(id(x))
                if names is not None:           # a given array: its own name's, or the one name it has
                    if slot not in names and len(names) > 1:
                        return None
                    sources.append((slot, slot if slot in names else names[0], 0))
                    continue
                if type(x) is not tensor or x.device != device:
                    return None
                storage = x.untyped_storage()
                base = storage.data_ptr()
                if base in given_storages:      # (a view of a given array, not its own scratch)
                    return None
                index = allocations.setdefault(base, (len(allocations), storage.nbytes()))[0]
                sources.append((slot, f"#{index}", x.data_ptr() - base))
            planned.append((launches, tuple(sources), aligned_names, aligned_d, aligned))
        return cls(planned, [nbytes for _, nbytes in sorted(allocations.values())], device, info)

    def replay(self, given: dict) -> bool:
        """The recorded launches on ``given`` (the arrays by the names they had at recording,
        C-contiguous), with fresh scratch; False, having launched nothing, where an array is
        not contiguous or the alignment the launches were bound for does not hold."""
        pointers = {}
        for name, x in given.items():
            if not x.is_contiguous():
                return False
            pointers[name] = x.data_ptr()
        if self.scratch_bytes:
            import torch

            scratch = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for nbytes in self.scratch_bytes]
            pointers.update((f"#{i}", s.data_ptr()) for i, s in enumerate(scratch))
        calls = []
        for launches, sources, aligned_names, aligned_d, aligned in self.steps:
            slots = {slot: pointers[source] + offset for slot, source, offset in sources}
            if int(aligned_d and all(slots[n] % 16 == 0 for n in aligned_names)) != aligned:   # (run_bound's rule)
                return False
            calls.append((launches, slots))
        for launches, slots in calls:
            launches(**slots)
        return True                             # (the scratch is freed here: stream-ordered, as in the long way)


class Plans:
    """Plans by key, the ``size`` most recently recorded kept."""

    def __init__(self, size: int = 64):
        self.size, self._plans, self._lock = size, OrderedDict(), threading.Lock()

    def replay(self, key, given: dict):
        """The plan of ``key`` replayed on ``given``: the plan (its ``info`` for the caller), or
        None where there is none or it declined (nothing launched: make the call the long way)."""
        plan = self._plans.get(key)
        if plan is not None and plan.replay(given):
            return plan
        return None

    def record(self, key, given: dict, call, info=None):
        """``call()``, a launcher's checked call on the ``given`` arrays that allocates only its
        scratch and launches only through ``run_bound``, recorded as ``key``'s plan (where it
        can be replayed; ``Plan.recorded``). Returns what ``call`` returns."""
        with recording_launches() as steps:
            result = call()
        plan = Plan.recorded(steps, given, info)
        if plan is not None:
            with self._lock:
                self._plans[key] = plan
                while len(self._plans) > self.size:
                    self._plans.popitem(last=False)
        return result

    def clear(self):
        """Forget every plan (the next call of each key goes the long way, and records)."""
        with self._lock:
            self._plans.clear()

    def __contains__(self, key):
        return key in self._plans

    def __len__(self):
        return len(self._plans)
