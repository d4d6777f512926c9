"""Named fused ops: each op's contract, defined by the package that owns it, and the fused
implementations kernel wheels provide for any of them.

A package defines an op with an entry point of the ``loongforge.ops`` group named after the op,
whose object is the op's torch reference (its contract: shapes, dtypes, numerics)::

    [project.entry-points."loongforge.ops"]
    rms_norm = "loongforge.core.kernels.reference:rms_norm"

Looking an op up loads that one entry point, so it imports the owning package's module and no
other modality's. A kernel wheel registers a provider under the ``loongforge.kernels`` group: a
zero-argument callable returning ``{op_name: KernelImpl}``, for ops of any package.
``get_kernel(name)`` returns the provider's implementation where one is installed and
``supports(accelerator)`` holds, else the reference. Errors name what is wrong: an op defined
twice (both sources), an implementation of an op no installed package defines (when that op is
looked up, or when the providers are listed: ``installed_kernels``) and an unknown op (with the
known ones).

The reference wherever a fused kernel would run: ``get_kernel(name, force_reference=True)`` for
one lookup, ``KernelPolicy(force_reference=True)`` handed to the modules a builder makes
(``policy.py``), or ``LOONGFORGE_KERNELS=reference`` in the environment (read here, never written).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cache
from importlib.metadata import EntryPoint, entry_points

from loongforge.core.errors import UserError

OPS_GROUP = "loongforge.ops"
ENTRY_POINT_GROUP = "loongforge.kernels"  # the providers' group
ENV_VAR = "LOONGFORGE_KERNELS"


class KernelRegistryError(UserError, LookupError):
    """An op defined twice, implemented but defined by no installed package, or unknown."""


@dataclass(frozen=True)
class OpContract:
    """One named op as the package that owns it defines it."""

    name: str
    reference: Callable  # the torch reference: what every implementation must compute
    source: str = ""  # where it is defined: "distribution: module:attribute"


@dataclass(frozen=True)
class KernelImpl:
    """A fused implementation of one named op."""

    fn: Callable
    supports: Callable[[object], bool]  # accelerator -> whether this implementation runs on it
    provider: str = ""


def _source(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name}: {ep.value}" if dist is not None else ep.value


class OpRegistry:
    """The ops defined by ``definitions`` (``loongforge.ops`` entry points) and the implementations
    of ``providers`` (``loongforge.kernels`` entry points); an entry point is loaded when first needed."""

    def __init__(self, definitions: Iterable[EntryPoint], providers: Iterable[EntryPoint]):
        self._definitions: dict[str, list[EntryPoint]] = {}
        for ep in definitions:
            self._definitions.setdefault(ep.name, []).append(ep)
        self._providers = tuple(providers)
        self._contracts: dict[str, OpContract] = {}
        self._provided: dict[str, KernelImpl] | None = None

    def names(self) -> list[str]:
        """Every defined op's name, from the packages' metadata (imports nothing)."""
        return sorted(self._definitions)

    def contract(self, name: str) -> OpContract:
        """The contract of op ``name``, importing only the module that defines it."""
        if name not in self._contracts:
            self._contracts[name] = self._load_contract(name)
        return self._contracts[name]

    def _load_contract(self, name: str) -> OpContract:
        definitions = self._definitions.get(name, [])
        if not definitions:
            if name in self.provided():
                raise KernelRegistryError(self._undefined_message([name]))
            raise KernelRegistryError(f"unknown kernel op {name!r}; known: {', '.join(self.names()) or 'none'}")
        if len(definitions) > 1:
            sources = " and by ".join(_source(ep) for ep in definitions)
            raise KernelRegistryError(f"op {name!r} is defined twice: by {sources}")
        (ep,) = definitions
        reference = ep.load()
        if not callable(reference):
            raise KernelRegistryError(f"op {name!r}: {_source(ep)} is not a callable (the op's torch reference)")
        return OpContract(name, reference, _source(ep))

    def contracts(self) -> dict[str, OpContract]:
        """Every defined op (imports every package that defines one)."""
        return {name: self.contract(name) for name in self.names()}

    def provided(self) -> dict[str, KernelImpl]:
        """Every provider's implementations by op, as the providers give them (not checked
        against the definitions; :meth:`kernels` is)."""
        if self._provided is None:
            found: dict[str, KernelImpl] = {}
            for ep in self._providers:
                for op, impl in ep.load()().items():
                    if op in found:
                        raise KernelRegistryError(
                            f"op {op!r} is implemented twice: by {found[op].provider} and by {ep.value}")
                    found[op] = KernelImpl(fn=impl.fn, supports=impl.supports, provider=ep.value)
            self._provided = found
        return self._provided

    def kernels(self) -> dict[str, KernelImpl]:
        """Every provided implementation by op; one of an op no installed package defines is an error naming it."""
        undefined = sorted(set(self.provided()) - set(self._definitions))
        if undefined:
            raise KernelRegistryError(self._undefined_message(undefined))
        return self.provided()

    def _undefined_message(self, ops: list[str]) -> str:
        listed = ", ".join(f"{op!r} (by {self.provided()[op].provider})" for op in ops)
        return (f"kernel providers implement ops that no installed package defines: {listed}; install the package "
                f"that defines them (its {OPS_GROUP!r} entry points) or remove the provider")

    def resolve(self, name: str, accelerator=None, force_reference: bool | None = None) -> Callable:
        """The implementation of op ``name`` to use on ``accelerator`` (default: the current one);
        ``force_reference`` None reads ``LOONGFORGE_KERNELS``."""
        contract = self.contract(name)
        if force_reference is None:
            force_reference = os.environ.get(ENV_VAR, "auto").lower() == "reference"
        impl = None if force_reference else self.provided().get(name)
        if impl is None:
            return contract.reference
        if accelerator is None:
            from loongforge.core.accelerators import get_accelerator

            accelerator = get_accelerator()
        return impl.fn if impl.supports(accelerator) else contract.reference


def reference_kernels_notice(accelerator_name: str, providers: Iterable[str], distribution: str) -> str | None:
    """The line a run prints when it trains on CUDA with only the torch references because no
    kernel wheel is installed (``providers``: the installed ``loongforge.kernels`` entry points);
    None where nothing is missing or no kernel wheel serves the accelerator."""
    if accelerator_name != "cuda" or any(True for _ in providers):
        return None
    return (f"loongforge-kernels is not installed: the fused ops run their PyTorch references "
            f"(pip install \"{distribution}[gpu]\" for the Triton kernels)")


def installed_kernel_providers() -> list[str]:
    return [ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)]


@cache
def installed_registry() -> OpRegistry:
    """The registry of the installed packages' op definitions and kernel providers."""
    return OpRegistry(entry_points(group=OPS_GROUP), entry_points(group=ENTRY_POINT_GROUP))


