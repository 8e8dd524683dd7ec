"""Every tolerance kdtr applies, per (storage dtype, output dtype, output).

Calibrated (docs/TOLERANCES.md says how): wide enough that a correct bf16 tensor-core kernel
passes every suite, tight enough that every planted bug (kdtr.bugs) fails. Layers, later wins:
this table, the values recorded in a bundle, then command-line overrides.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from kdtr.errors import InputError


@dataclass(frozen=True)
class Tol:
    """Bounds one output must meet."""

    atol: float
    """Element-wise: |got - want| <= atol + rtol * |want|."""
    rtol: float
    """Element-wise relative part."""
    rel_norm: float
    """Global: ||got - want||_2 / ||want||_2 <= rel_norm."""
    min_cos: float
    """Global: cosine(got, want) >= min_cos."""

    def __post_init__(self):
        values = (self.atol, self.rtol, self.rel_norm, self.min_cos)
        if not all(math.isfinite(v) for v in values) or min(values[:3]) < 0 or not -1.0 <= self.min_cos <= 1.0:
            raise ValueError(f"invalid tolerance {self}: every bound finite, atol, rtol, rel_norm >= 0, "
                             "-1 <= min_cos <= 1 (a NaN or infinite bound would switch its check off)")

    def to_json(self) -> dict:
        return asdict(self)


OUTPUTS = ("out", "lse")

# (kv/q storage dtype, out dtype, output) -> Tol.
# fp32 storage: fp32 arithmetic kernels (naive). bf16 storage: tensor-core kernels with bf16
# operands and P rounded to bf16 before P @ V. lse is always fp32.
TABLE: dict[tuple[str, str, str], Tol] = {
    ("fp32", "fp32", "out"): Tol(atol=2e-5, rtol=2e-4, rel_norm=2e-5, min_cos=0.99999),
    ("fp32", "bf16", "out"): Tol(atol=1e-3, rtol=8e-3, rel_norm=3e-3, min_cos=0.9999),
    ("fp32", "fp32", "lse"): Tol(atol=2e-5, rtol=1e-5, rel_norm=1e-5, min_cos=0.99999),
    ("fp32", "bf16", "lse"): Tol(atol=2e-5, rtol=1e-5, rel_norm=1e-5, min_cos=0.99999),
    ("bf16", "fp32", "out"): Tol(atol=3e-3, rtol=2e-2, rel_norm=6e-3, min_cos=0.9999),
    ("bf16", "bf16", "out"): Tol(atol=4e-3, rtol=2.5e-2, rel_norm=7e-3, min_cos=0.9999),
    ("bf16", "fp32", "lse"): Tol(atol=5e-4, rtol=1e-4, rel_norm=1e-4, min_cos=0.99999),
    ("bf16", "bf16", "lse"): Tol(atol=5e-4, rtol=1e-4, rel_norm=1e-4, min_cos=0.99999),
}


def default(kv_dtype: str, out_dtype: str, output: str) -> Tol:
    try:
        return TABLE[(kv_dtype, out_dtype, output)]
    except KeyError:
        raise ValueError(f"no tolerance for storage {kv_dtype}, output dtype {out_dtype}, output {output}") from None


def for_bundle_meta(kv_dtype: str, out_dtype: str) -> dict:
    """What a bundle records at generation time: {output: Tol as JSON}."""
    return {o: default(kv_dtype, out_dtype, o).to_json() for o in OUTPUTS}


def recorded_problem(recorded) -> str | None:
    """Why tolerances recorded in a bundle cannot be applied (None when they can): a golden file
    must not be able to make a check that cannot fail (an infinite atol) or crash verify."""
    names = [f.name for f in fields(Tol)]
    if not isinstance(recorded, dict):
        return "must be a JSON object"
    for output, layer in recorded.items():
        if output not in OUTPUTS:
            return f"name an unknown output {output!r} (known: {', '.join(OUTPUTS)})"
        if not isinstance(layer, dict):
            return f"{output} must be a JSON object"
        for key, value in layer.items():
            if key not in names:
                return f"{output}.{key} is not a tolerance (known: {', '.join(names)})"
            if type(value) not in (int, float) or not math.isfinite(value):
                return f"{output}.{key} must be a finite number, got {value!r}"
        try:
            Tol(**{**dict.fromkeys(names, 0.0), **layer})
        except ValueError:
            return f"{output} out of range: atol, rtol, rel_norm >= 0 and -1 <= min_cos <= 1, got {layer}"
    return None


def check_overrides(overrides: dict | None) -> None:
    """InputError (one line) unless every override {output: {bound: value or None}} is a bound that
    can still fail: a finite number, >= 0 (min_cos within [-1, 1]). NaN compares false and infinity
    admits everything, so either would switch a check off; a negative bound fails every element."""
    names = [f.name for f in fields(Tol)]
    for output, layer in (overrides or {}).items():
        if output not in OUTPUTS:
            raise InputError(f"tolerance override for unknown output {output!r} (known: {', '.join(OUTPUTS)})")
        for key, value in (layer or {}).items():
            if value is None:
                continue
            flag = key.replace("_", "-")
            if key not in names:
                raise InputError(f"{flag} is not a tolerance (known: {', '.join(n.replace('_', '-') for n in names)})")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InputError(f"{flag} of {output} must be a finite number, got {value!r} "
                                 "(NaN or infinity would switch that check off)")
            low, high = (-1.0, 1.0) if key == "min_cos" else (0.0, math.inf)
            if not low <= value <= high:
                raise InputError(f"{flag} of {output} must be " + ("within [-1, 1]" if key == "min_cos" else ">= 0")
                                 + f", got {value!r}")


def resolve(kv_dtype: str, out_dtype: str, output: str, recorded: dict | None = None, overrides: dict | None = None) -> Tol:
    """Layered tolerance: table, then the bundle's recorded values, then CLI overrides (checked:
    check_overrides)."""
    tol = default(kv_dtype, out_dtype, output)
    layer = (recorded or {}).get(output)
    if layer:
        tol = replace(tol, **{k: float(v) for k, v in layer.items() if k in Tol.__dataclass_fields__})
    if overrides:
        check_overrides({output: overrides})
        tol = replace(tol, **{k: float(v) for k, v in overrides.items() if v is not None})
    return tol
