"""LoongForge diffusion: Wan 2.x video DiT flow-matching training.

- ``model``: the Wan DiT in diffusers' ``WanTransformer3DModel`` layout on packed sequences,
  Wan 2.2 two experts, diffusers import/export;
- ``packing`` / ``context_parallel``: mixed-size sequence packing, Ulysses context parallelism;
- ``objective``: rectified flow with diffusers' timestep sampling;
- ``preprocess`` / ``data``: videos and prompts to latent shards, the built-in synthetic set;
- ``trainer`` / ``sampling`` / ``cli``: ``lf-diffusion train | preprocess | sample | convert | info | plot``.
"""
