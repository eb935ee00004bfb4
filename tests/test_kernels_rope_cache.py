"""The fused RoPE + KV-cache write (llmlab/kernels/rope_cache.py) against the unfused PyTorch ops."""

from __future__ import annotations

import pytest
import torch

from llmlab.kernels._util import interpret_mode

pytest.importorskip("triton")
if not torch.cuda.is_available() and not interpret_mode():
    pytest.skip("no CUDA GPU and TRITON_INTERPRET is not set", allow_module_level=True)

from llmlab.kernels.rope_cache import rope_and_cache_, rope_and_cache_reference  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU_DTYPES = [pytest.param(d, marks=pytest.mark.gpu) for d in (torch.float16, torch.bfloat16)]


def _case(B, H, Hkv, hd, S, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, H + 2 * Hkv, hd, generator=g).to(DEV, dtype)
    ang = torch.randn(B, hd // 2, generator=g).repeat(1, 2)
    cos, sin = ang.cos().to(DEV, dtype), ang.sin().to(DEV, dtype)
    pos = torch.randint(0, S, (B,), generator=g).to(DEV)
    k_cache = torch.full((B, Hkv, S, hd), float("nan"), dtype=dtype, device=DEV)  # untouched slots stay NaN
    v_cache = k_cache.clone()
    return qkv, cos, sin, pos, k_cache, v_cache


@pytest.mark.parametrize("dtype", [torch.float32, *GPU_DTYPES])
@pytest.mark.parametrize("B, H, Hkv, hd, S", [(1, 4, 2, 16, 8), (3, 8, 2, 64, 33), (2, 4, 4, 6, 5), (2, 2, 1, 128, 17)])
def test_fused_rope_and_cache_write_equals_the_unfused_ops(B, H, Hkv, hd, S, dtype):
    case = _case(B, H, Hkv, hd, S, dtype)
    ref = [t.clone() for t in case]
    rope_and_cache_(*case, n_heads=H)
    rope_and_cache_reference(*ref, n_heads=H)
    tol = {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    qkv, _, _, pos, k_cache, v_cache = case
    torch.testing.assert_close(qkv[:, :H], ref[0][:, :H], **tol)  # q rotated in place
    torch.testing.assert_close(qkv[:, H:], ref[0][:, H:])  # k and v heads of the input are left as they were
    torch.testing.assert_close(k_cache, ref[4], equal_nan=True, **tol)  # only each row's slot was written
    torch.testing.assert_close(v_cache, ref[5], equal_nan=True)
    assert int(torch.isnan(k_cache).logical_not().sum()) == B * Hkv * hd  # one slot per (row, KV head)


@pytest.mark.parametrize("B", [1, 7, 17])  # the grid: one program per (row, head)
@pytest.mark.parametrize("hd", [2, 14, 34, 998])  # the tiled dimension: hd / 2 lanes, padded to a power of 2
def test_sizes_in_the_tiled_dimensions(B, hd):
    case = _case(B, 2, 1, hd, 3, torch.float32, seed=B + hd)
    ref = [t.clone() for t in case]
    rope_and_cache_(*case, n_heads=2)
    rope_and_cache_reference(*ref, n_heads=2)
    for got, want in zip(case, ref):
        torch.testing.assert_close(got, want, equal_nan=True)


def test_rejects_shapes_that_do_not_fit():
    qkv, cos, sin, pos, k_cache, v_cache = _case(2, 4, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="q heads"):
        rope_and_cache_(qkv, cos, sin, pos, k_cache, v_cache, n_heads=3)
    with pytest.raises(ValueError, match="positions"):
        rope_and_cache_(qkv, cos, sin, pos[:1], k_cache, v_cache, n_heads=4)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_angles_from_inv_freq_equal_the_cos_sin_rows(dtype):
    """inv_freq= (angles computed in the kernel) gives what RotaryEmbedding's cos/sin rows give."""
    from llmlab.model import RotaryEmbedding
    from tiny_models import tiny_model

    cfg = tiny_model(seed=0).config
    rope = RotaryEmbedding(cfg).to(DEV)
    hd, H, Hkv, B, S = cfg.head_dim, 4, 2, 3, 64
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(B, H + 2 * Hkv, hd, generator=g).to(DEV, dtype)
    pos = torch.tensor([0, 17, 63], device=DEV)
    if DEV == "cuda":  # far positions too (angles of ~1e5 rad): the GPU's fast sin/cos need the range reduction
        S, pos = 131072, torch.tensor([0, 8191, 131071], device=DEV)
    cos, sin = rope(pos, dtype)  # (B, hd)
    outs = []
    for kw in (dict(cos=cos, sin=sin), dict(cos=None, sin=None, inv_freq=rope.inv_freq)):
        x = qkv.clone()
        kc, vc = (torch.zeros(B, Hkv, S, hd, device=DEV, dtype=dtype) for _ in range(2))
        rope_and_cache_(x, kw.pop("cos"), kw.pop("sin"), pos, kc, vc, n_heads=H, **kw)
        outs.append((x, kc, vc))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-6 if dtype == torch.float32 else 1e-2, rtol=1e-5)


def test_angles_given_twice_or_not_at_all_are_refused():
    qkv = torch.randn(1, 4, 8, device=DEV)
    kc = torch.zeros(1, 1, 4, 8, device=DEV)
    pos = torch.zeros(1, dtype=torch.long, device=DEV)
    cs = torch.ones(1, 8, device=DEV)
    with pytest.raises(ValueError, match="either as cos and sin, or as inv_freq"):
        rope_and_cache_(qkv, None, None, pos, kc, kc.clone(), n_heads=2)
    with pytest.raises(ValueError, match="either as cos and sin, or as inv_freq"):
        rope_and_cache_(qkv, cs, cs, pos, kc, kc.clone(), n_heads=2, inv_freq=torch.ones(4, device=DEV))
    with pytest.raises(ValueError, match="give both cos and sin"):
        rope_and_cache_(qkv, cs, None, pos, kc, kc.clone(), n_heads=2, inv_freq=torch.ones(4, device=DEV))
    with pytest.raises(TypeError, match="positions must be int32 or int64"):
        rope_and_cache_(qkv, cs, cs, pos.float(), kc, kc.clone(), n_heads=2)
    with pytest.raises(ValueError, match=r"inv_freq must be \(hd/2,\) = \(4,\)"):
        rope_and_cache_(qkv, None, None, pos, kc, kc.clone(), n_heads=2, inv_freq=torch.ones(3, device=DEV))
