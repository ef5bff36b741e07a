"""The runtime rules of validation: what the precision, sharding, rollback and spike runtimes
(parallel/precision.py, parallel/data/zero*.py, post-validation, train/spikes.py) combine with.
config/checks.validate runs them; each raises a
one-line `ConfigError` naming the key and the fix.
"""

from __future__ import annotations

from megapipe.config.schema import Config, ConfigError
from megapipe.plan.schedules import SCHEDULES


def require(ok: bool, message: str) -> None:
    """Raise `ConfigError(message)` unless `ok`."""
    if not ok:
        raise ConfigError(message)


def check_zero(cfg: Config) -> None:
    """What ZeRO-2/3 (parallel/data/zero2.py, zero3.py) do not combine with, in one line each."""
    p = cfg.parallel
    spec = SCHEDULES[p.schedule]
    require(
        not (p.zero >= 2 and p.pp > 1 and spec.placement == "dual"),
        f"parallel.zero={p.zero} with parallel.schedule={p.schedule}: DualPipe's twin stage "
        "copies sum full-size grads; set parallel.zero=0 or 1, or another schedule",
    )
    require(
        not (p.zero == 3 and p.pp > 1 and spec.segmented),
        f"parallel.zero=3 with parallel.schedule={p.schedule}: a segment's backward reads "
        "weights through the kept K/V before its block's output grad; set parallel.zero<=2",
    )
    require(
        p.grad_reduce != "microbatch" or p.zero >= 2,
        f"parallel.grad_reduce=microbatch with parallel.zero={p.zero}: only the sharded grads "
        "(zero>=2) are reduce-scattered each microbatch; set parallel.zero=2 or 3, or step",
    )
    require(
        p.grad_reduce != "step" or p.zero != 3,
        "parallel.grad_reduce=step with parallel.zero=3: ZeRO-3 holds no full-size grads, so "
        "it reduce-scatters every microbatch; set parallel.grad_reduce=auto (or microbatch), "
        "or parallel.zero=2",
    )
    require(
        p.grad_reduce_dtype == "float32" or p.zero >= 1,
        "parallel.grad_reduce_dtype=bfloat16 with parallel.zero=0: the all-reduce sums the "
        "float32 grads in place; set parallel.zero>=1 or parallel.grad_reduce_dtype=float32",
    )
    check_dp_shard(cfg)
    require(
        not (p.zero == 3 and cfg.train.compile),
        "parallel.zero=3 with train.compile=true: the compiled layers would guard on weights "
        "whose storage is freed between uses; set train.compile=false or parallel.zero<=2",
    )


def check_dp_shard(cfg: Config) -> None:
    """HSDP (parallel.dp_shard): shard groups that tile the dp axis, of a sharded level, each
    holding whole ep groups (its experts' shard groups are then the expert replicas in it)."""
    p, s = cfg.parallel, cfg.parallel.dp_shard
    if s in (0, p.dp):
        return
    require(
        p.dp % s == 0,
        f"parallel.dp_shard={s} does not divide parallel.dp={p.dp}; set a divisor of dp "
        "(0: dp, no replicas)",
    )
    require(
        p.zero >= 1,
        f"parallel.dp_shard={s} with parallel.zero=0: only ZeRO's state is sharded; set "
        "parallel.zero>=1 or parallel.dp_shard=0",
    )
    require(
        s % p.ep == 0,
        f"parallel.dp_shard={s} with parallel.ep={p.ep}: a shard group must hold whole ep "
        "groups; set parallel.dp_shard to a multiple of ep",
    )


def check_context_parallel(cfg: Config) -> None:
    """parallel.cp > 1 (parallel/context/): zigzag chunks, no attention dropout, and under
    parallel.cp_comm=a2a (Ulysses) whole query heads per cp rank."""
    p, m = cfg.parallel, cfg.model
    require(
        p.cp_a2a <= 1 or p.cp_comm == "hybrid",
        f"parallel.cp_a2a={p.cp_a2a} is read only under parallel.cp_comm=hybrid (it is "
        f"{p.cp_comm}); set parallel.cp_comm=hybrid or parallel.cp_a2a=1",
    )
    if p.cp == 1:
        return
    require(
        m.seq_len % (2 * p.cp) == 0,
        f"model.seq_len={m.seq_len} must be divisible by 2·parallel.cp={2 * p.cp} "
        "(zigzag sharding)",
    )
    name = {
        "ring": "ring attention",
        "a2a": "Ulysses attention (parallel.cp_comm=a2a)",
        "hybrid": "hybrid attention (parallel.cp_comm=hybrid)",
    }[p.cp_comm]
    require(
        m.dropout == 0.0,
        f"model.dropout={m.dropout} with parallel.cp={p.cp}: {name} has no "
        "attention dropout (it would not match one process); set model.dropout=0",
    )
    if p.sequence_parallel:
        require(
            m.seq_len // p.cp % p.tp == 0,
            f"parallel.sequence_parallel with parallel.cp={p.cp} needs the local sequence "
            f"model.seq_len/cp={m.seq_len // p.cp} divisible by parallel.tp={p.tp}",
        )
    heads = m.n_heads // p.tp
    require(
        p.cp_comm != "a2a" or heads % p.cp == 0,
        f"parallel.cp_comm=a2a needs the query heads per tp rank, model.n_heads/parallel.tp="
        f"{heads}, divisible by parallel.cp={p.cp} (Ulysses splits them over cp); change "
        "model.n_heads or use parallel.cp_comm=ring",
    )
    if p.cp_comm == "hybrid":
        check_hybrid(p.cp, p.cp_a2a, heads)


