"""Device tables of data pointers, the way the routing kernels take a list of tensors.

The kernels read the N sources (and gradients, running sums, ...) through int64 tables of
their addresses, so the sources are never stacked into a copy. Uploading a table costs the
host a pinned allocation and a copy per call; in a training loop the caching allocator
hands the same addresses to the same call step after step, so the tables repeat.

- Outside CUDA-graph capture, :func:`pointer_tables` keeps the most recent
  ``CACHE_ENTRIES`` tables on their device (host memory for the Triton interpreter),
  keyed by (device, stream, group sizes, addresses), and a repeated call reuses its table
  with no upload. The content of a table is its key, so a hit is always right. Tables are
  allocated on a thread of the module's own (see :func:`_allocate` for why) and copied on
  a stream of its own that the calling stream waits for; the calling stream is in the
  key, so every stream that reads a table has waited for its copy, and an evicted table's
  block is reused only after that stream's reads.
- During capture (``torch.compile(..., mode="reduce-overhead")``: Inductor records the
  compiled graphs as CUDA graphs), the table is copied from pinned host memory inside the
  graph, and the host tensor is kept for the life of the process: every replay repeats the
  copy from that same host block, which must still hold these addresses. It is small (8
  bytes an entry) and made once per captured call.

:func:`cache_counts` says how many lookups found their table and how many made one (an
upload costs the host ~250 us on the H200's hosts, docs/benchmarks.md session 35), so that a
benchmark can tell a step whose tables repeat from one whose addresses keep changing.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["pointer_tables", "Tables", "CACHE_ENTRIES", "clear_cache", "cache_counts"]

#: tables kept (a few hundred bytes each); a training step of the 24-layer DAR model of
#: docs/benchmarks.md makes 196 routing calls, each with tables of its own
CACHE_ENTRIES = 4096


class Tables(tuple):
    """The tables of one call in the order of its groups (a tuple of int64 tensors: unpack
    it), and per group whether every address in it is a multiple of 16 bytes (0 for None
    counts as one): the kernels' ALIGNED hint, found with the table instead of asking each
    tensor again at every call."""

    aligned: tuple[bool, ...]

    def __new__(cls, tables: Sequence[Tensor], aligned: tuple[bool, ...]) -> Tables:
        self = super().__new__(cls, tables)
        self.aligned = aligned
        return self

    def all_aligned(self, *groups: int) -> bool:
        """Whether the groups at these positions (every group when none is named) are aligned."""
        return all(self.aligned[g] for g in groups) if groups else all(self.aligned)


_cache: collections.OrderedDict[tuple, Tables] = collections.OrderedDict()
_cache_lock = threading.Lock()  # calls from several threads: a lookup and its refresh are one step
_upload_streams: dict[torch.device, torch.cuda.Stream] = {}
_allocator: concurrent.futures.ThreadPoolExecutor | None = None
#: pinned host tables read by the copies of captured CUDA graphs (never freed: see above)
_captured_host_tables: list[Tensor] = []
#: lookups since the process started, outside capture: found in the cache, or made
_counts = {"hits": 0, "made": 0}


def clear_cache() -> None:
    """Drop the cached device tables (the captured graphs' host tables stay)."""
    with _cache_lock:
        _cache.clear()


def cache_counts() -> dict[str, int]:
    """Lookups outside CUDA-graph capture since the process started: ``hits`` (the table
    was cached) and ``made`` (it was made, uploaded on CUDA), a copy."""
    with _cache_lock:
        return dict(_counts)


def _views(flat: Tensor, groups, ptrs: tuple[int, ...]) -> Tables:
    views, aligned, start = [], [], 0
    for group in groups:
        views.append(flat[start : start + len(group)])
        aligned.append(not any(p % 16 for p in ptrs[start : start + len(group)]))
        start += len(group)
    return Tables(views, tuple(aligned))


def _allocate(size: int, device: torch.device, stream: torch.cuda.Stream) -> Tensor:
    """An int64 device buffer allocated on a thread of our own. Not on the calling thread:
    during the warm-up runs of Inductor's CUDA-graph trees every allocation of that thread
    goes to the graphs' private pool, where a tensor that outlives the run is refused (only
    tracked outputs may stay alive), and a cached table outlives it."""
    global _allocator
    if _allocator is None:
        _allocator = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="depthrewrite-tables")

    def allocate():
        with torch.cuda.stream(stream):
            return torch.empty(size, dtype=torch.int64, device=device)

    return _allocator.submit(allocate).result()


def _upload(ptrs: tuple[int, ...], device: torch.device, consumer: torch.cuda.Stream) -> Tensor:
    """A table to cache, copied on a stream of our own that ``consumer`` then waits for."""
    side = _upload_streams.get(device)
    if side is None:
        side = _upload_streams[device] = torch.cuda.Stream(device)
    flat = _allocate(len(ptrs), device, side)
    # pinned + non_blocking: a pageable copy would make the host wait for the GPU to drain;
    # the caching host allocator keeps the pinned block until the copy is done
    host = torch.tensor(ptrs, dtype=torch.int64, pin_memory=True)
    with torch.cuda.stream(side):
        flat.copy_(host, non_blocking=True)
    consumer.wait_stream(side)
    # only `consumer` reads it: when evicted, its block is reused once that stream is past the reads
    flat.record_stream(consumer)
    return flat


def pointer_tables(device: torch.device, *groups: Sequence[Tensor | None]) -> Tables:
    """One int64 table of data pointers per group of tensors (0 for None): views of one
    device tensor, with each group's alignment (:class:`Tables`). The tables are read-only:
    kernels must not write them."""
    ptrs = tuple(0 if t is None else t.data_ptr() for group in groups for t in group)
    cuda = device.type == "cuda"
    if cuda and torch.cuda.is_current_stream_capturing():
        host = torch.tensor(ptrs, dtype=torch.int64, pin_memory=True)
        _captured_host_tables.append(host)
        return _views(host.to(device, non_blocking=True), groups, ptrs)
    stream = torch.cuda.current_stream(device) if cuda else None
    key = (device, stream and stream.cuda_stream, tuple(len(g) for g in groups), ptrs)
    with _cache_lock:
        tables = _cache.get(key)
        if tables is not None:
            _cache.move_to_end(key)
            _counts["hits"] += 1
            return tables
    if cuda:
        flat = _upload(ptrs, device, stream)
    else:  # the Triton interpreter reads host memory
        flat = torch.tensor(ptrs, dtype=torch.int64, device=device)
    tables = _views(flat, groups, ptrs)
    with _cache_lock:  # two threads that missed the same key both store it: same content
        _counts["made"] += 1
        _cache[key] = tables
        _cache.move_to_end(key)
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return tables
