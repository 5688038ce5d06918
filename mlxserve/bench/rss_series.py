"""What a soak's resident-memory samples say: growth, slope and flat stretches.

Pure functions over `(minutes, megabytes)` samples, so they are tested on
their own and the soak only collects.
"""

from __future__ import annotations

from collections.abc import Sequence

Sample = tuple[float, float]  # (minutes since the start, resident MB)

# A stretch is flat while its samples stay within this share of its first one.
FLAT_TOLERANCE = 0.01


def slope_mb_per_min(samples: Sequence[Sample]) -> float:
    """Least-squares slope of MB over minutes; 0 with fewer than two distinct times."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_mb = sum(mb for _, mb in samples) / n
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    if spread == 0:
        return 0.0
    return sum((t - mean_t) * (mb - mean_mb) for t, mb in samples) / spread


def longest_flat_minutes(samples: Sequence[Sample], tolerance: float = FLAT_TOLERANCE) -> float:
    """The longest span of consecutive samples that all stay within `tolerance`
    (a share) of the span's first sample."""
    best = 0.0
    for start, (t0, mb0) in enumerate(samples):
        end_t = t0
        for t, mb in samples[start + 1 :]:
            if abs(mb - mb0) > tolerance * mb0:
                break
            end_t = t
        best = max(best, end_t - t0)
    return best


def after(samples: Sequence[Sample], minute: float) -> list[Sample]:
    """The samples taken at or after `minute`."""
    return [sample for sample in samples if sample[0] >= minute]
