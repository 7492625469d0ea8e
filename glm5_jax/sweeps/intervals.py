"""Means with 95% confidence intervals over a few runs (seeds), the way results tables report them.

Student's t interval: mean +- t_{0.975, n-1} * s / sqrt(n), s the sample standard deviation
(n - 1). With the 3-10 runs a CPU affords, t is the honest choice: a bootstrap over so few
values under-covers (its interval is never wider than the values' own range), and a normal
interval (1.96) is too narrow by 2.2x at n = 3. The standard library has no t quantile, so the
two-sided 95% quantiles for 1-30 degrees of freedom are tabulated (to 3 decimals, as in any
statistics text) and larger ones use the Cornish-Fisher expansion around the normal quantile
(error < 1e-3 past 30).
"""

import math

import numpy as np

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
  """The 0.975 quantile of Student's t with `df` >= 1 degrees of freedom."""
  if df < 1:
    raise ValueError(f"t_quantile_975: df must be >= 1, got {df}")
  if df <= len(_T975):
    return _T975[df - 1]
  z = _Z975
  return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2))


def mean_interval(values) -> dict:
  """`{"n", "mean", "half_width", "low", "high", "min", "max"}` of `values` (finite floats): the
  95% t interval of their mean. One value has no interval (half_width None)."""
  x = np.asarray(values, np.float64).ravel()
  if x.size == 0 or not np.isfinite(x).all():
    raise ValueError(f"mean_interval: needs finite values, got {list(x)}")
  mean = float(x.mean())
  half = None
  if x.size > 1:
    half = t_quantile_975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
  return {"n": int(x.size), "mean": mean, "half_width": half,
          "low": None if half is None else mean - half,
          "high": None if half is None else mean + half,
          "min": float(x.min()), "max": float(x.max())}


def format_interval(stats: dict, *, scale: float = 1.0, digits: int = 1) -> str:
  """"33.5 +- 2.1" (mean +- half width, times `scale`), or "33.5" for one value."""
  mean = f"{stats['mean'] * scale:.{digits}f}"
  if stats["half_width"] is None:
    return mean
  return f"{mean} ± {stats['half_width'] * scale:.{digits}f}"


def excludes_zero(stats: dict) -> bool:
  """Whether the interval lies wholly on one side of 0: a difference the runs establish."""
  return stats["low"] is not None and (stats["low"] > 0 or stats["high"] < 0)
