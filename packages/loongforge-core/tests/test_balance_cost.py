import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from loongforge.core.balance import CostModel, SampleSizes, transformer_cost_model


def test_segments_are_quadratic_each_and_linear_in_total():
    model = CostModel(a=2.0, b=3.0, c=5.0)
    assert model.cost(10) == 2 * 100 + 3 * 10 + 5
    # a packed sample of three documents attends within each one
    assert model.cost([4, 6, 10]) == 2 * (16 + 36 + 100) + 3 * 20 + 5
    sizes = SampleSizes.from_lengths([10, [4, 6, 10], np.int64(7)])
    assert sizes.tokens.tolist() == [10, 20, 7]
    assert sizes.squares.tolist() == [100, 152, 49]
    np.testing.assert_array_equal(model.costs(sizes), [235.0, 369.0, 124.0])
    np.testing.assert_array_equal(SampleSizes.from_lengths(np.array([3, 4])).squares, [9, 16])


@pytest.mark.parametrize("bad", [[0], [5, -1], [[3, 0]], [[]], [2.5]])
def test_bad_lengths_name_the_sample(bad):
    with pytest.raises(ValueError, match="sample"):
        SampleSizes.from_lengths(bad)


def test_bad_coefficients():
    with pytest.raises(ValueError, match="a=-1"):
        CostModel(a=-1.0, b=1.0)
    with pytest.raises(ValueError, match="all 0"):
        CostModel(a=0.0, b=0.0)


class _Decoder(torch.nn.Module):
    """A Llama-shaped decoder (GQA attention, SwiGLU MLP, untied LM head) with eager attention."""

    def __init__(self, hidden=64, layers=2, ffn=96, heads=4, kv_heads=2, vocab=128):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(dict(q=lin(hidden, hidden), k=lin(hidden, kv_heads * self.head_dim),
                                     v=lin(hidden, kv_heads * self.head_dim), o=lin(hidden, hidden),
                                     gate=lin(hidden, ffn), up=lin(hidden, ffn), down=lin(ffn, hidden)))
            for _ in range(layers))
        self.head = lin(hidden, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        n, rep = ids.shape[1], self.heads // self.kv_heads
        mask = torch.full((n, n), float("-inf")).triu(1)
        for layer in self.layers:
            q = layer["q"](x).view(1, n, self.heads, self.head_dim).transpose(1, 2)
            k = layer["k"](x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(rep, 1)
            v = layer["v"](x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2).repeat_interleave(rep, 1)
            att = torch.softmax(q @ k.transpose(-1, -2) / self.head_dim**0.5 + mask, dim=-1) @ v
            x = x + layer["o"](att.transpose(1, 2).reshape(1, n, -1))
            x = x + layer["down"](torch.nn.functional.silu(layer["gate"](x)) * layer["up"](x))
        return self.head(x)


def _training_flops(seq_length: int) -> int:
    """Matmul FLOPs torch counts for one forward+backward of the decoder on one sequence."""
    torch.manual_seed(0)
    model = _Decoder()
    ids = torch.randint(0, 128, (1, seq_length))
    with FlopCounterMode(display=False) as counter:
        model(ids).sum().backward()
    return counter.get_total_flops()


def test_flop_formula_matches_torch_flop_counter():
    # eager attention multiplies the full L x L score matrix, so compare with causal=False
    formula = transformer_cost_model(hidden_size=64, num_layers=2, ffn_hidden_size=96, num_attention_heads=4,
                                     num_query_groups=2, vocab_size=128, gated_mlp=True, causal=False)
    for length in (16, 40):
        assert formula.a * length**2 + formula.b * length == _training_flops(length)
    causal = transformer_cost_model(hidden_size=64, num_layers=2, ffn_hidden_size=96, num_attention_heads=4,
                                    num_query_groups=2, vocab_size=128)
    assert causal.a == formula.a / 2 and causal.b == formula.b
    recompute = transformer_cost_model(hidden_size=64, num_layers=2, ffn_hidden_size=96, num_attention_heads=4,
                                       num_query_groups=2, vocab_size=128, recompute=True)
    assert recompute.b == formula.b * 4 / 3


def test_from_flops_per_token_recovers_the_formula():
    formula = transformer_cost_model(hidden_size=256, num_layers=4, ffn_hidden_size=688, num_attention_heads=8,
                                     num_query_groups=4, vocab_size=1000)
    derived = CostModel.from_flops_per_token(lambda n: formula.a * n + formula.b)
    assert derived.a == pytest.approx(formula.a, rel=1e-9)
    assert derived.b == pytest.approx(formula.b, rel=1e-9)
    with pytest.raises(ValueError, match="not affine"):
        CostModel.from_flops_per_token(lambda n: 1e6 + 10.0 * min(n, 2048))


def test_formula_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_query_groups=3"):
        transformer_cost_model(hidden_size=64, num_layers=2, ffn_hidden_size=96, num_attention_heads=4,
                               num_query_groups=3, vocab_size=128)
    with pytest.raises(ValueError, match="hidden_size=0"):
        transformer_cost_model(hidden_size=0, num_layers=2, ffn_hidden_size=96, num_attention_heads=4, vocab_size=128)
