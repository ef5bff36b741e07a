"""Tokenizers: a sentencepiece `.model` file, a local Hugging Face tokenizer directory, or a
Hub tokenizer id (e.g. `gpt2`) through transformers. One interface (encode, encode_batch,
encode_arrays, decode, vocab_size, eos_id) for preparation, export and generation.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from megapipe.data.errors import DataError, first_line


class SentencePieceTokenizer:
    """A sentencepiece `.model` file."""

    def __init__(self, path: Path):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self._sp.get_piece_size()
        self.eos_id = self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts)

    def encode_arrays(self, texts: list[str], threads: int = -1) -> list[np.ndarray]:
        """encode_batch as int32 arrays, with no Python int per token; `threads` for the
        batch (-1: sentencepiece's default, every core)."""
        return self._sp.encode(texts, out_type="numpy", num_threads=threads)

    def decode(self, ids: list[int]) -> str:
        return self._sp.decode(list(ids))


class HFTokenizer:
    """A Hugging Face tokenizer: a local directory, or (`local_only=False`) a Hub id that
    transformers downloads into the HF cache."""

    def __init__(self, path: Path | str, local_only: bool = True):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=local_only)
        # Documents are separated by EOS; fall back to SEP for BERT-style tokenizers.
        eos = self.hf.eos_token_id if self.hf.eos_token_id is not None else self.hf.sep_token_id
        if eos is None:
            raise DataError(f"tokenizer {path} has no eos_token; add one to its config")
        self.eos_id = int(eos)
        self.vocab_size = len(self.hf)  # counts added tokens, unlike hf.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        backend = getattr(self.hf, "backend_tokenizer", None)  # a fast tokenizer's Rust core
        if backend is not None:  # the ids hf(texts) gives, without its warning for documents
            # longer than the model's context (GPT-2's 1024), which is no error here
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def encode_arrays(self, texts: list[str], threads: int = -1) -> list[np.ndarray]:
        """encode_batch as arrays (`threads` is the tokenizers library's own business)."""
        return [np.asarray(row, dtype=np.int64) for row in self.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids))


Tokenizer = SentencePieceTokenizer | HFTokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A sentencepiece `.model` file or a local HF tokenizer directory."""
    path = Path(path)
    if path.is_dir():
        return HFTokenizer(path)
    if path.is_file():
        return SentencePieceTokenizer(path)
    raise DataError(f"tokenizer '{path}' not found; give a sentencepiece .model file or HF dir")


# A Hub repo id: NAME or ORG/NAME of letters, digits, '-', '_', '.' (as huggingface_hub checks).
HUB_ID = re.compile(r"^(?![./])[\w.-]+(/(?!\.)[\w.-]+)?$")


def is_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and ".." not in name and not name.endswith(".")


def hub_tokenizer(name: str) -> HFTokenizer:
    """The tokenizer of a Hugging Face Hub repo (e.g. gpt2), through transformers: downloaded
    into the HF cache when online, read from that cache alone when HF_HUB_OFFLINE (or
    TRANSFORMERS_OFFLINE) is set."""
    from huggingface_hub import is_offline_mode

    offline = is_offline_mode()
    try:
        return HFTokenizer(name, local_only=offline)
    except DataError:
        raise
    except (OSError, ValueError) as err:  # transformers raises OSError for a missing repo
        if offline:
            raise DataError(
                f"--tokenizer {name} is not a local dir or .model file, nor in the local Hugging "
                "Face cache (offline mode is set); run once online (unset HF_HUB_OFFLINE) to "
                "download it, or give a local HF tokenizer dir or a sentencepiece .model file"
            ) from None
        first = first_line(err)
        raise DataError(
            f"--tokenizer {name} is not a local dir or .model file, and the Hugging Face Hub "
            f"gives no tokenizer for it ({first}); check the id or give a local dir"
        ) from None
