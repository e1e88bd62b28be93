"""What a computation asks of the machine, counted at PyTorch's dispatcher, on any device, CPU included: the operators
it runs (each one kernel launch on a GPU) and the most tensor memory it holds at once.

Both are :class:`~torch.utils._python_dispatch.TorchDispatchMode` s, so they see every operator that reaches the
dispatcher below autograd, forward and backward alike, and nothing of Python's own work. Views and aliases are left
out of the count: they move no data and launch nothing. Under :func:`sizes_only` a computation dispatches the same
operators and makes the same storages on tensors without data (a CA-DeiT-T step at 1024^2 counted in about a second).
"""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["KernelCounter", "count_kernels", "TensorMemoryTracker", "peak_tensor_bytes", "sizes_only"]

_ALIASES = {
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
}


def _is_alias(func: torch._ops.OpOverload) -> bool:
    return func.is_view or func in _ALIASES


class KernelCounter(TorchDispatchMode):
    """Counts the operators dispatched while it is active, by name (``aten.mm``, ...), views and aliases left out."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _is_alias(func) and func.namespace != "prim":  # prim: metadata queries (a tensor's device), no kernel
            self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_kernels(fn: Callable[[], Any]) -> Counter[str]:
    """The operators one call of ``fn`` dispatches (:class:`KernelCounter`)."""
    with KernelCounter() as counter:
        fn()
    return counter.counts


class TensorMemoryTracker(TorchDispatchMode):
    """The bytes of tensor storage made while it is active and still alive, and the most of them at any moment
    (``peak``): what a computation holds beyond what existed before it, without the allocator's caching or the
    process's other memory. A storage counts from the operator that made it until it is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _freed(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _is_alias(func):
            return out
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = id(storage)
            if key in self._seen or key in inputs:  # written into (an out= or in-place operator), not made
                continue
            self._seen.add(key)
            self.live += storage.nbytes()
            # The storage's Python object lives exactly as long as the storage (PyTorch preserves it).
            weakref.finalize(storage, self._freed, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


@contextlib.contextmanager
def sizes_only() -> Iterator[None]:
    """Tensors made inside hold sizes, dtypes and devices but no data (PyTorch's fake tensors; existing tensors,
    such as a model's parameters, are read as such): every operator still dispatches, with the same inputs' sizes,
    so :func:`count_kernels` and :func:`peak_tensor_bytes` count what the real computation would, without its
    arithmetic. What reads values (``.item()``, data-dependent sizes) cannot run inside."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.device.type != "meta"]


def peak_tensor_bytes(fn: Callable[[], Any]) -> int:
    """The most tensor memory one call of ``fn`` holds at once beyond what existed before
    (:class:`TensorMemoryTracker`): storages made before the call (parameters, inputs) are left out, and so is
    what an operator allocates for itself and frees before it returns."""
    with TensorMemoryTracker() as tracker:
        fn()
    return tracker.peak
