"""LeRobot layouts are registered pieces of their families (``ModelSpec.hf_adapter``): conversion
finds them through the registry and tells a file's family by the names each adapter claims."""

from __future__ import annotations

import inspect

import pytest
import torch

import loongforge.embodied.convert.lerobot_config as lerobot_config
import loongforge.embodied.export as export
from loongforge.core.hf_mapping import MappingError
from loongforge.embodied.convert.lerobot_layout import lerobot_families, lerobot_family, to_lerobot
from loongforge.embodied.policies import build_policy, policy_config

FAMILIES = ("groot_n1_7", "pi0", "pi05", "smolvla")


def test_every_family_with_a_lerobot_layout_is_found_through_the_registry():
    assert tuple(lerobot_families()) == FAMILIES
    for source in (export, lerobot_config):  # no family is named where conversion happens
        text = inspect.getsource(source)
        assert not any(f'"{name}"' in text for name in (*FAMILIES, "groot")), source.__name__


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_recognises_its_own_lerobot_files_only(family):
    cfg = policy_config(family)
    with torch.device("meta"):
        names = list(to_lerobot(lerobot_families()[family], build_policy(cfg).state_dict(), cfg))
    assert lerobot_family(names, source="x")[0] == family
    assert lerobot_family(names, source="x", lerobot_type=lerobot_families()[family].lerobot_type)[0] == family
    other = next(a.lerobot_type for f, a in lerobot_families().items() if f != family)
    with pytest.raises(MappingError, match=f"not those of a LeRobot {other} policy"):
        lerobot_family(names, source="x", lerobot_type=other)


def test_an_unknown_file_is_one_error_naming_the_known_policies():
    with pytest.raises(MappingError, match=r"no installed policy family.*SmolVLAPolicy \(smolvla\)"):
        lerobot_family(["encoder.weight"], source="x")
    with pytest.raises(MappingError, match="type='act'; LeRobot policy types with a layout here: groot, pi0, pi05, smolvla"):
        lerobot_family(["encoder.weight"], source="x", lerobot_type="act")
