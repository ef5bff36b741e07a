"""The study file and its points (megapipe/study/__init__.py).

    name: tiny-weak                # default: the file's stem
    base: ../tiny.yaml             # the training config, relative to this file
    overrides: {train.lr: 0.003}   # for every point (dotted keys)
    kind: weak                     # weak: global batch grows with dp; strong: fixed
    steps: 6                       # steps each point trains
    warmup: 2                      # first steps left out of the measurements
    cluster: cpu                   # perf/clusters profile for the projections
    launcher: {kind: local}        # local | slurm | command (launchers.py); slurm: devices
                                   # gpu | cpu (CPU partitions: no GPU request, gloo)
    points:                        # measured: nodes × devices per node, a mesh or auto
      - {nodes: 1, devices_per_node: 1, mesh: {dp: 1}}
      - {nodes: 2, devices_per_node: 2, mesh: {dp: 2, pp: 2, microbatches: 2}}
      - {nodes: 4, devices_per_node: 8, mesh: auto}
    projected:                     # projected only (beyond the largest measured point)
      - {nodes: 8, devices_per_node: 2, mesh: {dp: 8, pp: 2}}

Weak scaling keeps the batch per data-parallel replica: a point's `train.global_batch` is the
base's times its dp over the first point's dp (an `auto` point: times its device count over the
first point's, since the planner picks dp). Every error is one line naming the file and key.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from megapipe.config import Config, ConfigError, load_config
from megapipe.config.load import read_yaml_mapping
from megapipe.perf import ClusterError, load_cluster
from megapipe.perf.search import SEARCHED, PlanError, search

KINDS = ("weak", "strong")
LAUNCHERS = ("local", "slurm", "command")
MESH_KEYS = ("dp", "pp", "cp", "tp", "vpp", "schedule", "microbatches", "sequence_parallel",
             "zero", "seq_segments", "zb_memory")  # fmt: skip
TOP_KEYS = {"name", "base", "overrides", "kind", "steps", "warmup", "cluster", "launcher",
            "points", "projected", "timeout_s"}  # fmt: skip
POINT_KEYS = {"nodes", "devices_per_node", "mesh", "name", "overrides"}
# keys the study sets itself on every point: a user value would be silently replaced
OWNED = ("run.dir", "train.steps")


class StudyError(ValueError):
    """A bad study file: one line naming the file, the key and the fix."""


@dataclass
class Point:
    """One point: where it runs, the overrides of the base config that make it, and either its
    resolved config or the one-line error that keeps it from running."""

    index: int
    name: str
    nodes: int
    devices_per_node: int
    mesh: str  # "auto" or the mesh as given, e.g. "dp=2 pp=2"
    overrides: list[str]  # section.key=value, applied after the study's own overrides
    projected_only: bool = False
    cfg: Config | None = None
    error: str | None = None

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index, "name": self.name, "nodes": self.nodes,
            "devices_per_node": self.devices_per_node, "world": self.world, "mesh": self.mesh,
            "overrides": self.overrides, "projected_only": self.projected_only,
            "error": self.error,
        }  # fmt: skip


@dataclass
class Study:
    path: str
    name: str
    base: str  # the base config's path (absolute)
    overrides: list[str]
    kind: str
    steps: int
    warmup: int
    cluster: str
    launcher: dict[str, Any]
    timeout_s: float
    points: list[Point] = field(default_factory=list)  # measured, then projected only

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path, "name": self.name, "base": self.base, "overrides": self.overrides,
            "kind": self.kind, "steps": self.steps, "warmup": self.warmup,
            "cluster": self.cluster, "launcher": self.launcher, "timeout_s": self.timeout_s,
            "points": [p.to_dict() for p in self.points],
        }  # fmt: skip

    def point_overrides(self, point: Point, run_dir: str) -> list[str]:
        """Everything a point's training run is given after `--config base`, in order."""
        return [*self.overrides, *point.overrides, f"train.steps={self.steps}",
                f"run.dir={run_dir}"]  # fmt: skip


def _fail(path: str, where: str, message: str) -> StudyError:
    return StudyError(f"{path}: {where}: {message}")


