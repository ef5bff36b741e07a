"""`train.init_from_hf=DIR`: a run that starts from a transformers directory (docs/models.md).

Two steps, each done once:
- `with_hf_model(cfg)`: DIR/config.json (read by transformers' AutoConfig, local files only,
  never `trust_remote_code`) sets the model's architecture keys through models/hf.py's
  config_from_hf. The run's own keys (RUN_KEYS: the training context, dropout, the MoE loss
  weights and capacity, aux-loss-free balancing's rate, multi-token prediction's depths and
  weight) stay as configured; any other model key that the config sets to a
  value other than its default and other than config.json's is a one-line ConfigError, so a
  run never silently trains another shape than the one it names.
- `load_hf_weights(chunks, DIR, model)`: every parameter of this rank's chunks is read from
  the safetensors files by its HF names (models/hf.py's tables, DeepSeek-V3's in
  models/hf_deepseek.py with its RoPE rows de-interleaved and its selection bias), only the rows
  this rank holds (safetensors' `get_slice`: its tp shard along the split dim, its ep experts
  along dim 0), so no rank reads the whole model (torchtitan's `initial_load_in_hf` does the
  same by DTensor).
The directory is data, never code: a pickled `pytorch_model.bin` is refused by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch
from safetensors import safe_open

from megapipe.config import Config, ConfigError, ModelConfig
from megapipe.config.checks import validate
from megapipe.models import hf_deepseek
from megapipe.models.hf import config_from_hf, hf_names, table_of
from megapipe.models.hf_deepseek import rope_rows
from megapipe.models.moe import routing_biases
from megapipe.parallel.expert.sharding import expert_offset, is_expert
from megapipe.parallel.tensor.layers import sharded_params

RUN_KEYS = (
    "seq_len",
    "dropout",
    "moe_aux_coef",
    "moe_z_coef",
    "moe_capacity_factor",
    "moe_bias_update_rate",
    "mtp_layers",
    "mtp_loss_coef",
)
# transformers keeps a MoE layer's experts stacked in memory but saves (and the released
# checkpoints hold) one tensor per expert: stacked name -> the names of expert {j}'s rows,
# Qwen3-MoE's, then Mixtral's (its conversion_mapping.py); gate_up is [gate | up].
PER_EXPERT = {
    "mlp.experts.gate_up_proj": (
        ("mlp.experts.{j}.gate_proj.weight", "mlp.experts.{j}.up_proj.weight"),
        ("block_sparse_moe.experts.{j}.w1.weight", "block_sparse_moe.experts.{j}.w3.weight"),
    ),
    "mlp.experts.down_proj": (
        ("mlp.experts.{j}.down_proj.weight",),
        ("block_sparse_moe.experts.{j}.w2.weight",),
    ),
}
SAVED_AS = {"mlp.gate.weight": "block_sparse_moe.gate.weight"}  # Mixtral's router on disk
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def with_hf_model(cfg: Config) -> Config:
    """`cfg` with the model keys of train.init_from_hf's config.json (unchanged without it)."""
    src = cfg.train.init_from_hf
    if not src:
        return cfg
    hf = _model_config(src)
    default, fields = ModelConfig(), {}
    for f in dataclasses.fields(ModelConfig):
        ours, theirs = getattr(cfg.model, f.name), getattr(hf, f.name)
        if f.name in RUN_KEYS or ours == theirs:
            fields[f.name] = ours
            continue
        if ours != getattr(default, f.name):
            raise ConfigError(
                f"model.{f.name}={ours} conflicts with {src}/config.json ({theirs}); drop "
                f"model.{f.name}: train.init_from_hf sets it"
            )
        fields[f.name] = theirs
    out = dataclasses.replace(cfg, model=ModelConfig(**fields))
    validate(out)
    return out


def _model_config(src: str) -> ModelConfig:
    from transformers import AutoConfig  # the HF extra's import, as models/hf.py's

    if not (Path(src) / "config.json").is_file():
        raise ConfigError(f"train.init_from_hf={src}: no config.json there; give a HF model dir")
    try:
        hf = AutoConfig.from_pretrained(src, local_files_only=True, trust_remote_code=False)
        return config_from_hf(hf)
    except ValueError as err:  # config_from_hf's one line, or transformers' own
        line = str(err).strip().splitlines()[0]
        raise ConfigError(f"train.init_from_hf={src}: {line}") from None


