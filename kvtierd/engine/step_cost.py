"""What an engine step costs, learned from the steps the engine runs.

    seconds = overhead_s + prefill_token_s x prefill tokens + decode_token_s x decodes
              + context_token_s x context tokens

The overhead is what every step pays whatever its size (the weights read once,
Python, sampling); the two per-token costs are fitted apart because a prefill
token shares its chunk's matrix products while a decode is a row of its own.
The context tokens are each scheduled sequence's context length (its cached
tokens and its new ones): attention reads all of their K/V, so a decode over
1,000 cached tokens costs far more than one over 40, and a step planned as a
count of decodes alone would run long when long contexts decode.

A quantized weight mode has regimes, one per set of kernels a step's size
picks: a step of at most `small_step_max_tokens` tokens runs the packed
quantized matrices (a high overhead per row, but few bytes), a larger one the
dense bfloat16 copies (model/llama.py: several times the bytes, then little
per row); with the int4 tile kernel, a middle regime (its tiles: nearly flat
in rows) sits between them. Each regime has its own four coefficients, the
next one's in `large` (a chain: `regime_max_tokens` are the bounds), fitted
from its own steps only: under a flood nearly every step is large, and one
fit over all would let the large steps' cost leak into what a lone decode is
believed to cost, the unit the step budget is built on (engine/scheduler.py).

Each fit is least squares over its steps, each weighted by how recent it is
(the weight halves every `half_life_steps` of that regime), so it follows the
machine as its load changes. A prior holds the coefficients the steps cannot
tell apart (only decodes seen: the prefill cost stays the prior's) and gives
the scheduler a plan before the first step is measured. Coefficients are kept
non-negative.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, replace

NUM_TERMS = 4  # overhead, prefill tokens, decodes, context tokens
LONE_DECODES_KEPT = 32  # the last steps of one decode alone, whose lower quartile is `one_decode_s`


@dataclass(frozen=True, slots=True)
class FeatureScales:
    """The prior pulls on each coefficient as a tenth of a step of this shape would: a regime's typical step."""

    prefill_tokens: float = 256.0
    decodes: float = 16.0
    context_tokens: float = 4096.0

    def features(self, shape: StepShape) -> list[float]:
        return [1.0, shape.num_prefill_tokens / self.prefill_tokens, shape.num_decodes / self.decodes,
                shape.num_context_tokens / self.context_tokens]

    def scaled(self, cost: StepCost) -> list[float]:
        return [cost.overhead_s, cost.prefill_token_s * self.prefill_tokens, cost.decode_token_s * self.decodes,
                cost.context_token_s * self.context_tokens]

    def unscaled(self, t: list[float]) -> StepCost:
        return StepCost(t[0], t[1] / self.prefill_tokens, t[2] / self.decodes, t[3] / self.context_tokens)


@dataclass(frozen=True, slots=True)
class StepShape:
    num_prefill_tokens: int = 0
    num_decodes: int = 0
    num_context_tokens: int = 0  # sum of the scheduled sequences' context lengths after the step

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decodes

    def plus(self, num_prefill_tokens: int = 0, num_decodes: int = 0, num_context_tokens: int = 0) -> StepShape:
        return StepShape(self.num_prefill_tokens + num_prefill_tokens, self.num_decodes + num_decodes,
                         self.num_context_tokens + num_context_tokens)