def _value(value: Any) -> str:
    """A YAML value as `--section.key=value` spells it (load.apply_override reads it back)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _dotted(path: str, where: str, raw: Any) -> list[str]:
    if raw is None:
        return []
    if not isinstance(raw, dict) or not all(isinstance(k, str) and "." in k for k in raw):
        raise _fail(path, where, "must map dotted keys to values, e.g. {train.lr: 0.001}")
    for key in raw:
        if key in OWNED:
            raise _fail(path, where, f"{key} is set by the study (steps: / --out); remove it")
    return [f"{k}={_value(v)}" for k, v in raw.items()]


def _positive(path: str, where: str, raw: Any, low: int = 1) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < low:
        raise _fail(path, where, f"must be an integer >= {low}, got {raw!r}")
    return raw


def _read(path: str) -> dict[str, Any]:
    raw = read_yaml_mapping(
        path, StudyError, "study file", "pass an existing STUDY.yaml",
        "the top level must be a mapping (name, base, points, ...)",
    )  # fmt: skip
    unknown = sorted(set(raw) - TOP_KEYS)
    if unknown:
        raise _fail(path, unknown[0], f"unknown key; use one of {', '.join(sorted(TOP_KEYS))}")
    return raw


def _launcher(path: str, raw: Any) -> dict[str, Any]:
    raw = {"kind": "local"} if raw is None else raw
    if not isinstance(raw, dict) or raw.get("kind") not in LAUNCHERS:
        raise _fail(path, "launcher.kind", f"must be one of {', '.join(LAUNCHERS)}")
    if raw["kind"] == "command" and not isinstance(raw.get("template"), str):
        raise _fail(path, "launcher.template", "the command launcher needs a template string")
    if raw.get("devices", "gpu") not in ("gpu", "cpu"):  # launchers.DEVICES (slurm)
        raise _fail(path, "launcher.devices", "must be gpu (GPU request, NCCL) or cpu (gloo)")
    return dict(raw)


def load_study(path: str) -> Study:
    """The study file read and checked, its points resolved (a point that cannot run keeps its
    error in `Point.error`; a bad study file raises StudyError)."""
    raw = _read(path)
    for key in ("base", "points"):
        if key not in raw:
            raise _fail(path, key, "missing; see configs/studies/ for examples")
    base = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), raw["base"]))
    if not os.path.isfile(base):
        raise _fail(path, "base", f"config '{base}' not found; give a path relative to the study")
    kind = raw.get("kind", "strong")
    if kind not in KINDS:
        raise _fail(path, "kind", f"must be weak or strong, got {kind!r}")
    steps = _positive(path, "steps", raw.get("steps", 6))
    warmup = _positive(path, "warmup", raw.get("warmup", 1), low=0)
    if warmup >= steps:
        raise _fail(path, "warmup", f"{warmup} leaves no measured step of {steps}; lower it")
    cluster = str(raw.get("cluster", "cpu"))
    try:
        load_cluster(cluster)
    except ClusterError as e:
        raise _fail(path, "cluster", str(e)) from None
    study = Study(
        path=os.path.abspath(path),
        name=str(raw.get("name") or os.path.splitext(os.path.basename(path))[0]),
        base=base,
        overrides=_dotted(path, "overrides", raw.get("overrides")),
        kind=kind,
        steps=steps,
        warmup=warmup,
        cluster=cluster,
        launcher=_launcher(path, raw.get("launcher")),
        timeout_s=float(raw.get("timeout_s", 1800)),
    )
    try:
        base_cfg = load_config(base, study.overrides)
    except ConfigError as e:
        raise _fail(path, "base/overrides", str(e)) from None
    measured, projected = raw["points"], raw.get("projected") or []
    if not isinstance(measured, list) or not measured or not isinstance(projected, list):
        raise _fail(path, "points", "must be a non-empty list of {nodes, devices_per_node, mesh}")
    items = [(p, False) for p in measured] + [(p, True) for p in projected]
    study.points = _resolve(study, base_cfg, items)
    return study


def _mesh_overrides(path: str, where: str, mesh: Any) -> tuple[str, list[str]]:
    """("auto", []) or the mesh's label and its parallel.* overrides."""
    if mesh == "auto":
        return "auto", []
    if not isinstance(mesh, dict) or not mesh:
        raise _fail(path, where, "must be 'auto' or a mapping such as {dp: 2, pp: 2}")
    out = []
    for key, value in mesh.items():
        if key not in MESH_KEYS:
            raise _fail(path, where, f"unknown key {key!r}; use {', '.join(MESH_KEYS)}")
        out.append(f"parallel.{key}={_value(value)}")
    return " ".join(f"{k}={_value(v)}" for k, v in mesh.items()), out


