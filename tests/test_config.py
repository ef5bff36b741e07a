import pytest

from megapipe.config import ConfigError, load_config, write_config
from tests.conftest import TINY


def test_yaml_and_overrides_later_wins(tmp_path):
    cfg = load_config(TINY, ["--train.lr=0.01", "train.lr=0.02", "model.tie_embeddings=false"])
    assert cfg.train.lr == 0.02
    assert cfg.model.tie_embeddings is False
    assert cfg.model.d_model == 32  # from the file


def test_int_accepted_for_float_key():
    assert load_config(TINY, ["train.lr=1"]).train.lr == 1.0


def test_derived_values():
    cfg = load_config(TINY, ["parallel.dp=2", "parallel.microbatches=2", "train.global_batch=8"])
    d = cfg.derived
    assert d.micro_batch_size == 2 and d.local_batch == 4
    assert d.tokens_per_step == 8 * cfg.model.seq_len
    assert d.world_size == 2 and d.head_dim == 8 and d.n_kv_heads == 4 and d.d_ff == 128


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(TINY, ["model.n_layers=3"])
    path = tmp_path / "config.yaml"
    write_config(cfg, str(path))
    assert load_config(str(path)) == cfg


@pytest.mark.parametrize(
    "override, expected",
    [
        ("model.bogus=1", "unknown key 'model.bogus'"),
        ("nosuch.key=1", "unknown section 'nosuch'"),
        ("train.steps=abc", "'train.steps' must be int"),
        ("model.tie_embeddings=3", "'model.tie_embeddings' must be bool"),
        ("train.steps=true", "'train.steps' must be int"),
        ("model.n_heads=5", "model.n_heads=5 must divide model.d_model=32"),
        ("model.n_kv_heads=3", "model.n_kv_heads=3 must divide model.n_heads=4"),
        ("model.arch=bert", "model.arch='bert' is not one of"),
        ("parallel.microbatches=3", "train.global_batch=8 must be divisible by"),
        ("parallel.schedule=foo", "parallel.schedule='foo' is not one of"),
        ("recompute.mode=some", "recompute.mode='some' is not one of"),
        ("recompute.modules=core_attn,moe", "'moe' is not one of core_attn, mlp"),
        ("train.stop_at_step=99", "train.stop_at_step=99 must be in"),
        ("data.source=memmap", "data.source=memmap needs data.path"),
        ("train.dtype=float16", "train.dtype='float16' is not one of"),
        ("model.dropout=1.5", "model.dropout must be in [0, 1)"),
        ("badformat", "must look like --section.key=value"),
    ],
)
def test_config_errors_are_one_line_and_name_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_unknown_key_in_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  n_layer: 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown key 'model.n_layer'"):
        load_config(str(bad))


def test_missing_and_malformed_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "broken.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(bad))


def test_train_cli_prints_one_line_error(tmp_path, capsys):
    import train

    code = train.main(["--config", TINY, "--model.n_heads=5", f"--run.dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: model.n_heads=5") and "\n" not in err


def test_too_many_pipeline_stages_is_a_config_error():
    with pytest.raises(ConfigError, match="stages") as err:
        load_config(TINY, ["parallel.pp=3", "parallel.vpp=2"])  # 6 stages, 2 layers + E + L
    assert "\n" not in str(err.value)


def test_bad_balance_layout_is_a_config_error():
    with pytest.raises(ConfigError, match="E,t"):
        load_config(TINY, ["parallel.pp=2", "parallel.balance=E,t|L"])  # drops a layer


def test_float_written_without_a_dot_is_a_float(tmp_path):
    """YAML 1.1 reads `3e-4` as a string; a float key must still take it."""
    cfg = load_config(TINY, ["train.lr=3e-4", f"run.dir={tmp_path}"])
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    with pytest.raises(ConfigError, match="'train.lr' must be float, got str 'fast'"):
        load_config(TINY, ["train.lr=fast"])
