"""Mixed-precision plans: which format each projection of each decoder layer takes.

A plan file (JSON, written by ``pdserve quantize --plan``, loaded with the engine setting
``quantization_plan``)::

    {"format": "pdserve-quant-plan/1", "model": "smollm2-135m", "default": "int4",
     "layers": {"layers.0.down": "int8", "layers.3.qkv": "none", ...},
     "sweep": {...how it was measured...}}

Projection names are ``layers.<i>.<qkv|o|gate_up|down>`` (q/k/v and gate/up are one fused
matmul each in this engine, so they are one "layer" of the plan). A name the plan does not
list takes ``default``. Formats: none (the model dtype), int8, int4, fp8.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import json
import re

from engine.quant.reference import FORMATS

PLAN_FORMAT = "pdserve-quant-plan/1"
PROJECTIONS = ("qkv", "o", "gate_up", "down")
_NAME = re.compile(r"^layers\.(\d+)\.(qkv|o|gate_up|down)$")
_CHOICES = ("none",) + FORMATS


def linear_names(num_layers: int) -> list[str]:
    return [f"layers.{i}.{p}" for i in range(num_layers) for p in PROJECTIONS]


@dataclass(frozen=True)
class QuantPlan:
    default: str
    layers: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, fmt in [("default", self.default), *self.layers.items()]:
            if fmt not in _CHOICES:
                raise ValueError(f"quantization plan: {name}: format {fmt!r} is not one of "
                                 f"{', '.join(_CHOICES)}")
            if name != "default" and not _NAME.match(name):
                raise ValueError(f"quantization plan: {name!r} is not a projection name "
                                 "(layers.<i>.<qkv|o|gate_up|down>)")

    @classmethod
    def uniform(cls, fmt: str) -> "QuantPlan":
        return cls(default=fmt)

    def format_of(self, name: str) -> str:
        return self.layers.get(name, self.default)

    def check_model(self, num_layers: int) -> None:
        for name in self.layers:
            if int(_NAME.match(name).group(1)) >= num_layers:
                raise ValueError(f"quantization plan names {name} but the model has "
                                 f"{num_layers} layers")

    @property
    def is_none(self) -> bool:
        return self.default == "none" and all(f == "none" for f in self.layers.values())

    def to_json(self) -> dict:
        return {"format": PLAN_FORMAT, "model": self.model, "default": self.default,
                "layers": dict(sorted(self.layers.items())), "sweep": self.meta}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path: str) -> "QuantPlan":
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"quantization plan {path!r}: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise ValueError(f"quantization plan {path!r}: not a {PLAN_FORMAT} file")
        layers = doc.get("layers") or {}
        if not isinstance(layers, dict):
            raise ValueError(f"quantization plan {path!r}: layers must be an object")
        return cls(default=doc.get("default", "none"), layers=dict(layers),
                   model=doc.get("model"), meta=doc.get("sweep") or {})


def plan_for(quantization: str, plan_path: str | None) -> QuantPlan | None:
    """The plan an engine runs: the file when given (its default then overrides
    ``quantization``, which must be none or agree), else uniform ``quantization``; None when
    nothing is quantized."""
    if plan_path:
        plan = QuantPlan.load(plan_path)
        if quantization not in ("none", plan.default):
            raise ValueError(f"quantization {quantization!r} disagrees with the plan file's "
                             f"default {plan.default!r} ({plan_path})")
    else:
        plan = QuantPlan.uniform(quantization)
    return None if plan.is_none else plan
