"""Activation-aware weight quantization (AWQ, Lin et al. 2023, https://arxiv.org/abs/2306.00978): scale the input
channels that carry large activations up before rounding, and fold the inverse scale into the op before.

Why it helps. A linear layer computes y = W x. Round-to-nearest (RTN) gives every weight of a group the same step
size, so each weight is off by up to half a step, whatever the activation it multiplies. Input channels whose
activations are large (a few per layer in trained LLMs) turn that error into a large output error. AWQ multiplies
column c of W by s_c > 1 for such channels and divides the activation by s_c, which leaves the float product
unchanged: W x = (W diag(s)) (diag(s)^-1 x). The scaled column is rounded with nearly the same step (the group's
scale is set by its largest weight), so its error RELATIVE to the weight shrinks by about s_c, and the large
activation, now divided by s_c, multiplies that smaller error.

How s is chosen, per group of layers that read the same input (the paper's search, with its formula):
    s = mean|x|^alpha per input channel, over the calibration tokens, normalised by sqrt(max(s) * min(s));
    alpha on a grid 0, 1/grid, ..., (grid-1)/grid; alpha = 0 is s = 1, plain RTN, so the search never does worse
    than RTN on the calibration tokens;
    the chosen alpha minimises the mean squared error between the group's output with its layers quantized (W diag(s)
    rounded, then divided by s again) and the float output, on the calibration activations.

The four groups of a `llmlab.model.Transformer` layer, and where 1/s is folded (the key of the scales dict):

    key (the op that takes 1/s)      layers whose columns take s      error measured on
    layers.i.input_layernorm         q_proj, k_proj, v_proj           the attention's output (o_proj unquantized)
    layers.i.post_attention_layernorm gate_proj, up_proj              the MLP's output (down_proj unquantized)
    layers.i.mlp.up_proj             down_proj                        down_proj's output
    layers.i.self_attn.v_proj        o_proj                           o_proj's output

RMSNorm gains take 1/s as `weight / s`; up_proj and v_proj take it on their output rows (a row of up_proj scales
channel c of silu(gate) * up; a row of v_proj scales channel c of the attention output, attention being linear in
v). With grouped-query attention (GQA) o_proj's input channel h * head_dim + d comes from KV head h // n_rep, so one
v_proj row feeds n_rep o_proj columns: the o_proj scale is searched per KV head (s has Hkv * head_dim entries,
mean|x| is averaged over the n_rep query heads that read a KV head) and repeated to the H * head_dim columns, which
keeps the fold exact. (The paper's code skips this group under GQA.) Scaling a row of up_proj or v_proj does not
change how that layer rounds: every group of that row moves by the same factor.

Not done here: the paper's search of a clipping threshold per group (`auto_clip`), and zero-point (asymmetric)
int4: the formats are llmlab's symmetric ones (`llmlab.kernels.weight_quant`). The lm_head is not scaled (with tied
embeddings its columns are the embedding's); include_lm_head rounds it with RTN.

    ids = calibration_ids(llm)                      # (16, 256) held-out tokens
    quantize_awq(llm.model, ids, "int4", 128)       # search, fold, then quantize_model: in place
"""

from __future__ import annotations

import copy
import math
import numbers

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from llmlab.kernels.weight_quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

from .quantize import (SCHEMES, _targets, check_int4_group, check_not_swapped, check_weights, is_quantized,
                       quantize_model, quantized_layers)

__all__ = ["AWQScales", "awq_scales", "apply_awq", "quantize_awq", "fake_quantize", "check_quantizable"]

# (key suffix of the op that takes 1/s, the layers whose input columns take s), per decoder layer
GROUPS = (
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
    ("self_attn.v_proj", ("self_attn.o_proj",)),
)