@dataclass(frozen=True, slots=True)
class StepCost:
    overhead_s: float
    prefill_token_s: float
    decode_token_s: float
    context_token_s: float = 0.0
    large: StepCost | None = None  # the costs of a step past small_step_max_tokens (the next regime)
    small_step_max_tokens: int | None = None  # None: steps of every size from here run the same kernels

    def is_large(self, shape: StepShape) -> bool:
        return self.small_step_max_tokens is not None and shape.num_tokens > self.small_step_max_tokens

    def regime(self, shape: StepShape) -> StepCost:
        """The coefficients a step of this shape is charged with."""
        return self.large.regime(shape) if self.large is not None and self.is_large(shape) else self

    def seconds(self, shape: StepShape) -> float:
        c = self.regime(shape)
        return c.overhead_s + c.prefill_token_s * shape.num_prefill_tokens + c.decode_token_s * shape.num_decodes \
            + c.context_token_s * shape.num_context_tokens

    def prefill_seconds(self, tokens: int, step_tokens: int, beside: StepShape = StepShape()) -> float:
        """A prompt of `tokens` computed in steps of at most `step_tokens`, each with `beside` in it too (the
        decodes running): what recomputing it costs, against which the restore planner weighs loading its KV."""
        seconds, done = 0.0, 0
        while done < tokens:
            n = min(step_tokens, tokens - done)
            done += n
            seconds += self.seconds(beside.plus(num_prefill_tokens=n, num_context_tokens=done))
        return seconds

    def prefill_tokens_within(self, shape: StepShape, limit_s: float, num_cached: int = 0) -> int:
        """How many prefill tokens of a sequence with `num_cached` tokens before them a step of `shape` can
        take and still cost at most `limit_s` (n of them add n prefill tokens and num_cached + n context, in
        the regime the step ends up in)."""

        def within(c: StepCost, base: StepShape) -> int:
            spare = limit_s - c.seconds(base) - c.context_token_s * num_cached
            per_token = c.prefill_token_s + c.context_token_s
            if spare < 0:
                return -1
            return int(spare / per_token) if per_token > 0 else 1 << 30

        if self.large is None:
            return max(within(self, shape), 0)
        if self.is_large(shape):
            return self.large.prefill_tokens_within(shape, limit_s, num_cached)
        room = self.small_step_max_tokens - shape.num_tokens  # tokens that keep the step in this regime
        # Crossing charges the whole step, its own tokens too, at the next regimes' costs.
        large = self.large.prefill_tokens_within(shape, limit_s, num_cached)
        return large if large > room else max(min(within(self, shape), room), 0)


# A small CPU's costs (SmolLM2-135M, float32): replaced within a few steps by what is measured.
PRIOR = StepCost(overhead_s=0.03, prefill_token_s=0.001, decode_token_s=0.001, context_token_s=5e-6)
# A quantized mode's large steps before any is measured: the dense matrices' read on top, little per row.
LARGE_PRIOR = StepCost(overhead_s=0.05, prefill_token_s=0.0005, decode_token_s=0.0005, context_token_s=5e-6)


class _RegimeFit:
    """Recency-weighted ridge least squares of one regime's four coefficients."""

    def __init__(self, prior: StepCost, decay: float, prior_weight: float, scales: FeatureScales) -> None:
        self.prior, self.decay, self.prior_weight, self.scales = prior, decay, prior_weight, scales
        self._xx = [[0.0] * NUM_TERMS for _ in range(NUM_TERMS)]  # weighted sums of x x^T, x y, y^2
        self._xy = [0.0] * NUM_TERMS
        self._yy = 0.0
        self._fitted: StepCost | None = None  # the last fit, until this regime's next step

    def observe(self, shape: StepShape, seconds: float) -> None:
        self._fitted = None
        x = self.scales.features(shape)
        for i in range(NUM_TERMS):
            self._xy[i] = self.decay * self._xy[i] + x[i] * seconds
            for j in range(NUM_TERMS):
                self._xx[i][j] = self.decay * self._xx[i][j] + x[i] * x[j]
        self._yy = self.decay * self._yy + seconds * seconds

    def fit(self) -> StepCost:
        """The coefficients for this regime's steps so far (refitted only after one more was observed)."""
        if self._fitted is None:
            self._fitted = self._solve_fit()
        return self._fitted

    def _solve_fit(self) -> StepCost:
        # Ridge towards the prior: minimise sum w (y - x.t)^2 + prior_weight |t - t_prior|^2, in scaled units.
        t0 = self.scales.scaled(self.prior)
        a = [[self._xx[i][j] + (self.prior_weight if i == j else 0.0) for j in range(NUM_TERMS)]
             for i in range(NUM_TERMS)]
        b = [self._xy[i] + self.prior_weight * t0[i] for i in range(NUM_TERMS)]
        c = self._yy + self.prior_weight * sum(t * t for t in t0)
        # Non-negative: the best of the fits with some coefficients held at 0 (15 tiny solves).
        best, best_loss = [0.0] * NUM_TERMS, c
        for size in range(NUM_TERMS, 0, -1):
            for free in itertools.combinations(range(NUM_TERMS), size):
                sub = _solve([[a[i][j] for j in free] for i in free], [b[i] for i in free])
                if sub is None or min(sub) < 0:
                    continue
                t = [0.0] * NUM_TERMS
                for i, v in zip(free, sub):
                    t[i] = v
                loss = c - 2 * sum(b[i] * t[i] for i in range(NUM_TERMS)) + \
                    sum(t[i] * a[i][j] * t[j] for i in range(NUM_TERMS) for j in range(NUM_TERMS))
                if loss < best_loss:
                    best, best_loss = t, loss
        return self.scales.unscaled(best)


