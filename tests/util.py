"""Comparison helpers shared by the parity tests."""

import torch

PARITY_REL = 1e-5  # docs/architecture.md: relative 1e-5 in float32


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
    scale = max(expected.double().norm().item(), reach * expected.numel() ** 0.5)
    return diff / scale if scale else diff


def assert_rel_close(
    actual, expected, rel: float = PARITY_REL, name: str = "", reach: float = 0.0
) -> None:
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = rel_error(actual, expected, reach)
    assert err <= rel, f"{name}: relative error {err:.3e} > {rel:.0e}"


def assert_state_close(
    actual: dict, expected: dict, rel: float = PARITY_REL, reach: float = 0.0
) -> None:
    """Every tensor within `rel` (see rel_error for `reach`, the most AdamW moves an element)."""
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert_rel_close(actual[name], expected[name], rel, name, reach)