class HFFiles(contextlib.ExitStack):
    """The safetensors files of a directory, opened lazily: tensor name -> its slice."""

    def __init__(self, src: str) -> None:
        super().__init__()
        self.src, root = src, Path(src)
        if (root / INDEX).is_file():
            self.where = json.loads((root / INDEX).read_text())["weight_map"]
        elif (root / SINGLE).is_file():
            with safe_open(root / SINGLE, framework="pt") as f:
                self.where = dict.fromkeys(f.keys(), SINGLE)
        else:
            pickled = sorted(p.name for p in root.glob("*.bin"))
            found = f" ({', '.join(pickled)} is pickled: megapipe reads safetensors only)"
            raise ConfigError(
                f"train.init_from_hf={src}: no {SINGLE} or {INDEX}{found if pickled else ''}; "
                "save it with save_pretrained(safe_serialization=True)"
            )
        self.opened: dict[str, object] = {}

    def part(self, name: str, transpose: bool):
        """The HF tensor `name`, stored whole or (stacked experts) one tensor per expert."""
        prefix, _, leaf = name.rpartition(".mlp.")
        if name not in self.where and "mlp." + leaf in PER_EXPERT:
            for pattern in PER_EXPERT["mlp." + leaf]:
                if f"{prefix}.{pattern[0].format(j=0)}" in self.where:
                    return _ExpertStack(self, name, [f"{prefix}.{p}" for p in pattern])
        if name not in self.where and "mlp." + leaf in SAVED_AS:
            name = f"{prefix}.{SAVED_AS['mlp.' + leaf]}"
        return _Part(self.slice(name), name, transpose)

    def slice(self, name: str):
        if name not in self.where:
            raise ConfigError(f"train.init_from_hf={self.src}: tensor {name} is missing")
        file = self.where[name]
        if file not in self.opened:
            path = Path(self.src) / file
            self.opened[file] = self.enter_context(safe_open(path, framework="pt"))
        return self.opened[file].get_slice(name)


# megapipe's modules that transformers' classes do not hold: multi-token prediction
# (model.mtp_layers, models/mtp.py) keeps the run's own seeded initialization
NOT_IN_HF = ("mtp.",)


@torch.no_grad()
def load_hf_weights(chunks, src: str, model: ModelConfig) -> None:
    """Copy into this rank's chunks their shards of the weights in `src` (module docstring);
    NOT_IN_HF's modules keep their initialization."""
    with HFFiles(src) as files:
        for chunk in chunks:
            for name, param, shape, spec, tp in sharded_params(chunk):
                if name.startswith(NOT_IN_HF):
                    continue
                parts = _parts(files, model, name)
                _check_shapes(src, name, parts, shape)
                param.copy_(_local(parts, param, shape, spec, tp))
            for name, buf, _ in routing_biases(chunk):  # DeepSeek-V3's selection bias, whole
                if name.startswith(NOT_IN_HF):
                    continue
                (part,) = _parts(files, model, name)
                _check_shapes(src, name, [part], buf.shape)
                buf.copy_(part.read(0, 0, buf.shape[0]))


def _parts(files: HFFiles, model: ModelConfig, name: str) -> list:
    """The HF tensors of our `name`; DeepSeek-V3's by models/hf_deepseek.py's table, its
    interleaved RoPE rows (config.json's rope_interleave, transformers' default true) read
    de-interleaved as hf_deepseek.load_hf does."""
    if model.arch != "deepseek_v3":
        names, transpose = hf_names(table_of(model), name)
        return [files.part(n, transpose) for n in names]
    parts = [files.part(n, False) for n in hf_deepseek.hf_names(model, name)]
    config = json.loads((Path(files.src) / "config.json").read_text())
    order = rope_rows(model, name, parts[0].shape[0]) if len(parts) == 1 else None
    if order is None or not config.get("rope_interleave", True):
        return parts
    return [_Reordered(parts[0], order)]


