"""Training data: byte-level tokens (vocabulary 256, no tokenizer), documents, a
deterministic train/validation split by document, and batches of random windows.

Sources (:func:`load_documents`):

- ``"stdlib"`` (the default): the Python standard library's own ``.py`` files, read at run
  time from ``sysconfig.get_paths()['stdlib']`` (``site-packages``/``dist-packages`` left
  out), in sorted path order, one document per file, capped at ``max_bytes`` (the last
  file taken is cut at the cap). It exists on every Python install; its content depends on
  the Python version, so runs are comparable only on the same interpreter.
- a text file: documents separated by ``<|endoftext|>`` when the file has that marker,
  otherwise blocks of consecutive paragraphs of about ``doc_bytes`` bytes (cut at the
  first blank line after every ``doc_bytes``; at a line end when the file has no blank
  line; at exactly ``doc_bytes`` when it has no line end at all, e.g. text8);
- a directory: every regular file under it (recursively, sorted, dot-files skipped), each
  split as a text file;
- Hugging Face ``datasets`` (optional import): each row's text field is a document.

Batches (:func:`batch_at`) are a pure function of ``(seed, step)``: the window offsets of
the *global* batch come from a generator seeded with both, and a rank takes its slice of
rows. So a resumed run sees exactly the batches it would have seen, and N ranks together
see exactly the batch one process sees.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pathlib
import sysconfig
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

VOCAB_SIZE = 256
EOT_MARKER = b"<|endoftext|>"
#: directories under the stdlib path that hold installed packages, not the standard library
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}


# ------------------------------------------------------------------------- sources
def stdlib_files() -> list[pathlib.Path]:
    """The standard library's ``.py`` files, sorted by their path relative to the stdlib root."""
    return list(_stdlib_files())


@functools.lru_cache(maxsize=1)
def _stdlib_files() -> tuple[pathlib.Path, ...]:
    # walking ~2000 files takes seconds on a cold disk; the stdlib does not change under a process
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"stdlib corpus: sysconfig's stdlib path {root} is not a directory")
    files = [p for p in root.rglob("*.py") if p.is_file() and not _NOT_STDLIB & set(p.relative_to(root).parts)]
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def stdlib_documents(max_bytes: int) -> list[bytes]:
    """One document per stdlib file, in sorted order, until ``max_bytes`` bytes in total."""
    docs, total = [], 0
    for path in stdlib_files():
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        if data:
            docs.append(data)
            total += len(data)
    log.info("stdlib corpus: %d files, %d bytes (cap %d)", len(docs), total, max_bytes)
    return docs


def split_text(data: bytes, doc_bytes: int) -> list[bytes]:
    """Documents of one file's bytes (see the module docstring for the rule)."""
    if EOT_MARKER in data:
        return [d for d in data.split(EOT_MARKER) if d.strip()]
    sep = b"\n\n" if b"\n\n" in data else (b"\n" if b"\n" in data else b"")
    docs, pos = [], 0
    while pos < len(data):
        if sep:
            cut = data.find(sep, pos + doc_bytes)
            end = len(data) if cut < 0 else cut + len(sep)
        else:
            end = min(pos + doc_bytes, len(data))
        docs.append(data[pos:end])
        pos = end
    return [d for d in docs if d.strip()]


def file_documents(path: pathlib.Path, doc_bytes: int, max_bytes: int) -> list[bytes]:
    """Documents of a text file or of every file of a directory, capped at ``max_bytes``."""
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")),
                       key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise ValueError(f"data: directory {path} holds no files")
    elif path.is_file():
        files = [path]
    else:
        raise ValueError(f"data: expected 'stdlib', a text file or a directory, found {str(path)!r} (not found)")
    docs, total = [], 0
    for f in files:
        for doc in split_text(f.read_bytes(), doc_bytes):
            if total >= max_bytes:
                return docs
            doc = doc[: max_bytes - total]
            docs.append(doc)
            total += len(doc)
    return docs


