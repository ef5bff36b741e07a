"""Comparison helpers shared by the parity tests."""

import torch

PARITY_REL = 1e-5  # design.md: relative 1e-5 in float32


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ (Frobenius), 0 when both are zero.

    Per-tensor norms rather than per-element ratios: AdamW's first steps divide each gradient
    by its own magnitude, so an element whose gradient is ~1e-8 moves by ±lr on round-off alone.
    """
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale else diff


def assert_rel_close(actual, expected, rel: float = PARITY_REL, name: str = "") -> None:
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != {expected.shape}"
    err = rel_error(actual, expected)
    assert err <= rel, f"{name}: relative error {err:.3e} > {rel:.0e}"


def assert_state_close(actual: dict, expected: dict, rel: float = PARITY_REL) -> None:
    assert sorted(actual) == sorted(expected)
    for name in expected:
        assert_rel_close(actual[name], expected[name], rel, name)
