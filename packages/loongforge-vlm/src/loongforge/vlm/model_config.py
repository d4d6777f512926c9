"""Architecture configs of a VLM's parts: the vision encoder, the projector, and how vision
tokens are positioned in the foundation (an LLM family's ``GPTConfig`` from loongforge-llm).

Each part is its own YAML config group (``encoder/``, ``projector/``, ``foundation/``), so a
VLM is a composition and swapping one part is a one-line change. Encoders and projectors are
components registered by name (``loongforge.components``, ``loongforge.core.models.ComponentSpec``):
the group's ``family`` key names one, and its own config class (a subclass of ``EncoderConfig`` or
``ProjectorConfig`` in the component's module) validates the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

NORM_PARAMETERS = {"RMSNorm": 1, "LayerNorm": 2}  # parameters per channel of a norm
ROPES = ("mrope", "mrope_interleaved", "rope")


@dataclass
class EncoderConfig:
    """What every vision encoder shares: a ViT over patch sequences (``patch_size``² pixels of
    ``temporal_patch_size`` frames), megatron layers of ``hidden_size`` with an MLP of
    ``ffn_hidden_size``. Patches of one LLM token (``spatial_merge_size``² neighbours) are
    consecutive in the patch sequence, so the projector can merge them with a reshape.

    An encoder family (``encoders/qwen2_5_vit.py``, ``encoders/siglip_vit.py``) subclasses it
    with its own fields and says how its layers compute through the class attributes and the
    read-only properties below (a family sets either kind with a class attribute; a property's
    setting may also be one of its config fields)."""

    family: str = "qwen2_5_vit"  # the registered component (loongforge.components)
    num_layers: int = 2  # vision transformer layers
    hidden_size: int = 32  # vision tower width
    num_attention_heads: int = 2  # attention heads
    ffn_hidden_size: int = 64  # hidden width of the MLP
    in_channels: int = 3  # image channels
    patch_size: int = 8  # side of a square patch in pixels
    temporal_patch_size: int = 2  # video frames per patch (1: images only, frame by frame)
    spatial_merge_size: int = 2  # side of the square of patches merged into one LLM token
    norm_epsilon: float = 1e-6  # epsilon of the norms
    init_method_std: float = 0.02  # standard deviation of the random weight init

    gated_mlp: ClassVar[bool] = False  # SwiGLU-style (two input projections)
    activation: ClassVar[str] = "gelu_tanh"  # silu | gelu_tanh
    patch_bias: ClassVar[bool] = True  # the patch embedding has a bias
    layer_scale: ClassVar[bool] = False  # learned per-channel factors on both residual branches (InternViT)

    def __post_init__(self):
        for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "in_channels",
                    "patch_size", "temporal_patch_size", "spatial_merge_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"encoder.{key}={getattr(self, key)}: must be >= 1")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"encoder.hidden_size={self.hidden_size} is not divisible by "
                             f"encoder.num_attention_heads={self.num_attention_heads}")

    # settings a family may also make config fields (or compute): a class attribute, a field or a
    # property of the family overrides each
    @property
    def normalization(self) -> str:
        """RMSNorm | LayerNorm."""
        return "LayerNorm"

    @property
    def post_norm(self) -> bool:
        """A norm after the last layer."""
        return False

    @property
    def qkv_bias(self) -> bool:
        """The query/key/value projections have biases."""
        return True

    @property
    def qk_norm(self) -> bool:
        """An RMSNorm of queries and keys over all heads together (InternViT-6B)."""
        return False

    @property
    def layer_scale_init(self) -> float:
        """The initial value of the layer-scale factors (with ``layer_scale``)."""
        return 1.0

    def deepstack_indices(self) -> tuple[int, ...]:
        """The 0-based layers whose outputs feed DeepStack (Qwen3-VL: merged by their own patch
        mergers and added to the hidden states of the foundation's first layers at the vision
        tokens); a family with DeepStack reads them from a config field (``deepstack_layers``)."""
        return ()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch (channels x frames x pixels)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def uses_windows(self) -> bool:
        """Whether some layers attend within windows (``window_size``) rather than whole frames."""
        return False

    @property
    def window_units(self) -> int:
        """A window's side in merged tokens (read where ``uses_windows``)."""
        raise NotImplementedError(f"encoder family {self.family!r} has no windows")

    def full_attention(self, layer: int) -> bool:
        """Whether ``layer`` (0-based) attends over whole frames (else within windows)."""
        return True

    def extra_parameters(self) -> int:
        """Parameters of the family's own modules besides layers, patch embedding and final norm."""
        return 0

    def parameter_count(self) -> int:
        h, f = self.hidden_size, self.ffn_hidden_size
        norm = NORM_PARAMETERS[self.normalization] * h
        attn = 4 * h * h + (4 if self.qkv_bias else 1) * h + (2 * h if self.qk_norm else 0)
        attn += h if self.layer_scale else 0
        mlp = (3 if self.gated_mlp else 2) * h * f + (2 * f if self.gated_mlp else f) + h
        mlp += h if self.layer_scale else 0
        embed = self.patch_dim * h + (h if self.patch_bias else 0)
        final = norm if self.post_norm else 0
        return self.num_layers * (attn + mlp + 2 * norm) + embed + final + self.extra_parameters()

    def flops_per_patch(self) -> float:
        """Training FLOPs (6 x matmul parameters) per patch; attention scores are left out
        (windows keep them small next to the projections)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        per_layer = 4 * h * h + (3 if self.gated_mlp else 2) * h * f
        return 6.0 * (self.num_layers * per_layer + self.patch_dim * h)


@dataclass
class ProjectorConfig:
    """Vision features -> foundation embeddings: every projector concatenates the
    ``spatial_merge_size``² patches of one LLM token, then runs an MLP (Linear, GELU, Linear) to
    the foundation's width. A projector family (``projectors/patch_merge_mlp.py``,
    ``projectors/mlp.py``) subclasses it: whether patches are normed first, the default width."""

    family: str = "patch_merge_mlp"  # the registered component (loongforge.components)
    ffn_hidden_size: int | None = None  # null: the family's default (default_ffn)
    norm_epsilon: float = 1e-6  # epsilon of the projector's norm

    def __post_init__(self):
        if self.ffn_hidden_size is not None and self.ffn_hidden_size < 1:
            raise ValueError(f"projector.ffn_hidden_size={self.ffn_hidden_size}: must be >= 1")

    def patch_norm(self) -> str | None:
        """The norm of each patch before merging (RMSNorm | LayerNorm), or None."""
        return None

    def norm_after_merge(self) -> bool:
        """Whether ``patch_norm`` normalises the merged patches (one token's ``merge²`` patches
        together, Qwen3-VL's DeepStack mergers) rather than each patch."""
        return False

    def default_ffn(self, merged: int, foundation_hidden: int) -> int:
        return foundation_hidden

    def ffn(self, merged: int, foundation_hidden: int) -> int:
        return self.ffn_hidden_size or self.default_ffn(merged, foundation_hidden)

    def parameter_count(self, encoder_hidden: int, merged: int, foundation_hidden: int) -> int:
        norm = self.patch_norm()
        f = self.ffn(merged, foundation_hidden)
        norm_params = NORM_PARAMETERS[norm] * (merged if self.norm_after_merge() else encoder_hidden) if norm else 0
        return norm_params + merged * f + f + f * foundation_hidden + foundation_hidden


@dataclass
class VisionTokensConfig:
    """How vision tokens enter the foundation's sequence.

    ``rope: mrope`` gives every token a (temporal, height, width) position (Qwen2-VL's
    multimodal RoPE: text tokens have three equal components, a vision token its frame, row
    and column), rotating ``mrope_section`` frequency pairs by each component, in three
    contiguous runs; ``tokens_per_second``: temporal positions of a video advance by this many
    per second of video. ``rope: mrope_interleaved`` is Qwen3-VL's: the pairs cycle t, h, w
    (``mrope_section`` says how many each component gets; the pairs past ``3 * h`` / ``3 * w``
    rotate by t), and every temporal patch group of a video is positioned as an image of its own
    (time is told by the timestamps between frames, not by positions). ``rope: rope`` keeps the
    foundation's 1D positions.
    """

    rope: str = "mrope"  # mrope (Qwen2/2.5-VL) | mrope_interleaved (Qwen3-VL) | rope
    mrope_section: list[int] | None = None  # default: half the rotated dims (head_dim x rotary_percent) split 1/4, 3/8, 3/8 (Qwen2.5-VL's 16/24/24)
    tokens_per_second: float = 2.0  # video: temporal RoPE positions per second of video
    image_token_id: int | None = None  # default: from the tokenizer
    video_token_id: int | None = None  # default: from the tokenizer
    vision_start_token_id: int | None = None  # default: from the tokenizer
    vision_end_token_id: int | None = None  # default: from the tokenizer

    def __post_init__(self):
        if self.rope not in ROPES:
            raise ValueError(f"vision.rope={self.rope!r}: one of {', '.join(ROPES)}")
        if self.mrope_section is not None and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0):
            raise ValueError(f"vision.mrope_section={self.mrope_section}: three non-negative sizes (t, h, w)")

    @property
    def multimodal(self) -> bool:
        """Whether tokens get (t, h, w) positions (``[3, b, s]`` position ids)."""
        return self.rope != "rope"

    @property
    def frames_as_images(self) -> bool:
        """Whether each temporal patch group of a video is positioned as an image of its own."""
        return self.rope == "mrope_interleaved"

    def rotary_chunks(self, rotary_dim: int) -> list[int]:
        """The ``mrope_section`` megatron-core's ``MultimodalRotaryEmbedding`` takes: it splits the
        frequency pairs into consecutive chunks of these sizes and rotates chunk ``k`` by
        component ``k % 3`` (t, h, w). For ``mrope`` that is the section itself; for
        ``mrope_interleaved`` one chunk per pair while the components alternate, then one chunk
        of the remaining t pairs (empty h/w chunks keep the cycle)."""
        section = self.section_for(rotary_dim)
        if self.rope != "mrope_interleaved":
            return section
        t, h, w = section
        axes = [1 if i % 3 == 1 and i < 3 * h else 2 if i % 3 == 2 and i < 3 * w else 0 for i in range(t + h + w)]
        chunks: list[int] = []
        for axis in axes:
            if chunks and len(chunks) % 3 == axis + 1:  # the chunk being filled rotates by this axis
                chunks[-1] += 1
                continue
            while len(chunks) % 3 != axis:
                chunks.append(0)
            chunks.append(1)
        return chunks + [0] * (-len(chunks) % 3)

    def section_for(self, rotary_dim: int) -> list[int]:
        """The mrope section for a foundation whose heads have ``rotary_dim`` rotated dims (the head
        dim, or its ``rotary_percent``; checked to cover them)."""
        if self.mrope_section is None:
            half = rotary_dim // 2
            t = half // 4
            h = (half - t) // 2
            return [t, h, half - t - h]
        if sum(self.mrope_section) * 2 != rotary_dim:
            raise ValueError(f"vision.mrope_section={self.mrope_section} sums to {sum(self.mrope_section)}; the "
                             f"foundation's {rotary_dim} rotated dims per head need {rotary_dim // 2}")
        return list(self.mrope_section)
