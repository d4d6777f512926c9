"""The LLM SFT recipe (``recipe: sft``): chat conversations, loss on assistant tokens only.

Conversations (``sft.files``, default the shipped set) are rendered with the tokenizer's chat
template and tokenized once into a cached index (``loongforge.llm.data.sft``). Each step takes
``train.global_batch_size`` conversations; the DP load balancer (``balance``,
``loongforge.core.training.balanced.BalancedSteps``) plans them across DP ranks and into
micro-batches of at most ``balance.token_cap`` tokens (default ``train.seq_length``), and each
rank reads only its own. A micro-batch is one packed row (``sft.packing``, THD with
``cu_seqlens``: every conversation attends only to itself) or, unpacked, one right-padded row per
conversation. The loss is summed over assistant tokens and normalised by their count over the
whole global batch, so the split across ranks and micro-batches changes neither the loss nor the
gradients.

With context parallelism (``parallel.cp > 1``) every CP rank of a DP replica collates the same
micro-batches and keeps its share of each: packed, every conversation is padded to a multiple of
``2*cp`` positions and split segment by segment (``data.packing.cp_share``); unpacked, the rows
are padded to a multiple of ``2*cp`` and split as pre-training rows are. The balancer plans with
the padded lengths (what is computed, and what must fit ``balance.token_cap``); its cost per CP
rank is the replica's over ``cp`` for every replica alike, so the plan is the same.
"""

from __future__ import annotations

from functools import partial

from loongforge.llm.recipe import LLMConfig, LLMTask, cp_share_of_rows, masked_token_loss


def _cp_collate(collate, cp_group, samples):
    """``collate(samples)``, then this CP rank's share of it."""
    from loongforge.llm.data.packing import cp_share

    batch = collate(samples)
    if "cu_seqlens" in batch:
        return cp_share(batch, cp_group.size(), cp_group.rank())
    return cp_share_of_rows(batch, cp_group)


class SFTTask(LLMTask):
    """Supervised fine-tuning on chat conversations, on the model families of ``LLMTask``."""

    variable_micro_batches = True

    def __init__(self, cfg: LLMConfig):
        super().__init__(cfg)
        self._tokenizer = None

    def fp8_tokens_per_micro_batch(self, ctx) -> int:
        """A micro-batch holds at most ``balance.token_cap`` tokens (default ``train.seq_length``):
        fp8=adaptive times its shapes at that cap, over the context-parallel split."""
        return (self.cfg.balance.token_cap or self.cfg.train.seq_length) // ctx.layout.cp

    def prepare(self, ctx) -> None:
        """Build the conversation index (every rank takes part) and report it."""
        report = self.dataset().report
        if ctx.is_main:
            print(f"lf-llm: SFT data: {report}", flush=True)

    # -- data ----------------------------------------------------------------------------------
    def tokenizer_dir(self):
        from loongforge.llm.data.bundled_files import bundled_tokenizer_path

        return self.cfg.data.tokenizer or bundled_tokenizer_path()

    def tokenizer_ref(self) -> str:
        return str(self.tokenizer_dir())

    def tokenizer(self):
        if self._tokenizer is None:
            from loongforge.llm.data.sft import load_chat_tokenizer
            from loongforge.llm.data.vocabulary import check_tokenizer_fits

            self._tokenizer = load_chat_tokenizer(self.tokenizer_dir())
            check_tokenizer_fits(self.tokenizer_dir(), len(self._tokenizer), self.cfg.model.vocab_size)
        return self._tokenizer

    def dataset(self):
        if self._dataset is None:
            from loongforge.llm.data.sft import SFTDataset, build_sft_index, bundled_sft_path, read_template

            sft = self.cfg.sft
            self.tokenizer()  # checks the vocabulary first
            index = build_sft_index(sft.files or [bundled_sft_path()], self.tokenizer_dir(), self.cfg.data.resolved_cache_dir(),
                                    chat_template=read_template(sft.chat_template))
            self._dataset = SFTDataset(index, self.cfg.train.seq_length, sft.truncation)
        return self._dataset

    def pad_id(self) -> int:
        tok = self.tokenizer()
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)

    def steps(self, ctx, start_step: int):
        from loongforge.core.training.balanced import BalancedSteps
        from loongforge.llm.data.packing import pack, pad_rows

        train, balance = self.cfg.train, self.cfg.balance
        data = self.dataset()
        cp = ctx.layout.cp
        multiple = 2 * cp if cp > 1 else 1
        if self.cfg.sft.packing:
            # a pipeline sends one tensor shape between stages: pad every packed row to seq_length
            collate = partial(pack, pad_to=train.seq_length if ctx.layout.pp > 1 else None, pad_id=self.pad_id(),
                              pad_multiple=multiple)
        else:
            collate = partial(pad_rows, pad_id=self.pad_id(), pad_multiple=multiple)
        lengths = data.lengths
        if cp > 1:
            collate = partial(_cp_collate, collate, ctx.pgs.cp)
            lengths = -(-lengths // multiple) * multiple  # the padded lengths: what each rank computes
        return BalancedSteps(
            data, lengths, collate, balance,
            samples_per_step=train.global_batch_size,
            token_cap=balance.token_cap or train.seq_length,
            dp_rank=ctx.dp_rank, dp_size=ctx.dp_size, seed=train.seed,
            flops_per_token=self.cfg.model.balance_flops_per_token,
            consumed_samples=start_step * train.global_batch_size,
            device=ctx.device,
        )

    # -- the step ------------------------------------------------------------------------------
    def schedule_plan(self, model, batch):
        # pre-training's plan would drop the packing: check_moe_a2a_overlap refuses recipe=sft
        raise NotImplementedError("SFTTask has no schedule plan for megatron's combined 1F1B schedule "
                                  "(model.moe_a2a_overlap is for recipe=pretrain)")

    def forward(self, model, batch):
        from loongforge.llm.data.packing import packed_seq_params

        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params(batch))
        return output, partial(masked_token_loss, batch["loss_mask"])