def check_hybrid(cp: int, k: int, heads: int) -> None:
    """parallel.cp_comm=hybrid (parallel/context/hybrid.py): a2a groups of K = cp_a2a, a
    proper divisor of cp above 1, each splitting the query heads per tp rank."""
    require(
        1 < k < cp,
        f"parallel.cp_comm=hybrid needs 1 < parallel.cp_a2a < parallel.cp={cp}, got "
        f"cp_a2a={k}; set parallel.cp_a2a to a divisor of cp (or use cp_comm=a2a or ring)",
    )
    require(
        cp % k == 0,
        f"parallel.cp_a2a={k} must divide parallel.cp={cp} (the ring runs over cp/cp_a2a "
        "groups); set parallel.cp_a2a to a divisor of cp",
    )
    require(
        heads % k == 0,
        f"parallel.cp_comm=hybrid needs the query heads per tp rank, model.n_heads/parallel.tp="
        f"{heads}, divisible by parallel.cp_a2a={k}; change model.n_heads or parallel.cp_a2a",
    )


def check_expert_parallel(cfg: Config) -> None:
    """parallel.ep (parallel/expert/): ranks taken from dp, whole experts per rank."""
    p, m = cfg.parallel, cfg.model
    if p.ep == 1:
        return
    require(
        p.dp % p.ep == 0,
        f"parallel.ep={p.ep} must divide parallel.dp={p.dp} (expert-parallel ranks are taken "
        "from the data-parallel group); set parallel.ep to a divisor of parallel.dp",
    )
    require(
        m.n_experts > 0 and m.n_experts % p.ep == 0,
        f"parallel.ep={p.ep} needs model.n_experts={m.n_experts} to be a positive multiple of "
        "it (each ep rank holds n_experts/ep whole experts); change either",
    )


def check_params_dtype(cfg: Config) -> None:
    """bf16 weights (parallel/precision.py): bf16 compute, and one optimizer step per step."""
    t, p = cfg.train, cfg.parallel
    if t.params_dtype == "float32":
        require(
            t.main_grads_dtype == "float32",
            "train.main_grads_dtype=bfloat16 with train.params_dtype=float32: float32 weights "
            "have no main grads; set train.params_dtype=bfloat16 (or main_grads_dtype=float32)",
        )
        return
    require(
        t.dtype == "bfloat16",
        f"train.params_dtype=bfloat16 with train.dtype={t.dtype}: bf16 weights compute in "
        "bf16; set train.dtype=bfloat16 (or train.params_dtype=float32)",
    )
    require(
        t.main_grads_dtype == "float32" or p.zero == 0 or p.grad_reduce_dtype == "bfloat16",
        f"train.main_grads_dtype=bfloat16 with parallel.zero={p.zero} and "
        "parallel.grad_reduce_dtype=float32: bf16 main grads are reduce-scattered in bf16 "
        "(Megatron-Core's grad_reduce_in_fp32=False); set parallel.grad_reduce_dtype=bfloat16",
    )
    require(
        not (p.pp > 1 and p.schedule == "pipedream_async") and not p.post_validation,
        "train.params_dtype=bfloat16 with parallel.schedule=pipedream_async or "
        "parallel.post_validation=true (weight versions and rollbacks of bf16 weights are not "
        "built); set train.params_dtype=float32",
    )


def check_tp_overlap(cfg: Config) -> None:
    """tp_overlap chunks SP's all-gather / reduce-scatter (parallel/tensor/overlap.py): it
    needs both."""
    p = cfg.parallel
    require(
        not p.tp_overlap or (p.sequence_parallel and p.tp > 1),
        f"parallel.tp_overlap=true overlaps sequence parallelism's collectives, with "
        f"parallel.tp={p.tp} and parallel.sequence_parallel={str(p.sequence_parallel).lower()}"
        ": set parallel.sequence_parallel=true and parallel.tp>1, or parallel.tp_overlap=false",
    )


