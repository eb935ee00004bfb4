"""Lab 04 (weight quantization): the check the notebook runs on the student's group-wise int4 quantize / dequantize,
and the lookup of the recorded GPU run whose ladder has the quantized rungs.

The exercise's format is `llmlab.kernels.weight_quant`'s int4 (the one the course's kernels read):

    packed (N, K // 2) uint8, scales (N, K // G) fp32, G = group_size consecutive inputs of a row per scale
    scale = max |w| over the group / 7;  code u = round(w / scale) + 8, in 1..15 (symmetric: 0, i.e. -8, unused)
    packed[n, j] = u[n, 2j] | (u[n, 2j + 1] << 4)     even k in the LOW nibble, odd k in the HIGH nibble
    W[n, k] ~= (u[n, k] - 8) * scales[n, k // G]

`check_int4_groupwise` tests a pair of functions by properties (dtypes, shapes, code range, round trip within half
a scale) and against the reference on several shapes, including an all-zero group and groups of one sign; a
failing check raises AssertionError with a message that says what is wrong and how to fix it.
"""

from __future__ import annotations

import os

import torch

from llmlab.kernels.weight_quant import dequantize_int4, quantize_int4

__all__ = ["check_int4_groupwise", "QUANT_STEPS", "is_quant_row", "recorded_quant_ladder"]

_NOT_WRITTEN = "{name} is not written yet: replace the `raise NotImplementedError(...)` line with your answer"


def _cases() -> list[tuple[str, torch.Tensor, int]]:
    """(description, weight (N, K), group_size): random rows, several group counts, an all-zero group, groups of one
    sign, one group per row, bf16 weights. Seeded: the same cases every call."""
    g = torch.Generator().manual_seed(4)
    cases = [("a (4, 64) weight, group_size 32", torch.randn(4, 64, generator=g), 32),
             ("a (3, 256) weight, group_size 128", torch.randn(3, 256, generator=g) * 0.02, 128),
             ("an (8, 192) weight, group_size 64", torch.randn(8, 192, generator=g) * 3, 64),
             ("a (3, 64) weight, group_size 64 (one group per row)", torch.randn(3, 64, generator=g), 64)]
    w = torch.randn(3, 96, generator=g)
    w[0, 32:64] = 0.0  # an all-zero group: its scale must not be NaN, its values must come back as 0
    w[1, :32] = w[1, :32].abs() + 0.05  # one sign: all positive
    w[2, 64:] = -(w[2, 64:].abs() + 0.05)  # one sign: all negative
    cases.append(("a (3, 96) weight, group_size 32, with an all-zero group and groups of one sign", w, 32))
    cases.append(("a (5, 128) bfloat16 weight, group_size 32", torch.randn(5, 128, generator=g).to(torch.bfloat16), 32))
    return cases


def _codes(packed: torch.Tensor) -> torch.Tensor:
    """(N, K // 2) uint8 -> (N, K) int64 codes, read in the documented layout (low nibble = even k)."""
    p = packed.to(torch.int64)
    return torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], -1)


def _call(fn, name: str, *args):
    try:
        return fn(*args)
    except NotImplementedError as e:
        raise AssertionError(_NOT_WRITTEN.format(name=name)) from e


