"""Launch helpers shared by the Triton kernels: device checks, block sizes, program counts."""

from __future__ import annotations

import torch
import triton
from triton import knobs

# Fixed when the kernel modules are imported: ``triton.jit`` decides then whether a kernel is
# compiled for the GPU or run by the CPU interpreter (``TRITON_INTERPRET=1``).
INTERPRETED = bool(knobs.runtime.interpret)


def _check_interpreter_consistent() -> None:
    """Triton's own library (``tl.max``, ``tl.sum``, ...) is decorated when ``triton`` is first
    imported; if ``TRITON_INTERPRET=1`` came later, our interpreted kernels would call compiled
    library functions and fail deep inside the interpreter. Say so at import instead."""
    if not INTERPRETED:
        return
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(standard.max, InterpretedFunction):
        raise RuntimeError(
            "loongforge.kernels: TRITON_INTERPRET=1 was set after `triton` had been imported, so "
            "Triton's language library is compiled while our kernels are interpreted; set "
            "TRITON_INTERPRET=1 before anything imports triton (for pytest, the repository's "
            "root conftest.py does this)"
        )


_check_interpreter_consistent()

# Largest row a kernel holds in one block (Triton caps a block at 2**20 elements; rows far below
# that keep register pressure sane).
MAX_ROW_BLOCK = 65536


def check_tensors(op: str, *tensors: torch.Tensor) -> torch.device:
    """The device of ``tensors``; raises when they are split over devices or cannot run Triton."""
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise ValueError(f"{op}: all inputs must be on one device; got {device} and {t.device}")
    if device.type == "cpu" and not INTERPRETED:
        raise ValueError(
            f"{op}: the fused Triton kernel runs on a GPU but got CPU tensors (shape "
            f"{tuple(tensors[0].shape)}); on CPU use the torch reference (get_kernel picks it for the "
            f"cpu accelerator) or set TRITON_INTERPRET=1 before importing loongforge.kernels"
        )
    return device


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: full fp32 for fp32 operands (Triton's default rounds them to
    tf32 on the GPU), the tensor cores' native precision otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def row_block(op: str, n: int) -> int:
    """Power-of-two block that holds a row of ``n`` elements."""
    block = triton.next_power_of_2(max(n, 1))
    if block > MAX_ROW_BLOCK:
        raise ValueError(f"{op}: rows of {n} elements exceed the fused kernel's limit of {MAX_ROW_BLOCK}")
    return block


def warps_for(block: int) -> int:
    """Warps per program for a row block of ``block`` elements (4 to 16)."""
    return min(max(block // 512, 4), 16)


def persistent_programs(device: torch.device, n_rows: int) -> int:
    """How many programs share ``n_rows`` rows in kernels that reduce over rows (e.g. dweight)."""
    if device.type == "cuda":
        slots = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    elif device.type == "cpu":  # the interpreter: few programs, each a python loop over rows
        slots = 4
    else:
        slots = 128
    return max(1, min(n_rows, slots))


def split_rows(device: torch.device, n_rows: int, block_rows: int, programs_per_slot: int = 1,
               column_blocks: int = 1) -> tuple[int, int]:
    """``(programs, rows per program)`` for a kernel whose programs each walk a range of rows,
    keeping per-column sums in registers: ``programs_per_slot`` programs per SM slot in all (shared
    among ``column_blocks`` blocks of columns), each range a multiple of ``block_rows``, none empty."""
    programs = programs_per_slot * persistent_programs(device, n_rows)
    groups = max(1, min(triton.cdiv(n_rows, block_rows), triton.cdiv(programs, column_blocks)))
    rows_per_program = triton.cdiv(triton.cdiv(n_rows, groups), block_rows) * block_rows
    return max(1, triton.cdiv(n_rows, rows_per_program)), rows_per_program
