"""``FP8Plan``: the run's ``fp8=adaptive`` choice -- for each dense linear shape, which of its
three GEMMs (fprop ``y = x w^T``, dgrad ``dx = dy w``, wgrad ``dw = dy^T x``) run in FP8.

The plan is a value owned by the run, never a module global: ``LLMTask`` makes it once at the
start (``fp8_measure``: every rank times the registry's ``fp8_linear`` at the run's shapes in
each of :data:`COMBINATIONS`, the times are agreed over the ranks, and the fastest combination is
chosen from the agreed times), hands every adaptive FP8 linear the choice for its shape
(``layers.fp8_linear.apply_fp8_plan``), saves it in every checkpoint's manifest under
``fp8_plan`` (:meth:`FP8Plan.to_dict`, plain JSON) and, on resume, reads it back instead of
measuring again.

A shape is a linear's local weight ``[out_features, in_features]`` (after the tensor-parallel
split); each entry records the tokens per micro-batch it was timed at and the agreed times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from loongforge.core.kernels.fp8_format import GEMMS, Fp8Gemms

PLAN_VERSION = 1

# every choice of a linear's three GEMMs, fewest in FP8 first: a tie in time goes to the choice
# with fewer FP8 GEMMs (the more accurate one)
COMBINATIONS: tuple[Fp8Gemms, ...] = tuple(Fp8Gemms.from_names(names) for names in (
    (), ("fprop",), ("dgrad",), ("wgrad",), ("fprop", "dgrad"), ("fprop", "wgrad"), ("dgrad", "wgrad"), GEMMS))


def label(gemms: Fp8Gemms) -> str:
    """``fprop+wgrad``-style name of a choice; ``none`` for no GEMM in FP8."""
    return "+".join(gemms.names()) or "none"


def _short(gemms: Fp8Gemms) -> str:
    return "".join(name[0] for name in gemms.names()) or "none"


def fastest(ms: Sequence[float]) -> Fp8Gemms:
    """The choice of :data:`COMBINATIONS` with the least time in ``ms`` (one per combination, in
    that order); ties go to the earlier one, a NaN counts as slowest."""
    if len(ms) != len(COMBINATIONS):
        raise ValueError(f"expected {len(COMBINATIONS)} times (one per FP8 GEMM combination), got {len(ms)}")
    keyed = [math.inf if math.isnan(t) else t for t in ms]
    return COMBINATIONS[min(range(len(keyed)), key=keyed.__getitem__)]


@dataclass(frozen=True)
class ShapePlan:
    """The choice for one linear shape (local weight ``[out_features, in_features]``)."""

    out_features: int
    in_features: int
    gemms: Fp8Gemms
    tokens: int = 0  # tokens per micro-batch it was timed at (0: given, not measured)
    ms: tuple[float, ...] = ()  # agreed ms of one forward+backward per COMBINATIONS entry (empty: not measured)

    @property
    def key(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def to_dict(self) -> dict:
        out = {"out_features": self.out_features, "in_features": self.in_features, "fp8": list(self.gemms.names()),
               "tokens": self.tokens}
        if self.ms:
            out["ms"] = {label(g): t for g, t in zip(COMBINATIONS, self.ms)}
        return out

    @classmethod
    def from_dict(cls, entry: dict) -> ShapePlan:
        try:
            ms = entry.get("ms") or {}
            times = tuple(float(ms[label(g)]) for g in COMBINATIONS) if ms else ()
            return cls(int(entry["out_features"]), int(entry["in_features"]), Fp8Gemms.from_names(entry["fp8"]),
                       int(entry.get("tokens", 0)), times)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"fp8_plan: malformed shape entry {entry!r} ({exc!r})") from exc


@dataclass(frozen=True)
class FP8Plan:
    """The run's per-shape FP8 GEMM choices (sorted by shape; one entry per shape)."""

    shapes: tuple[ShapePlan, ...] = ()

    def __post_init__(self):
        ordered = tuple(sorted(self.shapes, key=lambda s: s.key))
        keys = [s.key for s in ordered]
        if len(set(keys)) != len(keys):
            raise ValueError(f"fp8_plan: a shape appears twice in {keys}")
        object.__setattr__(self, "shapes", ordered)

    def gemms(self, out_features: int, in_features: int) -> Fp8Gemms:
        """The choice for a linear of local weight ``[out_features, in_features]``."""
        for entry in self.shapes:
            if entry.key == (out_features, in_features):
                return entry.gemms
        known = ", ".join(f"{o}x{i}" for o, i in (s.key for s in self.shapes)) or "none"
        raise LookupError(f"fp8_plan has no entry for a linear of weight {out_features}x{in_features} (has: {known})")

    def missing(self, shapes: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
        """The shapes of ``shapes`` this plan has no entry for, sorted."""
        have = {s.key for s in self.shapes}
        return sorted({(out_features, in_features) for out_features, in_features in shapes} - have)

    def merged(self, other: FP8Plan) -> FP8Plan:
        """This plan with ``other``'s entries for the shapes it lacks (its own entries win)."""
        have = {s.key for s in self.shapes}
        return FP8Plan(self.shapes + tuple(s for s in other.shapes if s.key not in have))

    def to_dict(self) -> dict:
        """The manifest's ``fp8_plan`` entry (JSON)."""
        return {"version": PLAN_VERSION, "shapes": [s.to_dict() for s in self.shapes]}

    @classmethod
    def from_dict(cls, record: dict) -> FP8Plan:
        """The plan :meth:`to_dict` wrote; a malformed record is a ``ValueError`` that says what is wrong."""
        if not isinstance(record, dict) or record.get("version") != PLAN_VERSION or not isinstance(
                record.get("shapes"), list):
            raise ValueError(f"fp8_plan: expected {{'version': {PLAN_VERSION}, 'shapes': [...]}}, got {record!r}")
        return cls(tuple(ShapePlan.from_dict(entry) for entry in record["shapes"]))

    def table(self) -> str:
        """One line per shape: its local weight, the tokens it was timed at, the agreed ms of a
        forward+backward in each combination (f/d/w: fprop/dgrad/wgrad in FP8), the choice, and
        the choice's speed against no GEMM and every GEMM in FP8."""
        heads = [_short(g) for g in COMBINATIONS]
        lines = [f"{'out':>6} {'in':>6} {'tokens':>7} " + " ".join(f"{h:>7}" for h in heads)
                 + f"  {'choice':<18} {'vs none':>8} {'vs fdw':>7}"]
        for s in self.shapes:
            if s.ms:
                times = " ".join(f"{t:>7.3f}" for t in s.ms)
                chosen = s.ms[COMBINATIONS.index(s.gemms)]
                ratios = f"{s.ms[0] / chosen:>7.2f}x {s.ms[-1] / chosen:>6.2f}x"
            else:
                times = " ".join(f"{'-':>7}" for _ in COMBINATIONS)
                ratios = f"{'-':>8} {'-':>7}"
            lines.append(f"{s.out_features:>6} {s.in_features:>6} {s.tokens or '-':>7} {times}  "
                         f"{label(s.gemms):<18} {ratios}")
        return "\n".join(lines)