def _check_scales(what: str, w32: torch.Tensor, scales: torch.Tensor, want: torch.Tensor, G: int,
                  w_dtype: torch.dtype = torch.float32) -> None:
    N, K = w32.shape
    absmax = w32.view(N, K // G, G).abs().amax(dim=2)
    zero = absmax == 0
    broken = ~torch.isfinite(scales) | (scales < 0)
    assert not broken.any(), (
        f"{what}: scales hold NaN, inf or negative values (the first at [row, group] = "
        f"{broken.nonzero()[0].tolist()}). An all-zero group has max |w| = 0, and 0 / 0 is NaN: clamp the max to a "
        f"tiny positive value (e.g. .clamp(min=1e-12)) before dividing")
    live = ~zero
    if torch.allclose(scales[live], want[live], rtol=1e-5, atol=0):
        return
    ratio = (scales[live] / want[live]).median().item()
    row_max = w32.abs().amax(dim=1, keepdim=True).expand(N, K // G) / 7
    n, j = (~torch.isclose(scales, want, rtol=1e-5, atol=0) & live).nonzero()[0].tolist()
    divisor = next((d for d in (8, 15, 16, 127) if abs(ratio - 7 / d) < 1e-3), None)
    if divisor is not None:
        why = (f"you divided by {divisor}: the largest code magnitude is 7 (codes -7..7, stored as 1..15), so "
               f"scale = max |w| / 7 puts the group's largest weight exactly on a code")
    elif torch.allclose(scales, row_max, rtol=1e-5):
        why = ("these are one scale per ROW repeated over the groups: take max |w| over each group of "
               "group_size consecutive inputs (view the row as (K // group_size, group_size) and reduce the last "
               "dimension)")
    elif K // G > 1 and torch.allclose(scales, w32.view(N, G, K // G).abs().amax(dim=1) / 7, rtol=1e-5):
        why = ("these groups take every (K // group_size)-th input: a group is group_size CONSECUTIVE inputs of a "
               "row, so view the row as (K // group_size, group_size) and reduce the LAST dimension")
    elif w_dtype != torch.float32 and torch.allclose(
            scales, (w32.to(w_dtype).view(N, K // G, G).abs().amax(dim=2) / 7).float(), rtol=1e-6):
        why = (f"these scales were computed in {w_dtype}: the weight is {w_dtype}, so convert it first "
               f"(w = w.float()) and compute max |w| / 7 in fp32")
    elif _signed_max_scales(scales, w32.view(N, K // G, G).amax(dim=2), absmax):
        why = ("these are the group's largest SIGNED weight / 7: a group whose largest magnitude is negative gets a "
               "scale too small (or negative); take the absolute value first, max |w| = w.abs().amax(...)")
    elif abs(ratio - 1) < 0.05 and torch.isclose(scales, want, rtol=0.05, atol=0)[live].all():
        why = ("close but not equal: the scale is exactly max |w| of the group / 7, in fp32, with nothing added "
               "(the clamp only lifts an all-zero group's max off 0)")
    else:
        why = "scale = max |w| over the group / 7 (symmetric: no zero point, the sign is in the code)"
    raise AssertionError(f"{what}: scales[{n}, {j}] = {scales[n, j].item():.6g}, expected {want[n, j].item():.6g} "
                         f"(max |w| = {absmax[n, j].item():.6g} over inputs {j * G}..{(j + 1) * G - 1} of row {n}); "
                         f"{why}")


def _signed_max_scales(scales: torch.Tensor, signed: torch.Tensor, absmax: torch.Tensor) -> bool:
    """Are `scales` the groups' largest SIGNED weight / 7, on the groups whose largest weight is positive, where some
    of those groups have a larger magnitude below zero (else the slip cannot be told from the right answer)?"""
    positive = signed > 0
    telling = positive & (signed < absmax * (1 - 1e-5))
    return bool(telling.any()) and torch.allclose(scales[positive], signed[positive] / 7, rtol=1e-5)


def _check_codes(what: str, w32: torch.Tensor, packed: torch.Tensor, ref_packed: torch.Tensor,
                 ref_scales: torch.Tensor, G: int, w_dtype: torch.dtype = torch.float32) -> None:
    """The student's bytes against the reference's, allowing either rounding where w / scale is a tie (x.5)."""
    u, want = _codes(packed), _codes(ref_packed)
    N, K = w32.shape
    x = w32 / ref_scales.repeat_interleave(G, dim=1)
    tie = ((x - x.floor()) - 0.5).abs() < 1e-4
    bad = (u != want) & ~tie
    if not bad.any():
        assert u.min() >= 1, (
            f"{what}: a code 0 appears (it stands for -8): with scale = max |w| / 7 every round(w / scale) lies in "
            f"-7..7, so after + 8 the codes are 1..15")
        return
    swapped = torch.stack([packed.to(torch.int64) >> 4, packed.to(torch.int64) & 0xF], -1).reshape(N, K)
    if not ((swapped != want) & ~tie).any():
        raise AssertionError(f"{what}: the two codes of each byte are swapped: the EVEN input k goes in the LOW "
                             f"nibble and the odd one in the HIGH nibble: packed = u[:, 0::2] | (u[:, 1::2] << 4)")
    if not ((u != (want - 8) % 16) & ~tie).any():
        raise AssertionError(f"{what}: the codes are the signed values' low 4 bits (two's complement); store "
                             f"u = round(w / scale) + 8, in 1..15, so that the code minus 8 is the value")
    for off in (-1, 1):
        if not ((u != want + off) & ~tie).any():
            raise AssertionError(f"{what}: every code is {'one below' if off < 0 else 'one above'} round(w / scale) "
                                 f"+ 8: the offset is 8 (the value 0 is code 8; -7..7 become 1..15)")
    n, k = bad.nonzero()[0].tolist()
    if w32.view(N, K // G, G)[n, k // G].abs().max() == 0:
        first = k // G * G
        raise AssertionError(f"{what}: row {n}'s all-zero group (inputs {first}..{first + G - 1}) has code "
                             f"{u[n, k].item()} at input {k}, expected 8 (the value 0): with a scale of 0, w / scale "
                             f"is 0 / 0 = NaN; clamp max |w| to a tiny positive value (e.g. .clamp(min=1e-12)) first")
    raise AssertionError(f"{what}: input k = {k} of row {n} (w = {w32[n, k].item():.6g}, its group's scale "
                         f"{ref_scales[n, k // G].item():.6g}) has code {u[n, k].item()}, expected "
                         f"round(w / scale) + 8 = {want[n, k].item()} (codes read with the even k in the low nibble "
                         f"of byte k // 2)" + (f"; this weight is {w_dtype}: divide in fp32 (w.float() / scale), "
                                               f"or the quotient is rounded to {w_dtype} before round()"
                                               if w_dtype != torch.float32 else ""))


def _check_dequantize(what: str, dequantize_fn, ref_packed: torch.Tensor, ref_scales: torch.Tensor, G: int) -> None:
    N, K = ref_packed.shape[0], 2 * ref_packed.shape[1]
    out = _call(dequantize_fn, "dequantize_int4_groupwise", ref_packed.clone(), ref_scales.clone())
    assert isinstance(out, torch.Tensor), (
        f"{what}: dequantize_int4_groupwise returned {type(out).__name__}; return the (N, K) fp32 tensor")
    assert tuple(out.shape) == (N, K), (
        f"{what}: dequantize_int4_groupwise returned shape {tuple(out.shape)}, expected (N, K) = {(N, K)}: each byte "
        f"holds two codes, so K = 2 * packed.shape[1], and the group size is K // scales.shape[1]")
    assert out.dtype == torch.float32, f"{what}: dequantize_int4_groupwise returned {out.dtype}, expected torch.float32"
    want = dequantize_int4(ref_packed, ref_scales)
    if torch.allclose(out, want, rtol=1e-6, atol=0):
        return
    u = _codes(ref_packed)
    per_col = ref_scales.repeat_interleave(G, dim=1)
    guesses = [
        ((torch.stack([u[:, 1::2], u[:, 0::2]], -1).reshape(N, K) - 8) * per_col,
         "the nibbles are read in the wrong order: the LOW nibble (packed & 0xF) is input 2j, the HIGH nibble "
         "(packed >> 4) is input 2j + 1"),
        (u.float() * per_col, "subtract 8 from each code before scaling: the code u stands for u - 8"),
        (((u - 8) % 256).float() * per_col, "the codes are uint8, where u - 8 wraps around below 0 (3 - 8 = 251): "
         "convert them first (codes.float() - 8, or .to(torch.int16))"),
        ((u.float() - 7) * per_col, "the offset is 8: the code u stands for u - 8"),
        ((u.float() - 8) * ref_scales.repeat(1, G), "group j's scale applies to inputs j * G .. (j + 1) * G - 1 "
         "(consecutive inputs): use scales.repeat_interleave(G, dim=1), not scales.repeat(1, G)"),
    ]
    for guess, why in guesses:
        if torch.allclose(out, guess.float(), rtol=1e-6, atol=0):
            raise AssertionError(f"{what}: dequantize_int4_groupwise: {why}")
    n, k = (~torch.isclose(out, want, rtol=1e-6, atol=0)).nonzero()[0].tolist()
    raise AssertionError(f"{what}: dequantize_int4_groupwise gave W[{n}, {k}] = {out[n, k].item():.6g}, expected "
                         f"(code {u[n, k].item()} - 8) x scale {ref_scales[n, k // G].item():.6g} = "
                         f"{want[n, k].item():.6g}")


def check_int4_groupwise(quantize_fn, dequantize_fn) -> None:
    """Check the student's `quantize_fn(w, group_size) -> (packed, scales)` and `dequantize_fn(packed, scales) -> W`
    against the format above and `llmlab.kernels.weight_quant.quantize_int4` / `dequantize_int4`.

    For each case (`_cases`: 6 shapes and group sizes, an all-zero group, groups of one sign, a bf16 weight):
    quantize_fn leaves w unchanged and returns a uint8 (N, K // 2) and an fp32 (N, K // G); the scales are
    max |w| / 7 per group (finite for an all-zero group); the codes are round(w / scale) + 8 in 1..15, even k in the
    low nibble (either rounding of an exact tie accepted); dequantize_fn of the REFERENCE's packed and scales gives
    its (N, K) fp32 weight; and dequantize_fn(quantize_fn(w)) is within half a scale of w.

    Raises:
        AssertionError: the first thing found wrong, with the case, the place and the fix (common mistakes named:
            nibbles swapped, scale = max / 8 or / 15 or per row, a NaN scale for a zero group, codes not offset by 8,
            groups' scales tiled instead of repeated). A function still raising NotImplementedError is reported so.
    """
    for what, w, G in _cases():
        N, K = w.shape
        w_before = w.clone()
        w32 = w.float()
        ref_packed, ref_scales = quantize_int4(w, G)
        out = _call(quantize_fn, "quantize_int4_groupwise", w, G)
        assert torch.equal(w, w_before), f"{what}: quantize_int4_groupwise changed w in place; leave the input as it is"
        assert isinstance(out, (tuple, list)) and len(out) == 2, (
            f"{what}: quantize_int4_groupwise returned {type(out).__name__}; return a pair (packed, scales)")
        packed, scales = out
        assert isinstance(packed, torch.Tensor) and isinstance(scales, torch.Tensor), (
            f"{what}: return two tensors (packed, scales), got ({type(packed).__name__}, {type(scales).__name__})")
        assert packed.dtype == torch.uint8, (
            f"{what}: packed is {packed.dtype}, expected torch.uint8 (two unsigned 4-bit codes per byte)")
        assert tuple(packed.shape) == (N, K // 2), (
            f"{what}: packed has shape {tuple(packed.shape)}, expected (N, K // 2) = {(N, K // 2)}"
            + (": store TWO codes per byte" if tuple(packed.shape) == (N, K) else ""))
        assert scales.dtype == torch.float32, (
            f"{what}: scales are {scales.dtype}, expected torch.float32 (compute in fp32: w.float())")
        per_row = tuple(scales.shape) in ((N,), (N, 1))
        assert tuple(scales.shape) == (N, K // G), (
            f"{what}: scales have shape {tuple(scales.shape)}, expected (N, K // group_size) = {(N, K // G)}"
            + (": one scale per GROUP of group_size consecutive inputs of a row, not one per row" if per_row else ""))
        _check_scales(what, w32, scales, ref_scales, G, w.dtype)
        _check_codes(what, w32, packed, ref_packed, ref_scales, G, w.dtype)
        _check_dequantize(what, dequantize_fn, ref_packed, ref_scales, G)
        back = _call(dequantize_fn, "dequantize_int4_groupwise", packed, scales)
        err = (back - w32).abs()
        limit = scales.repeat_interleave(G, dim=1) / 2 * (1 + 1e-5) + 1e-30
        assert (err <= limit).all(), (
            f"{what}: the round trip dequantize(quantize(w)) misses w by more than half a scale "
            f"(worst at {(err - limit).flatten().argmax().item() // K, (err - limit).flatten().argmax().item() % K} "
            f"[row, input])")
        zero = w32.view(N, K // G, G).abs().amax(dim=2) == 0
        if zero.any():
            assert (back.view(N, K // G, G)[zero] == 0).all(), (
                f"{what}: an all-zero group does not come back as zeros")


# -- the recorded GPU run with the quantized rungs ---------------------------------------------------------------

QUANT_STEPS = ("+int8", "+int4")  # the ladder's weight-quantization rungs (llmlab.ladder)


def is_quant_row(row: dict) -> bool:
    """True for a bench result row of a quantized rung: a step of QUANT_STEPS, or one whose settings set the
    `weights` switch (e.g. a rung registered for int4 at group size 32)."""
    settings = row.get("settings")
    return row.get("step") in QUANT_STEPS or bool(isinstance(settings, dict) and settings.get("weights"))


def recorded_quant_ladder(directory: str | os.PathLike | None = None, device_contains: str | None = None,
                          workload: str | None = None, model_id: str | None = None,
                          prefer: str | None = "H200") -> dict | None:
    """The newest bench file (default folder data/bench/) recorded on a GPU, of `workload` (e.g. "chat"; None: any)
    and model `model_id` (e.g. "llama-3.1-8b"; None: any), with at least one quantized row (`is_quant_row`), as
    `llmlab.measure.bench_file.load_bench` reads it; None when there is none. Invalid files are skipped.

    device_contains: only GPUs whose name contains it (None: any GPU). prefer: the newest such file on a GPU whose
    name contains `prefer` when there is one (the course's reference GPU), else the newest on any of them."""
    from llmlab.measure.bench_file import list_bench

    def field(doc: dict, key: str, inner: str):  # doc[key][inner], or doc[key] itself where it is a string
        value = doc.get(key)
        return value.get(inner) if isinstance(value, dict) else value

    def wanted(doc: dict) -> bool:
        return ("cpu" not in doc["device"].lower()
                and (workload is None or field(doc, "workload", "name") == workload)
                and (model_id is None or field(doc, "model", "id") == model_id)
                and any(is_quant_row(r) for r in doc["results"]))

    docs = [d for d in list_bench(directory, device_contains) if wanted(d)]
    preferred = [d for d in docs if prefer and prefer.lower() in d["device"].lower()]
    return (preferred or docs or [None])[-1]