def _point_name(index: int, nodes: int, dpn: int, label: str) -> str:
    short = label.replace("microbatches", "mb").replace("schedule=", "")
    slug = re.sub(r"[^A-Za-z0-9]+", "", short.replace("=", ""))[:24]
    return f"{index:02d}-n{nodes}x{dpn}-{slug}"


def _resolve(study: Study, base_cfg: Config, items: list[tuple[Any, bool]]) -> list[Point]:
    path, points = study.path, []
    first: tuple[int, int] | None = None  # (dp, world) of the first point, for weak scaling
    for i, (raw, projected_only) in enumerate(items):
        where = f"{'projected' if projected_only else 'points'}[{i}]"
        if not isinstance(raw, dict) or set(raw) - POINT_KEYS:
            raise _fail(path, where, f"must be a mapping of {', '.join(sorted(POINT_KEYS))}")
        nodes = _positive(path, f"{where}.nodes", raw.get("nodes"))
        dpn = _positive(path, f"{where}.devices_per_node", raw.get("devices_per_node"))
        label, mesh = _mesh_overrides(path, f"{where}.mesh", raw.get("mesh"))
        extra = _dotted(path, f"{where}.overrides", raw.get("overrides"))
        name = str(raw.get("name") or _point_name(i, nodes, dpn, label))
        point = Point(i, name, nodes, dpn, label, [*mesh, *extra], projected_only)
        try:
            dp = _dp_of(base_cfg, point)
            if first is None:
                first = (dp, point.world)
            if study.kind == "weak":
                point.overrides.append(_weak_batch(base_cfg, point, dp, first))
            point.cfg = _config(study, point)
        except (ConfigError, PlanError, ClusterError) as e:
            point.error = str(e).splitlines()[0]
        points.append(point)
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise _fail(path, "points", "two points have the same name; give each a unique name")
    return points


def _dp_of(base_cfg: Config, point: Point) -> int:
    if point.mesh == "auto":
        return 0  # unknown until the planner runs; weak scaling goes by device count
    dp = [o for o in point.overrides if o.startswith("parallel.dp=")]
    return int(dp[-1].split("=", 1)[1]) if dp else base_cfg.parallel.dp


def _weak_batch(base_cfg: Config, point: Point, dp: int, first: tuple[int, int]) -> str:
    gb = base_cfg.train.global_batch
    num, den = (point.world, first[1]) if point.mesh == "auto" or not first[0] else (dp, first[0])
    if (gb * num) % den:
        raise ConfigError(
            f"weak scaling: train.global_batch {gb} × {num}/{den} is not a whole number; "
            "give the base a global batch divisible by the first point's dp"
        )
    return f"train.global_batch={gb * num // den}"


def _config(study: Study, point: Point) -> Config:
    """The point's resolved config (ConfigError when a rule or the world size breaks); under
    `auto` the planner's best mesh for the point's devices, its keys added to the overrides."""
    cfg = load_config(study.base, [*study.overrides, *point.overrides])
    if point.mesh == "auto":
        cluster = load_cluster(study.cluster, point.devices_per_node)
        best = search(cfg, point.world, cluster).best
        chosen = [f"{key}={_value(_get(best.config, key))}" for key in SEARCHED]
        point.overrides = [*chosen, *point.overrides]
        p = best.config.parallel
        point.mesh = f"auto: dp{p.dp} pp{p.pp} cp{p.cp} tp{p.tp}"
        cfg = load_config(study.base, [*study.overrides, *point.overrides])
    if cfg.derived.world_size != point.world:
        p = cfg.parallel
        raise ConfigError(
            f"mesh dp·pp·cp·tp = {p.dp}·{p.pp}·{p.cp}·{p.tp} = {cfg.derived.world_size} != "
            f"{point.nodes} nodes × {point.devices_per_node} devices = {point.world}; "
            "change the point's mesh or its nodes/devices_per_node"
        )
    return cfg


def _get(cfg: Config, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)
