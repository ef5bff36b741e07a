"""train.init_from_hf (megapipe/train/hf_init.py): a run started from a transformers directory
(Qwen3, Qwen3-MoE, GPT-2, Mixtral, DeepSeek-V3; one safetensors file or an index of shards) has
transformers' own loss on its first batch, on one process and on tp2·pp2 and dp2·ep2·tp2 meshes
where each rank reads its own shard; conflicts and pickled weights are one line; checkpoint.save_hf
writes transformers dirs with the run's tokenizer."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
import transformers

from megapipe.config import ConfigError
from megapipe.train.hf_init import INDEX
from tests.parity import build_mesh
from tests.util import assert_state_close, rel_error

REL = 1e-5  # fp32 round-off of one forward (design.md's parity bound)
# configs/tiny.yaml's shape (d_model 32, 4 heads, 2 layers, vocab 96), head_dim 12 != 32/4
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=12,
             max_position_embeddings=64, tie_word_embeddings=False,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True)


def hf_dir(moe: bool) -> str:
    """A random Qwen3 (Qwen3-MoE: saved in several safetensors files) written to a temp dir."""
    torch.manual_seed(0)
    if moe:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**SHAPE, **MOE))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn_like(param))
    out = tempfile.mkdtemp()
    model.save_pretrained(out, max_shard_size="40KB" if moe else "1GB")
    return out


def tiny(overrides: list[str]):
    """configs/tiny.yaml with `overrides`, the model keys from train.init_from_hf, as train.py
    loads it (before validation: parallel.ep needs the experts config.json brings)."""
    from megapipe.config import load_config
    from megapipe.train.hf_init import with_hf_model

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = f"run.dir={tempfile.mkdtemp()}"
    return load_config(f"{root}/configs/tiny.yaml", [*overrides, run], resolve=with_hf_model)


def first_loss(overrides: list[str]) -> float:
    """Step 0's loss of the tiny config started from train.init_from_hf, under its mesh."""
    from megapipe.data.loader import build_data
    from megapipe.train.parallelize import parallelize

    cfg = tiny(overrides)
    job = parallelize(cfg, build_mesh(cfg), "cpu")
    batch = build_data(cfg.data, cfg.model, cfg.train.seed).batch(0, cfg.train.global_batch)
    return job.train_step(job.optimizer(), batch, 0).loss


