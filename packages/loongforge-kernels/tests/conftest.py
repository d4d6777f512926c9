"""The kernels' tests run on CPU through Triton's interpreter, which the repository's root
conftest.py switches on (``TRITON_INTERPRET=1``) before anything imports triton. With
``TRITON_INTERPRET=0`` on a CUDA machine the same tests run the compiled kernels on the GPU (their
tensors are created on it), and the ``gpu``-marked tests at model shapes run too."""

from __future__ import annotations

import os

import pytest


def compiled_on_gpu() -> bool:
    """Whether this session runs compiled kernels on a CUDA device (not the interpreter)."""
    import torch

    return os.environ.get("TRITON_INTERPRET", "0") != "1" and torch.cuda.is_available()


# Test modules whose tensors are made on torch's default device, which is the GPU when the
# kernels are compiled for it (the others place their tensors themselves).
DEFAULT_DEVICE_MODULES = (
    "test_rms_norm", "test_rope", "test_swiglu", "test_linear_cross_entropy", "test_registry", "test_gpu_model_shapes",
    "test_fp8", "test_sparse_mla", "test_gelu", "test_qk_norm_rope", "test_layer_norm", "test_grouped_qkv_rope", "test_adamw",
    "test_embedding_grad",
)


@pytest.fixture(autouse=True)
def _tensors_on_the_kernels_device(request):
    """New tensors go to the GPU when the kernels are compiled for it, else stay on the CPU."""
    import torch

    if not compiled_on_gpu() or request.module.__name__.rsplit(".", 1)[-1] not in DEFAULT_DEVICE_MODULES:
        yield
        return
    previous = torch.get_default_device()
    torch.set_default_device("cuda")
    yield
    torch.set_default_device(previous)


def pytest_collection_modifyitems(config, items):
    """Silence a numpy deprecation raised inside Triton's interpreter, for these tests only."""
    import pytest

    here = os.path.dirname(os.path.abspath(__file__))
    quiet = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
    for item in items:
        if str(item.path).startswith(here + os.sep):
            item.add_marker(quiet)
