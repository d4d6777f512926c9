"""The LoongForge checkpoint format: sharded safetensors + JSON manifest, layout-independent,
written atomically (see format.py, pieces.py, storage.py)."""

from loongforge.core.checkpoint.format import (
    FORMAT_VERSION,
    Checkpoint,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from loongforge.core.checkpoint.pieces import CheckpointNotFound, CheckpointReadError, Piece, PieceReader
from loongforge.core.checkpoint.storage import CheckpointOrderError, checkpoint_root, latest_checkpoint

__all__ = [
    "FORMAT_VERSION",
    "Checkpoint",
    "CheckpointNotFound",
    "CheckpointOrderError",
    "CheckpointReadError",
    "Piece",
    "PieceReader",
    "checkpoint_root",
    "latest_checkpoint",
    "load_checkpoint",
    "read_manifest",
    "save_checkpoint",
]