class AWQScales(dict):
    """{key: scales} as `awq_scales` returns it (a dict; see the module docstring for the keys), plus `search`: one
    record per group, {"key", "alpha" (the chosen exponent), "mse_rtn" (alpha = 0), "mse" (at alpha)}."""

    def __init__(self, *args, search: list[dict] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.search = list(search or [])


# -- checks ------------------------------------------------------------------------------------------------------
def _check_model(op: str, model, awq: bool = True) -> None:
    """A float `llmlab.model.Transformer`: not an LLM, not quantized, no Triton kernel modules. awq: the caller
    runs AWQ (the message says why AWQ needs float weights), else round-to-nearest."""
    if not isinstance(model, nn.Module):
        hint = " (an LLM: pass llm.model, or use llm.quantize(..., method='awq'))" \
            if isinstance(getattr(model, "model", None), nn.Module) else ""
        raise TypeError(f"{op}: expected a llmlab.model.Transformer{hint}, got {type(model).__name__}")
    if not hasattr(model, "layers") or not hasattr(model, "config") or not hasattr(model, "rope"):
        raise TypeError(f"{op}: expected a llmlab.model.Transformer (layers, config, rope), got "
                        f"{type(model).__name__}")
    if is_quantized(model):
        why = "AWQ scales the float weights before rounding them" if awq else \
            "quantizing twice would round the rounded weights again"
        raise ValueError(f"{op}: the model is already quantized ({len(quantized_layers(model))} layers); {why}. "
                         f"Reload the model (or llmlab.quant.dequantize_model, which keeps the rounded values) and "
                         f"quantize that")
    check_not_swapped(op, model)


def _check_scheme(op: str, model: nn.Module, scheme: str, group_size, include_lm_head: bool = False):
    """The scheme is known and (int4) every layer `quantize_model` would swap takes group_size (its own rule).
    Returns group_size, for int4 as a Python int."""
    if scheme not in SCHEMES:
        raise ValueError(f"{op}: unknown scheme {scheme!r}; use one of {SCHEMES}")
    if scheme != "int4":
        return group_size
    return check_int4_group(op, model, group_size, include_lm_head)  # quantize_model's own rule


def _check_ids(op: str, model: nn.Module, ids) -> torch.Tensor:
    """Calibration ids -> (n, T) int64 on the model's device; checked against the vocabulary and the context."""
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{op}: calibration_ids must be a LongTensor (n_samples, seq_len), e.g. from "
                        f"llmlab.quant.calibration_ids(llm); got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise TypeError(f"{op}: calibration_ids must hold integer token ids, got {ids.dtype}")
    if ids.dim() == 1:
        ids = ids[None]
    cfg = model.config
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2:
        raise ValueError(f"{op}: calibration_ids must be (n_samples, seq_len) with seq_len >= 2, got shape "
                         f"{tuple(ids.shape)}")
    if ids.shape[1] > cfg.max_seq_len:
        raise ValueError(f"{op}: calibration windows of {ids.shape[1]} tokens exceed the model's context "
                         f"max_seq_len = {cfg.max_seq_len}; use seq_len <= {cfg.max_seq_len}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ValueError(f"{op}: calibration_ids hold token ids outside the vocabulary 0..{cfg.vocab_size - 1}; "
                         f"tokenize with the model's own tokenizer")
    return ids.long().to(next(model.parameters()).device)


def _check_grid(op: str, grid) -> int:
    if isinstance(grid, bool) or not isinstance(grid, numbers.Integral) or grid < 1:
        raise ValueError(f"{op}: grid must be an int >= 1 (the number of alpha values tried), got {grid!r}")
    return int(grid)


def check_quantizable(op: str, model: nn.Module, scheme: str, group_size: int, include_lm_head: bool,
                      calibration_ids: torch.Tensor | None) -> None:
    """Everything `quantize_awq` checks before its search, for a caller that must refuse before changing anything
    (`LLM.quantize`); calibration_ids None: the checks round-to-nearest needs too (no calibration). `op` names the
    caller in the messages. Raises what `quantize_awq` raises for bad input."""
    _check_model(op, model, awq=calibration_ids is not None)
    _check_scheme(op, model, scheme, group_size, include_lm_head)
    if calibration_ids is not None:
        _check_ids(op, model, calibration_ids)
    check_weights(op, model, scheme, include_lm_head)  # weights no scale can hold, named before the search


# -- rounding, as the quantized layers do it ----------------------------------------------------------------------
def fake_quantize(w: torch.Tensor, scheme: str = "int4", group_size: int = 128) -> torch.Tensor:
    """(N, K) float -> (N, K) fp32: the values `Int8Linear` / `Int4Linear` would store for w, dequantized (RTN, the
    formats of `llmlab.kernels.weight_quant`). For int4 a K that group_size does not divide is padded with zero
    columns to the next multiple (zeros do not move a group's scale), and the padding is cut off again.

    Raises ValueError for an unknown scheme, and what `quantize_int8` / `quantize_int4` raise (NaN or inf weights,
    a group size that is not a positive multiple of 32)."""
    if scheme == "int8":
        return dequantize_int8(*quantize_int8(w))
    if scheme != "int4":
        raise ValueError(f"fake_quantize: unknown scheme {scheme!r}; use one of {SCHEMES}")
    K = w.shape[1]
    pad = -K % group_size if isinstance(group_size, int) and group_size > 0 else 0
    wp = nn.functional.pad(w, (0, pad)) if pad else w
    return dequantize_int4(*quantize_int4(wp, group_size))[:, :K]


# -- the search ---------------------------------------------------------------------------------------------------
def _normalised(mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^alpha, floored at 1e-4, divided by sqrt(max * min) so the scales straddle 1."""
    s = mean_abs.pow(alpha).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def _search(key: str, linears: list[nn.Linear], mean_abs: torch.Tensor, run, ref: torch.Tensor, scheme: str,
            group_size: int, grid: int, expand=None) -> tuple[torch.Tensor, dict]:
    """Grid search of alpha for one group. `linears` are fp32 copies whose weights are replaced by the rounded,
    rescaled ones for each alpha (and restored at the end); `run()` recomputes the group's output; `expand` maps s to
    the layers' columns (GQA). Returns (s at the best alpha, the search record)."""
    originals = [lin.weight.data for lin in linears]
    best = (math.inf, 0.0, torch.ones_like(mean_abs))
    mse_rtn = math.nan
    try:
        for i in range(grid):
            alpha = i / grid
            s = _normalised(mean_abs, alpha)
            cols = s if expand is None else expand(s)
            for lin, w in zip(linears, originals):
                lin.weight.data = fake_quantize(w * cols, scheme, group_size) / cols
            mse = (run() - ref).pow(2).mean().item()
            if i == 0:
                mse_rtn = mse
            if mse < best[0]:
                best = (mse, alpha, s)
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.data = w
    return best[2], {"key": key, "alpha": best[1], "mse_rtn": mse_rtn, "mse": best[0]}


def _capture_input(module: nn.Module, store: dict, name: str):
    def hook(_module, args):
        store[name] = args[0]
    return module.register_forward_pre_hook(hook)


@torch.no_grad()
def awq_scales(model: nn.Module, calibration_ids: torch.Tensor, scheme: str = "int4", group_size: int = 128,
               grid: int = 20, progress: bool = True) -> AWQScales:
    """Search AWQ scales for every layer of `model` on calibration activations; the model is not changed.

    Layer by layer: the calibration tokens' hidden states enter layer i (from the float layers before it), the four
    groups' input activations are recorded, and each group's alpha is searched (module docstring). Everything runs
    in fp32 on a copy of one layer at a time, on the model's device; the model may be fp32 or bf16 (or fp16).

    Args:
        model: a float `llmlab.model.Transformer`.
        calibration_ids: LongTensor (n_samples, seq_len) (e.g. `llmlab.quant.calibration_ids(llm)`); (T,) is one
            window. seq_len at most the model's max_seq_len.
        scheme, group_size: the rounding searched against: "int4" (group_size inputs per scale) or "int8" (per
            output channel; group_size ignored); use the same in `quantize_awq` / `quantize_model`.
        grid: alphas tried per group (0, 1/grid, ..., (grid - 1)/grid).
        progress: show a tqdm progress bar over the layers (on stderr, or a widget in a notebook).

    Returns:
        `AWQScales`: {key: scales (C,) fp32} with the keys of the module docstring (4 per layer; C = dim, dim,
        intermediate_size, n_kv_heads * head_dim), and `.search`, each group's chosen alpha and errors.

    Raises:
        TypeError: not a Transformer (an LLM: pass llm.model); ids not an integer tensor.
        ValueError: a quantized model or one with Triton kernel modules; an unknown scheme or a group size the
            quantizer refuses; ids of the wrong shape, longer than the context or outside the vocabulary; grid < 1.
    """
    op = "awq_scales"
    _check_model(op, model)
    group_size = _check_scheme(op, model, scheme, group_size)
    ids = _check_ids(op, model, calibration_ids)
    grid = _check_grid(op, grid)
    cfg = model.config
    Hkv, n_rep, hd = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    T = ids.shape[1]
    positions = torch.arange(T, device=ids.device)
    cos, sin = model.rope(positions, torch.float32)  # (T, hd)
    x = model.embed_tokens(ids).float()  # (n, T, D): the hidden states entering layer 0
    out, search = {}, []
    bar = tqdm(model.layers, desc=f"AWQ {scheme}" + (f" g{group_size}" if scheme == "int4" else ""), unit="layer",
               disable=not progress)
    for i, layer in enumerate(bar):
        blk = copy.deepcopy(layer).float()
        attn, mlp = blk.self_attn, blk.mlp
        acts: dict[str, torch.Tensor] = {}
        hooks = [_capture_input(attn.o_proj, acts, "o"), _capture_input(mlp.down_proj, acts, "down")]
        try:  # the block's forward, step by step (Block.forward), keeping each group's input and output
            attn_in = blk.input_layernorm(x)  # (n, T, D)
            attn_out = attn(attn_in, cos, sin, positions)  # (n, T, D)
            h = x + attn_out
            mlp_in = blk.post_attention_layernorm(h)  # (n, T, D)
            mlp_out = mlp(mlp_in)  # (n, T, D)
        finally:
            for hk in hooks:
                hk.remove()
        o_in, down_in = acts["o"], acts["down"]  # (n, T, H*hd), (n, T, I)

        def mean_abs(a):
            return a.abs().reshape(-1, a.shape[-1]).mean(0)  # (C,) per input channel

        def kv_mean_abs(a):  # (n, T, H*hd) -> (Hkv*hd,): averaged over the n_rep query heads of each KV head
            return a.abs().reshape(-1, Hkv, n_rep, hd).mean((0, 2)).reshape(-1)

        def expand_kv(s):  # (Hkv*hd,) -> (H*hd,): KV head g's scale for each of its n_rep query heads
            return s.view(Hkv, 1, hd).expand(Hkv, n_rep, hd).reshape(-1)

        p = f"layers.{i}."
        plans = [
            ("input_layernorm", [attn.q_proj, attn.k_proj, attn.v_proj], mean_abs(attn_in),
             lambda: attn(attn_in, cos, sin, positions), attn_out, None),
            ("post_attention_layernorm", [mlp.gate_proj, mlp.up_proj], mean_abs(mlp_in), lambda: mlp(mlp_in),
             mlp_out, None),
            ("mlp.up_proj", [mlp.down_proj], mean_abs(down_in), lambda: mlp.down_proj(down_in),
             mlp.down_proj(down_in), None),
            ("self_attn.v_proj", [attn.o_proj], kv_mean_abs(o_in), lambda: attn.o_proj(o_in), attn.o_proj(o_in),
             expand_kv),
        ]
        for key, linears, stat, run, ref, expand in plans:
            s, record = _search(p + key, linears, stat, run, ref, scheme, group_size, grid, expand)
            out[p + key] = s
            search.append(record)
        x = h + mlp_out  # the float output of layer i: layer i + 1's input
        del blk, acts
    return AWQScales(out, search=search)


# -- the fold -----------------------------------------------------------------------------------------------------
def _resolve(model: nn.Module, scales: dict) -> list[tuple]:
    """Check every key and shape of `scales` against the model before anything changes. Returns (key, the op that
    takes 1/s, the layers that take s, s (C,) fp32, s repeated to the layers' columns) per key."""
    cfg = model.config
    n_rep = cfg.n_heads // cfg.n_kv_heads
    if not isinstance(scales, dict) or not scales:
        raise ValueError("apply_awq: scales must be a non-empty dict {key: scales}, as awq_scales returns it")
    modules = dict(model.named_modules())
    suffixes = {prev: targets for prev, targets in GROUPS}
    plan = []
    for key, s in scales.items():
        prefix, _, rest = key.partition(".")
        idx, _, suffix = rest.partition(".")
        if prefix != "layers" or not idx.isdigit() or suffix not in suffixes or key not in modules:
            raise ValueError(f"apply_awq: unknown key {key!r}; keys are layers.<i>.<op> with <op> one of "
                             f"{list(suffixes)} and i < {len(model.layers)} (what awq_scales returns)")
        prev = modules[key]
        targets = [modules[f"layers.{idx}.{t}"] for t in suffixes[suffix]]
        if not all(type(m) is nn.Linear for m in targets) or not isinstance(prev, nn.Module):
            raise ValueError(f"apply_awq: the layers of {key!r} are not float nn.Linear layers")
        n_out = prev.weight.shape[0]  # norm gain (D,), up_proj / v_proj rows
        if not isinstance(s, torch.Tensor) or s.shape != (n_out,):
            shape = tuple(s.shape) if isinstance(s, torch.Tensor) else type(s).__name__
            raise ValueError(f"apply_awq: scales[{key!r}] must be a tensor of shape ({n_out},), got {shape}")
        if not torch.isfinite(s).all() or (s <= 0).any():
            raise ValueError(f"apply_awq: scales[{key!r}] must be positive and finite (it divides {key})")
        cols = s.float() if suffix != "self_attn.v_proj" else \
            s.float().view(cfg.n_kv_heads, 1, cfg.head_dim).expand(-1, n_rep, -1).reshape(-1)
        if any(t.in_features != cols.numel() for t in targets):
            raise ValueError(f"apply_awq: scales[{key!r}] has {cols.numel()} columns for layers of "
                             f"{targets[0].in_features} inputs")
        plan.append((key, prev, targets, s.float(), cols))
    return plan


@torch.no_grad()
def apply_awq(model: nn.Module, scales: dict) -> nn.Module:
    """Fold AWQ scales into the float model, in place: for each key (module docstring) the layers it names get
    W[:, c] *= s_c and the op before takes 1/s_c (an RMSNorm gain divided by s; up_proj's or v_proj's output row c
    divided by s_c, its bias too). The model computes the same function (up to rounding of the weights' dtype: exact
    in fp32 to ~1e-6); rounding it afterwards (`quantize_model`) is what profits. Returns the model.

    Each product is formed in fp32 and stored in the parameter's dtype. Every key and shape is checked before any
    weight changes.

    Raises:
        TypeError: not a Transformer.
        ValueError: a quantized model or one with Triton kernel modules; an unknown key; scales of the wrong shape,
            not positive, or not finite.
    """
    _check_model("apply_awq", model)
    plan = _resolve(model, scales)

    def scale_(t: torch.Tensor, f: torch.Tensor) -> None:
        t.copy_((t.float() * f.to(t.device)).to(t.dtype))

    for key, prev, targets, s, cols in plan:
        if isinstance(prev, nn.Linear):  # up_proj / v_proj: output rows
            scale_(prev.weight, 1.0 / s[:, None])
            if prev.bias is not None:
                scale_(prev.bias, 1.0 / s)
        else:  # an RMSNorm gain
            scale_(prev.weight, 1.0 / s)
        for lin in targets:
            scale_(lin.weight, cols[None, :])
    return model


def quantize_awq(model: nn.Module, calibration_ids: torch.Tensor, scheme: str = "int4", group_size: int = 128,
                 grid: int = 20, progress: bool = True, include_lm_head: bool = False) -> nn.Module:
    """AWQ end to end, in place: `awq_scales` on the calibration ids, `apply_awq`, then `quantize_model` (RTN of the
    rescaled weights into `Int8Linear` / `Int4Linear`). Returns the model.

    Args: as `awq_scales`; include_lm_head as `quantize_model` (the lm_head is rounded without scaling).

    Raises:
        as `awq_scales`, checked before the search; anything `quantize_model` raises afterwards restores the
        weights the fold changed, so a refused call leaves the model as it was.
    """
    check_quantizable("quantize_awq", model, scheme, group_size, include_lm_head, calibration_ids)
    scales = awq_scales(model, calibration_ids, scheme, group_size, grid, progress)
    linears = [(parent, attr, child) for parent in model.modules() for attr, child in parent.named_children()
               if type(child) is nn.Linear]
    params = [p for name, p in model.named_parameters() if name.startswith("layers.")]  # what the fold changes
    saved = [p.detach().clone() for p in params]
    try:
        apply_awq(model, scales)
        quantize_model(model, scheme, group_size=group_size, include_lm_head=include_lm_head)
    except BaseException:  # put the float layers back (a partial swap included), then their weights
        for parent, attr, child in linears:
            setattr(parent, attr, child)
        with torch.no_grad():
            for p, w in zip(params, saved):
                p.copy_(w)
        raise
    return model