def get_op(name: str) -> OpContract:
    """The contract of installed op ``name`` (imports only the module that defines it)."""
    return installed_registry().contract(name)


def installed_ops() -> dict[str, OpContract]:
    """Every installed op's contract, by name (imports every package that defines one)."""
    return installed_registry().contracts()


def installed_kernels() -> dict[str, KernelImpl]:
    """Every fused op provided by installed kernel wheels, by op name."""
    return installed_registry().kernels()


def get_kernel(name: str, accelerator=None, force_reference: bool | None = None) -> Callable:
    """The implementation of op ``name`` to use on ``accelerator`` (default: the current one)."""
    return installed_registry().resolve(name, accelerator, force_reference)


@dataclass(frozen=True)
class OpWithBackward:
    """A registry op and its backward, an op of its own named ``<name>_backward`` (one fused pass
    where autograd of the forward would make several), resolved together for the autograd
    function that calls both."""

    forward: Callable
    backward: Callable


def get_kernel_with_backward(name: str, accelerator=None, force_reference: bool | None = None) -> OpWithBackward:
    """``get_kernel`` of op ``name`` and of ``<name>_backward``."""
    return OpWithBackward(get_kernel(name, accelerator, force_reference),
                          get_kernel(f"{name}_backward", accelerator, force_reference))
