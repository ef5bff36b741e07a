"""Bad values are one-line ConfigErrors naming the key and the fix: every float key finite, every
declared range (schema.py `bounded`) enforced, and the values once accepted but unusable."""

import dataclasses
import math
import re
import typing

import pytest

from megapipe.config import Config, ConfigError, from_dict, load_config
from megapipe.config.checks import validate
from megapipe.config.schema import MAX_TIMEOUT_S, bounds_of
from tests.conftest import TINY


def _error(overrides: list[str], tmp_path) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [f"run.dir={tmp_path / 'run'}", *overrides])
    message = str(err.value)
    assert "\n" not in message
    return message


def _schema_keys(kinds: tuple[type, ...]) -> list[tuple[str, dataclasses.Field]]:
    """(`section.key`, field) of every schema key whose type is one of `kinds`."""
    found = []
    for section, section_type in typing.get_type_hints(Config).items():
        types = typing.get_type_hints(section_type)
        for f in dataclasses.fields(section_type):
            if types[f.name] in kinds:
                found.append((f"{section}.{f.name}", f))
    return found


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # the general finite rule (YAML spells infinity .inf and NaN .nan)
        (["train.lr=.inf"], "train.lr must be a finite number, got inf"),
        (["train.lr=-.inf"], "train.lr must be a finite number, got -inf"),
        (["train.lr=.nan"], "train.lr must be a finite number, got nan"),
        (["parallel.timeout_s=.inf"], "parallel.timeout_s must be a finite number, got inf"),
        (["model.rope_theta=.nan"], "model.rope_theta must be a finite number, got nan"),
        # ranges declared in schema.py
        (["model.rope_theta=0"], "model.rope_theta must be > 0, got 0.0"),
        (["model.rope_theta=-1"], "model.rope_theta must be > 0, got -1.0"),
        (["model.norm_eps=0"], "model.norm_eps must be > 0, got 0.0"),
        (["train.beta1=1.5"], "train.beta1 must be in [0, 1), got 1.5"),
        (["train.beta1=-0.1"], "train.beta1 must be in [0, 1), got -0.1"),
        (["train.beta2=1"], "train.beta2 must be in [0, 1), got 1.0"),
        (["train.seed=-1"],
         "train.seed must be in [0, 4294967296) (numpy's seed range: 0 <= seed < 2**32), got -1"),
        (["train.seed=4294967296"],
         "train.seed must be in [0, 4294967296) (numpy's seed range: 0 <= seed < 2**32), "
         "got 4294967296"),
        (["parallel.timeout_s=1e10"],
         "parallel.timeout_s must be in (0, 604800] seconds (at most 7 days), got 10000000000.0"),
        (["parallel.timeout_s=0"],
         "parallel.timeout_s must be in (0, 604800] seconds (at most 7 days), got 0.0"),
        (["train.lr=0"], "train.lr must be > 0, got 0.0"),
        (["model.dropout=1.5"], "model.dropout must be in [0, 1), got 1.5"),
        (["model.n_layers=0"], "model.n_layers must be >= 1, got 0"),
        (["parallel.microbatches=0"], "parallel.microbatches must be >= 1, got 0"),
        (["model.vocab_size=1"], "model.vocab_size must be >= 2, got 1"),
        (["model.d_ff=-1"], "model.d_ff must be >= 0 (0: default), got -1"),
        (["model.n_kv_heads=-1"], "model.n_kv_heads must be >= 0 (0: model.n_heads), got -1"),
        (["train.grad_clip=-1"], "train.grad_clip must be >= 0 (0: off), got -1.0"),
        (["train.weight_decay=-0.1"], "train.weight_decay must be >= 0, got -0.1"),
        (["train.eval_interval=-1"], "train.eval_interval must be >= 0 (0: never), got -1"),
        (["train.warmup=-1"], "train.warmup must be >= 0, got -1"),
        (["checkpoint.interval=-1"], "checkpoint.interval must be >= 0 (0: off), got -1"),
        (["checkpoint.keep=0"], "checkpoint.keep must be >= 1, got 0"),
        (["log.interval=0"], "log.interval must be >= 1, got 0"),
        (["log.peak_tflops=-1"], "log.peak_tflops must be >= 0 (0: look the device up), got -1.0"),
        (["recompute.layers=-1"], "recompute.layers must be >= 0 (0: all), got -1"),
        # the two new keys
        (["train.on_nonfinite=maybe"], "train.on_nonfinite='maybe' is not one of skip, stop"),
        (["train.max_skipped=0"], "train.max_skipped must be >= 1, got 0"),
        # rules that relate keys
        (["model.arch=llama", "model.d_model=36", "model.n_heads=4"],
         "model.d_model=36 / model.n_heads=4 gives head dim 9, but llama's RoPE needs an even "
         "head dim: make model.d_model a multiple of 2·model.n_heads=8"),
        (["train.steps=10", "train.warmup=100"],
         "train.warmup=100 must be <= train.steps=10; lower it with --train.warmup=10"),
        (["train.min_lr=0.1"], "train.min_lr must be in [0, train.lr], got 0.1"),
        (["recompute.layers=3"], "recompute.layers=3 must be in [0, model.n_layers=2]"),
    ],
)  # fmt: skip
def test_bad_value_is_one_exact_line(tmp_path, overrides, expected):
    assert _error(overrides, tmp_path) == expected


