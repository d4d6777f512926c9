"""Vendor spec peaks of dense bf16/fp16 tensor-core FLOP/s per GPU, keyed by a fragment of the
device name (``torch.cuda.get_device_name()``): what a bench's "MFU of spec" is taken against,
next to the measured matmul peak. The first matching fragment wins, so the more specific names
come first (``H100 PCIe`` before ``H100``, ``H200`` before ``H20``)."""

from __future__ import annotations

SPEC_PEAK_BF16 = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
}


def spec_peak_bf16(device_name: str) -> float | None:
    """The dense bf16 spec peak (FLOP/s) of the device named ``device_name``; None when not listed."""
    for fragment, flops in SPEC_PEAK_BF16.items():
        if fragment in device_name:
            return flops
    return None
