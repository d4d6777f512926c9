"""torch.compile of the blocks (with activation checkpointing) gives the eager loss and gradients.

The ``aot_eager`` backend runs Dynamo capture and AOTAutograd on every block without Inductor's
C++ code generation (minutes on CPU); GPU runs use the default ``inductor`` backend."""

from __future__ import annotations

import pytest
import torch

from loongforge.embodied.policies import build_policy, policy_config


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pi0", "pi05", "pi05_dit_head", "smolvla", "groot_n1_7"])
def test_compiled_checkpointed_blocks_match_eager(name):
    cfg = policy_config(name, chunk_size=4, max_action_dim=3, max_state_dim=3, num_cameras=1, image_size=16)
    torch.manual_seed(0)
    eager = build_policy(cfg)
    torch.manual_seed(0)
    compiled = build_policy(cfg)
    compiled.set_recompute("full")  # train.recompute=full, then the engine's regional compilation
    for block in compiled.repeated_blocks():
        block.compile(backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    b = 2
    batch = {
        "images": torch.rand(b, 1, 3, 16, 16, generator=g) * 2 - 1,
        "image_mask": torch.ones(b, 1, dtype=torch.bool),
        "tokens": torch.randint(4, 200, (b, 6), generator=g),
        "token_mask": torch.tensor([[True] * 6, [True] * 3 + [False] * 3]),
        "state": torch.randn(b, 3, generator=g),
        "actions": torch.randn(b, 4, 3, generator=g),
    }
    noise, t = torch.randn(b, 4, 3, generator=g), torch.tensor([0.2, 0.7])
    out, ref = compiled(batch, noise, t), eager(batch, noise, t)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    out.mean().backward()
    ref.mean().backward()
    for (n, p), q in zip(compiled.named_parameters(), eager.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-7, msg=n)
    assert compiled.activation_checkpointing
