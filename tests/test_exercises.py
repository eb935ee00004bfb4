"""The exercises of labs 00-03, 05 and 07. For each one: its check accepts the notebook's answer (the cell between
its solution markers, run on its own), rejects the student copy's stub (calling it raises NotImplementedError; the
check says the exercise is not written yet), and rejects plausible wrong answers, written here, with a message that
names the mistake. And labs/student/ is current: `python tools/make_student_labs.py --check` passes.

The notebooks themselves run under nbval (`pytest labs/0N_*.ipynb`); these tests run the exercise cells alone.
"""

from __future__ import annotations

import ast
import json
import importlib.util
import linecache
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from llmlab.kernels._util import interpret_mode
from llmlab.measure import roofline
from llmlab.solutions import lab00, lab01, lab02, lab03, lab05

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is a Linux-only dependency
    triton = tl = None

ROOT = Path(__file__).resolve().parents[1]
LABS = ROOT / "labs"
STUDENT = LABS / "student"
GPU = torch.cuda.is_available()
TRITON_OK = triton is not None and (GPU or interpret_mode())  # conftest.py sets TRITON_INTERPRET without a GPU
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="no triton, or no CUDA GPU and TRITON_INTERPRET is not set")


# -- running a notebook's cell on its own ---------------------------------------------------------------------------

def code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text(encoding="utf-8"))["cells"]
            if c["cell_type"] == "code"]


def cell_defining(path: Path, name: str) -> str:
    """The one code cell of `path` that defines `name` (a `def name(` line)."""
    found = [c for c in code_cells(path) if re.search(rf"^def {name}\(", c, re.M)]
    assert len(found) == 1, f"{path.name}: {len(found)} cells define {name}"
    return found[0]


def run_cell(path: Path, name: str, ns: dict) -> dict:
    """Execute the cell of `path` that defines `name` in the namespace `ns` and return it. The source is registered
    with linecache under a name of its own, as Jupyter does, so that @triton.jit can read a kernel's source."""
    source = cell_defining(path, name)
    filename = f"<{path.parent.name}/{path.name}: cell defining {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), ns)
    return ns


def _prelude(lab: str) -> dict:
    """The names the lab's setup cell imports and its exercise cells use."""
    if lab.startswith("02_"):
        return {"roofline": roofline}
    if lab.startswith("07_"):
        return {"torch": torch, "triton": triton, "tl": tl}
    return {}


@dataclass(frozen=True)
class Exercise:
    lab: str  # the notebook's file name
    name: str  # the function the student writes
    check: Callable[[Callable], None]  # runs the lab's check on a function
    entry: str | None = None  # the function the check takes, when it is not `name` (a kernel's wrapper)
    needs: tuple[str, ...] = ()  # other exercises of the lab whose answers the cell calls

    def __str__(self) -> str:
        return f"{self.lab[:2]}:{self.name}"

    def load(self, folder: Path, needs_from: Path | None = None) -> Callable:
        """The function the check takes, from the cell in `folder`'s copy of the lab; the exercises it calls are
        taken from `needs_from` (default: the same copy)."""
        ns = _prelude(self.lab)
        for other in self.needs:
            run_cell((needs_from or folder) / self.lab, other, ns)
        run_cell(folder / self.lab, self.name, ns)
        return ns[self.entry or self.name]


def _check_rmsnorm(fn):
    from llmlab.kernels.lab07_solutions import check_rmsnorm
    check_rmsnorm(fn, device="cuda" if GPU else "cpu", dtype=torch.bfloat16 if GPU else torch.float32)


def _check_rmsnorm_bytes(fn):
    from llmlab.kernels.lab07_solutions import check_rmsnorm_bytes
    check_rmsnorm_bytes(fn)


def _notebook_lengths() -> list[int]:
    """The seven prompt lengths lab 05's bucket check pads."""
    cell = next(c for c in code_cells(LABS / "05_system_overhead.ipynb") if re.search(r"^lengths = \[", c, re.M))
    return ast.literal_eval(re.search(r"^lengths = (\[[\d, ]+\])", cell, re.M).group(1))


