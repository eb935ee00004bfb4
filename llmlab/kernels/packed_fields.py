"""Triton helpers of the int8/int4 kernels: integer fields of 32-bit words turned into fp32 without an int -> float
conversion instruction (those run at a quarter of the FMA rate).

At batch 1 the memory system delivers a weight faster than a handful of warps per SM get through the instructions
it needs, so the instructions per weight count. The kernels read the packed weights 32 bits at a time (8 int4 or 4
int8 weights per word) and make each field a float in ONE instruction:

  * `field_f32` (the M = 1 GEMVs): the field masked in place and read as an fp32 SUBNORMAL, exactly
    field * 2^(SHIFT - 149); x is multiplied once per tile by the matching power of two (`lift`), so the FMA that
    multiplies the field by x yields field * x * 2^-X_EXP. The codes' offset (8 for int4, 128 for int8's bytes
    XOR 0x80) comes off as that times each word's x sum, one FMA per word, not a FADD per weight;
  * `code_f32` (the int4 tile kernel for M > 1, whose tl.dot needs the codes themselves): the field ORed into the
    mantissa of 2^(23 - SHIFT), then one FADD removes 2^(23 - SHIFT) + the offset.

Instructions per int4 weight in the K loop (compiled for sm_90, counted with cuobjdump -sass): 9.6 for a byte-wise
unpack and convert, 4.2 with `code_f32`, 3.1-3.7 with `field_f32`.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = 0x4B000000  # the bits of 2^23 in fp32; the int4 tile kernel takes it as an argument (see `code_f32`)
X_EXP = tl.constexpr(64)  # the GEMVs' sums are kept times 2^-X_EXP (see `field_f32`)


@triton.jit
def code_f32(w, SHIFT: tl.constexpr, BITS: tl.constexpr, OFFSET: tl.constexpr, magic):
    """(the BITS-bit field at bits SHIFT.. of int32 words w) - OFFSET as exact fp32, with no int -> float
    conversion instruction: one LOP3 masks the field in place and ORs in `magic`, the bits of 2^(23 - SHIFT) —
    whose mantissa's last place is worth 2^-SHIFT, so the field's lowest bit (bit SHIFT) is worth 1 and the float
    is 2^(23 - SHIFT) + the field's value; one FADD removes 2^(23 - SHIFT) + OFFSET. Needs SHIFT + BITS <= 23.
    `magic` comes from a kernel argument (`magic_shift`), not a constant: as a constant, the compiler re-creates the
    mask in a register for every LOP3 (a MOV per weight)."""
    field = w & (((1 << BITS) - 1) << SHIFT)
    return (field | magic).to(tl.float32, bitcast=True) - ((1 << (23 - SHIFT)) + OFFSET)


@triton.jit
def field_f32(w, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """The BITS-bit field at bits SHIFT.. of int32 words w, read in place as an fp32 SUBNORMAL: one LOP3 (a mask),
    no conversion instruction. With the exponent bits zero the float is exactly field * 2^(SHIFT - 149), so a
    product with `lift(x, SHIFT)` = x * 2^(149 - SHIFT - X_EXP) is field * x * 2^-X_EXP, exact up to the FMA's
    rounding. Needs SHIFT + BITS <= 23 (the field inside the mantissa) and FMAs that keep subnormal inputs (the
    default: Triton emits fma.rn.f32, not .ftz; on a CPU, `torch.set_flush_denormal(True)` breaks the interpreter's
    runs). The range this leaves x: |x| < 2^(X_EXP - 21 + SHIFT) — 2^43 for SHIFT 0 — before the lifted x
    overflows (inf, then NaN in every sum), and products stay normal (full precision) for
    |field * x| > 2^(X_EXP - 126); smaller ones lose bits and, below 2^-149 * 2^X_EXP, vanish."""
    return (w & (((1 << BITS) - 1) << SHIFT)).to(tl.float32, bitcast=True)


@triton.jit
def lift(x, SHIFT: tl.constexpr):
    """x (fp32) * 2^(149 - SHIFT - X_EXP), the partner of `field_f32(w, SHIFT, ...)` (a power of two: exact)."""
    return x * (2.0 ** (149 - SHIFT - X_EXP))


@triton.jit
def magic_shift(two23, SHIFT: tl.constexpr):
    """The bits of 2^(23 - SHIFT) from those of 2^23 (`two23` = MAGIC, passed as an argument): lower the exponent."""
    return two23 - (SHIFT << 23)


@triton.jit
def int4_codes(w, m0, m4, m8, m12, m16):
    """int32 words w (8 int4 codes each, code i at bits 4i) -> eight fp32 tensors shaped like w: code i - 8.
    m0..m16: `magic_shift(magic, SHIFT)` for SHIFT 0, 4, 8, 12, 16, made once before the K loop. Codes 5, 6, 7
    (bits 20..31) are shifted down to bits 8..19 first, to sit inside the fp32 mantissa."""
    top = w >> 12
    return (code_f32(w, 0, 4, 8, m0), code_f32(w, 4, 4, 8, m4), code_f32(w, 8, 4, 8, m8),
            code_f32(w, 12, 4, 8, m12), code_f32(w, 16, 4, 8, m16),
            code_f32(top, 8, 4, 8, m8), code_f32(top, 12, 4, 8, m12), code_f32(top, 16, 4, 8, m16))


@triton.jit
def split8(x):
    """(J, 8) -> eight (J,) tensors x[:, 0] .. x[:, 7] (three splits of trailing size-2 dimensions)."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], 2, 2, 2)))  # a: i = 0, 2, 4, 6; b: i = 1, 3, 5, 7
    a0, a1 = tl.split(a)  # a0: i = 0, 4; a1: i = 2, 6
    b0, b1 = tl.split(b)  # b0: i = 1, 5; b1: i = 3, 7
    x0, x4 = tl.split(a0)
    x2, x6 = tl.split(a1)
    x1, x5 = tl.split(b0)
    x3, x7 = tl.split(b1)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def split4(x):
    """(J, 4) -> four (J,) tensors x[:, 0] .. x[:, 3]."""
    a, b = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # a: i = 0, 2; b: i = 1, 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def quad_words(w):
    """(R, 4Q) int32 words -> words 4q + 0, 1, 2, 3 as four (R, Q) tensors. The input-stationary GEMVs load each
    thread's 16-byte quad as 4 consecutive words of a row, so all four come from one thread: no data moves."""
    a, b = tl.split(tl.reshape(w, (w.shape[0], w.shape[1] // 4, 2, 2)))  # a: words 0, 2; b: words 1, 3
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3
