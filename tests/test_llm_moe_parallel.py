"""Expert parallel (EP=2: the alltoall dispatcher exchanges tokens over gloo) and tensor parallel
(TP=2, with the sequence parallelism megatron's MoE layer needs) train the MoE debug models as
one process does: same losses and gradient norms, step by step.

Every run starts from the same weights, a random transformers model of the debug shape converted
with ``hf_to_lf`` (``checkpoint.load=``): processes of different layouts would otherwise
initialise the experts from different random streams.
"""

import json

import pytest
import torch
from cli_runner import run_cli

pytestmark = pytest.mark.slow

# step 1 runs the initial weights, step 2 the weights after one full-rate update (warmup_steps=1);
# later steps add nothing a layout could get wrong, only the drift of summation order through
# DeepSeek's sign-based expert-bias updates (~2e-4 in the grad norm by step 3)
STEPS = 2
COMMON = [
    f"train.steps={STEPS}", "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=64",
    "train.warmup_steps=1", "log.interval=1", "log.progress=false", "log.tensorboard=false",
    "checkpoint.save=false", "checkpoint.resume=false",
]
CONFIGS = {"qwen3_moe": "train_qwen3_moe_debug", "deepseek_v3": "train_deepseek_v3_debug"}


def hf_model(family: str):
    """A random transformers model of the family's debug shape (its config through the family's
    ``config_to_hf``)."""
    import transformers

    from loongforge.core.models import get_model_spec
    from loongforge.llm.families import deepseek_v3, qwen3_moe

    debug = {"qwen3_moe": qwen3_moe, "deepseek_v3": deepseek_v3}[family].flavour("debug")
    raw = get_model_spec(family).hf_adapter.config_to_hf(debug)
    model = getattr(transformers, raw["architectures"][0])(transformers.AutoConfig.for_model(**raw))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.02 * torch.randn(p.shape, generator=g))
    return model


# DeepSeek-V3 under -m long (the default tier's budget: its only case here is EP=2; MLA at TP=2 is
# test_mla_tensor_parallel.py's, and EP=2 runs in the default tier with Qwen3-MoE, its LoRA and the
# overlapped all-to-all)
@pytest.fixture(scope="module", params=[pytest.param(f, marks=pytest.mark.long) if f == "deepseek_v3" else f
                                        for f in sorted(CONFIGS)])
def start(request, tmp_path_factory, llm_data_cache):
    """(family, the converted initial weights, the one-process losses and grad norms)."""
    from loongforge.core.hf_mapping.convert import hf_to_lf

    family = request.param
    root = tmp_path_factory.mktemp(family)
    hf_model(family).save_pretrained(root / "hf")
    hf_to_lf(root / "hf", root / "weights", progress=False)
    return family, root / "weights", train(family, root / "ref", root / "weights", llm_data_cache)


def train(family, run_dir, weights, data_cache, extra=(), nproc=1) -> list[tuple[float, float]]:
    proc = run_cli(["lf-llm", "train", "--config", CONFIGS[family], *COMMON, f"checkpoint.load={weights}",
                    f"log.run_dir={run_dir}", f"data.cache_dir={data_cache}", *extra], nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return [(r["loss"], r["grad_norm"]) for r in rows]


@pytest.mark.parametrize("layout", ["parallel.ep=2", "parallel.tp=2"], ids=["ep2", "tp2"])
def test_layout_matches_one_process(layout, start, tmp_path, llm_data_cache):
    family, weights, ref = start
    if family == "deepseek_v3" and layout == "parallel.tp=2":
        pytest.skip("MLA at TP=2 is compared in every gradient by test_mla_tensor_parallel.py (losses and "
                    "grad norms alone missed a wrong key gradient there)")
    got = train(family, tmp_path, weights, llm_data_cache, [layout], nproc=2)
    assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in ref], rel=1e-5)
    assert [norm for _, norm in got] == pytest.approx([norm for _, norm in ref], rel=1e-4)
