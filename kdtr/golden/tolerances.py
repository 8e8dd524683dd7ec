"""Every tolerance kdtr applies, per (storage dtype, output dtype, output), scaled with the case.

Calibrated (docs/TOLERANCES.md says how): wide enough that a correct bf16 tensor-core kernel
passes every suite, tight enough that every planted bug (kdtr.bugs) fails. Layers, later wins:
this table (or the values recorded in a bundle), widened by the problem's conditioning (``scaled``:
the largest |scaled score| and |value|, beyond which fp32 score errors outgrow the table), then
command-line overrides. The bias bound of bf16 outputs (kdtr.check.compare) lives here too.
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


U_ACC = 2.0**-24
"""Unit roundoff of the fp32 arithmetic every kernel computes scores, exponentials and sums in."""
S_KNEE = 20.0
"""|scaled score| up to which the table holds as calibrated (unit-variance goldens stay within +-17)."""
S_MAX = 1.0e4
"""Scores are clipped here: beyond, fp32 scores carry errors of order one and no bound means much."""
K_SCORE = 4.0
"""Score error of a correct fp32-accumulating kernel, in units of U_ACC * |s| (docs/TOLERANCES.md)."""
V_REF = 2.0 * math.sqrt(3.0)
"""max |v| of unit-variance goldens (the Irwin-Hall bound): the value scale the table assumes."""
V_MAX = 1.0e4
"""Value magnitudes are clipped here (a bound must stay finite)."""
BIAS_MAX = 0.1
"""Largest |mean rounding error| of a bf16 output, in bf16 ulps (kdtr.check.compare): round-to-nearest
stays within 0.016 on the ci and graph goldens, truncation gives -0.17 to -0.49 (docs/TOLERANCES.md)."""
BIAS_MIN_COUNT = 4096
"""Fewest elements (8 output rows) the bias is judged on: below, the rows' own correlated errors make its
noise of the order of the bound."""


@dataclass(frozen=True)
class Conditioning:
    """What the bounds of one case scale with (docs/TOLERANCES.md, "Bounds that scale with the problem")."""

    max_abs_score: float = 0.0
    """Largest |scale * q.k| over visible (row, key) pairs; 0 means unknown (the table as is)."""
    max_abs_value: float = V_REF
    """Largest |v| (value columns of the request's keys)."""

    def __post_init__(self):
        for name in ("max_abs_score", "max_abs_value"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"invalid conditioning {name} {v!r}: a finite number >= 0 "
                                 "(a NaN or infinite one would make a bound that cannot fail)")

    def score_error(self) -> float:
        """The score error budget beyond the table's: K_SCORE * U_ACC * (|s| - S_KNEE), 0 below the knee."""
        return K_SCORE * U_ACC * max(0.0, min(self.max_abs_score, S_MAX) - S_KNEE)


def conditioning(recorded, cap: float, max_abs_value: float) -> Conditioning:
    """A case's Conditioning from a bundle's recorded max |s| (None when absent: the table as is), capped
    at the Cauchy-Schwarz bound ``cap`` computed from the stored inputs, so that no bundle can claim a
    larger score than its data allows; non-finite caps or values (corrupt inputs) count as 0 and V_REF."""
    s = 0.0 if recorded_conditioning_problem(recorded) or recorded is None else float(recorded["max_abs_score"])
    cap = float(cap) if math.isfinite(cap) and cap >= 0 else 0.0
    v = float(max_abs_value) if math.isfinite(max_abs_value) and max_abs_value >= 0 else V_REF
    return Conditioning(max_abs_score=min(s, cap, S_MAX), max_abs_value=min(v, V_MAX))


def recorded_conditioning_problem(recorded) -> str | None:
    """Why a bundle's ``conditioning`` metadata cannot be used (None when it can, or is absent)."""
    if recorded is None:
        return None
    if not isinstance(recorded, dict) or set(recorded) != {"max_abs_score"}:
        return "must be a JSON object with max_abs_score alone"
    v = recorded["max_abs_score"]
    if type(v) not in (int, float) or not math.isfinite(v) or v < 0:
        return f"max_abs_score must be a finite number >= 0, got {v!r}"
    return None


def record_score(max_abs_score: float) -> float:
    """max |s| as a bundle records it: rounded up to 12 significant bits, so that the float64 reference's
    last-bit noise across machines (kdtr.golden.generate.REPRO_RTOL) leaves the metadata byte-identical."""
    if not math.isfinite(max_abs_score) or max_abs_score <= 0:
        return 0.0
    m, e = math.frexp(max_abs_score)
    return math.ldexp(math.ceil(m * 4096.0), e - 12)


def scaled(tol: Tol, output: str, cond: Conditioning | None) -> Tol:
    """tol widened for the case's conditioning (docs/TOLERANCES.md derives it): with a score error budget
    d = K_SCORE * U_ACC * max(0, |s| - S_KNEE), out gains 2 d max|v| on atol and 2 d max|v| / V_REF on
    rel_norm, lse gains d on atol. Equal to tol for |s| <= S_KNEE, non-decreasing in |s|, always finite."""
    if cond is None:
        return tol
    d = cond.score_error()
    if d == 0.0:
        return tol
    if output == "out":
        v = max(cond.max_abs_value, V_REF)
        return replace(tol, atol=tol.atol + 2.0 * d * v, rel_norm=tol.rel_norm + 2.0 * d * v / V_REF)
    return replace(tol, atol=tol.atol + d)


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


def resolve(kv_dtype: str, out_dtype: str, output: str, recorded: dict | None = None, overrides: dict | None = None,
            cond: Conditioning | None = None) -> Tol:
    """Layered tolerance: table, then the bundle's recorded values, widened for the case's conditioning
    (scaled), then CLI overrides (checked: check_overrides), which are taken as given."""
    tol = default(kv_dtype, out_dtype, output)
    layer = (recorded or {}).get(output)
    if layer:
        tol = replace(tol, **{k: float(v) for k, v in layer.items() if k in Tol.__dataclass_fields__})
    tol = scaled(tol, output, cond)
    if overrides:
        check_overrides({output: overrides})
        tol = replace(tol, **{k: float(v) for k, v in overrides.items() if v is not None})
    return tol
