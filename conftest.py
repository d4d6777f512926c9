"""Process-wide settings for the test session, applied before any test module is collected.

Triton picks compiled or interpreted mode for every ``@triton.jit`` function when it is decorated,
including Triton's own library (``tl.max``, ``tl.sum``), which is decorated the first time anything
imports ``triton`` -- and transformers, diffusers and megatron-core all do at import. Tests run on
CPU, where Triton kernels only run through its interpreter, so the interpreter is switched on here,
at the root, before collection imports any of them. Set ``TRITON_INTERPRET=0`` to run the GPU tests
with compiled kernels on a CUDA machine.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
