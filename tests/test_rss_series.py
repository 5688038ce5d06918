"""The soak's reading of its memory samples: slope, flat stretches, the warm window."""

from __future__ import annotations

import pytest

from mlxserve.bench.rss_series import after, longest_flat_minutes, slope_mb_per_min


def test_slope_of_a_steady_climb_is_its_rate() -> None:
    samples = [(t * 0.5, 400 + 7 * t * 0.5) for t in range(20)]
    assert slope_mb_per_min(samples) == pytest.approx(7.0)


def test_slope_of_noise_around_a_level_is_near_zero() -> None:
    samples = [(t * 0.5, 450 + (1 if t % 2 else -1)) for t in range(40)]
    assert abs(slope_mb_per_min(samples)) < 0.1


def test_slope_needs_two_times() -> None:
    assert slope_mb_per_min([]) == 0.0
    assert slope_mb_per_min([(1.0, 400.0)]) == 0.0
    assert slope_mb_per_min([(1.0, 400.0), (1.0, 500.0)]) == 0.0


def test_longest_flat_stretch_ends_at_the_first_sample_off_the_band() -> None:
    # Flat from minute 0 to 3, a step up at 3.5, then flat again from 3.5 to 9.
    samples = [(m / 2, 400.0) for m in range(7)] + [(m / 2, 450.0) for m in range(7, 19)]
    assert longest_flat_minutes(samples) == pytest.approx(5.5)
    climbing = [(m / 2, 400 + 10 * m) for m in range(10)]
    assert longest_flat_minutes(climbing) == 0.0


def test_after_keeps_the_samples_from_a_minute_on() -> None:
    samples = [(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]
    assert after(samples, 1.0) == [(1.0, 2.0), (2.0, 3.0)]
