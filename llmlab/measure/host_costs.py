"""What the CPU spends around the model: tokenizing, copying to the GPU, sampling — each measured on its own.

Once the decode step is a CUDA graph, the GPU's time per token is small, and host work that used to hide behind
kernel launches starts to show. Three candidates, each with the number that matters for decode:

* the tokenizer: encoding a prompt is paid once per request (it adds to TTFT); decoding one new token to text
  (what a streaming server does every step) is paid per token;
* host->device copies: pageable memory is first copied into a driver buffer; pinned (page-locked) memory is
  DMA'd directly and `non_blocking=True` lets the CPU go on at once
  (https://pytorch.org/docs/stable/notes/cuda.html#use-pinned-memory-buffers). Decode copies almost nothing to
  the GPU (a prompt once), so this is usually small — the measurement says how small;
* sampling: on the GPU it is a handful of small kernels; reading the token back (`.tolist()`) waits for the
  whole step, which is the per-token synchronization that `gpu_sampling` removes. Sampling on the CPU copies the
  full logits row (vocab x 4 bytes) back first.

Every function returns plain dicts (milliseconds or microseconds as named) for a table or a plot.
"""

from __future__ import annotations

import statistics
import time

import torch

from llmlab.sampling import sample

SAMPLE_TEXT = (
    "Return a new sorted list from the items in iterable. A custom key function can be supplied to customize the "
    "sort order, and the reverse flag can be set to request the result in descending order.\n"
    "def sorted(iterable, /, *, key=None, reverse=False):\n    ...\n"
)


def _median_s(fn, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def tokenizer_cost(tokenizer=None, texts: list[str] | None = None, repeats: int = 20) -> dict:
    """Time the tokenizer: encode each prompt, decode its ids back, and decode one token at a time.

    Args:
        tokenizer: a `tokenizers.Tokenizer` (default: the shipped default model's, `llmlab.checkpoint`).
        texts: prompts to time (default: SAMPLE_TEXT repeated 1, 8 and 64 times: 60, 473 and 3777 tokens
            with the shipped tokenizer).
        repeats: timed calls per measurement (the median is reported).

    Returns:
        {"prompts": [{"chars", "tokens", "encode_ms", "decode_ms", "encode_us_per_token"}, ...],
         "decode_one_token_us": median time to turn one generated token id into text (paid every decode step),
         "tokenizer": a short description}.

    Raises:
        FileNotFoundError: no tokenizer given and the default model's folder has none.
    """
    if tokenizer is None:
        from llmlab.checkpoint import load_tokenizer

        tokenizer = load_tokenizer("default")
    texts = texts or [SAMPLE_TEXT * n for n in (1, 8, 64)]
    rows = []
    for text in texts:
        ids = tokenizer.encode(text).ids
        enc = _median_s(lambda: tokenizer.encode(text), repeats)
        dec = _median_s(lambda: tokenizer.decode(ids), repeats)
        rows.append({"chars": len(text), "tokens": len(ids), "encode_ms": enc * 1e3, "decode_ms": dec * 1e3,
                     "encode_us_per_token": enc * 1e6 / max(1, len(ids))})
    some_ids = tokenizer.encode(texts[0]).ids[:64] or [0]
    one = _median_s(lambda: [tokenizer.decode([i]) for i in some_ids], max(3, repeats // 4)) / len(some_ids)
    return {"prompts": rows, "decode_one_token_us": one * 1e6,
            "tokenizer": f"{type(tokenizer).__name__}, vocab {tokenizer.get_vocab_size()}"}


def h2d_copy_cost(sizes: tuple[int, ...] = (8, 4 << 10, 1 << 20, 64 << 20), device=None, repeats: int = 20) -> dict:
    """Time host->device copies from pageable vs pinned memory, for buffers of `sizes` bytes.

    For each size: `host_ms` is how long the CPU is held by the call (pinned + non_blocking returns at once),
    `total_ms` the time until the data is on the GPU (CUDA events), `gb_s` = bytes / total.

    Returns:
        {"available": bool, "reason": str, "rows": [{"bytes", "pageable_host_ms", "pageable_total_ms",
         "pageable_gb_s", "pinned_host_ms", "pinned_total_ms", "pinned_gb_s"}, ...]}; on a machine without a
        CUDA GPU available is False and rows is empty (nothing to copy to).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type != "cuda":
        return {"available": False, "reason": "host->device copies need a CUDA GPU", "rows": []}
    rows = []
    for nbytes in sizes:
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        row = {"bytes": nbytes}
        for kind in ("pageable", "pinned"):
            src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=(kind == "pinned"))
            host, total = [], []
            for i in range(repeats + 2):
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                start.record()
                dst.copy_(src, non_blocking=(kind == "pinned"))
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                if i >= 2:  # the first two warm up
                    host.append((t1 - t0) * 1e3)
                    total.append(start.elapsed_time(end))
            row[f"{kind}_host_ms"] = statistics.median(host)
            row[f"{kind}_total_ms"] = statistics.median(total)
            row[f"{kind}_gb_s"] = nbytes / (row[f"{kind}_total_ms"] / 1e3) / 1e9
        rows.append(row)
    return {"available": True, "reason": "", "rows": rows}


def sampling_cost(vocab_size: int = 8192, batch: int = 1, device=None, temperature: float = 1.0,
                  top_k: int | None = 50, top_p: float | None = 0.9, repeats: int = 50) -> dict:
    """Time picking the next token from (batch, vocab_size) logits, three ways (host clock, medians):

    * "gpu_ms": `sample` on the logits' device, no read-back (what gpu_sampling does each step; on a GPU this is
      the time to queue the kernels — they then run while the CPU goes on);
    * "gpu_then_host_ms": the same plus `.tolist()` (one synchronization per token, what `generate` does);
    * "cpu_ms": copy the logits to the host, then sample there.

    Greedy ("argmax") is timed the same three ways under "greedy_*". On a machine without a GPU the "gpu_*"
    entries are None and "reason" says why.

    Returns a dict of milliseconds plus the settings.
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(0)
    host_logits = torch.randn(batch, vocab_size, generator=gen) * 3
    out = {"vocab_size": vocab_size, "batch": batch, "temperature": temperature, "top_k": top_k, "top_p": top_p,
           "device": str(device), "reason": ""}
    on_gpu = device.type == "cuda"
    dev_logits = host_logits.to(device)
    cpu_gen = torch.Generator().manual_seed(1)
    dev_gen = torch.Generator(device=device).manual_seed(1)

    def sync():
        if on_gpu:
            torch.cuda.synchronize(device)

    for prefix, t in (("", temperature), ("greedy_", 0.0)):
        kw = dict(temperature=t, top_k=top_k if t > 0 else None, top_p=top_p if t > 0 else None)
        if on_gpu:
            def gpu():
                sample(dev_logits, generator=dev_gen, **kw)

            def gpu_host():
                sample(dev_logits, generator=dev_gen, **kw).tolist()

            sync()
            out[f"{prefix}gpu_ms"] = _median_s(gpu, repeats) * 1e3
            sync()
            out[f"{prefix}gpu_then_host_ms"] = _median_s(gpu_host, repeats) * 1e3
        else:
            out[f"{prefix}gpu_ms"] = out[f"{prefix}gpu_then_host_ms"] = None
            out["reason"] = "no CUDA GPU: only the CPU path is measured"
        out[f"{prefix}cpu_ms"] = _median_s(
            lambda: sample(dev_logits.cpu(), generator=cpu_gen, **kw).tolist(), repeats) * 1e3
    return out
