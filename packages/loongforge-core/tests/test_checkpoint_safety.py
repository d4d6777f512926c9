"""Crash safety and damage detection of the core checkpoint format: a save killed half-way
leaves the previous checkpoint and ``latest`` intact, the next save cleans up after it;
truncated or corrupted files and mismatching shapes fail with the file and the mismatch named."""

import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from loongforge.core.checkpoint import Checkpoint, CheckpointReadError, latest_checkpoint, save_checkpoint
from loongforge.core.checkpoint.storage import temp_dir

HERE = Path(__file__).resolve().parent
tensors = runpy.run_path(str(HERE / "stalled_save.py"))["tensors"]  # what that script saves at each step


def assert_holds(ckpt: Checkpoint, want: dict[str, torch.Tensor]) -> None:
    assert set(ckpt.reader.keys()) == set(want)
    for key, value in want.items():
        assert torch.equal(ckpt.tensor(key), value), key


@pytest.mark.slow
def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    root, marker = tmp_path / "ckpt", tmp_path / "stalled"
    proc = subprocess.Popen([sys.executable, str(HERE / "stalled_save.py"), str(root), str(marker)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0)
    deadline = time.monotonic() + 120
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the save did not reach its stall: {proc.communicate()[0].decode()[-3000:]}")
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL

    leftover = temp_dir(root, "step_00000002")
    assert (leftover / "shard-00000.safetensors").is_file()  # it died mid-save, not before it
    assert not (root / "step_00000002").exists()
    assert (root / "latest").read_text() == "step_00000001\n"
    previous = Checkpoint(root)
    assert previous.step == 1 and previous.objects() == {"note": "first"}
    assert_holds(previous, tensors(1))

    save_checkpoint(root, 3, tensors(3))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000001", "step_00000003"]
    assert_holds(Checkpoint(root), tensors(3))


def test_resave_that_died_between_renames_stays_readable(tmp_path):
    """Re-saving step 1 moves the old directory aside for an instant; a crash right then leaves
    ``latest`` naming a missing directory. The old copy is still what loads, and the next save
    puts it back."""
    save_checkpoint(tmp_path, 1, tensors(1))
    os.replace(tmp_path / "step_00000001", tmp_path / ".old-step_00000001")  # the state that crash leaves
    assert latest_checkpoint(tmp_path) == tmp_path / ".old-step_00000001"
    assert_holds(Checkpoint(tmp_path), tensors(1))
    save_checkpoint(tmp_path, 2, tensors(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001", "step_00000002"]
    assert_holds(Checkpoint(tmp_path / "step_00000001"), tensors(1))


def test_keep_last_prunes_oldest(tmp_path):
    for step in range(1, 5):
        save_checkpoint(tmp_path, step, tensors(step), keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000003", "step_00000004"]
    assert Checkpoint(tmp_path).step == 4


@pytest.fixture
def saved(tmp_path) -> Path:
    save_checkpoint(tmp_path, 7, tensors(7), objects={"note": "x"})
    return tmp_path / "step_00000007"


def data_start(path: Path) -> int:
    """Offset of the first tensor byte in a safetensors file (after the 8-byte length + JSON header)."""
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def test_truncated_shard_names_file(saved):
    shard = saved / "shard-00000.safetensors"
    size = shard.stat().st_size
    os.truncate(shard, size - 100)
    with pytest.raises(CheckpointReadError, match=rf"{shard}: truncated .*{size - 100} bytes, manifest says {size}"):
        Checkpoint(saved)
    unverified = Checkpoint(saved, verify=False)  # the reader still names the file
    with pytest.raises(CheckpointReadError, match=str(shard)):
        unverified.tensors()


@pytest.mark.parametrize("where", ["header", "data"])
def test_flipped_bytes_name_file(saved, where):
    shard = saved / "shard-00000.safetensors"
    raw = bytearray(shard.read_bytes())
    at = 12 if where == "header" else data_start(shard) + 40
    raw[at] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointReadError, match=rf"{shard}: content hash does not match the manifest"):
        Checkpoint(saved)


def test_corrupted_objects_file_names_file(saved):
    objects = saved / "objects-00000.pt"
    raw = bytearray(objects.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    objects.write_bytes(bytes(raw))
    with pytest.raises(CheckpointReadError, match=rf"{objects}: content hash"):
        Checkpoint(saved)


def test_missing_shard_and_bad_manifest_name_file(saved):
    shard = saved / "shard-00000.safetensors"
    shard.rename(saved / "moved")
    with pytest.raises(CheckpointReadError, match=rf"{shard}: missing"):
        Checkpoint(saved)
    (saved / "moved").rename(shard)
    manifest = saved / "manifest.json"
    manifest.write_text(manifest.read_text()[:-10])
    with pytest.raises(CheckpointReadError, match=rf"{manifest}: not valid JSON"):
        Checkpoint(saved)


def test_shape_mismatch_names_tensor_and_shapes(saved):
    ckpt = Checkpoint(saved)
    with pytest.raises(CheckpointReadError, match=r"tensor 'w' has shape \[64, 32\] .* offset=\[32, 0\] shape=\[64, 32\]"):
        ckpt.reader.read("w", (32, 0), (64, 32))
    with pytest.raises(CheckpointReadError, match=r"tensor 'v' is not in this checkpoint"):
        ckpt.tensor("v")


def test_files_are_plain_safetensors(saved):
    """Readable without LoongForge: entries are ``<key>@<offset>`` regions of the global tensor."""
    with safe_open(str(saved / "shard-00000.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("w@0_0"), tensors(7)["w"])


def test_latest_never_moves_to_a_lower_step(tmp_path):
    """A save of an earlier step into a root whose ``latest`` is further on is refused before
    anything is written; re-saving the same step, or a later one, is not."""
    from loongforge.core.checkpoint import CheckpointOrderError

    save_checkpoint(tmp_path, 8, tensors(8))
    with pytest.raises(CheckpointOrderError, match=r"step_00000004 not saved: .*latest is at step 8"):
        save_checkpoint(tmp_path, 4, tensors(4))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000008"]
    assert Checkpoint(tmp_path).step == 8
    save_checkpoint(tmp_path, 8, tensors(8))
    save_checkpoint(tmp_path, 9, tensors(9))
    assert Checkpoint(tmp_path).step == 9