class _Part:
    """One HF tensor of a parameter: rows along our dim `d` are its dim `d` (1 - d for GPT-2's
    transposed Conv1D weights)."""

    def __init__(self, sl, name: str, transpose: bool) -> None:
        self.sl, self.name, self.transpose = sl, name, transpose
        hf_shape = tuple(sl.get_shape())
        self.shape = hf_shape[::-1] if transpose else hf_shape  # in our orientation

    def read(self, dim: int, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) along our `dim`, in our orientation, float32."""
        hf_dim = len(self.shape) - 1 - dim if self.transpose else dim
        index = [slice(None)] * len(self.shape)
        index[hf_dim] = slice(lo, hi)
        value = self.sl[tuple(index)]
        return (value.t() if self.transpose else value).float()


class _Reordered:
    """A part whose rows along dim 0 are read in `order` (a permutation within each head, so a
    head-aligned tp range [lo, hi) reads only its own rows)."""

    def __init__(self, part: _Part, order: torch.Tensor) -> None:
        self.part, self.order, self.name, self.shape = part, order, part.name, part.shape

    def read(self, dim: int, lo: int, hi: int) -> torch.Tensor:
        if dim > 0:
            return self.part.read(dim, lo, hi)[self.order]
        rows = self.order[lo:hi]
        a, b = int(rows.min()), int(rows.max()) + 1
        return self.part.read(0, a, b)[rows - a]


class _ExpertStack:
    """A stacked expert tensor (E, rows, cols) read from its per-expert tensors (PER_EXPERT):
    expert j's rows are the concatenation of `patterns` formatted with j."""

    def __init__(self, files: HFFiles, name: str, patterns: list[str]) -> None:
        self.files, self.name, self.patterns = files, name, patterns
        n = 0
        while patterns[0].format(j=n) in files.where:
            n += 1
        first = [tuple(files.slice(p.format(j=0)).get_shape()) for p in patterns]
        self.shape = (n, sum(s[0] for s in first), *first[0][1:])

    def read(self, dim: int, lo: int, hi: int) -> torch.Tensor:
        """Experts [lo, hi) (dim 0: the stacked tensors are split over ep only)."""
        assert dim == 0, "stacked experts are split along the expert dim only"
        rows = []
        for j in range(lo, hi):
            parts = [self.files.slice(p.format(j=j))[:] for p in self.patterns]
            rows.append(torch.cat(parts, dim=0).float())
        return torch.stack(rows)


def _check_shapes(src: str, name: str, parts: list[_Part], shape) -> None:
    rows = sum(p.shape[0] for p in parts)
    rest = {p.shape[1:] for p in parts}
    prefix = name == "embed.pos.weight" and rows >= shape[0]  # GPT-2 positions: the first rows
    if rest != {tuple(shape[1:])} or (rows != shape[0] and not prefix):
        got = " + ".join(f"{p.name} {list(p.shape)}" for p in parts)
        raise ConfigError(
            f"train.init_from_hf={src}: {got} does not fit {name} {list(shape)}; is it this arch?"
        )


def _local(parts: list[_Part], param, shape, spec, tp) -> torch.Tensor:
    """This rank's shard of the concatenation (dim 0) of `parts`: its tp pieces along
    spec.dim (zero padding rows stay 0), its experts along dim 0 under ep."""
    out = torch.zeros(param.shape, dtype=torch.float32)
    if spec.dim is not None and tp.size > 1:
        for piece in spec.pieces(tp.size, tp.rank):
            rows = _rows(parts, spec.dim, piece.global_lo, piece.global_lo + piece.length)
            out.narrow(spec.dim, piece.local_lo, piece.length).copy_(rows)
        return out
    lo = expert_offset(param) if is_expert(param) else 0
    return out.copy_(_rows(parts, 0, lo, lo + param.shape[0]))


def _rows(parts: list[_Part], dim: int, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) along `dim` of the parts concatenated along dim 0 (one part if dim > 0)."""
    if dim > 0:
        return parts[0].read(dim, lo, hi)
    out, start = [], 0
    for part in parts:
        a, b = max(lo, start), min(hi, start + part.shape[0])
        if a < b:
            out.append(part.read(0, a - start, b - start))
        start += part.shape[0]
    return torch.cat(out, dim=0)
