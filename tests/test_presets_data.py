"""Every preset's data chain, fed from a small local fixture: the prepare_data command its
header gives is run (in-process) with the corpus swapped for a local one, the tokenizer for an
offline fixture of the same vocabulary (`gpt2`, Llama 3's and Qwen3's are looked up by id in a
local Hub cache holding 50257 ids, EOS 50256, 128256 ids, EOS 128001, and 151669 ids, EOS 151643),
one worker and the output in
tmp; then the preset's own data and model config (seq_len made small) draw a batch. The
missing-data hint names the same command."""

import json
import re
import shlex
from pathlib import Path

from megapipe.cli import prepare_data as cli
from megapipe.config import load_config
from megapipe.data.loader import build_data, prepare_hint
from tests.test_data import make_docs, write_txt
from tests.test_hub_offline import cache_hub_tokenizer, word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"^#\s+(python tools/prepare_data\.py .*)$", re.MULTILINE)
SEQ_LEN = 32
LLAMA3 = "meta-llama/Meta-Llama-3-8B"  # configs/llama_8b.yaml's tokenizer, by Hub id
# configs/qwen3_0.6b.yaml's: 151669 ids (EOS <|endoftext|> 151643), fewer than its 151936 rows
QWEN3, QWEN3_IDS = "Qwen/Qwen3-0.6B-Base", 151669


def preset_commands() -> dict[str, str]:
    """preset name -> the prepare_data command of its header, for every memmap preset whose
    data is not the quick start's Shakespeare."""
    commands = {}
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        cfg = load_config(str(path))
        if cfg.data.source != "memmap" or cfg.data.path == "data/shakespeare":
            continue
        found = COMMAND.findall(path.read_text())
        assert len(found) == 1, f"{path.name}: its header gives {len(found)} prepare commands"
        commands[path.stem] = found[0]
    return commands


def offline_argv(command: str, corpus: list[Path], out: Path, tmp: Path) -> list[str]:
    """The header's arguments with the corpus, output, workers and a trained tokenizer swapped
    for offline fixtures (a Hub tokenizer id is kept: the local Hub cache answers it)."""
    argv = shlex.split(command)[2:]  # after `python tools/prepare_data.py`
    header = cli.parse_args(argv)  # the header is a valid command line of the tool
    # a fresh machine can run it: the corpus comes from the Hub, no local copy is assumed
    assert len(header.input) == 1 and str(header.input[0]).startswith("hf:"), command
    swapped = []
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag == "--input":
            swapped += [flag, *map(str, corpus)]
        elif flag == "--out":
            swapped += [flag, str(out)]
        elif flag == "--workers":
            swapped += [flag, "1"]  # the test's one core
        elif flag == "--vocab-size":  # a tokenizer trained on the corpus: a fixture that size
            fixture = tmp / f"tokenizer_{value}"
            if not fixture.exists():
                word_tokenizer(int(value), int(value) - 1).save_pretrained(str(fixture))
            swapped += ["--tokenizer", str(fixture)]
        else:
            swapped += [flag, value]
    return swapped


def test_presets_data_chains_run_from_local_fixtures(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = cache_hub_tokenizer(tmp_path / "hub", "gpt2", word_tokenizer(50257, 50256))
    # Llama 3's tokenizer: 128256 ids, its <|end_of_text|> at 128001
    cache_hub_tokenizer(cache, LLAMA3, word_tokenizer(128256, 128001))
    cache_hub_tokenizer(cache, QWEN3, word_tokenizer(QWEN3_IDS, 151643))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    corpus = write_txt(tmp_path, make_docs(6, seed=4))
    commands = preset_commands()
    presets = {"gpt2_124m", "gpt2_124m_fineweb", "gpt2_350m", "gpt2_1.3b", "gpt3_13b", "llama_1b",
               "llama_8b", "qwen3_0.6b"}  # fmt: skip
    assert presets <= set(commands)
    prepared: dict[str, Path] = {}  # presets sharing a command share its dataset
    for preset, command in commands.items():
        cfg = load_config(str(ROOT / "configs" / f"{preset}.yaml"))
        assert prepare_hint(cfg.data.path).endswith(command), preset  # one command, two places
        assert command.split("--out ")[1].split()[0] == cfg.data.path, preset
        if command not in prepared:
            out = tmp_path / f"data{len(prepared)}"
            assert cli.main(offline_argv(command, corpus, out, tmp_path)) == 0, command
            prepared[command] = out
        out = prepared[command]
        meta = json.loads((out / "meta.json").read_text())
        if cfg.model.arch == "gpt2":  # GPT-2's own tokenizer, as the GPT-2 papers trained
            assert "--tokenizer gpt2 " in command, preset
            assert (meta["vocab_size"], meta["eos_id"]) == (50257, 50256), preset
        elif cfg.model.arch == "qwen3":  # Qwen3's padded embedding: its tokenizer's ids
            assert "--tokenizer Qwen/Qwen3" in command, preset
            assert (meta["vocab_size"], meta["eos_id"]) == (QWEN3_IDS, 151643), preset
        else:
            assert meta["vocab_size"] == cfg.model.vocab_size, preset
        cfg = load_config(
            str(ROOT / "configs" / f"{preset}.yaml"),
            [f"data.path={out}", f"model.seq_len={SEQ_LEN}"],
        )
        data = build_data(cfg.data, cfg.model, cfg.train.seed)  # checks vocab against the model
        batch = data.batch(0, 2)
        assert tuple(batch.shape) == (2, SEQ_LEN + 1), preset
        assert (
            int(batch.max()) < cfg.model.vocab_size and meta["vocab_size"] <= cfg.model.vocab_size
        )
    # OpenWebText with GPT-2's tokenizer, llama_1b's 32000 pieces, Llama 3's and Qwen3's
    # tokenizers; FineWeb-Edu with GPT-2's
    assert len(prepared) == 5