EXERCISES = [
    Exercise("00_tour.ipynb", "tokens_through_model", lab00.check_tokens_through_model),
    Exercise("01_gpu_utilization.ipynb", "tokens_per_s_ceiling", lab01.check_tokens_per_s_ceiling),
    Exercise("02_memory_wall.ipynb", "decode_intensity", lab02.check_decode_intensity),
    Exercise("02_memory_wall.ipynb", "critical_batch", lab02.check_critical_batch, needs=("decode_intensity",)),
    Exercise("03_kv_cache.ipynb", "kv_bytes_per_token", lab03.check_kv_bytes_per_token),
    Exercise("03_kv_cache.ipynb", "slot", lab03.check_slot),
    Exercise("03_kv_cache.ipynb", "paged_waste_tokens", lab03.check_paged_waste_tokens),
    Exercise("05_system_overhead.ipynb", "crossover_params", lab05.check_crossover),
    Exercise("05_system_overhead.ipynb", "bucket", lambda fn: lab05.check_bucket(fn, _notebook_lengths())),
    Exercise("07_triton_kernels.ipynb", "rmsnorm_kernel", _check_rmsnorm, entry="my_rmsnorm"),
    Exercise("07_triton_kernels.ipynb", "rmsnorm_bytes", _check_rmsnorm_bytes),
]


def _marks(ex: Exercise):
    return [needs_triton] if ex.lab.startswith("07_") else []


PARAMS = [pytest.param(ex, id=str(ex), marks=_marks(ex)) for ex in EXERCISES]


# -- the notebook's answer passes; the stub is rejected -------------------------------------------------------------

@pytest.mark.parametrize("ex", PARAMS)
def test_the_notebooks_answer_passes_its_check(ex):
    ex.check(ex.load(LABS))


@pytest.mark.parametrize("ex", PARAMS)
def test_the_student_stub_is_rejected_as_not_written(ex):
    fn = ex.load(STUDENT, needs_from=LABS)  # the other exercises answered: the failure is this one's own
    with pytest.raises(AssertionError, match=rf"{ex.name} is not written yet: replace the `raise "
                                             rf"NotImplementedError\(\.\.\.\)` line") as caught:
        ex.check(fn)
    error, chain = caught.value.__cause__, []
    while error is not None:  # the stub's NotImplementedError, possibly wrapped by Triton's interpreter
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert any(isinstance(e, NotImplementedError) or "NotImplementedError" in str(e) for e in chain), chain


def test_an_answer_calling_an_unwritten_exercise_names_that_one():
    fn = Exercise("02_memory_wall.ipynb", "critical_batch", lab02.check_critical_batch,
                  needs=("decode_intensity",)).load(LABS, needs_from=STUDENT)
    with pytest.raises(AssertionError, match="critical_batch calls decode_intensity, which is not written yet"):
        lab02.check_critical_batch(fn)


# -- plausible wrong answers are rejected, with the mistake named ----------------------------------------------------

def _tokens(cache_rule, no_cache_rule):
    return lambda p, n, use_cache: cache_rule(p, n) if use_cache else no_cache_rule(p, n)


_RIGHT_CACHE = lambda p, n: p + n - 1  # noqa: E731
_RIGHT_NO_CACHE = lambda p, n: sum(p + i for i in range(n))  # noqa: E731

WRONG_TOKENS = [
    (_tokens(lambda p, n: p + n, _RIGHT_NO_CACHE), "never fed back"),
    (_tokens(lambda p, n: n, _RIGHT_NO_CACHE), "the prompt still goes through once"),
    (_tokens(_RIGHT_NO_CACHE, _RIGHT_CACHE), "swapped"),
    (_tokens(_RIGHT_CACHE, lambda p, n: n * p), "the sequence grows"),
    (_tokens(_RIGHT_CACHE, lambda p, n: n * (p + n)), "not at its final length"),
    (_tokens(_RIGHT_CACHE, lambda p, n: sum(p + i for i in range(1, n + 1))), "feeds the prompt alone"),
    (lambda p, n, use_cache: None, "returned None"),
    (lambda p, n, use_cache: p + n, "count one forward pass at a time on a small case"),  # wrong in both cases
]


