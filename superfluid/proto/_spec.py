"""What ``--speculate`` and the ``--spec-*`` flags ask of a worker (a pure value:
the daemon's command line builds it, the worker's gates read it)."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["MAX_DRAFT_DEPTH", "SPEC_DIRECTIVES", "SPEC_FLAGS", "SpecConfig"]

SPEC_DIRECTIVES = ("off", "auto", "prompt-lookup")
MAX_DRAFT_DEPTH = 15
SPEC_FLAGS = {"depth": "--spec-draft-tokens", "adaptive": "--spec-adaptive", "min_yield": "--spec-min-yield",
          "yield_rounds": "--spec-yield-rounds", "throughput_gate": "--spec-throughput-gate",
          "probe_rounds": "--spec-gate-probe-tokens", "min_speedup": "--spec-min-speedup",
          "reprobe": "--spec-gate-reprobe", "reprobe_max": "--spec-gate-reprobe-max",
          "max_temperature": "--spec-max-temperature"}


@attrs.frozen(kw_only=True)
class SpecConfig:
    """What ``--speculate`` and the ``--spec-*`` flags ask of one worker."""

    depth: int = 4                 # --spec-draft-tokens: the deepest draft
    adaptive: bool = True          # --spec-adaptive
    min_yield: float = 0.75        # --spec-min-yield: accepted tokens per drafting round
    yield_rounds: int = 24         # --spec-yield-rounds
    throughput_gate: bool = True   # --spec-throughput-gate
    probe_rounds: int = 16         # --spec-gate-probe-tokens: rounds per side of a probe
    min_speedup: float = 1.08      # --spec-min-speedup
    reprobe: int = 32              # --spec-gate-reprobe: admissions before a failed lane count re-probes
    reprobe_max: int = 1024        # --spec-gate-reprobe-max
    max_temperature: float = -1.0  # --spec-max-temperature: lanes sampling hotter never draft (< 0: no cap)

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.depth <= MAX_DRAFT_DEPTH:
            raise ValueError(f"spec draft depth must be in [1, {MAX_DRAFT_DEPTH}]")
        if self.yield_rounds < 1 or self.probe_rounds < 1 or self.reprobe < 1 or self.reprobe_max < self.reprobe:
            raise ValueError("spec gate rounds and re-probe intervals must be >= 1 (max >= first)")
        if self.min_speedup <= 0 or self.min_yield < 0:
            raise ValueError("spec min speedup must be > 0 and min yield >= 0")

    @classmethod
    def from_argv(cls, argv: list[str] | tuple[str, ...]) -> SpecConfig:
        """The inverse of :meth:`to_argv`."""
        values = dict(zip(argv[::2], argv[1::2], strict=True))
        kw: dict[str, Any] = {}
        for field in attrs.fields(cls):
            flag = SPEC_FLAGS[field.name]
            if flag in values:
                kw[field.name] = (bool(int(values[flag])) if field.type in (bool, "bool") else
                                  int(values[flag]) if field.type in (int, "int") else float(values[flag]))
        return cls(**kw)

    def to_argv(self) -> list[str]:
        out: list[str] = []
        for field in attrs.fields(type(self)):
            value = getattr(self, field.name)
            out += [SPEC_FLAGS[field.name], str(int(value)) if isinstance(value, bool) else repr(value)]
        return out