def hf_loss(src: str) -> float:
    """transformers' mean next-token loss on the tiny config's first batch."""
    from megapipe.data.loader import build_data

    cfg = tiny([f"train.init_from_hf={src}"])
    batch = build_data(cfg.data, cfg.model, cfg.train.seed).batch(0, cfg.train.global_batch)
    model = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        logits = model(batch[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def dirs() -> dict:
    deepseek = random_dir(deepseek_model(), Path(tempfile.mkdtemp()))
    return {moe: hf_dir(moe) for moe in (False, True)} | {"deepseek_v3": deepseek}


@pytest.mark.parametrize("moe", [False, True])
def test_one_process_starts_at_transformers_loss(dirs, moe):
    src = dirs[moe]
    want = hf_loss(src)
    got = first_loss([f"train.init_from_hf={src}"])
    assert abs(got - want) <= REL * want, (got, want)


MESHES = [
    (False, ["parallel.tp=2", "parallel.pp=2", "parallel.microbatches=2"]),
    (True, ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    # MLA's query heads split over tp: each rank de-interleaves the RoPE rows of its own heads
    ("deepseek_v3", ["parallel.dp=2", "parallel.ep=2", "parallel.tp=2"]),
]


@pytest.mark.parametrize(
    "moe, mesh", MESHES, ids=["tp2-pp2", "dp2-ep2-tp2-sp", "deepseek_v3-dp2-ep2-tp2"]
)
def test_meshes_read_their_shards_and_start_at_transformers_loss(gloo_pool, dirs, moe, mesh):
    src = dirs[moe]
    want = hf_loss(src)
    for rank, got in enumerate(gloo_pool(4).run(first_loss, [f"train.init_from_hf={src}", *mesh])):
        assert abs(got - want) <= REL * want, f"rank {rank}: {got} != {want}"


def hf_run(overrides: list[str], steps: int = 3) -> dict:
    """`steps` steps of the tiny config started from train.init_from_hf under its mesh: the
    losses and the final weights (whole over tp, the selection biases too) by logical name."""
    from megapipe.data.loader import build_data
    from megapipe.parallel.tensor.gather import gather_logical
    from megapipe.train.parallelize import parallelize

    cfg = tiny(overrides)
    job = parallelize(cfg, build_mesh(cfg), "cpu")
    optimizer, data = job.optimizer(), build_data(cfg.data, cfg.model, cfg.train.seed)
    losses = [
        job.train_step(optimizer, data.batch(step, cfg.train.global_batch), step).loss
        for step in range(steps)
    ]
    weights = {}
    with job.full_weights():
        for chunk in job.engine.chunks:
            weights.update(gather_logical(chunk))
            weights.update({n: b.clone() for n, b in chunk.named_buffers() if "routing" in n})
    return {"losses": losses, "weights": weights}


# DeepSeek-V3 from its HF directory with megapipe's own training keys on: two MTP depths (their
# modules are not in transformers' class: initialized as the run's own) and aux-loss-free
# balancing, whose bias starts from the directory's e_score_correction_bias
HF_TRAINING = ["model.mtp_layers=2", "model.mtp_loss_coef=0.5", "model.moe_bias_update_rate=0.01"]
HF_MESHES = {
    "tp2-sp-pp2": ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"],
    "dp2-cp2-ep2": ["parallel.dp=2", "parallel.cp=2", "parallel.ep=2"],
}


@pytest.mark.spawn
@pytest.mark.parametrize("mesh", sorted(HF_MESHES))
def test_a_run_from_hf_trains_like_one_process(gloo_pool, dirs, mesh):
    """Issue 50's target: started from a DeepSeek-V3 directory with MTP and aux-loss-free
    balancing on, tp, pp, cp and ep train like one process (losses at rel 1e-5, weights and
    biases within the parity bound); the bias moved from where the directory put it."""
    start = [f"train.init_from_hf={dirs['deepseek_v3']}", *HF_TRAINING, "parallel.microbatches=2"]
    ref = hf_run(start)
    weights = {}
    for rank, got in enumerate(gloo_pool(4).run(hf_run, [*start, *HF_MESHES[mesh]])):
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= 1e-5 * abs(b), f"rank {rank} step {step}: loss {a} != {b}"
        weights.update(got["weights"])
    assert set(weights) == set(ref["weights"])
    assert_state_close(weights, ref["weights"])
    first = hf_run(start, steps=0)["weights"]
    bias = "layers.1.mlp.routing.bias"
    assert not torch.equal(ref["weights"][bias], first[bias]) and first[bias].abs().sum() > 0


def test_a_conflicting_model_key_is_one_line(dirs):
    with pytest.raises(ConfigError, match="model.n_layers=3 conflicts with") as err:
        first_loss([f"train.init_from_hf={dirs[False]}", "model.n_layers=3"])
    assert "\n" not in str(err.value)


def test_pickled_weights_are_refused_by_name(dirs, tmp_path):
    (tmp_path / "config.json").write_text(open(os.path.join(dirs[False], "config.json")).read())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ConfigError, match="pytorch_model.bin is pickled") as err:
        first_loss([f"train.init_from_hf={tmp_path}"])
    assert "\n" not in str(err.value)


def test_save_hf_writes_each_checkpoint_as_a_transformers_dir(dirs):
    """A run started from HF with checkpoint.save_hf: every step_*/hf loads in transformers
    with the checkpoint's own logits."""
    from megapipe.train.checkpoint import complete_checkpoints, load_for_inference
    from megapipe.train.loop import run

    src = dirs[True]  # Qwen3-MoE: the stacked experts go out one tensor per expert again
    cfg = tiny([f"train.init_from_hf={src}", "train.steps=2", "checkpoint.interval=1"])
    cfg.checkpoint.save_hf = True
    run(cfg)
    ckpts = complete_checkpoints(os.path.join(cfg.run.dir, "checkpoints"))
    assert [os.path.basename(c) for c in ckpts] == ["step_00000001", "step_00000002"]
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(3))
    for ckpt in ckpts:
        hf = transformers.AutoModelForCausalLM.from_pretrained(f"{ckpt}/hf").eval()
        assert type(hf) is transformers.Qwen3MoeForCausalLM
        _, ours = load_for_inference(ckpt)
        with torch.no_grad():
            want = ours.eval()(ids)
            assert rel_error(hf(ids).logits, want) <= REL


def test_save_hf_of_an_arch_without_export_is_one_line():
    from megapipe.train.checkpoint_async import Saver

    cfg = tiny(["checkpoint.save_hf=true", "model.n_experts=4", "model.moe_shared_experts=1",
                "model.arch=qwen3"])  # fmt: skip
    with pytest.raises(ConfigError, match="checkpoint.save_hf=true: model.moe_shared_experts"):
        Saver(cfg)


def random_dir(model, tmp_path, shard: str = "1GB") -> str:
    """`model` with its weights perturbed (no zero/one norms hide a misread), saved."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size=shard)
    return str(tmp_path)


def gpt2_model():
    """GPT-2's transposed Conv1D weights, its positions longer than tiny's seq_len 16."""
    torch.manual_seed(1)
    shape = dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                 activation_function="gelu_new", tie_word_embeddings=True,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**shape))


def mixtral_model():
    """Mixtral's experts: saved one tensor per expert (block_sparse_moe.experts.{j}.w1/w2/w3)."""
    torch.manual_seed(2)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")  # fmt: skip
    shape = {k: SHAPE[k] for k in keys} | dict(intermediate_size=24, sliding_window=None)
    moe = dict(num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(**shape, **moe))


def deepseek_model():
    """DeepSeek-V3's MLA (interleaved RoPE rows, YaRN with its softmax mscale), a dense first
    layer, shared + routed experts with the selection bias."""
    torch.manual_seed(3)
    shape = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                 v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                 max_position_embeddings=64, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                  "original_max_position_embeddings": 16, "mscale": 1.0,
                                  "mscale_all_dim": 0.7},
                 bos_token_id=None, eos_token_id=None, pad_token_id=None)  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**shape))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn_like(buf))
    return model


