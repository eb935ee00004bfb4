"""KV-cache quantization: store past keys/values in int8 (or fp8 e4m3) with one scale per token per head, and keep
the most recent R tokens in full precision.

Every decode step reads the whole cache, so at long contexts the cache — not the weights — is most of the bytes
moved. Storing it in 8 bits halves those bytes (vs bf16) and doubles the tokens that fit. The quantizer here:

* per token, per KV head: scale = max |x| over head_dim / 127 (int8) or / 448 (fp8 e4m3, the largest finite e4m3
  value); q = round(x / scale). One outlier channel then spoils only its own token's vector, not the whole tensor;
* a residual window: the R most recent tokens stay in the model's dtype (they receive the most attention and are
  still being written). When a token leaves the window it is quantized once, in place (KIVI, Liu et al. 2024,
  https://arxiv.org/abs/2402.02750, keeps a full-precision residual the same way; vLLM's fp8 KV cache,
  https://docs.vllm.ai/en/latest/features/quantization/quantized_kvcache.html, quantizes everything);
* the tokens written in a call (a prefill) attend to each other in full precision, as fresh K/V; what the cache
  keeps for later steps is the quantized copy.

`QuantizedKVCache` has `KVCache`'s interface, so `generate(model, ids, cache_factory=QuantizedKVCache)` runs it.
The attention here dequantizes to the model's dtype (the reference); a fused kernel would read the 8-bit values.
`perplexity` and `greedy_agreement` measure what the quantization costs in quality.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch
import torch.nn.functional as F

from llmlab.config import ModelConfig
from llmlab.cache.kv_cache import check_cache_args
from llmlab.cache.sizing import check_fits

QMAX = {"int8": 127.0, "fp8": 448.0}  # largest magnitude of each format (fp8 = float8_e4m3fn)


def storage_dtype(kind: str) -> torch.dtype:
    """torch dtype of the stored values: int8, or float8_e4m3fn for 'fp8'. Raises ValueError otherwise."""
    if kind == "int8":
        return torch.int8
    if kind == "fp8":
        if not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("this PyTorch has no float8_e4m3fn; use kind='int8'")
        return torch.float8_e4m3fn
    raise ValueError(f"unknown KV quantization {kind!r}; use 'int8' or 'fp8'")


def quantize(x: torch.Tensor, kind: str = "int8") -> tuple[torch.Tensor, torch.Tensor]:
    """x: (..., hd) float -> (q (..., hd) int8 / float8_e4m3fn, scale (..., 1) fp32), one scale per vector.

    int8: q = round(x / s).clamp(-127, 127), s = amax / 127. fp8: q = (x / s) cast to e4m3, s = amax / 448.
    Raises ValueError for another kind (see `storage_dtype`).
    """
    storage_dtype(kind)  # an unknown kind: the error names the known ones
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / QMAX[kind]  # (..., 1)
    y = x32 / scale
    if kind == "int8":
        return y.round().clamp(-127, 127).to(torch.int8), scale
    return y.clamp(-448, 448).to(storage_dtype(kind)), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (..., hd), scale (..., 1) -> q * scale in `dtype`."""
    return (q.float() * scale).to(dtype)


