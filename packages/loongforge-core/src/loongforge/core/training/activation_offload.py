"""Activation offloading (``train.offload_layers=N``): what the first N repeated blocks of a model
(or of a pipeline stage) save for their backward waits in pinned host memory instead of on the
accelerator, and comes back for the backward.

Both engines attach it the same way (``ActivationOffload.attach(blocks)``): a block's forward runs
under ``torch.autograd.graph.saved_tensors_hooks``, so every tensor an operation saves inside the
block (compiled regions included) passes through ``pack`` and ``unpack``:

- ``pack`` copies a saved activation to pinned host memory on a side stream (after the compute
  stream's work that produced it) and hands autograd a handle; the caching allocator is told
  (``record_stream``) that the device memory is in use until the copy is done, so it is freed then
  without a synchronisation. Parameters (and tensors sharing a parameter's storage), tensors
  already on the host and tensors under ``min_bytes`` stay where they are.
- The backward reaches the blocks last to first. When the gradient of block ``i``'s output is
  ready (its backward is about to start), a hook copies block ``i``'s activations back (if not
  already there) and prefetches block ``i - 1``'s on a second side stream, so that copy runs while
  block ``i``'s backward computes. ``unpack`` makes the compute stream wait for the copy.

On the CPU there is no device memory to free: ``pack`` keeps a copy of the tensor (the same
bookkeeping, the same values), which is what lets the CPU tests check that an offloaded step
equals one that is not. ``step_bytes`` counts what one step moved.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class _Saved:
    """One saved activation while it is off the device."""

    __slots__ = ("host", "device", "copied", "reloaded", "ready", "uses")

    def __init__(self, host: torch.Tensor, device: torch.device, copied):
        self.host, self.device, self.copied = host, device, copied
        self.reloaded: torch.Tensor | None = None
        self.ready: Any = None  # the event after which ``reloaded`` holds the values
        self.uses = 1  # the saves of this tensor (one per op that saved it) not unpacked yet


class _Group:
    """What one forward of one block saved off the device, and the group of the block before it in
    the same forward (prefetched while this one's backward runs)."""

    __slots__ = ("saved", "by_key", "previous")

    def __init__(self, previous: "_Group | None"):
        self.saved: list[_Saved] = []
        # a tensor saved by several operations moves once: key -> (a weak reference to the tensor, its
        # copy); an entry counts only while that tensor lives, since the memory of a dead one can hold
        # a new tensor of the same shape at the same address
        self.by_key: dict[tuple, tuple[weakref.ref, _Saved]] = {}
        self.previous = previous


class ActivationOffload:
    """Offloads the saved activations of the blocks it is attached to (see the module docstring)."""

    def __init__(self, device: torch.device, min_bytes: int = 1 << 14):
        self.device = device
        self.min_bytes = min_bytes
        self.cuda = device.type == "cuda"
        # the copy streams (CUDA only: elsewhere the copies are plain clones)
        self.d2h: Any = torch.cuda.Stream(device) if self.cuda else None
        self.h2d: Any = torch.cuda.Stream(device) if self.cuda else None
        self.step_bytes = 0  # bytes moved off the device since the last ``reset_step``
        self._blocks: list[nn.Module] = []
        self._param_storages: set[int] = set()
        self._handles: list = []
        self._active: list[tuple[object, _Group]] = []  # the hooks context and group of each block in forward
        self._last: tuple[int, _Group] | None = None  # the block index and group that finished last

    # -- attaching -----------------------------------------------------------------------------
    def attach(self, blocks: Sequence[nn.Module]) -> None:
        """Offload what ``blocks`` (consecutive, in forward order) save for their backward."""
        for block in blocks:
            index = len(self._blocks)
            self._blocks.append(block)
            for p in block.parameters():
                self._param_storages.add(p.untyped_storage().data_ptr())
            self._handles.append(block.register_forward_pre_hook(self._enter(index)))
            self._handles.append(block.register_forward_hook(self._exit(index)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter(self, index: int):
        def pre_hook(module, args):
            previous = self._last[1] if self._last is not None and self._last[0] == index - 1 else None
            group = _Group(previous)
            hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(group, t), self._unpack)
            hooks.__enter__()
            self._active.append((hooks, group))

        return pre_hook

    def _exit(self, index: int):
        def hook(module, args, output):
            hooks, group = self._active.pop()
            hooks.__exit__(None, None, None)
            self._last = (index, group)
            tensor = _first_tensor_needing_grad(output)
            if tensor is not None and torch.is_grad_enabled():
                tensor.register_hook(self._backward_reached(group))
            return None

        return hook

    # -- pack / unpack -------------------------------------------------------------------------
    def _keeps(self, t: torch.Tensor) -> bool:
        """Whether ``t`` stays where it is (not worth or not right to move)."""
        if isinstance(t, nn.Parameter) or t.device.type != self.device.type:
            return True
        if t.numel() * t.element_size() < self.min_bytes:
            return True
        return t.untyped_storage().data_ptr() in self._param_storages or _is_cast_of_leaf(t)

    def _pack(self, group: _Group, t: torch.Tensor):
        if self._keeps(t):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        known = group.by_key.get(key)
        if known is not None and known[0]() is not None:
            known[1].uses += 1
            return known[1]
        self.step_bytes += t.numel() * t.element_size()
        if not self.cuda:
            saved = _Saved(t.detach().clone(), t.device, None)
        else:
            compute = torch.cuda.current_stream(self.device)
            self.d2h.wait_stream(compute)
            with torch.cuda.stream(self.d2h):
                host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
                host.copy_(t, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(self.d2h)
            t.record_stream(self.d2h)  # the allocator frees t's memory once the copy is done
            saved = _Saved(host, t.device, copied)
        group.saved.append(saved)
        group.by_key[key] = (weakref.ref(t), saved)
        return saved

    def _reload(self, saved: _Saved) -> None:
        if saved.reloaded is not None:
            return
        if not self.cuda:
            saved.reloaded = saved.host
            return
        with torch.cuda.stream(self.h2d):
            self.h2d.wait_event(saved.copied)
            saved.reloaded = saved.host.to(saved.device, non_blocking=True)
            saved.ready = torch.cuda.Event()
            saved.ready.record(self.h2d)

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        self._reload(saved)
        tensor = saved.reloaded
        if self.cuda:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(saved.ready)
            tensor.record_stream(compute)
        saved.uses -= 1
        if saved.uses <= 0:  # the last save of it unpacked: autograd holds the tensor while it needs it
            saved.reloaded = None
        return tensor

    def _backward_reached(self, group: _Group):
        def hook(grad):
            for g in (group, group.previous):
                if g is not None:
                    for saved in g.saved:
                        self._reload(saved)
            group.previous = None
            return None

        return hook

    def reset_step(self) -> int:
        """Bytes moved off the device since the last call."""
        moved, self.step_bytes = self.step_bytes, 0
        self._last = None
        return moved


def _is_cast_of_leaf(t: torch.Tensor) -> bool:
    """An autocast copy of a parameter (weight-sized, not an activation; autocast caches it)."""
    fn = t.grad_fn
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    return any(type(nxt).__name__ == "AccumulateGrad" for nxt, _ in fn.next_functions if nxt is not None)


def _first_tensor_needing_grad(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    if isinstance(output, (tuple, list)):
        for item in output:
            found = _first_tensor_needing_grad(item)
            if found is not None:
                return found
    return None


def offload_first(blocks: Sequence[nn.Module], count: int, device: torch.device) -> ActivationOffload | None:
    """An ``ActivationOffload`` attached to the first ``count`` of ``blocks``; None for 0."""
    if count <= 0:
        return None
    if count > len(blocks):
        raise ValueError(f"train.offload_layers={count}: the model has {len(blocks)} repeated blocks here")
    offload = ActivationOffload(device)
    offload.attach(list(blocks)[:count])
    return offload