def nemotron_model():
    """Nemotron-4's layout: LayerNorm1P (offsets and biases perturbed from 0), relu², RoPE on
    half of each head."""
    torch.manual_seed(5)
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    shape = {k: SHAPE[k] for k in keys} | dict(intermediate_size=48, rope_parameters=rope)
    model = transformers.NemotronForCausalLM(transformers.NemotronConfig(**shape))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    return model


ARCHS = [
    (gpt2_model, "1GB"),
    (mixtral_model, "1GB"),
    (mixtral_model, "20KB"),
    (deepseek_model, "1GB"),
    (nemotron_model, "20KB"),
]


@pytest.mark.parametrize(
    "make, shard", ARCHS, ids=["gpt2", "mixtral", "mixtral-sharded", "deepseek_v3", "nemotron"]
)
def test_other_archs_start_at_transformers_loss(make, shard, tmp_path):
    src = random_dir(make(), tmp_path, shard)
    assert (tmp_path / INDEX).is_file() == (shard != "1GB")
    want = hf_loss(src)
    got = first_loss([f"train.init_from_hf={src}"])
    assert abs(got - want) <= REL * want, (got, want)
    # the logits too: a loss near log(vocab) hides a misread that the logits show
    from megapipe.models.gpt import GPT
    from megapipe.train.hf_init import load_hf_weights

    cfg = tiny([f"train.init_from_hf={src}"])
    ours = GPT(cfg.model).eval()
    load_hf_weights([ours], src, cfg.model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert rel_error(ours(ids), hf(ids).logits) <= REL


def test_save_hf_writes_the_run_tokenizer(dirs, tmp_path):
    """data.tokenizer (a local HF tokenizer dir) goes into every step_*/hf beside the weights,
    and transformers reads it back as the same tokenizer."""
    from megapipe.train.checkpoint import complete_checkpoints
    from megapipe.train.loop import run
    from tests.test_hub_offline import word_tokenizer

    tok = word_tokenizer(96, 95)
    tok.save_pretrained(str(tmp_path / "tok"))
    cfg = tiny([f"train.init_from_hf={dirs[False]}", "train.steps=1", "checkpoint.interval=1",
                f"data.tokenizer={tmp_path / 'tok'}", "checkpoint.save_hf=true"])  # fmt: skip
    run(cfg)
    (ckpt,) = complete_checkpoints(os.path.join(cfg.run.dir, "checkpoints"))
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert os.path.isfile(f"{ckpt}/hf/tokenizer.json")
    back = transformers.AutoTokenizer.from_pretrained(f"{ckpt}/hf")
    text = " ".join(list(tok.get_vocab())[:20])
    assert back(text)["input_ids"] == tok(text)["input_ids"]
    assert back.eos_token_id == 95
