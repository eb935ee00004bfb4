"""The named workloads of `llmlab bench`: how many requests, how long their prompts, how many new tokens.

    chat    batch 1, a 128-token prompt, 256 new tokens
    batch   64 requests at once: 16 each of 64-, 128-, 256- and 512-token prompts, 128 new tokens each
    long    batch 1, an 8K context: an (8192 - 256)-token prompt, 256 new tokens

Prompts are random token ids (seeded), the same for every row of a bench run and for its peers. Without the
batching switch the llmlab rows run a workload as groups of equal-length prompts (`group_by_length`), one group after
the other; with it, as one left-padded batch or by continuous batching (`llmlab.batching`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Workload:
    """A named set of requests: one prompt length per request, new tokens per request.

    quick_new_tokens replaces new_tokens under `--quick` (tests, CPU smoke runs); prompts keep their lengths.
    """

    name: str
    description: str
    prompt_lens: tuple[int, ...]
    new_tokens: int
    quick_new_tokens: int

    @property
    def n_requests(self) -> int:
        return len(self.prompt_lens)

    def context_needed(self, quick: bool = False) -> int:
        """Longest prompt + new tokens: the context length the model must have."""
        return max(self.prompt_lens) + (self.quick_new_tokens if quick else self.new_tokens)


WORKLOADS: dict[str, Workload] = {
    "chat": Workload("chat", "batch 1, 128-token prompt, 256 new tokens", (128,), 256, 16),
    "batch": Workload("batch", "64 requests at once: 16 each of 64-, 128-, 256- and 512-token prompts, "
                      "128 new tokens each", tuple(n for n in (64, 128, 256, 512) for _ in range(16)), 128, 8),
    "long": Workload("long", "batch 1, 8K context: 7936-token prompt, 256 new tokens", (8192 - 256,), 256, 16),
}


def get_workload(name: str) -> Workload:
    """Raises ValueError naming the known workloads."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known workloads: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


def make_prompts(workload: Workload, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """One list of random token ids per request (seeded: every row and every peer gets the same prompts)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in workload.prompt_lens]


def group_by_length(prompts: list[list[int]]) -> list[list[int]]:
    """Indices of the requests grouped by prompt length (shortest first): the llmlab engine runs each group as one
    batch, since all prompts of one `generate` call must have the same length."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(len(p), []).append(i)
    return [groups[n] for n in sorted(groups)]
