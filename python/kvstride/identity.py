"""The identity of a checkpoint's weights: what a stored KV value is bound to, so that an engine
never loads KV that other weights computed (a new checkpoint rolled out to the same path, a
fine-tune beside its base model).

:func:`checkpoint_digest` reads, in a fraction of a second whatever the checkpoint's size:

- every top-level ``*.json`` file but the tokenizer's (``config.json``, quantization configs,
  the safetensors index), whole;
- each ``*.safetensors`` file's header whole (every tensor's name, dtype, shape and byte
  offsets, and the ``__metadata__``), and of each tensor's data ``WINDOWS`` windows of
  ``WINDOW_BYTES`` spread over it (its first and last bytes among them), or all of it when it is
  not larger than those windows; a checkpoint of more than ``MAX_SAMPLED_WINDOWS / WINDOWS``
  tensors (MoE experts) gets fewer windows a tensor, at least its first ``WINDOW_BYTES``;
- a checkpoint in another format (``*.bin``, ``*.pt``, ``*.pth``, a ``.gguf`` file): each file's
  size and ``FILE_WINDOWS`` windows spread evenly over it.

What it detects: any change to the config, to a tensor's name, dtype, shape or place, and any
change that touches a tensor broadly: a full fine-tune, a merged LoRA (its low-rank update
changes nearly every element of the matrices it targets), re-quantization, a different seed;
and any change at all to a small tensor (norms, biases: hashed whole). What it cannot see: a
change confined to bytes between the sampled windows (an edit of a few rows or single
weights in a large tensor, of the same size). An operator who changes weights that way sets
``kv_connector_extra_config["model_identity"]`` to a new release tag.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

__all__ = [
    "CheckpointDigest",
    "checkpoint_digest",
    "checkpoint_files",
    "code_digest",
    "WINDOW_BYTES",
    "WINDOWS",
    "FILE_WINDOWS",
    "MAX_SAMPLED_WINDOWS",
    "local_checkpoint",
    "plain",
]

#: Bytes in one sampled window of a tensor's data.
WINDOW_BYTES = 4096
#: Windows per safetensors tensor: its start, end and evenly between.
WINDOWS = 4
#: Windows per weight file of another format (no tensor table to follow).
FILE_WINDOWS = 64
#: Windows of a whole checkpoint at most: a checkpoint of more than MAX_SAMPLED_WINDOWS /
#: WINDOWS tensors (tens of thousands of MoE experts) gets fewer windows a tensor, down to one,
#: its first bytes (every read costs a drive seek where the page cache is cold).
MAX_SAMPLED_WINDOWS = 16384
#: The largest safetensors header read (the format's own readers refuse larger ones).
MAX_HEADER_BYTES = 100 << 20
#: Top-level JSON files that describe the tokenizer: block keys are token ids, so a tokenizer
#: change alone does not change a block's KV.
_TOKENIZER_FILES = ("tokenizer", "vocab", "special_tokens_map", "added_tokens", "merges")
_OTHER_WEIGHTS = (".bin", ".pt", ".pth")
_THREADS = 8  # files read at once: a cold drive serves several reads in parallel


@dataclass(frozen=True)
class CheckpointDigest:
    """``digest``: SHA-256 hex over every file's part, in file-name order; ``files``,
    ``tensors`` and ``bytes_read``: what it covered and what that cost."""

    digest: str
    files: int
    tensors: int
    bytes_read: int


def checkpoint_files(path, weights: bool = True) -> List[Path]:
    """The files :func:`checkpoint_digest` reads in ``path`` (a folder, or one weight file):
    the config JSONs and, with ``weights``, the weights vLLM would load (``*.safetensors`` when
    there are any, else ``*.bin`` / ``*.pt`` / ``*.pth``), sorted; ``ValueError`` when there
    are no weights."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"checkpoint {str(path)!r} is neither a folder nor a file")
    entries = sorted(p for p in path.iterdir() if p.is_file())
    configs = [p for p in entries if p.suffix == ".json" and not p.name.startswith(_TOKENIZER_FILES)]
    if not weights:
        return configs
    found = [p for p in entries if p.suffix == ".safetensors"] or [p for p in entries if p.suffix in _OTHER_WEIGHTS]
    if not found:
        raise ValueError(f"checkpoint folder {str(path)!r} holds no *.safetensors, *.bin, *.pt or *.pth weights")
    return configs + found


