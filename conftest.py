"""Process-wide settings for the test session, applied before any test module is collected.

Triton picks compiled or interpreted mode for every ``@triton.jit`` function when it is decorated,
including Triton's own library (``tl.max``, ``tl.sum``), which is decorated the first time anything
imports ``triton`` -- and transformers, diffusers and megatron-core all do at import. Tests run on
CPU, where Triton kernels only run through its interpreter, so the interpreter is switched on here,
at the root, before collection imports any of them. Set ``TRITON_INTERPRET=0`` to run the GPU tests
with compiled kernels on a CUDA machine.

The LoongForge cache (``LOONGFORGE_CACHE``) is a temporary directory of the session.
"""

import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# derived files (tokenized corpora, generated demo datasets) go to a cache of this session's own,
# never to the user's ~/.cache/loongforge; each xdist worker builds what it needs once
os.environ.setdefault("LOONGFORGE_CACHE", tempfile.mkdtemp(prefix="loongforge-test-cache-"))