def check_cp_balance(cfg: Config) -> None:
    """parallel.cp_balance=documents deals chunks of each row by document-masked attention work
    (parallel/context/balance.py): it needs the documents, and MoE capacity, which drops tokens
    by their place in the sequence, reads the zigzag positions."""
    p = cfg.parallel
    if p.cp_balance != "documents":
        return
    require(
        cfg.data.document_mask,
        "parallel.cp_balance=documents needs data.document_mask=true (it balances documents' "
        "attention work): set data.document_mask=true or parallel.cp_balance=position",
    )
    require(
        cfg.model.n_experts == 0,
        f"parallel.cp_balance=documents with model.n_experts={cfg.model.n_experts}: MoE capacity "
        "orders tokens by zigzag position; set parallel.cp_balance=position",
    )
    require(
        p.cp_comm != "a2a",
        "parallel.cp_balance=documents with parallel.cp_comm=a2a: the split is for the ring "
        "(ring or hybrid); Ulysses attends whole sequences, balanced already: set "
        "parallel.cp_balance=position",
    )


def check_post_validation(cfg: Config) -> None:
    """Zero Bubble §4 post-validation replaces the pipeline's global reduction before the
    optimizer: it needs a pipeline whose stages step once per step, on whole (unsharded) state."""
    p = cfg.parallel
    if not p.post_validation:
        return
    require(
        p.pp > 1,
        f"parallel.post_validation=true needs a pipeline (parallel.pp > 1, got {p.pp}): "
        "with one stage there is no synchronisation to bypass; remove parallel.post_validation",
    )
    require(
        p.schedule != "pipedream_async",
        "parallel.post_validation=true with parallel.schedule=pipedream_async: PipeDream steps "
        "each stage after every microbatch without a global reduction already; remove "
        "parallel.post_validation",
    )
    require(
        not (p.zero and p.dp * p.cp > 1),
        f"parallel.post_validation=true with parallel.zero={p.zero} is not supported yet (the "
        "rollback copies are not sharded); set parallel.zero=0 or parallel.post_validation=false",
    )


def check_spikes(cfg: Config) -> None:
    """Loss spikes are judged on the step's loss before the optimizer steps (train/spikes.py):
    post-validation and PipeDream step before that loss is known."""
    t, p = cfg.train, cfg.parallel
    if not (t.spike_factor or t.spike_rollback):
        return
    require(
        t.spike_factor != 0,
        f"train.spike_rollback={t.spike_rollback} counts loss spikes, but train.spike_factor=0 "
        "finds none; set train.spike_factor (e.g. 3)",
    )
    require(
        t.spike_factor > 1,
        f"train.spike_factor={t.spike_factor} must be 0 (off) or > 1 (a multiple of the median "
        "loss)",
    )
    stepped_early = "parallel.post_validation=true" if p.post_validation else ""
    if p.pp > 1 and p.schedule == "pipedream_async":
        stepped_early = "parallel.schedule=pipedream_async"
    require(
        not stepped_early,
        f"train.spike_factor with {stepped_early}: the optimizer steps before the step's loss "
        "is known, so a spike cannot be skipped; set train.spike_factor=0 or "
        + ("parallel.post_validation=false" if p.post_validation else "another schedule"),
    )
    require(
        not t.spike_rollback or cfg.checkpoint.interval,
        f"train.spike_rollback={t.spike_rollback} reloads the newest checkpoint, but "
        "checkpoint.interval=0 saves none; set checkpoint.interval",
    )


def check_moe(cfg: Config) -> None:
    """The mixture-of-experts keys (models/moe.py, docs/moe.md), in one line each. Seq1F1B's
    segments carry each sequence's expert counts (parallel/autograd/segment_kv.py)."""
    m = cfg.model
    if m.n_experts == 0:
        return
    require(
        m.top_k <= m.n_experts,
        f"model.top_k={m.top_k} exceeds model.n_experts={m.n_experts}; lower model.top_k",
    )
    require(
        m.moe_every <= m.n_layers,
        f"model.moe_every={m.moe_every} exceeds model.n_layers={m.n_layers}, so no layer "
        "would be MoE; lower model.moe_every",
    )


EVAL_TASKS = ("hellaswag",)  # train/tasks.py TASKS


def check_eval_tasks(cfg: Config) -> None:
    """`train.eval_tasks` (train/tasks.py): known names, scored through the engine on any mesh
    with the run's tokenizer at each evaluation."""
    t = cfg.train
    names = [name.strip() for name in t.eval_tasks.split(",") if name.strip()]
    for name in names:
        require(
            name in EVAL_TASKS,
            f"train.eval_tasks: {name!r} is not one of {', '.join(EVAL_TASKS)}",
        )
    if not names:
        return
    require(
        t.eval_interval > 0,
        "train.eval_tasks are scored at each evaluation, but train.eval_interval=0; set it",
    )
    require(
        cfg.data.source == "memmap" or bool(cfg.data.tokenizer),
        "train.eval_tasks needs the run's tokenizer: data.source=memmap or data.tokenizer",
    )
