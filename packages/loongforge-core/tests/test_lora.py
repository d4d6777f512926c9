"""LoRA of the PyTorch-native engine (loongforge.core.lora) on a small module: wrapping, freezing,
initialisation, merging and PEFT's adapter format (loaded back by PEFT itself)."""

import json

import pytest
import torch
import torch.nn as nn

from loongforge.core.lora import (
    AdapterLayout,
    LoRAConfig,
    LoRALinear,
    _minimal_targets,
    apply_lora,
    export_peft_adapter,
    merge_lora,
    merge_state,
    matches,
)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        x = x + self.q_proj(x) * torch.sigmoid(self.k_proj(x))
        return x + self.mlp(self.norm(x))


class Toy(nn.Module):
    def __init__(self, dim=8, depth=2):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _toy(seed=0):
    torch.manual_seed(seed)
    return Toy()


def _randomise_b(model):
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.weight.normal_(0, 0.3)


def test_matching_suffixes_and_regex():
    assert matches("blocks.0.attn1.to_q", ["to_q"]) and matches("blocks.0.attn1.to_q", ["attn1.to_q"])
    assert not matches("blocks.0.attn1.to_qx", ["to_q"]) and not matches("blocks.0.xattn1.to_q", ["attn1.to_q"])
    assert matches("blocks.0.mlp.0", ["mlp.0"]) and not matches("blocks.0.mlp.0", ["0.mlp"])
    assert matches("blocks_.1.self_attn.q", [r"re:.*_attn\.(q|k)"]) and not matches("blocks_.1.self_attn.v", [r"re:.*_attn\.(q|k)"])
    with pytest.raises(ValueError, match="not a regular expression"):
        LoRAConfig(rank=2, target_modules=["re:("])
    with pytest.raises(ValueError, match="lora.target_modules is empty"):
        LoRAConfig(rank=2)


def test_apply_wraps_freezes_and_starts_at_the_base_model():
    base, model = _toy(), _toy()
    x = torch.randn(5, 8)
    adapted = apply_lora(model, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "mlp.2"]), seed=3)
    assert adapted == ["blocks.0.q_proj", "blocks.0.mlp.2", "blocks.1.q_proj", "blocks.1.mlp.2"]
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{a}.{f}.weight" for a in adapted for f in ("lora_A", "lora_B"))
    # base names unchanged, adapters beside them; B = 0: the output is the base model's
    assert set(model.state_dict()) - set(base.state_dict()) == {f"{a}.{f}.weight" for a in adapted for f in ("lora_A", "lora_B")}
    torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
    layer = model.blocks[0].q_proj
    assert layer.lora_A.weight.shape == (4, 8) and layer.lora_B.weight.shape == (8, 4) and layer.scaling == 2.0
    assert layer.lora_A.weight.abs().max() <= 8 ** -0.5 and layer.lora_A.weight.std() > 0.1
    # A depends on the seed and the layer's name only
    again = _toy(seed=7)
    apply_lora(again, LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "mlp.2"]), seed=3)
    assert torch.equal(again.blocks[1].mlp[2].lora_A.weight, model.blocks[1].mlp[2].lora_A.weight)
    assert not torch.equal(model.blocks[0].q_proj.lora_A.weight, model.blocks[1].q_proj.lora_A.weight)


def test_forward_is_base_plus_scaled_low_rank_update_and_merges():
    model = _toy()
    apply_lora(model, LoRAConfig(rank=2, alpha=6, target_modules=["head"]))
    _randomise_b(model)
    x = torch.randn(4, 8)
    h = x
    for b in model.blocks:
        h = b(h)
    head = model.head
    want = h @ head.weight.T + head.bias + 3.0 * (h @ head.lora_A.weight.T) @ head.lora_B.weight.T
    torch.testing.assert_close(model(x), want)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    merged = merge_state(state, 3.0)
    assert "head.lora_A.weight" not in merged
    torch.testing.assert_close(merged["head.weight"], head.weight + 3.0 * head.lora_B.weight @ head.lora_A.weight)
    out = model(x).detach()
    assert merge_lora(model) == ["head"] and type(model.head) is nn.Linear
    torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-6)
    assert set(model.state_dict()) == set(merged)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, merged[k], msg=k)


def test_frozen_layers_keep_frozen_adapters_and_errors_name_the_layers():
    model = _toy()
    model.blocks[1].requires_grad_(False)  # what a run does not train
    apply_lora(model, LoRAConfig(rank=2, target_modules=["q_proj"]))
    assert model.blocks[0].q_proj.lora_A.weight.requires_grad and not model.blocks[1].q_proj.lora_A.weight.requires_grad
    with pytest.raises(ValueError, match=r"match no linear layer; the model's are \['0', '2', 'head', 'k_proj', 'q_proj'\]"):
        apply_lora(_toy(), LoRAConfig(rank=2, target_modules=["to_q"]))
    frozen = _toy()
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="adapt only layers this run keeps frozen"):
        apply_lora(frozen, LoRAConfig(rank=2, target_modules=["q_proj"]))


