"""A distribution of a positive quantity (token counts, seconds): the lengths a config
expects (inference capacity planning) and the simulator's workloads and service times."""

from __future__ import annotations

import dataclasses
import math
import random
from typing import Any, Literal

from rlax_tpu.config.base import ConfigBase, require

_Z95 = 1.6448536269514722  # the standard normal's 95th percentile


@dataclasses.dataclass(kw_only=True, frozen=True)
class Distribution(ConfigBase):
    """A positive quantity (tokens or seconds): `fixed` at `median`; `lognormal` with that
    median and shape `sigma` (p95 = median·e^(1.645σ), heavy-tailed); or `empirical`,
    drawn uniformly from `values`. Draws are clipped to [minimum, maximum] (maximum 0 = no
    upper bound); token counts are rounded up."""

    # fixed at median, lognormal around it, or empirical (drawn from values)
    kind: Literal["fixed", "lognormal", "empirical"] = "fixed"
    # the median (the value of fixed)
    median: float = 1.0
    # lognormal's shape (p95 = median·e^(1.645σ))
    sigma: float = 0.0
    # draws are clipped below at this
    minimum: float = 0.0
    # draws are clipped above at this (0 = no upper bound)
    maximum: float = 0.0
    # empirical: the values drawn from, uniformly
    values: tuple[float, ...] = ()

    def validate(self) -> None:
        require(self.median >= 0, "median", f"must be >= 0, got {self.median}")
        require(self.sigma >= 0, "sigma", f"must be >= 0, got {self.sigma}")
        require(self.minimum >= 0, "minimum", "must be >= 0")
        require(
            self.maximum == 0 or self.maximum >= self.minimum,
            "maximum",
            f"must be 0 (unbounded) or >= minimum ({self.minimum}), got {self.maximum}",
        )
        require(
            self.kind != "empirical" or bool(self.values),
            "values",
            "an empirical distribution needs its values",
        )

    @classmethod
    def from_p50_p95(cls, p50: float, p95: float, **kwargs: Any) -> Distribution:
        """The lognormal with these two percentiles."""
        sigma = math.log(max(p95, p50) / p50) / _Z95 if p50 > 0 else 0.0
        return cls(kind="lognormal", median=p50, sigma=sigma, **kwargs)

    def _clip(self, x: float) -> float:
        x = max(self.minimum, x)
        return min(self.maximum, x) if self.maximum else x

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self._clip(self.median)
        if self.kind == "empirical":
            return self._clip(self.values[rng.randrange(len(self.values))])
        return self._clip(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0)))

    def tokens(self, rng: random.Random) -> int:
        return max(1, math.ceil(self.sample(rng)))

    def quantile(self, q: float) -> float:
        if self.kind == "fixed":
            return self._clip(self.median)
        if self.kind == "empirical":
            ordered = sorted(self.values)
            return self._clip(ordered[min(len(ordered) - 1, int(q * len(ordered)))])
        from statistics import NormalDist

        q = min(max(q, 1e-9), 1 - 1e-9)
        return self._clip(self.median * math.exp(self.sigma * NormalDist().inv_cdf(q)))

    def mean(self) -> float:
        """The mean of the clipped distribution (by its quantiles)."""
        if self.kind == "fixed":
            return self._clip(self.median)
        if self.kind == "empirical":
            return sum(self._clip(v) for v in self.values) / len(self.values)
        n = 400
        return sum(self.quantile((i + 0.5) / n) for i in range(n)) / n
