"""`llmlab.sampling.sample`: greedy, temperature, top-k and top-p masks, seeding, argument checks.

The mask tests draw thousands of samples in one call (one row per draw) from logits whose probabilities are known,
and check that the excluded tokens never appear, every kept token does, and the kept tokens' frequencies follow the
renormalized probabilities.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmlab.sampling import ARGMAX_CHUNK, argmax_rows, check_sampling_args, sample

N = 20000  # draws per distribution; the frequency tolerance below is > 5 standard errors at this N

PROBS = torch.tensor([0.05, 0.5, 0.0125, 0.3, 0.0125, 0.125])  # sorted: 1 (.5), 3 (.3), 5 (.125), 0 (.05), 2/4
LOGITS = PROBS.log()


def draws(logits: torch.Tensor, n: int = N, seed: int = 0, **kw) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return sample(logits.expand(n, -1).contiguous(), generator=gen, **kw)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


def check_support_and_freqs(tokens: torch.Tensor, keep: list[int], temperature: float = 1.0):
    vocab = len(PROBS)
    freq = frequencies(tokens, vocab)
    dropped = [i for i in range(vocab) if i not in keep]
    assert freq[dropped].sum() == 0, f"masked tokens were sampled: {freq.tolist()}"
    assert (freq[keep] > 0).all()
    expected = torch.zeros(vocab)
    p = PROBS[keep] ** (1 / temperature)
    expected[keep] = p / p.sum()
    assert (freq - expected).abs().max() < 0.02, (freq.tolist(), expected.tolist())


def test_greedy_is_argmax_per_row():
    logits = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits)
    assert out.dtype == torch.int64 and out.shape == (7,)
    assert torch.equal(out, logits.argmax(-1))


@pytest.mark.parametrize("V", [1, 7, ARGMAX_CHUNK - 1, ARGMAX_CHUNK, ARGMAX_CHUNK + 1, 5000, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_two_stage_argmax_equals_torch_argmax(V, dtype):
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g).to(dtype)
    x[1] = 0.0  # a row of ties: the first index wins
    x[2, V // 3] = x[2, -1] = 100.0  # the max twice, in different slices
    x[3] = float("-inf")  # nothing finite: index 0, as torch.argmax
    x[4, -1] = 50.0  # the max in the padded last slice
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_two_stage_argmax_takes_other_shapes_and_integer_scores_as_torch_does():
    x = torch.randn(5000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))  # 1-D: one index
    xi = torch.randint(0, 9, (2, 5000), generator=torch.Generator().manual_seed(2))
    assert torch.equal(argmax_rows(xi), xi.argmax(dim=-1))  # integers: no -inf padding


def test_plain_sampling_follows_the_distribution():
    check_support_and_freqs(draws(LOGITS, temperature=1.0), keep=list(range(6)))


def test_temperature_sharpens_and_flattens():
    for t in (0.5, 2.0):
        check_support_and_freqs(draws(LOGITS, temperature=t), keep=list(range(6)), temperature=t)


@pytest.mark.parametrize("k,keep", [(1, [1]), (2, [1, 3]), (3, [1, 3, 5]), (4, [0, 1, 3, 5])])
def test_top_k_keeps_exactly_the_k_best(k, keep):
    check_support_and_freqs(draws(LOGITS, temperature=1.0, top_k=k), keep)


def test_top_k_larger_than_vocab_keeps_all():
    check_support_and_freqs(draws(LOGITS, temperature=1.0, top_k=100), keep=list(range(6)))


@pytest.mark.parametrize("p,keep", [
    (0.3, [1]),  # the top token alone already reaches 0.3
    (0.45, [1]),
    (0.7, [1, 3]),
    (0.85, [1, 3, 5]),  # 0.8 < 0.85 -> the third token (0.125) is needed
    (0.95, [0, 1, 3, 5]),
    (0.99, [0, 1, 2, 3, 4, 5]),
])
def test_top_p_keeps_the_smallest_nucleus(p, keep):
    check_support_and_freqs(draws(LOGITS, temperature=1.0, top_p=p), keep)


def test_top_p_with_top_k_applies_both():
    # top_k=3 keeps {1, 3, 5} with renormalized probs .5/.925, .3/.925, .125/.925; top_p=0.8 then needs 1 and 3
    # (0.54 + 0.32 >= 0.8)
    check_support_and_freqs(draws(LOGITS, temperature=1.0, top_k=3, top_p=0.8), keep=[1, 3])


def test_top_p_is_applied_after_temperature():
    # at temperature 0.5 the probs become ~ p^2 normalized: token 1 has .25/.3558 = 0.70 > 0.6 alone
    check_support_and_freqs(draws(LOGITS, temperature=0.5, top_p=0.6), keep=[1], temperature=0.5)


def test_masks_are_per_row():
    """Each row gets its own top-k / top-p set (row 2's best token is row 1's worst)."""
    logits = torch.stack([LOGITS, LOGITS.flip(0)])  # (2, V)
    gen = torch.Generator().manual_seed(0)
    out = sample(logits.repeat(N // 2, 1), temperature=1.0, top_k=2, generator=gen).view(N // 2, 2)
    assert set(out[:, 0].tolist()) == {1, 3}
    assert set(out[:, 1].tolist()) == {5 - 1, 5 - 3}


def test_tiny_top_p_and_top_k_1_are_greedy():
    logits = torch.randn(64, 1000, generator=torch.Generator().manual_seed(1)) * 3
    greedy = logits.argmax(-1)
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(sample(logits, temperature=1.0, top_k=1, generator=gen), greedy)
    assert torch.equal(sample(logits, temperature=1.0, top_p=1e-6, generator=gen), greedy)
    assert torch.equal(sample(logits, temperature=1e-3, generator=gen), greedy)


def test_seeded_generator_is_reproducible_and_seed_matters():
    logits = torch.zeros(256, 1000)  # uniform: any two seeds disagree somewhere
    a = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(42))
    b = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(42))
    c = sample(logits, temperature=1.0, generator=torch.Generator().manual_seed(43))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_half_precision_logits_are_accepted():
    out = sample(LOGITS.to(torch.bfloat16).expand(4000, -1), temperature=1.0, top_k=2,
                 generator=torch.Generator().manual_seed(0))
    assert set(out.tolist()) == {1, 3}


@pytest.mark.parametrize("kw,name", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=-1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=1.0, top_k=0), "top_k"),
    (dict(temperature=1.0, top_k=-3), "top_k"),
    (dict(temperature=1.0, top_k=1.5), "top_k"),
    (dict(temperature=1.0, top_k=math.inf), "top_k"),  # was an OverflowError from int(inf)
    (dict(temperature=1.0, top_k=math.nan), "top_k"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=-0.1), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_p=math.nan), "top_p"),
])
def test_bad_settings_raise_naming_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        sample(LOGITS[None], **kw)
    with pytest.raises(ValueError, match=name):
        check_sampling_args(kw.get("temperature", 0.0), kw.get("top_k"), kw.get("top_p"))


def test_edge_settings_are_valid():
    check_sampling_args(0.0, None, None)
    check_sampling_args(1.0, 1, 1.0)  # top_p = 1 keeps everything
    out = draws(LOGITS, n=5000, temperature=1.0, top_p=1.0)
    assert set(out.tolist()) == set(range(6))


def test_a_tiny_temperature_is_greedy_not_nan():
    """logits / 1e-40 overflows to inf, and softmax(inf - inf) is NaN: the scores are shifted first, so the best
    token keeps all the probability (found by a fresh user: it used to pick id 0, the EOS of the shipped model)."""
    logits = torch.tensor([[1.0, 50.0, 3.0], [7.0, -2.0, 6.5]])
    for t in (1e-38, 1e-40, 1e-45):
        assert sample(logits, temperature=t, generator=torch.Generator().manual_seed(0)).tolist() == [1, 0]


def test_a_temperature_below_fp32s_range_is_greedy():
    """1 / T is no fp32 number there: the division used to give NaN and the sampler token 0."""
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    for t in (1e-46, 1e-39):
        assert sample(logits, temperature=t).tolist() == [1]


def test_top_k_keeps_exactly_k_tokens_when_scores_tie():
    logits = torch.zeros(1, 50)
    drawn = {sample(logits, 1.0, top_k=2, generator=torch.Generator().manual_seed(i)).item() for i in range(200)}
    assert len(drawn) == 2  # every token ties with the 2nd: masking by its score used to keep all 50
    top1 = {sample(logits, 1.0, top_k=1, generator=torch.Generator().manual_seed(i)).item() for i in range(50)}
    assert len(top1) == 1


def test_logits_that_are_not_one_row_per_sequence_are_named():
    for temperature in (0.0, 0.7):
        with pytest.raises(ValueError, match=r"logits must be a \(B, V\) tensor.*got \(50,\).*logits\[None\]"):
            sample(torch.randn(50), temperature=temperature, top_k=5 if temperature else None)