def test_inf_written_without_a_dot_is_still_one_line_naming_the_key(tmp_path):
    """`inf` (not YAML's `.inf`) is a string to YAML: refused by the type check or the finite
    rule, either way on one line naming the key."""
    for text in ("inf", "nan", "-inf"):
        assert "train.lr" in _error([f"train.lr={text}"], tmp_path)


@pytest.mark.parametrize("section", ["run", "checkpoint"])
def test_dir_that_is_a_file(tmp_path, section):
    path = tmp_path / "some_file"
    path.write_text("not a directory")
    overrides = [f"run.dir={tmp_path / 'run'}", f"{section}.dir={path}"]
    with pytest.raises(ConfigError) as err:
        load_config(TINY, overrides)
    assert str(err.value) == f"{section}.dir '{path}' is a file; give a directory"
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [*overrides[:1], f"{section}.dir={path / 'sub' / 'dir'}"])
    assert str(err.value) == (
        f"{section}.dir '{path / 'sub' / 'dir'}' is inside '{path}', which is a file; "
        "give a directory"
    )


def test_dirs_that_exist_or_not_yet_are_fine(tmp_path):
    load_config(TINY, [f"run.dir={tmp_path}", f"checkpoint.dir={tmp_path / 'a' / 'b'}"])


def test_finite_rule_covers_every_float_key(tmp_path):
    floats = _schema_keys((float,))
    assert {"train.lr", "parallel.timeout_s", "model.rope_theta"} <= {n for n, _ in floats}
    for name, _ in floats:
        for text, shown in ((".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan")):
            message = _error([f"{name}={text}"], tmp_path)
            assert message == f"{name} must be a finite number, got {shown}"


def test_finite_rule_holds_for_configs_built_in_code(tmp_path):
    cfg = from_dict({"run": {"dir": str(tmp_path)}})
    cfg.train.beta2 = math.inf
    with pytest.raises(ConfigError, match=r"^train.beta2 must be a finite number, got inf$"):
        validate(cfg)


RELATED = {"train.min_lr": "[0, train.lr]", "train.stop_at_step": "[0, train.steps]"}
"""Numeric keys whose whole range depends on another key: checked in checks.py, not bounded."""


def test_every_numeric_key_has_a_declared_range():
    for name, f in _schema_keys((int, float)):
        assert (bounds_of(f) is not None) != (name in RELATED), name


def _edge(bounds, value, side: str):
    """The allowed value at one end of `bounds` (the nearest allowed one if that end is open)."""
    edge, is_open = (
        (bounds.low, bounds.low_open) if side == "low" else (bounds.high, bounds.high_open)
    )
    if edge is None:
        return value
    if not is_open:
        return type(value)(edge)
    if isinstance(value, int):
        return edge + 1 if side == "low" else edge - 1
    return math.nextafter(edge, math.inf if side == "low" else -math.inf)


@pytest.mark.parametrize("side", ["low", "high"])
def test_every_range_edge_is_accepted(tmp_path, side):
    """Every bounded key at the edge of its range at once: the config still loads."""
    raw: dict[str, dict] = {"run": {"dir": str(tmp_path)}}
    defaults = Config()
    for name, f in _schema_keys((int, float)):
        bounds = bounds_of(f)
        if bounds is None:
            continue
        section, key = name.split(".")
        value = _edge(bounds, getattr(getattr(defaults, section), key), side)
        raw.setdefault(section, {})[key] = value
    cfg = from_dict(raw)
    validate(cfg)
    if side == "high":
        assert cfg.parallel.timeout_s == MAX_TIMEOUT_S == 604800
        assert cfg.train.seed == 2**32 - 1 and cfg.train.beta1 < 1
    else:
        assert cfg.model.n_layers == 1 and cfg.train.beta1 == 0 and cfg.train.lr > 0


def test_new_keys_have_their_defaults():
    cfg = load_config(TINY)
    assert cfg.train.on_nonfinite == "skip" and cfg.train.max_skipped == 3
    assert load_config(TINY, ["train.on_nonfinite=stop"]).train.on_nonfinite == "stop"


def test_train_cli_prints_one_line_for_a_bad_value(tmp_path, capsys):
    import train

    code = train.main(["--config", TINY, "--train.beta1=1.5", f"--run.dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: train.beta1") and "\n" not in err
    assert re.fullmatch(r"error: train\.beta1 must be in \[0, 1\), got 1\.5", err)