class StepCostModel:
    def __init__(self, prior: StepCost = PRIOR, half_life_steps: float = 64.0, prior_weight: float = 0.1,
                 regime_max_tokens: tuple[int, ...] = ()) -> None:
        """`regime_max_tokens`: the most tokens of each regime but the last, ascending (none: one regime)."""
        self.regime_max_tokens = regime_max_tokens
        decay = 0.5 ** (1.0 / half_life_steps)
        priors = [replace(prior, large=None, small_step_max_tokens=None)]
        priors += [replace(prior.large or LARGE_PRIOR, large=None, small_step_max_tokens=None)] * len(regime_max_tokens)
        # A bounded regime's steps have at most its bound of tokens: its per-token costs are pulled towards the
        # prior as such a step would.
        scales = [FeatureScales(n, n) for n in regime_max_tokens] + [FeatureScales()]
        self._fits = [_RegimeFit(p, decay, prior_weight, sc) for p, sc in zip(priors, scales, strict=True)]
        self.prior = self._chain(priors)
        self.num_observed = 0
        self._current: StepCost | None = self.prior
        self._lone_decodes: deque[float] = deque(maxlen=LONE_DECODES_KEPT)

    def _chain(self, costs: list[StepCost]) -> StepCost:
        """Each regime's costs linked to the next's, with its bound."""
        chained = costs[-1]
        for cost, bound in zip(reversed(costs[:-1]), reversed(self.regime_max_tokens), strict=True):
            chained = replace(cost, large=chained, small_step_max_tokens=bound)
        return chained

    @property
    def current(self) -> StepCost:
        """The chained fits: a regime whose steps did not change since its last fit keeps it (a fit is 15 small
        solves in Python, ~0.3 ms: three regimes refitted for every admission cost a long prompt's first step
        ~1 ms, while the decodes beside it touched one regime)."""
        if self._current is None:
            self._current = self._chain([f.fit() for f in self._fits])
        return self._current

    @property
    def one_decode_s(self) -> float:
        """What a step of one decode alone costs (a lone request's inter-token latency): the lower quartile of
        the last such steps, as measured; predicted by the fit until one ran. Measured rather than predicted
        because a flood's steps are all alike (every one has long contexts, few are small): a fit over them
        extrapolates poorly to one short decode, and this is the unit the step budget is built on. The lower
        quartile, not the median: lone decodes run while a flood's requests arrive (parsed and tokenized on
        the daemon's other thread) measured twice their cost, and the budget would grow with them."""
        if self._lone_decodes:
            return sorted(self._lone_decodes)[len(self._lone_decodes) // 4]
        return self.current.seconds(StepShape(num_decodes=1))

    def observe(self, shape: StepShape, seconds: float) -> None:
        if shape.num_decodes == 1 and shape.num_prefill_tokens == 0:
            self._lone_decodes.append(seconds)
        regime = sum(shape.num_tokens > n for n in self.regime_max_tokens)
        self._fits[regime].observe(shape, seconds)
        self.num_observed += 1
        self._current = None  # refitted when next asked


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
