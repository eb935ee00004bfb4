"""KV-cache memory math: how many bytes a cache needs, whether it fits, and how much of it a layout wastes.

One token of one sequence costs, in every layer, a key and a value vector per KV head:

    bytes per token = 2 (K and V) x layers x KV heads x head_dim x bytes per element

so a cache of `batch` sequences of `tokens` each is batch x tokens x that. Multi-head attention (MHA) has as many
KV heads as query heads; grouped-query attention (GQA, Ainslie et al. 2023, https://arxiv.org/abs/2305.13245)
shares each KV head among a group of query heads; multi-query attention (MQA, Shazeer 2019,
https://arxiv.org/abs/1911.02150) keeps one. `variants()` builds the three for one model shape.

The module also:

* checks a formula against what is really allocated (`allocated_bytes(cache)` sums the cache's tensors);
* refuses a cache larger than the free memory before allocating anything (`check_fits`: CUDA free memory from
  `torch.cuda.mem_get_info`, host memory from /proc/meminfo's MemAvailable);
* compares max-length preallocation with a paged cache on a mixed-length workload (`waste`; measured with real
  caches in `llmlab.measure.kv_costs`).

It imports no cache class: the caches import it.
"""

from __future__ import annotations

import math
import numbers
import os
import random
from dataclasses import dataclass, replace

import torch

from llmlab.config import ModelConfig


def element_size(dtype: torch.dtype) -> int:
    """Bytes per element of `dtype`. TypeError for anything but a torch.dtype (a name such as "bf16" included)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype={dtype!r}: give a torch.dtype, e.g. torch.bfloat16, torch.float16, torch.float32 or "
                        f"torch.int8")
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_token(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
    """2 x layers x KV heads x head_dim x bytes per element (bytes per token of one sequence, all layers)."""
    return 2 * config.n_layers * config.n_kv_heads * config.head_dim * element_size(dtype)


def _check_counts(**counts) -> None:
    """ValueError naming the first count that is not a whole number >= 0 (>= 1 for block_size)."""
    for name, value in counts.items():
        low = 1 if name == "block_size" else 0
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"{name}={value!r}: must be a whole number >= {low}")


def cache_bytes(config: ModelConfig, tokens: int, batch: int = 1, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a contiguous cache for `batch` sequences of `tokens` tokens. Raises ValueError for a negative
    or non-integer count."""
    _check_counts(tokens=tokens, batch=batch)
    return int(batch) * int(tokens) * bytes_per_token(config, dtype)  # NumPy integers are taken, ints returned


def variants(config: ModelConfig) -> dict[str, ModelConfig]:
    """The same shape with MHA (KV heads = query heads), its own KV-head count, and MQA (one KV head).

    The model's own variant is named after it: 'GQA' when 1 < KV heads < heads (or 'MHA'/'MQA' if it is one).
    """
    out = {"MHA": replace(config, n_kv_heads=config.n_heads)}
    if 1 < config.n_kv_heads < config.n_heads:
        out[f"GQA ({config.n_heads // config.n_kv_heads} q heads per KV head)"] = config
    out["MQA"] = replace(config, n_kv_heads=1)
    return out


