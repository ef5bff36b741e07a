"""Comparison helpers shared by the parity tests.

Weights after AdamW are held to a bound derived per tensor, not a fixed number. AdamW's step
lr·m̂/(√v̂ + ε) divides each gradient by its own size, so float32 round-off in a gradient
reaches the weights magnified wherever a gradient is small beside its tensor's others (up to
±lr per step where it is within round-off of zero, ~lr·δ/|g| where it is not); which elements
those are, and how the kernels round, differs per instruction set: a bar tuned on one machine
failed on another (AVX-512: 1.1e-5 to 1.7e-5 against 1e-5). So the reference gets twins
(tests/parity.reference_case), each a sample of what round-off does to this trajectory, on this
machine, after these steps with this lr and Adam's ε:
- the same run in float64 from the float32 initial weights: the float32 run's distance to it is
  the round-off this trajectory actually carries;
- three float32 runs (CADNA's three samples) with noise of u·√N of each grad's RMS added to
  every nonzero grad element
  (N the step's tokens: the random-walk size of a float32 sum's error, Higham §4.2; stochastic
  arithmetic's way of sampling round-off): it samples the heavy tail, the near-zero grads that
  AdamW flips, which one float64 comparison may miss (compiled GPT-2 lay 64× further from
  float64 than eager GPT-2, one flipped element, docs/benchmarks/2026-11-28-tolerances-two-isas-
  cpu.md).
A run that only sums in another order (a mesh, a compiled graph, another ISA's kernels) is
float32 round-off of the same math too, so by the triangle inequality it lies within (1 + c) of
the twins' spread; ROUNDOFF_K = 4 allows c = 3. The fixed PARITY_REL·‖ref‖ stays as the floor,
and a wrong gradient (a dropped row, a 1e-3 error in one tensor's grad) still lands orders above
the bound (tests/test_tolerance.py).
"""

import torch

PARITY_REL = 1e-5  # the floor of every bound: relative 1e-5 in float32
ROUNDOFF_K = 4  # ‖run − ref‖ ≤ K·max ‖ref − twin‖ (+ the floor): module docstring


def rel_error(actual: torch.Tensor, expected: torch.Tensor, reach: float = 0.0) -> float:
    """‖actual − expected‖ / max(‖expected‖, reach·√numel) (Frobenius), 0 when both are zero.

    Per-tensor norms rather than per-element ratios: AdamW's first steps divide each gradient
    by its own magnitude, so an element whose gradient is ~1e-8 moves by ±lr on round-off alone.
    `reach` (lr × steps: AdamW's normalised step moves an element by at most ~lr) keeps a
    zero-initialised tensor (a bias) from being judged against its own tiny norm: its whole
    value is a few updates, and one element whose gradient cancels to ~1e-3 of the others'
    carries float32 round-off of ~1e-4 into its update (seen: Seq1F1B's per-segment sums, seed
    1234, q-bias error 5.6e-8 on a value of 2.8e-4). A wrong gradient still moves the update
    by ~lr per element, far above the bar.
    """
    diff = (actual.double() - expected.double()).norm().item()
    scale = _scale(expected, reach)
    return diff / scale if scale else diff


def _scale(expected: torch.Tensor, reach: float) -> float:
    return max(expected.double().norm().item(), reach * expected.numel() ** 0.5)


def assert_rel_close(
    actual, expected, rel: float = PARITY_REL, name: str = "", reach: float = 0.0
) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = rel_error(actual, expected, reach)
    assert err <= rel, f"{name}: relative error {err:.3e} > {rel:.0e}"


def roundoff_bound(expected: torch.Tensor, exact, rel: float, reach: float) -> float:
    """The absolute Frobenius bound on ‖actual − expected‖ for one tensor: rel·max(‖expected‖,
    reach·√n) plus ROUNDOFF_K × the float32 reference's largest distance to its twins `exact`
    (a tensor or a list: the float64 run, the round-off-noise run; module docstring); without
    `exact`, the floor alone."""
    bound = rel * _scale(expected, reach)
    twins = [] if exact is None else exact if isinstance(exact, list) else [exact]
    spread = max((expected.double() - t.double()).norm().item() for t in twins) if twins else 0
    return bound + ROUNDOFF_K * spread


def _twins(exact) -> list[dict]:
    """`exact` as a list of twins' weights (one dict, or reference_case's list)."""
    return exact if isinstance(exact, list) else [exact]


def state_ratios(
    actual: dict, expected: dict, rel: float = PARITY_REL, reach: float = 0.0, exact=None
) -> dict:
    """{name: ‖actual − expected‖ / roundoff_bound}: every one must be <= 1."""
    assert sorted(actual) == sorted(expected)
    out = {}
    for name, ref in expected.items():
        assert actual[name].shape == ref.shape, f"{name}: shape {actual[name].shape}"
        twins = None if exact is None else [t[name] for t in _twins(exact)]
        bound = roundoff_bound(ref, twins, rel, reach)
        diff = (actual[name].double() - ref.double()).norm().item()
        out[name] = diff / bound if bound else (0.0 if diff == 0 else float("inf"))
    return out


def assert_state_close(
    actual: dict, expected: dict, rel: float = PARITY_REL, reach: float = 0.0, exact=None
) -> None:
    """Every tensor within its bound: `rel` of its norm (see rel_error for `reach`, the most
    AdamW moves an element), plus, given the float64 reference `exact`, ROUNDOFF_K times the
    float32 reference's own round-off (module docstring)."""
    ratios = state_ratios(actual, expected, rel, reach, exact)
    worst = max(ratios, key=ratios.get, default=None)
    if worst is not None and ratios[worst] > 1.0:
        err = rel_error(actual[worst], expected[worst], reach)
        raise AssertionError(
            f"{worst}: relative error {err:.3e}, {ratios[worst]:.2f}× its bound "
            f"({rel:.0e} + {ROUNDOFF_K}× the reference's float32 round-off)"
        )
