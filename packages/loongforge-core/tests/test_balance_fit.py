import numpy as np
import pytest

from loongforge.core.balance import CostFitter, SampleSizes


def _synthetic_steps(rng, steps, ranks, a, b, c, overhead, noise=0.0):
    """Per rank-step: the rank's random samples and the seconds a*sum(l^2) + b*tokens + c*samples + overhead."""
    records = []
    for _ in range(steps * ranks):
        count = int(rng.integers(1, 9))
        lengths = [[int(x) for x in rng.integers(64, 4096, int(rng.integers(1, 4)))] for _ in range(count)]
        sizes = SampleSizes.from_lengths(lengths)
        seconds = a * sizes.squares.sum() + b * sizes.tokens.sum() + c * count + overhead
        records.append((sizes, seconds * (1.0 + noise * rng.standard_normal())))
    return records


def test_fit_recovers_known_coefficients_exactly_without_noise():
    rng = np.random.default_rng(0)
    a, b, c, overhead = 2e-9, 3e-5, 4e-3, 0.25
    fitter = CostFitter()
    for sizes, seconds in _synthetic_steps(rng, 10, 4, a, b, c, overhead):
        fitter.add_sizes(sizes, seconds)
    fit = fitter.fit()
    assert fit.model.a == pytest.approx(a, rel=1e-6)
    assert fit.model.b == pytest.approx(b, rel=1e-6)
    assert fit.model.c == pytest.approx(c, rel=1e-5)
    assert fit.overhead == pytest.approx(overhead, rel=1e-5)
    assert fit.rms_error < 1e-6 and fit.num_measurements == 40


def test_fit_with_noise_is_close_and_never_negative():
    rng = np.random.default_rng(1)
    a, b, overhead = 1e-9, 2e-5, 0.1  # no per-sample cost: c is 0
    fitter = CostFitter()
    for sizes, seconds in _synthetic_steps(rng, 50, 8, a, b, 0.0, overhead, noise=0.01):
        fitter.add_sizes(sizes, seconds)
    fit = fitter.fit()
    assert fit.model.a == pytest.approx(a, rel=0.1)
    assert fit.model.b == pytest.approx(b, rel=0.05)
    assert fit.model.c >= 0.0 and fit.overhead >= 0.0
    # the fitted costs predict the measurements about as well as the true model
    assert fit.rms_error < 0.02 * np.mean([s for _, s in _synthetic_steps(rng, 5, 8, a, b, 0.0, overhead)])


def test_negative_unconstrained_solution_is_clamped_to_the_best_nonnegative_one():
    # seconds fall with the sample count: plain least squares would give c < 0
    fitter = CostFitter(fit_overhead=False)
    for tokens, samples in [(1000, 1), (2000, 1), (3000, 4), (4000, 8), (5000, 2)]:
        fitter.add(squares=0.0, tokens=tokens, samples=samples, seconds=tokens * 1e-3 - samples * 1e-2)
    fit = fitter.fit()
    assert fit.model.c == 0.0 and fit.model.a == 0.0
    x = np.array([1000, 2000, 3000, 4000, 5000.0])
    y = x * 1e-3 - np.array([1, 1, 4, 8, 2]) * 1e-2
    assert fit.model.b == pytest.approx(float(x @ y / (x @ x)), rel=1e-9)  # the 1-feature least squares


def test_statistics_add_up_across_fitters():
    rng = np.random.default_rng(2)
    records = _synthetic_steps(rng, 6, 2, 3e-9, 1e-5, 1e-3, 0.05, noise=0.02)
    pooled, parts = CostFitter(), [CostFitter(), CostFitter()]
    for k, (sizes, seconds) in enumerate(records):
        pooled.add_sizes(sizes, seconds)
        parts[k % 2].add_sizes(sizes, seconds)
    merged = CostFitter()
    merged.load_statistics(parts[0].statistics() + parts[1].statistics())
    got, want = merged.fit(), pooled.fit()
    assert got.model.as_tuple() == pytest.approx(want.model.as_tuple(), rel=1e-9, abs=1e-15)
    assert (got.overhead, got.num_measurements) == (pytest.approx(want.overhead, rel=1e-9), 12)


def test_fit_errors_name_the_problem():
    fitter = CostFitter()
    fitter.add(1.0, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="at least 4 measurements, has 1"):
        fitter.fit()
    with pytest.raises(ValueError, match="seconds"):
        fitter.add(1.0, 1.0, 1.0, float("nan"))
    flat = CostFitter()
    for tokens in (100, 200, 300, 400, 500):
        flat.add(tokens**2, tokens, 1, 2.0)  # time does not grow with length
    with pytest.raises(ValueError, match="do not determine a cost that grows with length"):
        flat.fit()