def calculator(presets: list[str] | None = None, context: int = 8192, batch: int = 1,
               dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """One row per (preset, attention variant): KB per token and GB for `batch` x `context` tokens.

    presets: names from `llmlab.config.PRESETS` (default: all). Raises ValueError for a negative context or batch.
    """
    from llmlab.config import PRESETS
    _check_counts(context=context, batch=batch)
    context, batch = int(context), int(batch)
    rows = []
    for name in presets or list(PRESETS):
        config = ModelConfig.from_preset(name)
        for kind, c in variants(config).items():
            rows.append({"model": name, "attention": kind, "layers": c.n_layers, "heads": c.n_heads,
                         "kv_heads": c.n_kv_heads, "head_dim": c.head_dim,
                         "kb_per_token": bytes_per_token(c, dtype) / 1024,
                         "gb": cache_bytes(c, context, batch, dtype) / 1e9, "context": context, "batch": batch})
    return rows


def allocated_bytes(cache) -> int:
    """Bytes actually held by a cache's tensors (every tensor attribute, and lists of tensors, counted once)."""
    seen, total = set(), 0
    for value in vars(cache).values():
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


# -- does it fit? -------------------------------------------------------------------------------------------------

CGROUP_FILES = {"v2": ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                "v1": ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")}


def _cgroup_room() -> int | None:
    """Bytes left under this container's memory limit (cgroup v2, else v1), or None without a limit. Binder,
    Docker and Kubernetes limit a container below the host's memory, which /proc/meminfo still shows."""
    for limit_file, usage_file in CGROUP_FILES.values():
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 writes a huge number for none
            return None
        return max(0, int(limit) - usage)
    return None


def available_memory(device) -> tuple[int, str]:
    """(bytes free for a new allocation, a description) on `device`.

    CUDA: `torch.cuda.mem_get_info` free bytes plus what PyTorch's caching allocator holds but no tensor uses
    ("GPU memory is free"). CPU: MemAvailable from /proc/meminfo (Linux), else available pages x page size from
    os.sysconf, and no more than what this container's memory limit (cgroup) leaves ("host memory is
    available"). A reading that is missing or not positive counts as unknown: 2^62 bytes, so nothing is refused.
    Raises ValueError for a CUDA device on a machine without one.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():  # else an AssertionError deep in torch ("not compiled with CUDA")
            raise ValueError(f"device {str(device)!r}: this machine has no CUDA GPU that PyTorch can use; use "
                             f"device='cpu'")
        free, _total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + max(0, cached), "GPU memory is free"
    host = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    host = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if host is None:
        try:
            pages, page = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")  # -1: unknown
            host = pages * page if pages > 0 and page > 0 else None
        except (ValueError, OSError, AttributeError):
            host = None
    if host is not None and host <= 0:
        host = None
    room = _cgroup_room()
    if room is not None:
        return (room if host is None else min(host, room)), "host memory is available (container limit included)"
    if host is None:
        return 1 << 62, "host memory is available (unknown)"
    return host, "host memory is available"


def _size(nbytes: float) -> str:
    """Bytes in GB, or MB below 1 GB (so that small sizes do not all read 0.06 GB)."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"


def check_fits(nbytes: int, device, what: str, fix: str) -> None:
    """Raise MemoryError BEFORE allocating when `nbytes` exceed the free memory of `device`.

    The message names what (e.g. 'KV cache (16 layers x batch 8 x 4096 tokens)'), the bytes needed and available,
    and `fix` (what to change). Raises nothing when it fits.
    """
    free, where = available_memory(device)
    if nbytes > free:
        raise MemoryError(f"{what} needs {_size(nbytes)} but only {_size(free)} of {where}; {fix}")


# -- waste: max-length preallocation vs paging ---------------------------------------------------------------------

def mixed_lengths(n: int = 64, low: int = 16, high: int = 1024, seed: int = 0) -> list[int]:
    """A mixed-length workload: n final sequence lengths (prompt + output), log-uniform in [low, high]
    (many short chats, a few long ones). Seeded."""
    rng = random.Random(seed)
    return [int(round(math.exp(rng.uniform(math.log(low), math.log(high))))) for _ in range(n)]


@dataclass
class Waste:
    """Token slots reserved vs used by a layout on one workload (multiply by bytes_per_token for bytes)."""

    layout: str
    reserved_tokens: int
    used_tokens: int

    @property
    def wasted_tokens(self) -> int:
        return self.reserved_tokens - self.used_tokens

    @property
    def waste_fraction(self) -> float:
        """Share of the reserved memory that holds no token (0..1)."""
        return self.wasted_tokens / self.reserved_tokens if self.reserved_tokens else 0.0


def _check_lengths(lengths: list[int], max_seq_len: int, block_size: int) -> None:
    """ValueError for a bad count, or a sequence longer than the max_seq_len every slot of the layout holds."""
    _check_counts(max_seq_len=max_seq_len, block_size=block_size)
    for n in lengths:
        _check_counts(length=n)
    too_long = [n for n in lengths if n > max_seq_len]
    if too_long:
        raise ValueError(f"{len(too_long)} of the {len(lengths)} lengths exceed max_seq_len={max_seq_len} (the "
                         f"longest: {max(too_long)}); raise max_seq_len to at least {max(too_long)} or drop the "
                         f"longer sequences")


def waste(lengths: list[int], max_seq_len: int, block_size: int = 16) -> list[Waste]:
    """Reserved vs used slots for contiguous max-length preallocation and for a paged cache.

    Contiguous: every sequence reserves max_seq_len slots (it may grow that long; the server cannot know). Paged:
    ceil(length / block_size) blocks each, so at most block_size - 1 slots wasted per sequence. Raises ValueError
    for a block_size < 1, a negative length, or a length beyond max_seq_len (a preallocated sequence cannot grow
    past it: its waste would come out negative).
    """
    _check_lengths(lengths, max_seq_len, block_size)
    lengths, max_seq_len, block_size = [int(n) for n in lengths], int(max_seq_len), int(block_size)
    used = sum(lengths)
    return [Waste("max-length preallocation", len(lengths) * max_seq_len, used),
            Waste(f"paged (block_size={block_size})", sum(-(-n // block_size) * block_size for n in lengths), used)]