def hf_documents(name: str, split: str, text_field: str, max_bytes: int) -> list[bytes]:
    """Rows of a Hugging Face dataset (a hub name, or a local .txt/.json/.jsonl/.csv/.parquet
    file loaded with the matching builder), one document per row's ``text_field``."""
    try:
        import datasets  # optional dependency
    except ImportError as exc:
        raise ImportError("--hf-dataset needs the optional package `datasets` (pip install datasets)") from exc
    builders = {".txt": "text", ".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
    suffix = pathlib.Path(name).suffix
    try:
        if os.path.isfile(name) and suffix in builders:
            ds = datasets.load_dataset(builders[suffix], data_files={split: name}, split=split)
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as exc:  # datasets raises many kinds (no network, no such name or split): name the flag
        raise ValueError(f"hf_dataset {name!r} (split {split!r}) could not be loaded: {type(exc).__name__}: "
                         f"{exc}") from exc
    if text_field not in ds.column_names:
        raise ValueError(f"hf_text_field: dataset {name!r} has columns {ds.column_names}, found no {text_field!r}")
    docs, total = [], 0
    for row in ds:
        if total >= max_bytes:
            break
        doc = row[text_field].encode("utf-8")[: max_bytes - total]
        if doc.strip():
            docs.append(doc)
            total += len(doc)
    return docs


@dataclass
class DataConfig:
    """Where the text comes from and how it is cut; see the module docstring."""

    source: str = "stdlib"  # 'stdlib', a text file or a directory (ignored when hf_dataset is set)
    max_bytes: int = 8_000_000
    doc_bytes: int = 4096
    val_fraction: float = 0.1
    hf_dataset: str | None = None
    hf_split: str = "train"
    hf_text_field: str = "text"

    def validate(self) -> None:
        for name in ("max_bytes", "doc_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"data: {name} must be a positive int, found {value!r}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"data: val_fraction must be in (0, 1), found {self.val_fraction!r}")


def load_documents(config: DataConfig) -> list[bytes]:
    config.validate()
    if config.hf_dataset is not None:
        docs = hf_documents(config.hf_dataset, config.hf_split, config.hf_text_field, config.max_bytes)
    elif config.source == "stdlib":
        docs = stdlib_documents(config.max_bytes)
    else:
        docs = file_documents(pathlib.Path(config.source), config.doc_bytes, config.max_bytes)
    if len(docs) < 2:
        raise ValueError(
            f"data: a train/validation split by document needs at least 2 documents, found {len(docs)} "
            f"in {config.hf_dataset or config.source!r} (lower doc_bytes or give more text)"
        )
    return docs


# --------------------------------------------------------------------------- split
def split_documents(docs: list[bytes], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of the training and validation documents: a seeded permutation, the first
    ``ceil(val_fraction * n)`` documents (at least one, at most n - 1) for validation.
    Each list is returned in corpus order, so the joined text reads as the corpus does."""
    n = len(docs)
    n_val = min(max(1, math.ceil(val_fraction * n)), n - 1)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    val = sorted(perm[:n_val])
    train = sorted(perm[n_val:])
    return train, val


def to_tokens(docs: list[bytes], indices: list[int], separator: bytes = b"\n") -> torch.Tensor:
    """The chosen documents joined by ``separator`` as one uint8 tensor of byte tokens."""
    joined = separator.join(docs[i] for i in indices)
    return torch.frombuffer(bytearray(joined), dtype=torch.uint8)


@dataclass
class Splits:
    train: torch.Tensor  # uint8 tokens
    val: torch.Tensor
    train_docs: list[int]
    val_docs: list[int]


def load_splits(config: DataConfig, seed: int) -> Splits:
    docs = load_documents(config)
    train_idx, val_idx = split_documents(docs, config.val_fraction, seed)
    splits = Splits(to_tokens(docs, train_idx), to_tokens(docs, val_idx), train_idx, val_idx)
    log.info("data: %d documents, train %d (%d bytes), validation %d (%d bytes)",
             len(docs), len(train_idx), splits.train.numel(), len(val_idx), splits.val.numel())
    return splits


# ------------------------------------------------------------------------- batches
#: stream ids mixed into the batch seed, so train and validation windows are independent
TRAIN_STREAM, VAL_STREAM = 0, 1


def batch_seed(seed: int, stream: int, step: int) -> int:
    # distinct (seed, stream, step) give distinct 63-bit seeds for any realistic step count
    return (seed * 2 + stream) * 1_000_000_007 + step


def batch_at(tokens: torch.Tensor, *, seed: int, step: int, batch_size: int, seq_len: int,
             rank: int = 0, world_size: int = 1, stream: int = TRAIN_STREAM) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets, each ``(batch_size // world_size, seq_len)`` int64: this
    rank's rows of the global batch of random windows drawn for ``(seed, stream, step)``."""
    if tokens.numel() < seq_len + 2:
        raise ValueError(f"data: seq_len={seq_len} needs more than {seq_len + 1} tokens, found {tokens.numel()}")
    if batch_size % world_size != 0:
        raise ValueError(f"batch_size must be divisible by the world size {world_size}, found {batch_size}")
    gen = torch.Generator().manual_seed(batch_seed(seed, stream, step))
    offsets = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=gen)
    per_rank = batch_size // world_size
    mine = offsets[rank * per_rank:(rank + 1) * per_rank]
    windows = torch.stack([tokens[o:o + seq_len + 1] for o in mine.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]
