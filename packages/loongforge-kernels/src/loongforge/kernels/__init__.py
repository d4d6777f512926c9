"""Fused Triton kernels for LoongForge's named ops, with autograd.

Found through the ``loongforge.kernels`` entry point (``provider.fused_kernels``) and picked by
``loongforge.core.kernels.get_kernel`` where the accelerator runs Triton. Modules: ``rms_norm``
(rms_norm, add_rms_norm), ``rope``, ``swiglu``, ``linear_cross_entropy``; ``launch`` holds their
shared launch helpers. Importing this package imports no Triton.
"""
