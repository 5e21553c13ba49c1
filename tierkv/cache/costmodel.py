"""Cost model: is fetching a cold run of blocks faster than recomputing its tokens?

Per tier (or link: any name) the model keeps exponentially weighted least-squares sums of observed
transfers ``(nbytes, seconds)`` and fits ``seconds = latency + nbytes / bandwidth``; configured priors
answer until a tier has ``min_observations``. When every observation has about the same size (fixed-size
blocks) the split between latency and bandwidth is not identifiable, so the prior latency is kept and
the bandwidth absorbs the rest: predictions at the observed sizes stay exact either way.

Recompute (prefill) cost per token grows with its position because attention reads the whole context:
``seconds(tokens, depth) = c * (tokens + (tokens * depth + tokens**2 / 2) / attention_tokens)``, where
``c`` is seconds per token at position 0 (the inverse of the engine's reported tokens/s, or an EMA of
observed prefills) and ``attention_tokens`` the context length at which attention costs as much per
token as the rest of the model. The cost of consecutive runs adds up exactly, so :meth:`CostModel.plan`
can pick the best split of a prefix between fetching and recomputing.

The daemon's block store owns one model: it feeds it the bytes and seconds of every load the movers
report, and the engine's measured prefill speed, and asks it whether to fetch.
"""

from __future__ import annotations

import contextlib
import math
import operator
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import NamedTuple, SupportsIndex

__all__ = ["DEFAULT_PRIORS", "CostModel", "Prior", "Run", "RunPlan"]


class Prior(NamedTuple):
    """Assumed speed of a tier before it has been measured."""

    bandwidth: float  # bytes/s
    latency: float    # seconds per transfer


# Conservative guesses for a PCIe 4/5 server with NVMe and a 10-25 Gb/s network.
DEFAULT_PRIORS: dict[str, Prior] = {
    "gpu": Prior(500e9, 20e-6),
    "host": Prior(20e9, 50e-6),
    "disk": Prior(2e9, 500e-6),
    "remote": Prior(1e9, 2e-3),
}


class Run(NamedTuple):
    """A cold run of consecutive blocks in one tier."""

    tier: str
    nbytes: int
    tokens: int


@dataclass(frozen=True, slots=True)
class RunPlan:
    """The decision for one run: ``fetch`` is True when fetching it beats recomputing it."""

    tier: str
    nbytes: int
    tokens: int
    depth: int           # tokens before this run
    fetch: bool
    fetch_s: float       # predicted seconds to fetch
    recompute_s: float   # predicted seconds to recompute its tokens at this depth


def _nonneg_int(value: object, what: str) -> int:
    v = operator.index(value) if isinstance(value, SupportsIndex) else -1
    if isinstance(value, bool) or v < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return v