def _ceiling(c, bw, bytes_per_param=2, context_len=0, batch=1, kv_bytes_per_elem=2, *, heads=None, kv_factor=2,
             embedding=None, cache_per_seq=True, tokens_per_seq=True, giga=1e9, bpp=None, kv_elem=None):
    """A student's tokens/s ceiling with one slip (the keyword given)."""
    include = c.tie_embeddings if embedding is None else embedding
    weights = c.num_params(include_embedding=include) * (bpp or bytes_per_param)
    kv_token = kv_factor * c.n_layers * (heads or c.n_kv_heads) * c.head_dim * (kv_elem or kv_bytes_per_elem)
    kv = (batch if cache_per_seq else 1) * context_len * kv_token
    return (batch if tokens_per_seq else 1) * bw * giga / (weights + kv)


def _ceiling_with(**slip):
    return lambda c, bw, **kw: _ceiling(c, bw, **kw, **slip)


WRONG_CEILING = [
    (lambda c, bw, **kw: _ceiling(c, bw, **kw, heads=c.n_heads), r"per KV HEAD \(config.n_kv_heads\)"),
    (_ceiling_with(kv_factor=1), "a key AND a value"),
    (_ceiling_with(embedding=True), "input embedding table of an untied model"),
    (_ceiling_with(embedding=False), "tied to the output layer"),
    (_ceiling_with(cache_per_seq=False), "its own KV cache"),
    (_ceiling_with(tokens_per_seq=False), "one token for EACH sequence"),
    (_ceiling_with(giga=2 ** 30), r"not 2\*\*30"),
    (_ceiling_with(bpp=2), "not a fixed 2"),
    (lambda c, bw, **kw: _ceiling(c, bw, **kw, kv_elem=kw["bytes_per_param"]), "kv_bytes_per_elem"),
    (lambda c, bw, **kw: "fast", "a number"),
]


def _intensity(c, batch, ctx, bpp=2, *, flop_params=None, att_heads=None, kv_heads=None, kv_elem=2,
               kv_batch=True, weight_batch=False):
    """A student's decode intensity with one slip (the keyword given)."""
    per_layer = (c.dim * c.n_heads * c.head_dim + 2 * c.dim * c.n_kv_heads * c.head_dim
                 + c.n_heads * c.head_dim * c.dim + 3 * c.dim * c.intermediate_size)
    matmul = c.n_layers * per_layer + c.vocab_size * c.dim
    att_h = c.n_heads if att_heads is None else att_heads
    flops = batch * (2 * (flop_params or matmul) + 4 * c.n_layers * att_h * c.head_dim * ctx)
    weights = c.num_params(include_embedding=c.tie_embeddings) * bpp * (batch if weight_batch else 1)
    kv_elem = bpp if kv_elem == "weights" else kv_elem
    kv = (batch if kv_batch else 1) * ctx * 2 * c.n_layers * (kv_heads or c.n_kv_heads) * c.head_dim * kv_elem
    return flops / (weights + kv)


