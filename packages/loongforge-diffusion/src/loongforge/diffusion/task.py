"""Flow matching on packed latents as a task of the shared loop (PyTorch-native engine, Ulysses CP),
the task of every diffusion family whose model reads ``PackedBatch`` (Wan, Qwen-Image, a plugin's
DiT: ``loongforge.diffusion.model.family``).

Per step: the step's global samples (a fixed function of (seed, step): ``data.batching``) are
planned over DP ranks by compute cost (core balancer; ``balance.*``); each rank packs its samples
(mixed sizes in one sequence, split further into micro-batches of at most ``balance.token_cap``
tokens), adds noise online (per sample, seeded by (seed, step, position), so the result does not
depend on the layout) and regresses the flow-matching velocity. Wan 2.2 trains one expert per step
(``StepBatch.part``), chosen with the probability of its timestep range unless
``model.train_expert`` names one; the other expert is frozen. Image-conditioned models
(``model.condition``) build each sample's input from its first frame
(``loongforge.diffusion.conditioning``): I2V from the condition latents and CLIP tokens stored by
``lf-diffusion preprocess``, TI2V from the clip's own first latent frame.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from loongforge.core.balance import CostModel
from loongforge.core.errors import DataError
from loongforge.core.training.task import StepBatch, TorchTask
from loongforge.diffusion.conditioning import (
    dataset_condition,
    given_tokens,
    image_tokens,
    model_input,
    token_timesteps,
)
from loongforge.diffusion.context_parallel import ContextParallel
from loongforge.diffusion.data.batching import generator, plan, step_samples
from loongforge.diffusion.data.shards import LatentShards
from loongforge.diffusion.model.family import diffusers_adapter
from loongforge.diffusion.objective import (
    TimestepSampler,
    noisy_and_target,
    pick_expert,
    token_weights,
)
from loongforge.diffusion.packing import grid_of, num_tokens, pack, pack_targets, pad_text
from loongforge.diffusion.schema import DiffusionRecipe


def resolve_data_root(recipe: DiffusionRecipe, is_main: bool, progress: bool = True) -> Path:
    """``data.path``, or the built-in moving-shapes set (written into the cache by the main rank)."""
    if recipe.data.path:
        return Path(recipe.data.path).expanduser()
    from loongforge.diffusion.data.synthetic import builtin_dataset, latents_dir

    if is_main:
        builtin_dataset(recipe.data.synthetic_clips, show_progress=progress, max_frames=recipe.data.synthetic_frames)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return latents_dir(recipe.data.synthetic_clips, recipe.data.synthetic_frames)


def packed_flops(cost: CostModel, token_counts: list[int]) -> float:
    """Training FLOPs of samples of these token counts under a family's cost model."""
    return float(sum(cost.a * t * t + cost.b * t + cost.c for t in token_counts))