def _positive(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{what} must be a positive finite number, got {value!r}")
    return float(value)


def _nonneg(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(f"{what} must be a non-negative finite number, got {value!r}")
    return float(value)


class _LineFit:
    """Exponentially weighted least squares of y = a + b x, bias-corrected like Adam's moments."""

    __slots__ = ("alpha", "count", "sw", "sx", "sy", "sxx", "sxy")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.count = 0
        self.sw = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        keep, a = 1.0 - self.alpha, self.alpha
        self.sw = keep * self.sw + a
        self.sx = keep * self.sx + a * x
        self.sy = keep * self.sy + a * y
        self.sxx = keep * self.sxx + a * x * x
        self.sxy = keep * self.sxy + a * x * y
        self.count += 1

    def fit(self, prior_latency: float) -> tuple[float, float]:
        """(latency seconds, seconds per byte)."""
        mx, my = self.sx / self.sw, self.sy / self.sw
        vx = max(self.sxx / self.sw - mx * mx, 0.0)
        cxy = self.sxy / self.sw - mx * my
        if mx > 0 and vx > (0.05 * mx) ** 2 and cxy > 0:
            slope = cxy / vx
            latency = my - slope * mx
            if latency < 0:  # noise: refit through the origin
                latency, slope = 0.0, self.sxy / self.sxx
            return latency, slope
        # Sizes barely vary: keep the prior latency (capped by what was seen), fit the rest as bandwidth.
        latency = min(prior_latency, my)
        if mx <= 0:
            return my, 0.0
        return latency, (my - latency) / mx


class CostModel:
    """Measured tier speeds and recompute speed; decides fetch versus recompute.

    Thread-safe under the ``lock`` it is given (the daemon gives it a ``threading.Lock``: load completions
    call :meth:`observe` on mover threads while lookups call :meth:`plan`); without one, single-threaded.

    Args:
        priors: bandwidth and latency per tier before measurements (default :data:`DEFAULT_PRIORS`);
            tiers not listed are learned from observations alone.
        recompute_tokens_per_s: prefill speed at position 0 until the engine reports or is observed.
        attention_tokens: context length at which attention costs as much per token as the rest.
        alpha: EMA weight of each new observation (0 < alpha <= 1).
        min_observations: observations of a tier before they replace its prior.
        safety: fetch only when ``fetch_s * safety <= recompute_s`` (>= 1 favours recompute).
        lock: held around every read and update of the measurements.
    """

    def __init__(self, priors: Mapping[str, Prior | tuple[float, float]] | None = None, *,
                 recompute_tokens_per_s: float = 10_000.0, attention_tokens: int = 32_768, alpha: float = 0.2,
                 min_observations: int = 3, safety: float = 1.0,
                 lock: AbstractContextManager[object] | None = None) -> None:
        src = DEFAULT_PRIORS if priors is None else priors
        self._priors: dict[str, Prior] = {}
        for tier, p in src.items():
            bw, lat = p
            self._priors[self._tier(tier)] = Prior(_positive(bw, f"prior bandwidth of {tier!r}"),
                                                   _nonneg(lat, f"prior latency of {tier!r}"))
        if not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.min_observations = _nonneg_int(min_observations, "min_observations")
        self.attention_tokens = _nonneg_int(attention_tokens, "attention_tokens")
        if self.attention_tokens == 0:
            raise ValueError("attention_tokens must be positive")
        self.safety = _positive(safety, "safety")
        self._lock: AbstractContextManager[object] = lock if lock is not None else contextlib.nullcontext()
        self._fits: dict[str, _LineFit] = {}
        self._sec_per_token = 1.0 / _positive(recompute_tokens_per_s, "recompute_tokens_per_s")
        self._rc_sum = self._rc_w = 0.0
        self._rc_count = 0
        self._rc_given = False

    @staticmethod
    def _tier(tier: object) -> str:
        if not isinstance(tier, str) or not tier:
            raise ValueError(f"tier must be a non-empty string, got {tier!r}")
        return tier

    # ------------------------------------------------------------------------------------ observing

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """Record one finished transfer from ``tier``: ``nbytes`` took ``seconds`` end to end."""
        tier = self._tier(tier)
        x = _nonneg_int(nbytes, "nbytes")
        y = _nonneg(seconds, "seconds")
        with self._lock:
            fit = self._fits.get(tier)
            if fit is None:
                fit = self._fits[tier] = _LineFit(self.alpha)
            fit.add(float(x), y)

    def observe_recompute(self, tokens: int, seconds: float, depth: int = 0) -> None:
        """Record a prefill: ``tokens`` new tokens after ``depth`` cached ones took ``seconds``."""
        tokens = _nonneg_int(tokens, "tokens")
        depth = _nonneg_int(depth, "depth")
        seconds = _nonneg(seconds, "seconds")
        work = self._work(tokens, depth)
        if work <= 0:
            return
        with self._lock:
            keep = 1.0 - self.alpha
            self._rc_sum = keep * self._rc_sum + self.alpha * (seconds / work)
            self._rc_w = keep * self._rc_w + self.alpha
            self._rc_count += 1

    def set_recompute_speed(self, tokens_per_s: float) -> None:
        """The engine's own figure of prefill tokens/s (at short context); replaces what was observed."""
        rate = _positive(tokens_per_s, "tokens_per_s")
        with self._lock:
            self._sec_per_token = 1.0 / rate
            self._rc_sum = self._rc_w = 0.0
            self._rc_count = 0
            self._rc_given = True

    # ----------------------------------------------------------------------------------- estimating

    def _speed(self, tier: str) -> tuple[float, float, str]:
        """(latency s, seconds per byte, source) under the lock."""
        prior = self._priors.get(tier)
        fit = self._fits.get(tier)
        enough = fit is not None and fit.count >= max(1, self.min_observations)
        if fit is not None and (enough or prior is None):
            latency, slope = fit.fit(prior.latency if prior else 0.0)
            return latency, slope, "measured"
        if prior is None:
            raise ValueError(f"tier {tier!r} has no prior and no observations")
        return prior.latency, 1.0 / prior.bandwidth, "prior"

    def bandwidth(self, tier: str) -> float:
        """Estimated bytes/s of ``tier`` (``inf`` when transfers look size-independent)."""
        with self._lock:
            _, slope, _ = self._speed(self._tier(tier))
        return math.inf if slope <= 0 else 1.0 / slope

    def latency(self, tier: str) -> float:
        """Estimated fixed seconds per transfer from ``tier``."""
        with self._lock:
            return self._speed(self._tier(tier))[0]

    def fetch_seconds(self, tier: str, nbytes: int) -> float:
        """Predicted seconds to fetch ``nbytes`` from ``tier``."""
        n = _nonneg_int(nbytes, "nbytes")
        with self._lock:
            latency, slope, _ = self._speed(self._tier(tier))
        return latency + n * slope

    def recompute_tokens_per_s(self) -> float:
        """Estimated prefill tokens/s at position 0."""
        with self._lock:
            return 1.0 / self._seconds_per_token()

    def recompute_source(self) -> str:
        """Where the recompute speed comes from: ``measured`` (observed prefills), ``engine`` (the engine's
        own figure) or ``prior`` (the default; nothing known of this engine yet)."""
        with self._lock:
            return self._rc_source()

    def _rc_source(self) -> str:
        if self._rc_count >= max(1, self.min_observations):
            return "measured"
        return "engine" if self._rc_given else "prior"

    def prefix_recompute_seconds(self, block_tokens: int, blocks: int) -> list[float]:
        """Predicted seconds to prefill the first 1, 2, ... ``blocks`` blocks of a prompt."""
        bt, n = _nonneg_int(block_tokens, "block_tokens"), _nonneg_int(blocks, "blocks")
        with self._lock:
            spt = self._seconds_per_token()
        return [self._work((i + 1) * bt, 0) * spt for i in range(n)]

    def _seconds_per_token(self) -> float:
        if self._rc_count >= max(1, self.min_observations):
            return self._rc_sum / self._rc_w
        return self._sec_per_token

    def _work(self, tokens: int, depth: int) -> float:
        return tokens + (tokens * depth + tokens * tokens / 2.0) / self.attention_tokens

    def recompute_seconds(self, tokens: int, depth: int = 0) -> float:
        """Predicted seconds to prefill ``tokens`` tokens that follow ``depth`` tokens of context."""
        work = self._work(_nonneg_int(tokens, "tokens"), _nonneg_int(depth, "depth"))
        with self._lock:
            return work * self._seconds_per_token()

    # -------------------------------------------------------------------------------------- planning

    def plan(self, runs: Iterable[Run | tuple[str, int, int]], *, depth: int = 0,
             prefix: bool = True) -> list[RunPlan]:
        """Decide, for each cold run, whether to fetch it or recompute its tokens.

        Args:
            runs: ``(tier, nbytes, tokens)`` runs in prefix order.
            depth: tokens before the first run (already resident).
            prefix: engines can only skip a prefix: once one run is recomputed, every later run is too.
                The split minimising total time is chosen (ties go to fetching). With False each run is
                decided on its own.

        Returns:
            One :class:`RunPlan` per run, in order.
        """
        start = _nonneg_int(depth, "depth")
        items = []
        for r in runs:
            try:
                tier, nbytes, tokens = r
            except (TypeError, ValueError) as exc:
                raise ValueError(f"a run is (tier, nbytes, tokens), got {r!r}") from exc
            items.append((self._tier(tier), _nonneg_int(nbytes, "nbytes"), _nonneg_int(tokens, "tokens")))
        with self._lock:
            spt = self._seconds_per_token()
            depths, fetch_s, recompute_s = [], [], []
            d = start
            for tier, nbytes, tokens in items:
                latency, slope, _ = self._speed(tier)
                depths.append(d)
                fetch_s.append(latency + nbytes * slope)
                recompute_s.append(self._work(tokens, d) * spt)
                d += tokens
        m = len(items)
        if prefix:
            # cost(k) = fetch runs [0, k) + recompute runs [k, m); recompute costs add up exactly.
            suffix = [0.0] * (m + 1)
            for j in range(m - 1, -1, -1):
                suffix[j] = suffix[j + 1] + recompute_s[j]
            best_k, best, fetched = 0, math.inf, 0.0
            for k in range(m + 1):
                cost = fetched * self.safety + suffix[k]
                if cost <= best:
                    best_k, best = k, cost
                if k < m:
                    fetched += fetch_s[k]
            decisions = [j < best_k for j in range(m)]
        else:
            decisions = [fetch_s[j] * self.safety <= recompute_s[j] for j in range(m)]
        return [RunPlan(tier, nbytes, tokens, depths[j], decisions[j], fetch_s[j], recompute_s[j])
                for j, (tier, nbytes, tokens) in enumerate(items)]

    def snapshot(self) -> dict[str, object]:
        """Current estimates, for stats and the CLI."""
        with self._lock:
            tiers = {}
            for tier in sorted(set(self._priors) | set(self._fits)):
                latency, slope, source = self._speed(tier)
                fit = self._fits.get(tier)
                tiers[tier] = {"bandwidth": math.inf if slope <= 0 else 1.0 / slope, "latency": latency,
                               "observations": fit.count if fit else 0, "source": source}
            return {"tiers": tiers, "recompute": {"tokens_per_s": 1.0 / self._seconds_per_token(),
                                                  "observations": self._rc_count,
                                                  "source": self._rc_source(),
                                                  "attention_tokens": self.attention_tokens}}
