"""Every adaptation megatron-core (0.19.x) needs to train on CPU with gloo, in one place.

megatron-core is written for CUDA. Nothing else in LoongForge patches it; each adaptation here
says why it exists, and ``tests/test_cpu_megatron.py`` shows each one is needed by running a
megatron code path with that adaptation left out (``LOONGFORGE_CPU_SKIP=name``) and expecting it
to fail. ``install()`` is idempotent and is called by the cpu accelerator before any model is built.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import torch

SKIP_ENV = "LOONGFORGE_CPU_SKIP"
_installed: list[str] = []


def _is_cuda_device(device) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # a bare int is a CUDA ordinal in torch's factory/`.to` signatures
    return isinstance(device, int) and not isinstance(device, bool)


def current_device() -> None:
    """megatron allocates buffers with ``device=torch.cuda.current_device()`` in ~200 places
    (global memory buffer, TP all-gather/reduce-scatter buffers, PP p2p buffers, DDP grad
    buffers, optimizer state). Answer the CPU device so those allocations land in host memory."""
    torch.cuda.current_device = lambda: torch.device("cpu")


def cuda_device_strings() -> None:
    """~100 call sites hard-code ``device="cuda"`` or call ``.cuda()`` (pipeline schedules'
    token counts, clip_grads' norms, grad scaler, optimizer state, dist_checkpointing exchange).
    Route CUDA device arguments of tensor factories and ``Tensor.to`` to the CPU."""

    def route(factory: Callable) -> Callable:
        @functools.wraps(factory)
        def on_cpu(*args, **kwargs):
            if _is_cuda_device(kwargs.get("device")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return on_cpu

    # torch's device context (``with torch.device("meta"):``, used by transformers' from_pretrained)
    # recognises factories by identity, from a set it builds once on first use: build it now, from
    # the original functions, or the context would stop placing them (and ignore the wrappers)
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "randn", "rand", "randint",
                 "randperm", "empty_like", "zeros_like", "ones_like", "full_like", "as_tensor",
                 "eye", "linspace", "empty_strided"):
        setattr(torch, name, route(getattr(torch, name)))

    to = torch.Tensor.to

    def to_cpu(self, *args, **kwargs):
        if args and _is_cuda_device(args[0]):
            args = ("cpu",) + args[1:]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return to(self, *args, **kwargs)

    # an opaque call to torch.compile: traced into, the wrapper's call of the original method
    # descriptor is a graph break, so `.to` in compiled code (e.g. FP8 casts) would split graphs
    torch.Tensor.to = torch.compiler.allow_in_graph(to_cpu)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def pinned_host_memory() -> None:
    """megatron's RoPE under context parallelism (``get_pos_emb_on_this_cp_rank``: MLA, the
    local-backend attention) builds its chunk index with ``torch.tensor(..., pin_memory=True)``;
    pinning needs a CUDA driver. Without one, drop the request: the tensor is host memory anyway."""
    if torch.cuda.is_available():
        return

    def unpinned(factory: Callable) -> Callable:
        @functools.wraps(factory)
        def host(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return host

    from torch.utils._device import _device_constructors

    _device_constructors()  # see cuda_device_strings: the device context keeps recognising the originals
    for name in ("tensor", "zeros", "empty", "ones", "full", "arange", "empty_like", "zeros_like", "ones_like",
                 "full_like", "empty_strided"):
        setattr(torch, name, unpinned(getattr(torch, name)))


def cuda_tensor_type_names() -> None:
    """The optimizers and clip_grads check ``param.type() == 'torch.cuda.FloatTensor'`` to find
    fp32 params; on CPU the name is ``torch.FloatTensor``. Report CPU dense tensors under the
    CUDA type name (the only consumer of these strings is that check)."""
    type_ = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        if args or kwargs:
            return type_(self, *args, **kwargs)
        name = type_(self)
        if self.is_sparse or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_named_type


def synchronize_and_streams() -> None:
    """megatron calls ``torch.cuda.synchronize()`` and creates CUDA streams/events
    unconditionally (timers, the MoE alltoall dispatcher's D2H copies, DDP overlap). On CPU all
    work is synchronous, so these become no-ops."""

    class _Event:
        def record(self, *args, **kwargs):
            return None

        def wait(self, *args, **kwargs):
            return None

        def synchronize(self):
            return None

        def query(self):
            return True

        def elapsed_time(self, other):
            return 0.0

    class _Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, *args, **kwargs):
            return None

        def wait_event(self, *args, **kwargs):
            return None

        def record_event(self, *args, **kwargs):
            return _Event()

        def synchronize(self):
            return None

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    default = _Stream()
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.Stream = _Stream
    torch.cuda.Event = lambda *args, **kwargs: _Event()
    torch.cuda.current_stream = lambda *args, **kwargs: default
    torch.cuda.default_stream = lambda *args, **kwargs: default
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, stream: None


def rng_tracker() -> None:
    """megatron's RNG tracker (TP-aware dropout/init seeds, activation recompute) keeps CUDA
    generator states (``torch.cuda.get_rng_state``). Keep the same named-state semantics on the
    CPU generator instead."""
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            self.seeds_.add(seed)
            saved = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            saved = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(saved)

    mrandom.CudaRNGStatesTracker = CpuRNGStatesTracker
    # activation recompute saves and restores the "cuda" state through these two helpers
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mrandom.initialize_rng_tracker(force_reset=True)


def moe_split_sizes() -> None:
    """The MoE alltoall dispatcher turns its split sizes into host numbers only when the
    tensor ``is_cuda``; on CPU they stay tensors and gloo's ``all_to_all_single`` rejects them.
    Convert whenever a host copy is asked for."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.detach().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = to_host
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


ADAPTATIONS: dict[str, Callable[[], None]] = {
    "current_device": current_device,
    "cuda_device_strings": cuda_device_strings,
    "pinned_host_memory": pinned_host_memory,
    "cuda_tensor_type_names": cuda_tensor_type_names,
    "synchronize_and_streams": synchronize_and_streams,
    "rng_tracker": rng_tracker,
    "moe_split_sizes": moe_split_sizes,
}


def install() -> list[str]:
    """Install every adaptation not named in ``$LOONGFORGE_CPU_SKIP`` (comma separated)."""
    skip = {s.strip() for s in os.environ.get(SKIP_ENV, "").split(",") if s.strip()}
    unknown = skip - ADAPTATIONS.keys()
    if unknown:
        raise ValueError(f"{SKIP_ENV}: unknown adaptation(s) {sorted(unknown)}; known: {sorted(ADAPTATIONS)}")
    for name, adapt in ADAPTATIONS.items():
        if name not in skip and name not in _installed:
            adapt()
            _installed.append(name)
    return list(_installed)
