"""CaDDTree's verify-cost model (the stopping rule that uses it lives in drafttree.policies).

Units are milliseconds. Verify curves are functions of the number of TOKENS in the verify
forward; a tree with n draft nodes verifies n + 1 tokens (the root is not cached yet), so
`verify_ms(num_nodes, ...)` evaluates the curve at num_nodes + 1 (the original code mixed the
two up; see design notes §G.16).
"""
from __future__ import annotations

import bisect
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from scipy.optimize import minimize, nnls

from .atomic import atomic_path, atomic_write_text
from .validate import InputError, check_cost_model


class CostModelError(InputError):
    """A cost-model file that cannot be used."""


# ---- convex monotone piecewise-linear curves ----------------------------------------------


@dataclass(frozen=True)
class ConvexCost:
    """Piecewise-linear, non-decreasing, convex function given by its values at knots.

    Constant below the first knot, linear extrapolation with the last slope above the last one,
    which keeps it monotone and convex everywhere (the property CaDDTree's stopping rule needs).
    """

    knots: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self):
        object.__setattr__(self, "knots", tuple(float(x) for x in self.knots))
        object.__setattr__(self, "values", tuple(float(y) for y in self.values))
        k, v = self.knots, self.values
        if len(k) < 1 or len(k) != len(v):
            raise ValueError(f"need >= 1 knot and one value per knot, got {len(k)} knots and {len(v)} values")
        if any(b <= a for a, b in zip(k, k[1:])):
            raise ValueError("knots must be strictly increasing")
        if not all(math.isfinite(x) for x in k + v):
            raise ValueError("knots and values must be finite")
        s = self.slopes
        tol = 1e-9 * (1.0 + max(abs(y) for y in v))
        if s and s[0] < -tol:
            raise ValueError(f"cost must be non-decreasing; first slope is {s[0]:.4g}")
        if any(b < a - tol for a, b in zip(s, s[1:])):
            raise ValueError("cost must be convex (slopes non-decreasing)")

    @property
    def slopes(self) -> tuple[float, ...]:
        k, v = self.knots, self.values
        return tuple((v[i + 1] - v[i]) / (k[i + 1] - k[i]) for i in range(len(k) - 1))

    def __call__(self, x: float) -> float:
        """Scalar evaluation in pure Python: this sits in CaDDTree's per-node loop."""
        k, v = self.knots, self.values
        if x <= k[0]:
            return v[0]
        i = bisect.bisect_right(k, x) - 1
        if i >= len(k) - 1:  # at or past the last knot: extend the last segment
            if len(k) == 1:
                return v[0]
            i = len(k) - 2
        return v[i] + (v[i + 1] - v[i]) * (x - k[i]) / (k[i + 1] - k[i])

    def evaluate(self, x) -> np.ndarray:
        """Vectorised evaluation (reference for __call__ and for plotting)."""
        x = np.asarray(x, dtype=float)
        k, v = np.array(self.knots), np.array(self.values)
        y = np.interp(x, k, v)  # clamps to v[0] below and v[-1] above
        if len(k) > 1:
            last_slope = (v[-1] - v[-2]) / (k[-1] - k[-2])
            y = np.where(x > k[-1], v[-1] + last_slope * (x - k[-1]), y)
        return y

    def to_dict(self) -> dict:
        return {"knots": list(self.knots), "values": list(self.values)}

    @classmethod
    def from_dict(cls, d: dict) -> "ConvexCost":
        return cls(tuple(d["knots"]), tuple(d["values"]))


