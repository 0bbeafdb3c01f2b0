"""What an engine step costs, learned from the steps the engine runs.

    seconds = overhead_s + prefill_token_s x prefill tokens + decode_token_s x decodes
              + context_token_s x context tokens + large_step_s (steps past small_step_max_tokens)

The overhead is what every step pays whatever its size (the weights read once,
Python, sampling); the two per-token costs are fitted apart because a prefill
token shares its chunk's matrix products while a decode is a row of its own.
The context tokens are each scheduled sequence's context length (its cached
tokens and its new ones): attention reads all of their K/V, so a decode over
1,000 cached tokens costs far more than one over 40, and a step planned as a
count of decodes alone would run long when long contexts decode. In a
quantized weight mode, a step of more than `small_step_max_tokens` tokens runs
the dense bfloat16 matrices instead of the packed ones (model/llama.py): it
reads several times the bytes, a jump no per-token cost can express, so it is
a term of its own. The fit is least squares over the measured steps, each
weighted by how recent it is (the weight halves every `half_life_steps`), so
it follows the machine as its load changes. A prior holds the coefficients the
steps cannot tell apart (only decodes seen: the prefill cost stays the prior's)
and gives the scheduler a plan before the first step is measured. Coefficients
are kept non-negative.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

NUM_TERMS = 5  # overhead, prefill tokens, decodes, context tokens, past the small-step size
# Feature scales: the prior pulls on each coefficient as a tenth of a step of this shape would.
PREFILL_SCALE = 256.0
DECODE_SCALE = 16.0
CONTEXT_SCALE = 4096.0


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
    large_step_s: float = 0.0  # what a step past small_step_max_tokens costs on top
    small_step_max_tokens: int | None = None  # None: steps of every size run the same kernels

    def is_large(self, shape: StepShape) -> bool:
        return self.small_step_max_tokens is not None and shape.num_tokens > self.small_step_max_tokens

    def seconds(self, shape: StepShape) -> float:
        return self.overhead_s + self.prefill_token_s * shape.num_prefill_tokens + \
            self.decode_token_s * shape.num_decodes + self.context_token_s * shape.num_context_tokens + \
            (self.large_step_s if self.is_large(shape) else 0.0)

    def prefill_seconds(self, tokens: int, step_tokens: int) -> float:
        """A prompt of `tokens` computed alone in steps of at most `step_tokens`: what recomputing it costs,
        against which the restore planner weighs loading its KV."""
        seconds, done = 0.0, 0
        while done < tokens:
            n = min(step_tokens, tokens - done)
            done += n
            seconds += self.seconds(StepShape(num_prefill_tokens=n, num_context_tokens=done))
        return seconds

    def prefill_tokens_within(self, shape: StepShape, limit_s: float, num_cached: int = 0) -> int:
        """How many prefill tokens of a sequence with `num_cached` tokens before them a step of `shape` can
        take and still cost at most `limit_s` (n of them add n prefill tokens and num_cached + n context;
        past the small-step size, the large step's extra too)."""
        per_token = self.prefill_token_s + self.context_token_s

        def within(extra_s: float) -> int:
            spare = limit_s - self.seconds(shape) - extra_s - self.context_token_s * num_cached
            if spare < 0:
                return -1
            return int(spare / per_token) if per_token > 0 else 1 << 30

        if self.small_step_max_tokens is None or self.is_large(shape):
            return max(within(0.0), 0)
        room = self.small_step_max_tokens - shape.num_tokens  # tokens that keep the step small
        large = within(self.large_step_s)
        return large if large > room else max(min(within(0.0), room), 0)


# A small CPU's costs (SmolLM2-135M, float32): replaced within a few steps by what is measured.
PRIOR = StepCost(overhead_s=0.03, prefill_token_s=0.001, decode_token_s=0.001, context_token_s=5e-6,
                 large_step_s=0.02)


class StepCostModel:
    def __init__(self, prior: StepCost = PRIOR, half_life_steps: float = 64.0, prior_weight: float = 0.1,
                 small_step_max_tokens: int | None = None) -> None:
        self.small_step_max_tokens = small_step_max_tokens
        prior = replace(prior, small_step_max_tokens=small_step_max_tokens,
                        large_step_s=prior.large_step_s if small_step_max_tokens is not None else 0.0)
        self.prior = prior
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self.prior_weight = prior_weight
        self.num_observed = 0
        self._xx = [[0.0] * NUM_TERMS for _ in range(NUM_TERMS)]  # weighted sums of x x^T, x y, y^2
        self._xy = [0.0] * NUM_TERMS
        self._yy = 0.0
        self._current: StepCost | None = prior

    @property
    def current(self) -> StepCost:
        if self._current is None:
            self._current = self._fit()
        return self._current

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = _features(shape, self.prior)
        for i in range(NUM_TERMS):
            self._xy[i] = self.decay * self._xy[i] + x[i] * seconds
            for j in range(NUM_TERMS):
                self._xx[i][j] = self.decay * self._xx[i][j] + x[i] * x[j]
        self._yy = self.decay * self._yy + seconds * seconds
        self.num_observed += 1
        self._current = None  # refitted when next asked

    def _fit(self) -> StepCost:
        # Ridge towards the prior: minimise sum w (y - x.t)^2 + prior_weight |t - t_prior|^2, in scaled units.
        t0 = _scaled(self.prior)
        a = [[self._xx[i][j] + (self.prior_weight if i == j else 0.0) for j in range(NUM_TERMS)]
             for i in range(NUM_TERMS)]
        b = [self._xy[i] + self.prior_weight * t0[i] for i in range(NUM_TERMS)]
        c = self._yy + self.prior_weight * sum(t * t for t in t0)
        # Non-negative: the best of the fits with some coefficients held at 0 (31 tiny solves).
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
        return StepCost(best[0], best[1] / PREFILL_SCALE, best[2] / DECODE_SCALE, best[3] / CONTEXT_SCALE, best[4],
                        self.small_step_max_tokens)


def _features(shape: StepShape, cost: StepCost) -> list[float]:
    return [1.0, shape.num_prefill_tokens / PREFILL_SCALE, shape.num_decodes / DECODE_SCALE,
            shape.num_context_tokens / CONTEXT_SCALE, 1.0 if cost.is_large(shape) else 0.0]


def _scaled(cost: StepCost) -> list[float]:
    return [cost.overhead_s, cost.prefill_token_s * PREFILL_SCALE, cost.decode_token_s * DECODE_SCALE,
            cost.context_token_s * CONTEXT_SCALE, cost.large_step_s]


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
