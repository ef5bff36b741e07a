"""Hugging Face Hub datasets as corpus inputs: `hf:NAME[:CONFIG[:SPLIT]][@REVISION]`.

Online, `datasets.load_dataset(NAME, CONFIG, split=SPLIT, revision=REVISION, streaming=True)`
streams the rows (nothing copied to disk, nothing held in memory); offline (HF_DATASETS_OFFLINE or
HF_HUB_OFFLINE set) the local datasets cache (HF_DATASETS_CACHE, by default $HF_HOME/datasets)
answers, and it keeps no revision: the cached copy is read whichever revision it was made from.

Script datasets. `datasets` 4 and later refuse a Hub repository holding a loading script
(`RuntimeError: Dataset scripts are no longer supported, but found NAME.py`, datasets/load.py
`dataset_module_factory`); Skylion007/openwebtext is one (nanoGPT issue #633). The Hub keeps its
own parquet export of such a repository on the revision `refs/convert/parquet`, readable by the
same `load_dataset`. megapipe names that revision in a one-line error rather than falling back to
it by itself: the export of a dataset over 5 GB can hold only its first 5 GB (split directories
named `partial-train`), an export can be missing (the conversion ran under datasets >= 4 too and
could fail), and an explicit revision is recorded in meta.json's `source`, so a prepared dataset
says which rows it holds. The presets' commands name the revision, so they run as documented.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.data.errors import DataError, first_line

HF_PREFIX = "hf:"
PARQUET_EXPORT = "refs/convert/parquet"  # the Hub's parquet export of every public dataset
SCRIPT_REFUSED = "Dataset scripts are no longer supported"  # datasets >= 4, load.py


@dataclass(frozen=True)
class HFInput:
    """`hf:NAME[:CONFIG[:SPLIT]][@REVISION]`: a Hub dataset (all splits, in key order, when SPLIT
    is not given; the default config, or offline the one cached config, when CONFIG is not) at
    REVISION (a branch, tag, commit or ref such as refs/convert/parquet; the default: main)."""

    name: str
    config: str | None = None
    split: str | None = None
    revision: str | None = None

    @classmethod
    def parse(cls, text: str) -> HFInput:
        # REVISION may hold '/' (refs/convert/parquet) but never '@' or ':' (git ref names)
        spec, at, revision = text[len(HF_PREFIX) :].partition("@")
        parts = spec.split(":")
        if not parts[0] or len(parts) > 3 or (at and (not revision or ":" in revision)):
            raise DataError(
                f"input {text}: write hf:NAME[:CONFIG[:SPLIT]][@REVISION], e.g. hf:org/name or "
                f"hf:org/name@{PARQUET_EXPORT}"
            )
        config, split = ([part or None for part in parts[1:]] + [None, None])[:2]
        return cls(parts[0], config, split, revision or None)

    def __str__(self) -> str:
        parts = [self.name, self.config or "", self.split or ""]
        text = HF_PREFIX + ":".join(parts).rstrip(":")
        return f"{text}@{self.revision}" if self.revision else text


def load_hub(source: HFInput):
    """`source` as a Dataset or DatasetDict from the local HF datasets cache when offline, else
    as an IterableDataset or IterableDatasetDict streamed from the Hub."""
    import datasets

    if datasets.config.HF_HUB_OFFLINE:
        return _load_cached(source)
    revision = {"revision": source.revision} if source.revision else {}
    try:
        return datasets.load_dataset(
            source.name, source.config, split=source.split, streaming=True, **revision
        )
    except (OSError, ValueError, RuntimeError) as err:  # not found, no network, a script repo
        if isinstance(err, RuntimeError) and SCRIPT_REFUSED in str(err):
            raise DataError(_script_hint(source, err)) from None
        raise DataError(
            f"input {source} cannot be streamed from the Hugging Face Hub: {first_line(err)}"
        ) from None


def _script_hint(source: HFInput, err: RuntimeError) -> str:
    """The one line for a repository `datasets` refuses as a loading script."""
    script = str(err).rsplit("found ", 1)[-1].strip() if "found " in str(err) else "a script"
    fixed = HFInput(source.name, source.config, source.split, PARQUET_EXPORT)
    return (
        f"input {source} is a script dataset ({script}), which datasets>=4 no longer runs; read "
        f"the Hub's parquet export of it instead: --input {fixed}"
    )


def _load_cached(source: HFInput):
    """The Dataset or DatasetDict of `source` from the local HF datasets cache, offline."""
    import datasets

    cache = datasets.config.HF_DATASETS_CACHE
    try:
        return datasets.load_dataset(
            source.name, source.config, split=source.split, cache_dir=str(cache)
        )
    except (ConnectionError, FileNotFoundError, ValueError) as err:
        first = first_line(err)
        if "Unknown split" in first:
            reason = f"has no split '{source.split}' in the cache ({first.split('. ', 1)[-1]})"
        elif "multiple" in first:
            configs = ", ".join(sorted(first.split(": ", 1)[-1].split(", ")))
            reason = f"has several configs in the cache ({configs}); write hf:NAME:CONFIG"
        elif "Couldn't find cache" in first:
            configs = str(err).splitlines()[-1].split(": ", 1)[-1]
            reason = f"has no config '{source.config}' in the cache (cached configs: {configs})"
        else:
            reason = (
                f"is not in the local HF datasets cache {cache} (offline mode is set): unset "
                "HF_DATASETS_OFFLINE and HF_HUB_OFFLINE to stream it from the Hub, or on a "
                f"machine with network run datasets.load_dataset('{source.name}') with the same "
                "HF_HOME (or HF_DATASETS_CACHE), or save it with save_to_disk and give its dir "
                "as --input (files fetched with `hf download` are not in the cache: give their "
                "dir as --input)"
            )
        raise DataError(f"input {source} {reason}") from None