def _check_points(n_values, ms_values) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(n_values, dtype=float).reshape(-1)
    y = np.asarray(ms_values, dtype=float).reshape(-1)
    if x.size != y.size or x.size < 1:
        raise ValueError(f"need >= 1 point and as many n values as ms values, got {x.size} and {y.size}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("n values and ms values must be finite")
    if (x < 0).any() or (y < 0).any():
        raise ValueError("n values and ms values must be >= 0")
    return x, y


def fit_convex_cost(n_values, ms_values) -> ConvexCost:
    """Least-squares monotone convex fit (repeated n allowed), knots at the distinct n values.

    Basis: 1, (n - n0), hinges max(0, n - k) at interior knots. Non-negative coefficients are
    exactly "value >= 0, first slope >= 0, every slope increase >= 0", so NNLS solves the
    constrained regression with no solver dependency.
    """
    x, y = _check_points(n_values, ms_values)
    knots = np.unique(x)
    if knots.size == 1:
        return ConvexCost((knots[0],), (float(y.mean()),))
    scale = knots[-1] - knots[0]  # unit-range columns keep NNLS well conditioned

    def basis(t):
        cols = [np.ones_like(t), (t - knots[0]) / scale]
        cols += [np.maximum(0.0, t - k) / scale for k in knots[1:-1]]
        return np.stack(cols, axis=1)

    coef, _ = nnls(basis(x), y)
    values = basis(knots) @ coef
    # Rounding can leave a slope a hair below its predecessor; the invariants are what callers rely on.
    values = np.maximum.accumulate(values)
    return ConvexCost(tuple(knots), tuple(values))


def fit_convex_cost_reference(n_values, ms_values) -> ConvexCost:
    """Slow reference: SLSQP on the knot values with explicit slope constraints."""
    x, y = _check_points(n_values, ms_values)
    knots = np.unique(x)
    if knots.size == 1:
        return ConvexCost((knots[0],), (float(y.mean()),))
    idx = np.searchsorted(knots, x)
    start = np.array([y[idx == i].mean() for i in range(knots.size)])
    start = np.maximum.accumulate(start)
    dk = np.diff(knots)

    def slopes(b):
        return np.diff(b) / dk

    cons = [{"type": "ineq", "fun": lambda b: slopes(b)[:1]},
            {"type": "ineq", "fun": lambda b: np.diff(slopes(b))}]
    res = minimize(lambda b: 0.5 * np.sum((y - b[idx]) ** 2), start, jac=lambda b: np.bincount(
        idx, weights=b[idx] - y, minlength=knots.size), constraints=cons, method="SLSQP",
        options={"ftol": 1e-12, "maxiter": 1000})
    values = np.maximum.accumulate(res.x)
    # SLSQP honours constraints only up to its tolerance; clip tiny convexity violations.
    s = np.maximum.accumulate(np.maximum(slopes(values), 0.0))
    values = np.concatenate([[values[0]], values[0] + np.cumsum(s * dk)])
    return ConvexCost(tuple(knots), tuple(values))


# ---- the cost model: C_d + C_v(tokens, context) --------------------------------------------


@dataclass
class VerifyCostModel:
    """Per-context-length verify curves (ms vs tokens in the forward) and the draft cost.

    Between profiled context lengths the curves are interpolated linearly (a convex combination
    of convex curves is convex); outside the profiled range the nearest curve is used.
    """

    context_lens: list[int]
    curves: list[ConvexCost]  # curves[i]: ms as a function of verify TOKENS at context_lens[i]
    draft_ms: float = 0.0  # C_d at context length 0
    draft_ms_per_context_token: float = 0.0  # C_d slope in context length (0 = constant)
    measurements: dict = field(default_factory=dict)  # raw medians for plots: see profile_grid

    def __post_init__(self):
        if len(self.context_lens) < 1 or len(self.context_lens) != len(self.curves):
            raise ValueError("need >= 1 context length and one curve per context length")
        if any(b <= a for a, b in zip(self.context_lens, self.context_lens[1:])):
            raise ValueError("context_lens must be strictly increasing")
        if self.draft_ms < 0 or self.draft_ms_per_context_token < 0:
            raise ValueError("draft cost and its slope must be >= 0")
        self._curve_cache: dict[int, ConvexCost] = {}

    def verify_curve(self, context_len: int) -> ConvexCost:
        """The verify curve (ms vs tokens) at one context length, exactly interpolated."""
        cached = self._curve_cache.get(context_len)
        if cached is not None:
            return cached
        lens = self.context_lens
        if context_len <= lens[0]:
            curve = self.curves[0]
        elif context_len >= lens[-1]:
            curve = self.curves[-1]
        else:
            i = bisect.bisect_right(lens, context_len) - 1
            w = (context_len - lens[i]) / (lens[i + 1] - lens[i])
            a, b = self.curves[i], self.curves[i + 1]
            # Both are piecewise linear, so the blend is piecewise linear on the union of knots.
            knots = sorted(set(a.knots) | set(b.knots))
            curve = ConvexCost(tuple(knots), tuple((1 - w) * a(k) + w * b(k) for k in knots))
        if len(self._curve_cache) > 4096:
            self._curve_cache.clear()
        self._curve_cache[context_len] = curve
        return curve

    def verify_ms_for_tokens(self, num_tokens: float, context_len: int) -> float:
        return self.verify_curve(context_len)(num_tokens)

    def verify_ms(self, num_nodes: int, context_len: int) -> float:
        """Verify cost of a tree with `num_nodes` draft nodes: the forward holds num_nodes + 1 tokens."""
        if num_nodes < 0:
            raise ValueError(f"num_nodes must be >= 0, got {num_nodes}")
        return self.verify_curve(context_len)(num_nodes + 1)

    def draft_cost_ms(self, context_len: int) -> float:
        return self.draft_ms + self.draft_ms_per_context_token * max(context_len, 0)

    def round_ms(self, num_nodes: int, context_len: int) -> float:
        return self.draft_cost_ms(context_len) + self.verify_ms(num_nodes, context_len)

    # ---- persistence ----

    def to_dict(self) -> dict:
        return {
            "format": "drafttree.verify_cost_model", "version": 1, "units": "ms",
            "curve_x": "tokens in the verify forward = draft nodes + 1",
            "context_lens": list(self.context_lens),
            "curves": [c.to_dict() for c in self.curves],
            "draft_ms": self.draft_ms, "draft_ms_per_context_token": self.draft_ms_per_context_token,
            "measurements": self.measurements,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "VerifyCostModel":
        if d.get("format") != "drafttree.verify_cost_model":
            raise ValueError(f"not a drafttree verify cost model (format={d.get('format')!r})")
        if d.get("version") != 1:
            raise ValueError(f"unsupported cost model version {d.get('version')!r}")
        return cls([int(x) for x in d["context_lens"]], [ConvexCost.from_dict(c) for c in d["curves"]],
                   float(d["draft_ms"]), float(d["draft_ms_per_context_token"]), d.get("measurements", {}))

    def save(self, path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1))  # a killed profile leaves no truncated JSON

    @classmethod
    def load(cls, path) -> "VerifyCostModel":
        """The model in `path`, checked (see validate.check_cost_model); a broken file raises a CostModelError
        that names it and the command that rebuilds it."""
        rebuild = f"rebuild it with `drafttree profile --out {path}` (same --model, --dtype and --threads)"
        try:
            model = cls.from_dict(json.loads(Path(path).read_bytes()))
            check_cost_model(model)
        except json.JSONDecodeError as e:
            raise CostModelError(f"{path}: the cost model is not valid JSON, perhaps truncated ({e}); {rebuild}") from None
        except KeyError as e:
            raise CostModelError(f"{path}: the cost model lacks the key {e}; {rebuild}") from None
        except (ValueError, TypeError, AttributeError) as e:
            raise CostModelError(f"{path}: not a usable cost model ({e}); {rebuild}") from None
        return model

    def plot(self, path, title: str = "verify cost") -> None:
        """Measured medians (points) and convex fits (lines), one colour per context length."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure  # no pyplot: leaves the global backend alone

        fig = Figure(figsize=(7, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        meas = self.measurements or {}
        top = max([c.knots[-1] for c in self.curves] + [max(meas.get("token_counts", [1]))])
        xs = np.linspace(0, top * 1.1, 200)
        for i, (ctx, curve) in enumerate(zip(self.context_lens, self.curves)):
            color = f"C{i % 10}"
            ax.plot(xs, curve.evaluate(xs), color=color, label=f"fit, context {ctx}")
            if meas and str(ctx) in meas.get("median_ms", {}):
                ax.scatter(meas["token_counts"], meas["median_ms"][str(ctx)], color=color, s=12)
        ax.set_xlabel("tokens in the verify forward (draft nodes + 1)")
        ax.set_ylabel("ms")
        ax.set_title(f"{title}; draft {self.draft_ms:.2f} ms + {self.draft_ms_per_context_token:.2g} ms/ctx token")
        ax.legend(fontsize=7)
        fig.tight_layout()
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120)


# ---- profiling -----------------------------------------------------------------------------


def profile_grid(measure_fn: Callable[[int, int], float], token_counts: Sequence[int],
                 context_lens: Sequence[int], repeats: int = 5, warmup: int = 1,
                 draft_measure_fn: Callable[[int], float] | None = None, draft_ms: float = 0.0,
                 progress: bool = True) -> VerifyCostModel:
    """Time the target on a grid, take medians, fit one convex curve per context length.

    measure_fn(n_tokens, context_len) -> ms for ONE verify forward of n_tokens tokens (a tree of
    n_tokens - 1 draft nodes) on top of context_len cached tokens. Context is the outer loop, so
    a measure_fn may cache its prefill per context length. draft_measure_fn(context_len) -> ms,
    if given, replaces the constant `draft_ms` by an affine fit in the context length.
    """
    token_counts = sorted({int(n) for n in token_counts})
    context_lens = sorted({int(c) for c in context_lens})
    if not token_counts or token_counts[0] < 1:
        raise ValueError("token_counts must be non-empty and >= 1 (a verify has at least the root)")
    if not context_lens or context_lens[0] < 0:
        raise ValueError("context_lens must be non-empty and >= 0")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats} and {warmup}")
    from tqdm.auto import tqdm

    per_call = repeats + warmup
    total = len(context_lens) * (len(token_counts) + (draft_measure_fn is not None)) * per_call
    medians: dict[str, list[float]] = {}
    draft_medians: list[float] = []
    with tqdm(total=total, desc="profiling verify cost", disable=not progress) as bar:
        for ctx in context_lens:
            row = []
            for n in token_counts:
                row.append(_median_ms(lambda: measure_fn(n, ctx), repeats, warmup))
                bar.update(per_call)
            medians[str(ctx)] = row
            if draft_measure_fn is not None:
                draft_medians.append(_median_ms(lambda: draft_measure_fn(ctx), repeats, warmup))
                bar.update(per_call)
    curves = [fit_convex_cost(token_counts, medians[str(c)]) for c in context_lens]
    slope = 0.0
    if draft_medians:
        draft_ms, slope = _fit_affine_nonneg(context_lens, draft_medians)
    meas = {"token_counts": token_counts, "median_ms": medians, "repeats": repeats}
    if draft_medians:
        meas["draft_median_ms"] = draft_medians
    return VerifyCostModel(context_lens, curves, float(draft_ms), float(slope), meas)


def _median_ms(call: Callable[[], float], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        call()
    samples = [float(call()) for _ in range(repeats)]
    if not all(math.isfinite(s) and s >= 0 for s in samples):
        raise ValueError(f"measure function returned invalid times {samples}")
    return statistics.median(samples)


def _fit_affine_nonneg(xs, ys) -> tuple[float, float]:
    """Least-squares a + b·x with a, b >= 0 (draft cost cannot fall with context)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    (a, b), _ = nnls(np.stack([np.ones_like(x), x], axis=1), y)
    return float(a), float(b)
