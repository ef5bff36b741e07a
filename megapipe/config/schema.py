"""The run configuration's schema: one dataclass per section, every key typed with a default.

Derived values (micro-batch size, tokens per step, ...) are computed once in `Config.derived`
after validation (checks.py), so no other module re-derives them. Loading is in load.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A bad config: the message is one line naming the key and the fix."""


@dataclass
class ModelConfig:
    arch: str = "gpt2"  # gpt2 | llama
    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads (multi-head attention)
    d_ff: int = 0  # 0: 4·d_model (gpt2) or the Llama 2/3·4·d rounded to 64 (llama)
    vocab_size: int = 256
    seq_len: int = 32
    tie_embeddings: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


@dataclass
class ParallelConfig:
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    vpp: int = 1  # model chunks (virtual stages) per pipeline rank
    schedule: str = "1f1b"
    microbatches: int = 1
    sequence_parallel: bool = False
    balance: str = "uniform"  # uniform | llama3 | cost | explicit layout "E,t|t,L"
    seq_segments: int = 1  # Seq1F1B segments per microbatch
    weight_sync: str = "stash"  # pipedream_async: stash | vertical (PipeDream §3.3)
    schedule_costs: str = "profile"  # zb_v: profile (2nd step) | unit | F=..,B=..,W=..
    timeout_s: float = 600.0  # a collective or p2p waiting longer on a peer (a dead rank) errors


@dataclass
class RecomputeConfig:
    mode: str = "none"  # none | full | selective (attention core only)
    layers: int = 0  # recompute only the first N layers; 0 means all


@dataclass
class TrainConfig:
    steps: int = 10
    global_batch: int = 8  # sequences per optimizer step, over all dp ranks and microbatches
    lr: float = 1e-3
    min_lr: float = 0.0
    warmup: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    seed: int = 1234
    dtype: str = "float32"  # float32 | bfloat16 (autocast; master weights stay float32)
    grad_clip: float = 1.0  # 0 disables clipping
    stop_at_step: int = 0  # save and exit after this step, as if cut off; 0: run to `steps`
    eval_interval: int = 0  # validation every N steps (and at the end); 0: never
    eval_batches: int = 4


@dataclass
class DataConfig:
    source: str = "synthetic"  # synthetic | memmap
    path: str = ""
    tokenizer: str = ""  # "" : the tokenizer recorded in the dataset's meta.json


@dataclass
class CheckpointConfig:
    dir: str = ""  # "" : run.dir/checkpoints
    interval: int = 0  # steps between checkpoints; 0: none (stop_at_step still saves)
    keep: int = 2
    resume: str = "auto"  # auto | none | PATH


@dataclass
class LogConfig:
    interval: int = 1
    wandb: str = "disabled"  # disabled | offline | online
    wandb_project: str = "megapipe"
    peak_tflops: float = 0.0  # 0: look the device up in train.metrics.PEAK_TFLOPS
    progress: bool = True


@dataclass
class RunConfig:
    dir: str = "runs/default"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def derived(self) -> Derived:
        return Derived.of(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Derived:
    """Values computed from the config once; the only place these formulas live."""

    world_size: int
    micro_batch_size: int  # sequences per microbatch on one dp rank
    local_batch: int  # sequences per step on one dp rank
    tokens_per_step: int
    head_dim: int
    n_kv_heads: int
    d_ff: int

    @staticmethod
    def of(cfg: Config) -> Derived:
        m, p, t = cfg.model, cfg.parallel, cfg.train
        d_ff = m.d_ff or default_d_ff(m.arch, m.d_model)
        return Derived(
            world_size=p.dp * p.pp * p.cp * p.tp,
            micro_batch_size=t.global_batch // (p.dp * p.microbatches),
            local_batch=t.global_batch // p.dp,
            tokens_per_step=t.global_batch * m.seq_len,
            head_dim=m.d_model // m.n_heads,
            n_kv_heads=m.n_kv_heads or m.n_heads,
            d_ff=d_ff,
        )


def default_d_ff(arch: str, d_model: int) -> int:
    if arch == "llama":  # SwiGLU keeps 8/3·d hidden units, rounded up to 64 (Llama paper §2)
        return 64 * ((8 * d_model // 3 + 63) // 64)
    return 4 * d_model


SECTIONS: dict[str, type] = {f.name: f.type for f in dataclasses.fields(Config)}
