"""The GPU profiles' own achievable rates (megapipe/perf/clusters/*.yaml, cluster.Cluster).

The H100 and H200 profiles state e_max, κ, μ and the attention kernels' rates read from
published H100 measurements; the cost model prices with them in place of Table 1's fit, each
where the profile states it (a profile without one keeps the fit's). The A100 profile states
none, so it and Table 1 keep the fit. Changing a profile's YAML changes the projection: the
constants are read, not decorative.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from megapipe.config import load_config
from megapipe.perf import MEGAPIPE, load_cluster, project
from megapipe.perf.cluster import CLUSTER_DIR, ClusterError
from megapipe.perf.cost_terms import CALIBRATION, shapes
from megapipe.perf.costs import CostModel

OWN = ("gemm_efficiency", "gemm_knee", "memory_efficiency", "attention_efficiency",
       "cudnn_attention_efficiency")  # fmt: skip


def _raw(name: str) -> dict:
    return yaml.safe_load((CLUSTER_DIR / f"{name}.yaml").read_text())


def _llama(*overrides):
    """A Llama of d=2048 at 8192 tokens, bf16 without dropout: the fused attention path, with
    attention a large share of the step."""
    return load_config(
        None,
        ["model.arch=llama", "model.n_layers=4", "model.d_model=2048", "model.n_heads=16",
         "model.n_kv_heads=8", "model.vocab_size=32000", "model.seq_len=8192",
         "model.dropout=0.0", "train.dtype=bfloat16", *overrides],
    )  # fmt: skip


def _with(tmp_path, name: str, **values) -> str:
    """A copy of profile `name` with `values` set (None: the key removed)."""
    raw = {**_raw(name), **values}
    raw = {k: v for k, v in raw.items() if v is not None}
    path = tmp_path / f"{name}_{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a100_keeps_the_table1_fit():
    raw = _raw("a100")
    assert not set(OWN) & set(raw)  # the fit is A100's: nothing to replace it with
    a100 = load_cluster("a100")
    assert a100.calibration(CALIBRATION) == CALIBRATION
    cm = CostModel(_llama(), a100, MEGAPIPE, CALIBRATION)
    assert cm.dev.cal == CALIBRATION


@pytest.mark.parametrize("name", ["h100", "h200"])
def test_hopper_profiles_load_their_own_constants(name):
    raw, cluster = _raw(name), load_cluster(name)
    cal = cluster.calibration(CALIBRATION)
    assert cal.gemm == raw["gemm_efficiency"] != CALIBRATION.gemm
    assert cal.memory == raw["memory_efficiency"] != CALIBRATION.memory
    assert cal.knee == raw["gemm_knee"] != CALIBRATION.knee
    assert CostModel(_llama(), cluster, MEGAPIPE, CALIBRATION).dev.cal == cal
    assert cluster.attention_factor("flash") == raw["attention_efficiency"]
    assert cluster.attention_factor("cudnn") == raw["cudnn_attention_efficiency"]
    # H100 measurements give the Hopper kernels' rates: cuDNN's attention beats FA2's
    assert 0 < raw["attention_efficiency"] < raw["cudnn_attention_efficiency"] < 1


@pytest.mark.parametrize(
    "key, scale, kernel",
    [("gemm_efficiency", 0.8, "auto"), ("memory_efficiency", 0.8, "auto"),
     ("cudnn_attention_efficiency", 0.8, "auto"),  # megapipe's own kernel on Hopper
     ("attention_efficiency", 0.8, "flash"), ("gemm_knee", 2.0, "auto")],
)  # fmt: skip
def test_changing_the_h100_yaml_changes_the_projection(tmp_path, key, scale, kernel):
    cfg, rt = _llama(), dataclasses.replace(MEGAPIPE, attention_kernel=kernel)
    base = project(cfg, load_cluster("h100"), rt, memory=False).step_time_s
    value = (_raw("h100").get(key) or CALIBRATION.knee) * scale
    changed = project(cfg, load_cluster(_with(tmp_path, "h100", **{key: value})), rt, memory=False)
    assert changed.step_time_s > base * 1.005, key  # slower rates: a longer step


def test_h100_without_its_constants_is_priced_as_before(tmp_path):
    """The profile with its own keys removed is priced on the fit, as every profile was before
    it had measurements: the rates, not the datasheet terms, moved the projection."""
    cfg = _llama()
    bare = load_cluster(_with(tmp_path, "h100", **dict.fromkeys(OWN)))
    assert bare.calibration(CALIBRATION) == CALIBRATION and bare.attention_factor("flash") == 1
    own = project(cfg, load_cluster("h100"), memory=False).step_time_s
    fit = project(cfg, bare, memory=False).step_time_s
    assert own != pytest.approx(fit, rel=0.01)


def test_cudnn_kernel_prices_attention_faster_on_h100():
    cfg, h100 = _llama(), load_cluster("h100")
    flash = CostModel(cfg, h100, dataclasses.replace(MEGAPIPE, attention_kernel="flash"),
                      CALIBRATION)  # fmt: skip
    cudnn = CostModel(cfg, h100, dataclasses.replace(MEGAPIPE, attention_kernel="cudnn"),
                      CALIBRATION)  # fmt: skip
    assert flash.attention == "fused"
    x = shapes(cfg)
    (f_flash, b_flash), (f_cudnn, b_cudnn) = flash.attention_seconds(x), cudnn.attention_seconds(x)
    ratio = h100.cudnn_attention_efficiency / h100.attention_efficiency
    assert f_flash / f_cudnn == pytest.approx(ratio) and b_flash / b_cudnn == pytest.approx(ratio)


def test_negative_constant_is_one_line(tmp_path):
    path = _with(tmp_path, "h100", memory_efficiency=-0.5)
    with pytest.raises(ClusterError, match="memory_efficiency must be >= 0"):
        load_cluster(path)


def test_compute_capability_of_each_gpu_profile(tmp_path):
    """Each GPU profile states its compute capability (the attention kernel megapipe runs
    there, runtime.resolved_for); a malformed one is a one-line error."""
    caps = {name: load_cluster(name).capability for name in ("a100", "h100", "h200")}
    assert caps == {"a100": (8, 0), "h100": (9, 0), "h200": (9, 0)}
    assert load_cluster("cpu").capability is None
    with pytest.raises(ClusterError, match='compute_capability must read like "9.0"') as err:
        load_cluster(_with(tmp_path, "h100", compute_capability="sm90"))
    assert "\n" not in str(err.value)