def checkpoint_digest(path, weights: bool = True, threads: int = _THREADS) -> CheckpointDigest:
    """The digest of the checkpoint at ``path`` (see the module docstring for what it covers;
    without ``weights``, its config files alone); ``ValueError`` naming the file when one
    cannot be read or is not what its name says."""
    files = checkpoint_files(path, weights)
    with ThreadPoolExecutor(max(1, min(threads, len(files) or 1))) as pool:
        heads = list(pool.map(_file_head, files))
        tensors = sum(len(head.spans) for head in heads)
        # Many-tensor checkpoints (MoE experts) get fewer windows a tensor, never fewer than one.
        windows = max(1, min(WINDOWS, MAX_SAMPLED_WINDOWS // max(1, tensors)))
        parts = list(pool.map(lambda head: _file_part(head, windows), heads))
    total = hashlib.sha256(b"kvstride checkpoint digest v1\0")
    bytes_read = 0
    for file, (digest, nbytes) in zip(files, parts):
        total.update(file.name.encode() + b"\0" + digest)
        bytes_read += nbytes
    return CheckpointDigest(total.hexdigest(), len(files), tensors, bytes_read)


@dataclass
class _Head:
    """What one file's first read found: the bytes to hash whole (a JSON file, a safetensors
    header) and the (start, length) in the file of each tensor's data to sample."""

    file: Path
    size: int
    whole: bytes
    spans: list


def _file_head(file: Path) -> _Head:
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if file.suffix == ".json":
                return _Head(file, size, f.read(), [])
            if file.suffix == ".safetensors":
                return _safetensors_head(file, f.fileno(), size)
            return _Head(file, size, struct.pack("<Q", size), [])
    except OSError as err:
        raise ValueError(f"cannot read checkpoint file {str(file)!r}: {err}") from err


def _safetensors_head(file: Path, fd: int, size: int) -> _Head:
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise ValueError(f"{str(file)!r} is not a safetensors file (shorter than its 8-byte header length)")
    (header_len,) = struct.unpack("<Q", head)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise ValueError(f"{str(file)!r} is not a safetensors file (header length {header_len} of a {size}-byte file)")
    header = os.pread(fd, header_len, 8)
    try:
        table = json.loads(header)
        offsets = sorted(
            (int(v["data_offsets"][0]), int(v["data_offsets"][1])) for k, v in table.items() if k != "__metadata__"
        )
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise ValueError(f"{str(file)!r} is not a safetensors file (its header does not parse: {err})") from err
    data_start = 8 + header_len
    for begin, end in offsets:
        if not 0 <= begin <= end or data_start + end > size:
            raise ValueError(f"{str(file)!r}: a tensor's data_offsets [{begin}, {end}] fall outside the file")
    return _Head(file, size, head + header, [(data_start + begin, end - begin) for begin, end in offsets])


def _file_part(head: _Head, windows: int):
    """(digest, bytes read) of one file: its whole part, then the sampled windows of each
    tensor (``windows`` each) or, for a weight file without a tensor table, of the file."""
    digest = hashlib.sha256(head.whole)
    nbytes = len(head.whole) if head.file.suffix in (".json", ".safetensors") else 0  # else its size, not read
    if head.file.suffix == ".json":
        return digest.digest(), nbytes
    spans = head.spans if head.file.suffix == ".safetensors" else [(0, head.size)]
    count = windows if head.file.suffix == ".safetensors" else FILE_WINDOWS
    try:
        with open(head.file, "rb") as f:
            for start, length in spans:
                for offset, window in _windows(length, count):
                    chunk = os.pread(f.fileno(), window, start + offset)
                    digest.update(chunk)
                    nbytes += len(chunk)
    except OSError as err:
        raise ValueError(f"cannot read checkpoint file {str(head.file)!r}: {err}") from err
    return digest.digest(), nbytes


def _windows(size: int, count: int):
    """(offset, length) of ``count`` windows of ``WINDOW_BYTES`` spread over ``size`` bytes, the
    first at 0 and the last ending at ``size`` (one window: the first); one window of everything
    when that is no more."""
    if size <= count * WINDOW_BYTES:
        return [(0, size)] if size else []
    if count == 1:
        return [(0, WINDOW_BYTES)]
    last = size - WINDOW_BYTES
    return [(last * i // (count - 1), WINDOW_BYTES) for i in range(count)]


def local_checkpoint(model: str, revision: Optional[str] = None, download_dir: Optional[str] = None) -> Optional[Path]:
    """Where the weights of vLLM's ``--model`` are on this host: the path itself when it
    exists, else the Hugging Face cache's snapshot of that repository and revision (vLLM
    downloads it there before the scheduler starts); None when neither is found."""
    path = Path(model).expanduser()
    if path.exists():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True))
    except Exception:  # not a repository id, or not in the cache: the caller says what that means
        return None


def code_digest(path) -> str:
    """SHA-256 hex of the model code in checkpoint folder ``path``: every ``*.py`` file in it
    and its subfolders (what ``trust_remote_code`` imports), by relative path and content."""
    root = Path(path)
    total = hashlib.sha256(b"kvstride model code v1\0")
    for file in sorted(p for p in root.rglob("*.py") if p.is_file()):
        try:
            content = file.read_bytes()
        except OSError as err:
            raise ValueError(f"cannot read model code {str(file)!r}: {err}") from err
        name = file.relative_to(root).as_posix().encode()
        total.update(struct.pack("<QQ", len(name), len(content)) + name + content)
    return total.hexdigest()


def plain(value):
    """``value`` as JSON-ready data, the same in every process: dicts by key, sets sorted, a
    function or class by its qualified name, anything else by its repr (configuration such as
    ``hf_overrides`` in a fingerprint)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if callable(value) and hasattr(value, "__qualname__"):  # its repr holds an address: another in each process
        return f"callable:{getattr(value, '__module__', '?')}.{value.__qualname__}"
    return repr(value)
