"""Prompt tokenizers: a tokenizer directory (the pretrained checkpoint's, or ``data.tokenizer``)
gives the ids LeRobot's own Pi0 / Pi0.5 processors give with that tokenizer; without one, the byte
tokenizer; a configured tokenizer that does not load is one ``error:`` line naming it."""

from __future__ import annotations

import pytest
import torch
from lerobot.policies.pi0.processor_pi0 import Pi0NewLineProcessor
from lerobot.policies.pi05.processor_pi05 import Pi05PrepareStateTokenizerProcessorStep
from lerobot.processor import TokenizerProcessorStep, create_transition
from lerobot.utils.constants import OBS_LANGUAGE_ATTENTION_MASK, OBS_LANGUAGE_TOKENS, OBS_STATE
from transformers import AutoTokenizer

from embodied_helpers import tiny_overrides
from loongforge.core.config import ConfigError
from loongforge.embodied.cli import main
from loongforge.embodied.config import DatasetConfig
from loongforge.embodied.data.dataset import EmbodiedDataset
from loongforge.embodied.data.tokenizer import ByteTokenizer, HFPromptTokenizer, make_tokenizer
from loongforge.embodied.policies import policy_config

MAX_LEN = 40


def save_tiny_tokenizer(directory):
    """A byte-level BPE tokenizer trained here on a few prompts (BOS prepended, like PaliGemma's),
    saved as transformers saves a fast tokenizer: tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=["<pad>", "<eos>", "<bos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["pick the cube\n", "place the cube on the plate\n", "Task: pick, State: 1 22 128 255;\nAction: "] * 5
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>").save_pretrained(directory)
    return directory


def dataset(root, policy, tokenizer=None):
    return EmbodiedDataset(DatasetConfig(path=str(root), repo_id="local/tiny", tokenizer=tokenizer), policy, str(root),
                           "train")


def lerobot_tokens(steps, task, state=None):
    """LeRobot's processor steps on one frame: its (ids, mask)."""
    transition = create_transition(observation={OBS_STATE: state[None]} if state is not None else {},
                                   complementary_data={"task": [task]})
    for step in steps:
        transition = step(transition)
    obs = transition["observation"]
    return obs[OBS_LANGUAGE_TOKENS][0], obs[OBS_LANGUAGE_ATTENTION_MASK][0]


def test_pi0_prompt_uses_the_pretrained_checkpoints_tokenizer(tiny_dataset, tmp_path):
    ckpt = save_tiny_tokenizer(tmp_path / "pi0_ckpt")  # the weights file itself is not read here
    policy = policy_config("pi0", image_size=16, chunk_size=4, max_state_dim=4, max_action_dim=4, max_token_len=MAX_LEN,
                           pretrained=str(ckpt / "model.safetensors"), pretrained_format="lerobot")
    ds = dataset(tiny_dataset, policy)
    assert isinstance(ds.tokenizer, HFPromptTokenizer)
    hf = AutoTokenizer.from_pretrained(str(ckpt))
    steps = [Pi0NewLineProcessor(), TokenizerProcessorStep(tokenizer=hf, max_length=MAX_LEN)]
    for idx in (0, 8):  # episode 0 ("pick the cube") and episode 1 ("place_the cube\non the plate")
        item, task = ds[idx], ds.source[idx]["task"]
        ids, mask = lerobot_tokens(steps, task)
        assert torch.equal(item["tokens"], ids) and torch.equal(item["token_mask"], mask)
        assert item["tokens"][0] == hf.bos_token_id and 3 < int(mask.sum()) < MAX_LEN
        assert item["tokens"].tolist()[: int(mask.sum())] == hf(task if task.endswith("\n") else task + "\n")["input_ids"]


def test_pi05_prompt_with_the_state_uses_the_configured_tokenizer(tiny_dataset, tmp_path):
    directory = save_tiny_tokenizer(tmp_path / "tok")
    policy = policy_config("pi05", image_size=16, chunk_size=4, max_state_dim=4, max_action_dim=4, max_token_len=MAX_LEN)
    ds = dataset(tiny_dataset, policy, tokenizer=str(directory))
    hf = AutoTokenizer.from_pretrained(str(directory))
    steps = [Pi05PrepareStateTokenizerProcessorStep(), TokenizerProcessorStep(tokenizer=hf, max_length=MAX_LEN)]
    for idx in (2, 9):
        item, task = ds[idx], ds.source[idx]["task"]
        state = item["state"][: ds.spec.state_dim]  # the normalised state, before padding
        ids, mask = lerobot_tokens(steps, task, state)
        assert torch.equal(item["tokens"], ids) and torch.equal(item["token_mask"], mask)
        assert int(mask.sum()) > 10


def test_byte_tokenizer_without_a_tokenizer_and_errors_naming_the_path(tmp_path):
    (tmp_path / "plain").mkdir()
    fields = dict(image_size=16, max_token_len=MAX_LEN)
    assert isinstance(make_tokenizer(policy_config("pi0", **fields)), ByteTokenizer)
    no_files = policy_config("pi0", pretrained=str(tmp_path / "plain" / "model.safetensors"), **fields)
    assert isinstance(make_tokenizer(no_files), ByteTokenizer)  # a checkpoint directory without tokenizer files
    with pytest.raises(ConfigError, match=r"data.tokenizer='.*missing': no such directory"):
        make_tokenizer(policy_config("pi0", **fields), str(tmp_path / "missing"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"model.pretrained=.*its directory's tokenizer '.*broken': cannot be loaded"):
        make_tokenizer(policy_config("pi0", pretrained=str(broken / "model.safetensors"), **fields))
    with pytest.raises(ConfigError, match=r"data.tokenizer='.*broken': cannot be loaded"):
        make_tokenizer(policy_config("pi05", **fields), str(broken))


def test_bad_tokenizer_is_one_error_line(tiny_dataset, tmp_path, capsys):
    args = tiny_overrides(tiny_dataset, tmp_path / "run", "--model", "pi0", "train.steps=1",
                          f"data.tokenizer={tmp_path / 'nowhere'}")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: data.tokenizer=") and "nowhere" in err[-1]