WRONG_INTENSITY = [
    (lambda c, b, ctx, bpp=2: _intensity(c, b, ctx, bpp, att_heads=0), "add attention over the cached tokens"),
    (lambda c, b, ctx, bpp=2: _intensity(c, b, ctx, bpp, att_heads=c.n_kv_heads), "every QUERY head attends"),
    (lambda c, b, ctx, bpp=2: _intensity(c, b, ctx, bpp, flop_params=c.num_params(include_embedding=c.tie_embeddings)),
     "MATRIX MULTIPLY only"),
    (lambda c, b, ctx, bpp=2: _intensity(c, b, ctx, bpp, kv_heads=c.n_heads), r"per KV HEAD \(config.n_kv_heads\)"),
    (lambda c, b, ctx, bpp=2: _intensity(c, b, ctx, bpp, kv_batch=False), "every sequence reads its own KV cache"),
    (lambda c, b, ctx, bpp=2: _intensity(c, b, ctx, bpp, weight_batch=True), "read ONCE per step"),
    (lambda c, b, ctx, bpp=2: _intensity(c, b, ctx, bpp, kv_elem="weights"), "the KV cache stays bf16"),
]


def _search(decide, limit=4096, give_up=None):
    """A student's critical_batch from a rule `decide(intensity, ridge, batch) -> answer or None`, searching batches
    1..limit and returning `give_up` when none is found."""
    def critical_batch(config, ridge, context_len):
        for b in range(1, limit + 1):
            answer = decide(roofline.arithmetic_intensity(config, b, context_len), ridge, b)
            if answer is not None:
                return answer
        return give_up
    return critical_batch


WRONG_CRITICAL = [
    (_search(lambda i, r, b: b - 1 if i >= r else None), "one short"),
    (_search(lambda i, r, b: b + 1 if i >= r else None), "one past"),
    (_search(lambda i, r, b: b if i >= r else None, give_up=4096), "expected None, got 4096.*levels off"),
    (_search(lambda i, r, b: b if i >= r else None, limit=100), "got None: search further"),
    (lambda config, ridge, context_len: None, "got None: search further"),
]

WRONG_KV = [
    (lambda c, b=2: 2 * c.n_layers * c.n_heads * c.head_dim * b, "query heads"),
    (lambda c, b=2: c.n_layers * c.n_kv_heads * c.head_dim * b, "K alone"),
    (lambda c, b=2: 2 * c.n_kv_heads * c.head_dim * b, "one layer"),
    (lambda c, b=2: 2 * c.n_layers * c.n_kv_heads * c.head_dim, "elements, not bytes"),
    (lambda c, b=2: None, "got None"),
    (lambda c, b=2: 3 * c.n_layers * c.n_kv_heads * c.head_dim * b, "a key and a value vector for each KV head"),
]