class QuantizedKVCache:
    """A contiguous KV cache stored in 8 bits with per-token, per-head fp32 scales and an R-token full-precision tail.

    Args:
        config, batch_size, max_seq_len, dtype, device: as `KVCache` (dtype = the model's, used for the tail and for
            what attention reads).
        residual: R, the most recent tokens kept in full precision (0 = quantize everything).
        kind: 'int8' or 'fp8' (float8_e4m3fn; any device that has the dtype can store it — Hopper GPUs also compute
            with it).

    Raises:
        ValueError: sizes, unknown kind. MemoryError: does not fit (needed vs available, before allocating).

    Layout per layer: kq, vq (B, Hkv, max_seq_len, hd) 8-bit; k_scale, v_scale (B, Hkv, max_seq_len, 1) fp32;
    tokens 0..n_quant-1 live there, tokens n_quant..length-1 (at most R) in the full-precision tails.
    """

    def __init__(self, config: ModelConfig, batch_size: int, max_seq_len: int, dtype: torch.dtype, device,
                 residual: int = 32, kind: str = "int8"):
        check_cache_args(config, dtype, batch_size=batch_size, max_seq_len=max_seq_len)
        batch_size, max_seq_len = int(batch_size), int(max_seq_len)
        _check_residual(residual)
        qdtype = storage_dtype(kind)
        device = torch.device(device)
        shape = (batch_size, config.n_kv_heads, max_seq_len, config.head_dim)
        elem = torch.empty((), dtype=dtype).element_size()
        self.nbytes = 2 * config.n_layers * (
            torch.Size(shape).numel() * 1 + torch.Size(shape[:3]).numel() * 4  # 8-bit values + fp32 scales
            + batch_size * config.n_kv_heads * min(residual, max_seq_len) * config.head_dim * elem)  # the tail
        check_fits(self.nbytes, device, f"{kind} KV cache ({config.n_layers} layers x batch {batch_size} x "
                   f"{max_seq_len} tokens)", "lower the batch size or max_seq_len (in generate: fewer prompts, a "
                   "shorter prompt or a smaller max_new_tokens; the cache holds prompt + new tokens)")
        self.config, self.batch_size, self.max_seq_len = config, batch_size, max_seq_len
        self.residual, self.kind, self.dtype = int(residual), kind, dtype  # a numpy count becomes a plain int
        L = config.n_layers
        self.kq = [torch.zeros(shape, dtype=qdtype, device=device) for _ in range(L)]
        self.vq = [torch.zeros(shape, dtype=qdtype, device=device) for _ in range(L)]
        self.k_scale = [torch.zeros(shape[:3] + (1,), device=device) for _ in range(L)]
        self.v_scale = [torch.zeros(shape[:3] + (1,), device=device) for _ in range(L)]
        empty = (batch_size, config.n_kv_heads, 0, config.head_dim)
        self.k_tail = [torch.zeros(empty, dtype=dtype, device=device) for _ in range(L)]
        self.v_tail = [torch.zeros(empty, dtype=dtype, device=device) for _ in range(L)]
        self.n_quant = 0  # tokens stored quantized
        self.length = 0

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> int:
        """Bytes of one quantized token (values + fp32 scales, all layers); the R-token tail costs the dtype's."""
        return 2 * config.n_layers * config.n_kv_heads * (config.head_dim + 4)

    def update(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Append k, v (B, Hkv, T, hd) at positions length..length+T-1; return (B, Hkv, S, hd) K/V in the model's
        dtype: the quantized tokens dequantized, then the full-precision tail (which includes this call's tokens).

        Raises:
            ValueError: a write that does not continue the cache (positions[0] != length), or past max_seq_len.
        """
        B, T = k.shape[0], k.shape[2]
        if layer == 0:
            start = int(positions[0])
            if start != self.length:
                raise ValueError(f"the quantized cache holds {self.length} tokens; writes must continue at that "
                                 f"position (got {start})")
            if start + T > self.max_seq_len:
                raise ValueError(f"the KV cache holds {self.max_seq_len} tokens but position {start + T - 1} was "
                                 f"written; allocate a larger cache")
            tail = self.length - self.n_quant + T
            self._plan = (self.n_quant, max(0, tail - self.residual))  # (quantized before, tokens to spill now)
            self._new_tails = {}  # layer -> its tail after this call, committed with the length at the last layer
        n_q, spill = self._plan
        k_tail = torch.cat([self.k_tail[layer][:B], k], dim=2)  # (B, Hkv, tail, hd) full precision
        v_tail = torch.cat([self.v_tail[layer][:B], v], dim=2)
        k_old = dequantize(self.kq[layer][:B, :, :n_q], self.k_scale[layer][:B, :, :n_q], k.dtype)
        v_old = dequantize(self.vq[layer][:B, :, :n_q], self.v_scale[layer][:B, :, :n_q], v.dtype)
        k_all, v_all = torch.cat([k_old, k_tail], dim=2), torch.cat([v_old, v_tail], dim=2)
        if spill:  # the oldest tail tokens leave the window: quantize them once
            qk, sk = quantize(k_tail[:, :, :spill], self.kind)
            qv, sv = quantize(v_tail[:, :, :spill], self.kind)
            self.kq[layer][:B, :, n_q:n_q + spill], self.k_scale[layer][:B, :, n_q:n_q + spill] = qk, sk
            self.vq[layer][:B, :, n_q:n_q + spill], self.v_scale[layer][:B, :, n_q:n_q + spill] = qv, sv
        # the tails are replaced only once every layer has run: a call cut short (an error, Ctrl-C) leaves the cache
        # as it was, and a retry of the same positions appends once (the spilled slots above lie past n_quant, so
        # writing them again is harmless)
        self._new_tails[layer] = (k_tail[:, :, spill:], v_tail[:, :, spill:])
        if layer == len(self.kq) - 1:
            for i, (kt, vt) in self._new_tails.items():
                self.k_tail[i], self.v_tail[i] = kt, vt
            self._new_tails = {}
            self.n_quant += spill
            self.length += T
        return k_all, v_all

    def reset(self) -> None:
        self.n_quant = self.length = 0
        self.k_tail = [t[:, :, :0] for t in self.k_tail]
        self.v_tail = [t[:, :, :0] for t in self.v_tail]


def _check_residual(residual) -> None:
    if isinstance(residual, bool) or not isinstance(residual, numbers.Integral) or residual < 0:
        raise ValueError(f"residual={residual!r}: the full-precision window must be a whole number of tokens >= 0 "
                         f"(0 = quantize everything), e.g. 32")


def quantized_cache(residual: int = 32, kind: str = "int8"):
    """A `cache_factory` for `generate`: QuantizedKVCache with this residual window and format.

    Raises ValueError for an unknown kind or a residual that is not a whole number >= 0, here rather than at the
    first generate call."""
    storage_dtype(kind)  # the unknown-kind message
    _check_residual(residual)
    return functools.partial(QuantizedKVCache, residual=residual, kind=kind)


# -- quality ----------------------------------------------------------------------------------------------------

@torch.inference_mode()
def perplexity(model, ids: list[int] | torch.Tensor, cache_factory=None, prefill: int = 1) -> float:
    """exp(mean next-token NLL) of `ids`, decoded through a KV cache token by token (after a `prefill`-token prefill).

    Token by token matters: a long prefill attends over the fresh full-precision K/V and would hide the cache's
    quantization; each decode step reads what the cache stored. cache_factory: None = the contiguous `KVCache`.
    ids: N token ids, 2 <= N <= the model's context; prefill: 1 .. N - 1 tokens. Raises ValueError otherwise.
    """
    from llmlab.cache.kv_cache import KVCache

    param = next(model.parameters())
    ids = torch.as_tensor(ids, dtype=torch.long, device=param.device).reshape(1, -1)  # (1, N)
    N, context = ids.shape[1], model.config.max_seq_len
    if not 2 <= N <= context:
        raise ValueError(f"perplexity needs 2 to {context} token ids (the model's context) and got {N}: one token "
                         f"predicts nothing")
    if isinstance(prefill, bool) or not isinstance(prefill, int) or not 1 <= prefill <= N - 1:
        raise ValueError(f"prefill={prefill!r}: give 1 to {N - 1} tokens (the rest are decoded and scored)")
    cache = (cache_factory or KVCache)(model.config, 1, N, param.dtype, param.device)
    logits = [model(ids[:, :prefill], kv_cache=cache)]  # (1, prefill, V)
    for t in range(prefill, N - 1):
        logits.append(model(ids[:, t:t + 1], torch.tensor([t], device=param.device), kv_cache=cache))
    logits = torch.cat(logits, dim=1)[0, :N - 1].float()  # (N-1, V): predictions of tokens 1..N-1
    return math.exp(F.cross_entropy(logits, ids[0, 1:]).item())


def greedy_agreement(a: list[int], b: list[int]) -> dict:
    """How two greedy continuations agree: tokens equal position by position, and the first divergence."""
    n = min(len(a), len(b))
    same = sum(x == y for x, y in zip(a, b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    return {"tokens": n, "equal": same, "agreement": same / n if n else float("nan"), "first_divergence": first}


def heldout_text() -> str:
    """Docstrings of `bdb`, a standard-library module held out from the default model's training corpus."""
    from llmlab.train.corpus import is_val, module_document, stdlib_files

    for module, path in stdlib_files():
        if module == "bdb" and is_val("module:bdb"):
            return module_document(module, path)[0].text
    raise FileNotFoundError("bdb.py not found in this Python's standard library")


def quality_report(llm, prompt: str = "def fibonacci(n):", new_tokens: int = 64, residual: int = 32,
                   kinds=("int8", "fp8"), eval_tokens: int = 512) -> list[dict]:
    """Greedy agreement over `new_tokens` and perplexity on held-out text (first `eval_tokens` tokens) for each
    format vs the full-precision cache. One row per format (plus the full-precision baseline); a format this
    PyTorch cannot store is left out. Raises ValueError for a bad residual, a kind other than 'int8' / 'fp8',
    new_tokens < 1 or eval_tokens outside 2 .. the model's context (before any work)."""
    _check_residual(residual)  # checked here: below, a ValueError of quantized_cache only means "format unavailable"
    unknown = [k for k in kinds if k not in QMAX]
    if isinstance(kinds, str) or unknown:
        raise ValueError(f"kinds={kinds!r}: give a tuple of KV quantization formats from {tuple(QMAX)}"
                         + (f" ({unknown} unknown)" if unknown and not isinstance(kinds, str) else ""))
    context = llm.config.max_seq_len
    if isinstance(eval_tokens, bool) or not isinstance(eval_tokens, int) or not 2 <= eval_tokens <= context:
        raise ValueError(f"eval_tokens={eval_tokens!r}: perplexity is measured on 2 to {context} tokens of held-out "
                         f"text (the model's context)")
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise ValueError(f"new_tokens={new_tokens!r}: give a whole number of tokens, 1 or more")
    ref = llm.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False)
    ids = llm.encode(heldout_text())[:eval_tokens]
    ppl_ref = perplexity(llm.model, ids)
    rows = [{"cache": str(llm.dtype).removeprefix("torch."), "residual": None, "perplexity": ppl_ref,
             "ppl_change": 0.0, "agreement": 1.0, "first_divergence": None}]
    for kind in kinds:
        try:
            factory = quantized_cache(residual, kind)
        except ValueError:
            continue
        g = llm.generate(prompt, max_new_tokens=new_tokens, stop_at_eos=False, cache_factory=factory)
        agree = greedy_agreement(ref.token_ids[0], g.token_ids[0])
        ppl = perplexity(llm.model, ids, factory)
        rows.append({"cache": kind, "residual": residual, "perplexity": ppl, "ppl_change": ppl / ppl_ref - 1,
                     "agreement": agree["agreement"], "first_divergence": agree["first_divergence"]})
    return rows