def test_meta_model_gets_the_same_adapters_after_materialising():
    from loongforge.core.lora import init_adapters

    ref = _toy()
    apply_lora(ref, LoRAConfig(rank=2, target_modules=["k_proj"]), seed=5)
    with torch.device("meta"):
        meta = Toy()
    apply_lora(meta, LoRAConfig(rank=2, target_modules=["k_proj"]), seed=5)
    assert meta.blocks[0].k_proj.lora_A.weight.is_meta
    meta.to_empty(device="cpu")
    init_adapters(meta, seed=5)
    for name, t in ref.state_dict().items():
        if "lora_" in name:
            assert torch.equal(meta.state_dict()[name], t), name


def test_minimal_targets():
    universe = [f"blocks.{i}.attn{j}.{p}" for i in range(2) for j in (1, 2) for p in ("to_q", "to_k", "to_out.0")]
    assert _minimal_targets([u for u in universe if "to_q" in u or "to_out" in u], universe) == ["to_out.0", "to_q"]
    only_attn1 = [u for u in universe if "attn1.to_q" in u]
    assert _minimal_targets(only_attn1, universe) == ["attn1.to_q"]
    first = ["blocks.0.attn1.to_q"]
    assert _minimal_targets(first, universe) == ["blocks.0.attn1.to_q"]


def test_peft_adapter_loads_with_peft_and_gives_the_lora_output(tmp_path):
    """The adapter export, loaded by PEFT onto the base model (``PeftModel.from_pretrained``),
    gives the LoRA model's output."""
    from peft import PeftModel

    base, model = _toy(), _toy()
    lora = LoRAConfig(rank=4, alpha=12, target_modules=["q_proj", "mlp.0"])
    apply_lora(model, lora)
    _randomise_b(model)
    state = model.state_dict()
    layout = AdapterLayout(prefix="", rename=lambda ws: {w: w for w in ws}, library="toy", key_prefix="base_model.model.")
    record = {"rank": 4, "alpha": 12.0, "dropout": 0.0, "target_modules": lora.target_modules}
    [written] = export_peft_adapter(state, state.__getitem__, record, tmp_path / "adapter", [layout])
    config = json.loads((written / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", 4, 12.0, "none")
    assert config["target_modules"] == ["mlp.0", "q_proj"]
    x = torch.randn(6, 8)
    peft_model = PeftModel.from_pretrained(base, str(written))
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x), model(x), rtol=1e-5, atol=1e-6)
    with pytest.raises(FileExistsError):
        export_peft_adapter(state, state.__getitem__, record, tmp_path / "adapter", [layout])


ENGINE_SCRIPT = """
import torch
import torch.nn as nn
from loongforge.core.config import ConfigError
from loongforge.core.lora import LoRAConfig
from loongforge.core.parallel import destroy_parallel, init_parallel
from loongforge.core.training.schema import ParallelConfig, TrainConfig
from loongforge.core.training.task import StepBatch, TorchTask
from loongforge.core.training.torch_model import TorchModel
from loongforge.core.training.torch_engine import TorchEngine


class Model(TorchModel):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.fused = nn.Linear(4, 4)  # its weight is read directly, as a fused GEMM would

    def repeated_blocks(self):
        return []

    def forward(self, x):
        return nn.functional.linear(self.used(x), self.fused.weight, self.fused.bias)


class Task(TorchTask):
    family = "toy"

    def model_config_dict(self):
        return {}

    def steps(self, ctx, start_step):
        return iter(())

    def build_model(self, ctx):
        return Model()

    def forward(self, model, x):
        out = model(x)
        return out, lambda o: (o.pow(2).sum(), o.numel())


ctx = init_parallel(seed=0)
step = StepBatch(micro_batches=[torch.randn(3, 4)])
train = TrainConfig(seed=0, compile=False)
engine = TorchEngine(Task(), ctx, train, ParallelConfig(), lora=LoRAConfig(rank=2, target_modules=["used"]))
engine.forward_backward(step)
assert sorted(engine.named_trainable) == ["used.lora_A.weight", "used.lora_B.weight"]
engine = TorchEngine(Task(), ctx, train, ParallelConfig(), lora=LoRAConfig(rank=2, target_modules=["used", "fused"]))
try:
    engine.forward_backward(step)
except ConfigError as exc:
    assert "never ran the adapters of ['fused']" in str(exc), exc
else:
    raise AssertionError("an adapter the forward skips must be refused")
destroy_parallel()
print("ok")
"""


def test_engine_refuses_adapters_the_forward_never_runs():
    import subprocess
    import sys

    env = {"PATH": "/usr/bin:/bin", "LOONGFORGE_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", ENGINE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-4000:]