WRONG_SLOT = [
    (lambda t, p, bs: (p // bs, p % bs), "the block's INDEX"),
    (lambda t, p, bs: (t[p // 16], p % 16), "not a fixed 16"),
    (lambda t, p, bs: (t[math.ceil(p / bs)], p % bs), "rounds DOWN"),
    (lambda t, p, bs: (t[p // bs + 1], p % bs), "count from 0"),
    (lambda t, p, bs: t[p // bs], "return a pair"),
]

WRONG_WASTE = [
    (lambda lengths, bs: sum(bs - n % bs for n in lengths), "wastes nothing, not a whole block"),
    (lambda lengths, bs: sum(n % bs for n in lengths), "FILLED slots"),
    (lambda lengths, bs: sum(math.ceil(n / bs) * bs for n in lengths), "subtract the tokens stored"),
    (lambda lengths, bs: len(lengths) * (bs - 1), "worst case"),
]

WRONG_CROSSOVER = [
    (lambda n, us, bw, bpp=2: n * us * bw * 1e9 / bpp, "multiply by 1e-6"),
    (lambda n, us, bw, bpp=2: n * us * 1e-6 * bw / bpp, "multiply by 1e9"),
    (lambda n, us, bw, bpp=2: n * us * 1e-6 * bw * 1e9 * bpp, "divide, do not multiply"),
    (lambda n, us, bw, bpp=2: us * 1e-6 * bw * 1e9 / bpp, "EVERY launch"),
    (lambda n, us, bw, bpp=2: bpp / (n * us * 1e-6 * bw * 1e9), "solve for params"),
]

WRONG_BUCKET = [
    (lambda n: n, "too fine"),
    (lambda n: -(-n // 8) * 8, "too fine"),  # multiples of 8: the sizes grow with the length
    (lambda n: 1 << (n.bit_length() - 1), "round UP"),  # the power of two at or BELOW n
    (lambda n: 1024, "more than twice"),
    (lambda n: 2.0 ** math.ceil(math.log2(max(n, 8))), r"return a whole number of tokens \(an int"),
    (lambda n: -(-n // 16) * 16, "sizes a fixed step apart"),  # 4 sizes for the lab's lengths, 19 over 1..299
]

WRONG_BYTES = [
    (lambda rows, D, e: rows * D * e + D * e, "also WRITES y"),
    (lambda rows, D, e: 2 * rows * D * e, "add the weight"),
    (lambda rows, D, e: 3 * rows * D * e, "read ONCE"),
    (lambda rows, D, e: 2 * rows * D + D, "multiply by elem_bytes"),
]

WRONG = {
    "tokens_through_model": WRONG_TOKENS, "tokens_per_s_ceiling": WRONG_CEILING, "decode_intensity": WRONG_INTENSITY,
    "critical_batch": WRONG_CRITICAL, "kv_bytes_per_token": WRONG_KV, "slot": WRONG_SLOT,
    "paged_waste_tokens": WRONG_WASTE, "crossover_params": WRONG_CROSSOVER, "bucket": WRONG_BUCKET,
    "rmsnorm_bytes": WRONG_BYTES,
}
WRONG_PARAMS = [pytest.param(ex, fn, lesson, id=f"{ex}-{i}")
                for ex in EXERCISES if ex.name in WRONG for i, (fn, lesson) in enumerate(WRONG[ex.name])]


@pytest.mark.parametrize("ex, wrong, lesson", WRONG_PARAMS)
def test_a_plausible_wrong_answer_is_rejected_with_its_lesson(ex, wrong, lesson):
    with pytest.raises(AssertionError, match=lesson):
        ex.check(wrong)


def test_every_exercise_has_wrong_answers():
    assert {ex.name for ex in EXERCISES} - set(WRONG) == {"rmsnorm_kernel"}  # its wrong kernels are below


# -- lab 07's kernel: wrong kernels, each with one slip --------------------------------------------------------------

# (slip, its number in the kernel below, the lesson the check must give)
SLIPS = [("mean over BLOCK_D", 1, "divided the sum of squares by BLOCK_D"), ("sum, not mean", 2, "the MEAN square"),
         ("no square root", 3, "take the square root"), ("no weight", 4, "multiply by the weight"),
         ("no eps", 5, "add eps inside the square root"), ("rows at row x D", 6, "stride_x elements after"),
         ("squares in the input dtype", 7, "sum the squares in fp32"),
         ("x loaded without a mask", 8, "loaded without a mask.*mask=cols < D")]

if triton is not None:
    @triton.jit
    def rmsnorm_with_a_slip(x_ptr, w_ptr, y_ptr, D, eps, stride_x, stride_y, BLOCK_D: tl.constexpr,
                            SLIP: tl.constexpr):
        """Lab 07's kernel with the slip numbered SLIP (0: none)."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < D
        if SLIP == 6:
            x = tl.load(x_ptr + row * D + cols, mask=mask, other=0.0)  # rows taken as packed
        elif SLIP == 8:
            x = tl.load(x_ptr + row * stride_x + cols)  # every lane, the ones past D too
        else:
            x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        if SLIP == 7:
            xs = x  # squares in the input dtype: fp16 overflows past 65504
        else:
            xs = x.to(tl.float32)
        total = tl.sum(xs * xs, axis=0).to(tl.float32)
        if SLIP == 1:
            mean_square = total / BLOCK_D
        elif SLIP == 2:
            mean_square = total
        else:
            mean_square = total / D
        if SLIP == 5:
            rstd = 1.0 / tl.sqrt(mean_square)
        elif SLIP == 3:
            rstd = 1.0 / (mean_square + eps)
        else:
            rstd = 1.0 / tl.sqrt(mean_square + eps)
        y = (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32)
        if SLIP != 4:
            y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _with_a_slip(slip: int):
    """The notebook's wrapper `my_rmsnorm`, launching the kernel with slip number `slip`."""
    def my_rmsnorm(x, weight, eps=1e-5):
        D = x.shape[-1]
        x2 = x.reshape(-1, D)
        y = torch.empty_like(x2)
        rmsnorm_with_a_slip[(x2.shape[0],)](x2, weight, y, D, eps, x2.stride(0), y.stride(0),
                                           BLOCK_D=triton.next_power_of_2(D), SLIP=slip)
        return y.view(x.shape)
    return my_rmsnorm


@needs_triton
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy warns on 1 / sqrt(0)
@pytest.mark.parametrize("slip, number, lesson", SLIPS, ids=[s[0] for s in SLIPS])
def test_a_wrong_kernel_is_rejected_with_its_lesson(slip, number, lesson):
    with pytest.raises(AssertionError, match=lesson):
        _check_rmsnorm(_with_a_slip(number))


@needs_triton
def test_the_kernel_without_a_slip_passes():
    """The wrong kernels differ from a right one only by their slip."""
    _check_rmsnorm(_with_a_slip(0))


# -- the notebooks and their student copies -------------------------------------------------------------------------

def _tool():
    spec = importlib.util.spec_from_file_location("make_student_labs", ROOT / "tools" / "make_student_labs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("ex", EXERCISES, ids=str)
def test_the_lab_holds_the_answer_and_the_student_copy_the_stub(ex):
    lab, student = cell_defining(LABS / ex.lab, ex.name), cell_defining(STUDENT / ex.lab, ex.name)
    for cell in (lab, student):  # no reference answer imported as the answer, no placeholder left
        for stale in ("llmlab.solutions", "lab07_solutions", "as reference", "YOUR ANSWER HERE"):
            assert stale not in cell, f"{ex.lab}: the cell defining {ex.name} holds {stale!r}"
    assert lab.count("# BEGIN SOLUTION") == lab.count("# END SOLUTION") >= 1
    assert "NotImplementedError" not in lab
    assert 'raise NotImplementedError("write your answer here")' in student and "SOLUTION" not in student


@pytest.mark.parametrize("lab", sorted({ex.lab for ex in EXERCISES}))
def test_the_copies_parse_and_carry_no_outputs(lab):
    for path in (LABS / lab, STUDENT / lab):
        nb = json.loads(path.read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                ast.parse("".join(cell["source"]))
                assert cell["outputs"] == [] and cell["execution_count"] is None, path


def test_every_student_copy_is_current():
    jobs = _tool().plan(sorted(LABS.glob("[0-9][0-9]_*.ipynb")), STUDENT)
    assert {ex.lab for ex in EXERCISES} <= {lab.name for lab, *_ in jobs}  # each of these labs has a copy
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "make_student_labs.py"), "--check"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, "labs/student is stale: run python3 tools/make_student_labs.py\n" + out.stderr


def test_the_textbook_next_power_of_two_is_a_right_bucket():
    """No smallest bucket: 1 << (n - 1).bit_length() pads the lab's lengths to 5 sizes, the reference (smallest
    bucket 8) to 4; both grow geometrically and both pass."""
    from llmlab.solutions.lab05 import check_bucket

    lengths = [3, 5, 9, 14, 23, 37, 60]  # the lab's
    assert check_bucket(lambda n: 1 << (n - 1).bit_length(), lengths) == 5


def test_the_kv_bytes_check_shows_the_number_not_the_formula():
    # a wrong answer learns the expected bytes and what to count, not the product that is the exercise's answer
    with pytest.raises(AssertionError) as e:
        lab03.check_kv_bytes_per_token(lambda c, b=2: 12345)
    message = str(e.value)
    assert "expected 131072 bytes per token" in message and "got 12345" in message
    assert "2 x 32 x 8 x 128" not in message