class FlowMatchingTask(TorchTask):
    variable_micro_batches = True
    loads_into_shards = True  # the diffusers checkpoint holds every tensor of the DiT

    def __init__(self, recipe: DiffusionRecipe):
        self.recipe = recipe
        m = recipe.model
        self.family = m.family
        self.context_parallel = m.context_parallel
        self.sampler = TimestepSampler(recipe.objective)
        self.flops_model = m.cost_model()
        coefficients = recipe.balance.coefficients
        self.cost_model = CostModel(*coefficients) if coefficients is not None else self.flops_model
        self.features = m.latent_channels * m.patch_volume
        self.names = m.part_names()
        self.trainable = self.names if m.train_expert == "all" else [m.train_expert]
        boundary = None if m.boundary_ratio is None else m.boundary_ratio * recipe.objective.num_train_timesteps
        self.ranges = {n: self.sampler.index_range(boundary, i) for i, n in enumerate(self.names)}
        self.dataset: LatentShards | None = None
        self.data_root: Path | None = None
        self.tokens: list[int] = []

    @property
    def has_pretrained(self) -> bool:
        return bool(self.recipe.model.pretrained)

    def describe(self) -> str:
        return self.recipe.model.describe()

    # -- data ---------------------------------------------------------------------------------
    def prepare(self, ctx) -> None:
        """Open the latent shards (the main rank writes the built-in set first) and check they fit the model."""
        r, m = self.recipe, self.recipe.model
        self.data_root = resolve_data_root(r, ctx.is_main, r.log.progress)
        self.dataset = LatentShards(self.data_root)
        facts = self.dataset.manifest
        for key, ours in (("latent_channels", m.latent_channels), ("text_dim", m.text_width)):
            if facts.get(key) is not None and facts[key] != ours:
                raise DataError(f"{self.data_root}/manifest.json: {key}={facts[key]} but the {m.family!r} model "
                                f"takes {key}={ours}")
        self.check_image_condition(facts)
        longest = max(rec["text_tokens"] for rec in self.dataset.records)
        if longest > m.text_len:
            raise DataError(f"{self.data_root}/manifest.json: prompts of up to {longest} tokens but model.text_len={m.text_len}")
        self.tokens = [num_tokens(self.dataset.latent_shape(i), m.patch) for i in range(len(self.dataset))]

    def check_image_condition(self, facts: dict) -> None:
        """An I2V model needs the dataset's condition latents (and CLIP tokens of its width)."""
        m, where = self.recipe.model, f"{self.data_root}/manifest.json"
        if m.condition != "i2v":
            return
        if not facts.get("image_condition"):
            raise DataError(f"{where}: no I2V condition latents, which model.condition='i2v' trains on; "
                            f"preprocess with image_condition=true")
        t_factor = (facts.get("vae_factors") or [m.mask_channels])[0]
        if t_factor != m.mask_channels:
            raise DataError(f"{where}: the VAE's temporal factor is {t_factor} but model.in_channels - 2 x "
                            f"model.out_channels = {m.mask_channels} mask channels")
        if m.image_dim is not None and facts.get("image_dim") != m.image_dim:
            raise DataError(f"{where}: image_dim={facts.get('image_dim')} (CLIP tokens; preprocess with "
                            f"image_encoder=DIR) but model.image_dim={m.image_dim}")

    def manifest_fields(self) -> dict:
        return {"data_root": str(self.data_root.resolve()) if self.data_root else None, "experts": self.names}

    def model_config_dict(self) -> dict:
        return self.recipe.model.model_config_dict()

    def choose_expert(self, step: int) -> str:
        """The expert trained at ``step`` (the same on every rank)."""
        if len(self.trainable) == 1:
            return self.trainable[0]
        return pick_expert(self.sampler, self.ranges, generator(self.recipe.train.seed, step, -1))

    def steps(self, ctx, start_step: int):
        r = self.recipe
        assert self.dataset is not None  # opened by prepare, which runs first
        cp = ContextParallel.from_group(ctx.pgs.cp)
        dp_rank, dp_size = ctx.pgs.dp.rank(), ctx.dp_size
        step = start_step
        while True:
            expert = self.choose_expert(step)
            indices = step_samples(step, r.train.global_batch_size, len(self.dataset), r.train.seed)
            tokens = [self.tokens[i] for i in indices]
            step_plan = plan(tokens, self.cost_model, dp_size, r.balance.token_cap,
                             r.balance.skip_threshold if r.balance.enable else float("inf"))
            micro = [self.micro_batch(step, positions, indices, tokens, self.ranges[expert], cp, ctx.device)
                     for positions in step_plan.micro_batches(dp_rank)]
            mine = [tokens[j] for positions in step_plan.micro_batches(dp_rank) for j in positions]
            yield StepBatch(
                micro_batches=micro, tokens=sum(mine), flops=packed_flops(self.flops_model, mine), part=expert,
                metrics={"expert": float(self.names.index(expert)), "micro_batches": float(len(micro)),
                         **step_plan.metrics.as_dict()},
                sample_ids=[indices[j] for positions in step_plan.micro_batches(dp_rank) for j in positions],
            )
            step += 1

    def micro_batch(self, step: int, positions: list[int], indices: list[int], tokens: list[int], index_range,
                    cp: ContextParallel | None, device) -> dict:
        """Noisy packed inputs, targets and per-token loss weights of some of the step's samples
        (this CP rank's token range of the targets and weights)."""
        r, m = self.recipe, self.recipe.model
        assert self.dataset is not None  # opened by prepare, which runs first
        latents, texts, targets, timesteps, conds, steps, given = [], [], [], [], [], [], []
        for j in positions:
            x0, text = self.dataset.load(indices[j])
            cond = dataset_condition(m, self.dataset, indices[j], x0)
            g = generator(r.train.seed, step, j)
            sigma, t = self.sampler.sample(1, g, index_range)
            noise = torch.randn(x0.shape, generator=g)
            if r.objective.text_dropout and torch.rand(1, generator=g).item() < r.objective.text_dropout:
                text = torch.zeros_like(text)
            xt, target = noisy_and_target(x0, noise, sigma.item())
            grid = grid_of(x0.shape, m.patch)
            latents.append(model_input(m, xt, cond))
            targets.append(target)
            texts.append(text)
            timesteps.append(t)
            conds.append(cond)
            steps.append(token_timesteps(m, t, grid, cond))
            given.append(given_tokens(m, grid, cond))
        batch = pack(latents, torch.cat(timesteps), pad_text(texts, m.text_len), m.patch,
                     pad_to_multiple=cp.size if cp else 1, image=image_tokens(conds) if m.image_dim else None,
                     token_timesteps=steps if m.condition == "ti2v" else None,
                     text_lengths=[t.shape[0] for t in texts])
        target = pack_targets(targets, m.patch, batch.num_pad)
        weights = token_weights([tokens[j] for j in positions], batch.num_pad, r.objective.loss_reduction,
                                self.features, given)
        lo, hi = cp.local_range(batch.num_tokens) if cp else (0, batch.num_tokens)
        return {"batch": batch.to(device), "target": target[lo:hi].to(device), "weights": weights[lo:hi].to(device),
                "cp": cp}

    # -- model --------------------------------------------------------------------------------
    def build_model(self, ctx):
        from loongforge.core.models import get_model_spec

        model = get_model_spec(self.family).build(self.recipe.model)
        parts = model.parts()
        if list(parts) != self.names:
            raise TypeError(f"the {self.family!r} model has parts {list(parts)} but its config names {self.names}")
        for name, part in parts.items():
            if name not in self.trainable:
                part.requires_grad_(False)
        return model

    def load_pretrained(self, model) -> None:
        pretrained = self.recipe.model.pretrained
        assert pretrained  # the engine calls this only when has_pretrained
        diffusers_adapter(self.family).load_pretrained(model, pretrained)

    def compile_default(self, ctx) -> bool:
        """Compiled blocks on CUDA for a family whose compiled blocks are verified there, except under
        context parallelism (the Ulysses all-to-alls stay eager)."""
        return self.recipe.model.compile_on_cuda and ctx.device.type == "cuda" and ctx.layout.cp == 1

    def forward(self, model, micro: dict):
        pred = model(micro["batch"], micro["cp"])
        weights = micro["weights"]

        def loss_fn(output):
            err = (output.float() - micro["target"].float()).pow(2).sum(-1)
            return (err * weights).sum(), weights.sum() * self.features

        return pred, loss_fn
