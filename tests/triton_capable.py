"""An accelerator for tests that claims Triton, so the kernel registry picks the Triton kernels,
which run under the interpreter on CPU (the root conftest sets ``TRITON_INTERPRET=1``)."""


class TritonCapable:
    """``base`` (an accelerator) in all but ``supports_triton``, which is True."""

    def __init__(self, base):
        self._base = base

    def __getattr__(self, name):
        return getattr(self._base, name)

    def supports_triton(self) -> bool:
        return True
