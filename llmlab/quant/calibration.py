"""Calibration text for activation-aware quantization (AWQ, `llmlab.quant.awq`): the held-out documents of the
default model's corpus, cut into token windows, and the tokens left after them for measuring perplexity.

The default model (`data/models/pydoc-llama`) was trained on Python's documentation, read from the running
interpreter (`llmlab.train.corpus`): pydoc topics and standard-library docstrings. About 3% of the documents, chosen
by a hash of their name, were held out of training; the model card (`training.json`, corpus.val_documents) lists
them. `heldout_text()` rebuilds exactly those documents from this interpreter, so nothing is downloaded and no text
file ships with the repository. A different Python version carries slightly different docstrings: the text, its
token count and the perplexities measured on it move a little with the version (`tools/quant_quality.py` records it).

    tokens = heldout_ids(llm)                                   # (T,) the whole held-out stream
    calib = calibration_ids(llm)                                # (16, 256): its first 16 * 256 tokens
    rest = evaluation_ids(llm)                                  # (T - 4096,): the tokens after them
    calibration_ids(llm, my_text, n_samples=8, seq_len=512)     # any text a user gives

The calibration windows are the FIRST n_samples * seq_len tokens of the text, consecutive and non-overlapping;
`evaluation_ids` returns the tokens after them, so a perplexity measured on those never sees a calibration token.
AWQ (Lin et al. 2023, https://arxiv.org/abs/2306.00978) calibrates on 128 windows of 512 tokens of the Pile; a
model of 8 layers of width 256 needs far fewer, and its corpus holds ~25k held-out tokens in all.
"""

from __future__ import annotations

import json
import numbers

import torch

__all__ = ["heldout_text", "heldout_ids", "calibration_ids", "evaluation_ids"]


def _heldout_names() -> list[str] | None:
    """The held-out document names of the shipped model's card (training.json, corpus.val_documents), or None when
    the card is absent (then every document `llmlab.train.corpus.is_val` holds out is used)."""
    from llmlab.checkpoint import DEFAULT_MODEL_DIR

    card = DEFAULT_MODEL_DIR / "training.json"
    if not card.is_file():
        return None
    names = json.loads(card.read_text()).get("corpus", {}).get("val_documents")
    return list(names) if names else None


def heldout_text() -> str:
    """The held-out documents of the default model's training corpus, joined by its separator `<|endoftext|>`.

    The documents are those the model card lists as held out (`data/models/pydoc-llama/training.json`), rebuilt from
    this interpreter's pydoc topics and standard-library sources (`llmlab.train.corpus`), in corpus order (topics,
    then modules by name). A listed module this Python lacks is skipped. Takes about a second (only the held-out
    modules are parsed).

    Returns:
        str, ~90k characters (~25k tokens of the default tokenizer) on CPython 3.11-3.12.

    Raises:
        FileNotFoundError: none of the held-out documents exists in this Python's standard library.
    """
    from llmlab.train.corpus import EOT, is_val, module_document, stdlib_files, topic_documents

    names = _heldout_names()
    wanted = (lambda name: name in names) if names is not None else is_val
    docs = [d for d in topic_documents() if wanted(d.name)]
    for module, path in stdlib_files():
        if wanted(f"module:{module}"):
            try:
                doc, _ = module_document(module, path)
            except (SyntaxError, ValueError, UnicodeDecodeError):
                continue
            if doc is not None:
                docs.append(doc)
    if not docs:
        raise FileNotFoundError("heldout_text: none of the default model's held-out documents (pydoc topics and "
                                "standard-library modules) exists in this Python; give calibration text yourself")
    return EOT.join(d.text for d in docs)


def _encode(tokenizer_or_llm, text: str) -> list[int]:
    """Token ids of `text` with an `LLM` (its encode), a `tokenizers.Tokenizer` (encode(text).ids) or a Hugging Face
    tokenizer (encode(text) -> list)."""
    if not isinstance(text, str):
        raise TypeError(f"calibration text must be a str, got {type(text).__name__}; pass token ids to "
                        f"llmlab.quant.quantize_awq directly")
    encode = getattr(tokenizer_or_llm, "encode", None)
    if encode is None:
        raise TypeError(f"expected an LLM or a tokenizer (something with .encode(text)), got "
                        f"{type(tokenizer_or_llm).__name__}")
    out = encode(text)
    ids = out.ids if hasattr(out, "ids") else out
    return [int(i) for i in ids]


def heldout_ids(tokenizer_or_llm, text: str | None = None) -> torch.Tensor:
    """(T,) int64: `text` (default `heldout_text()`) tokenized by an `LLM` or a tokenizer."""
    return torch.tensor(_encode(tokenizer_or_llm, heldout_text() if text is None else text), dtype=torch.long)


def _check_sizes(n_samples, seq_len) -> None:
    for name, v, low in (("n_samples", n_samples, 1), ("seq_len", seq_len, 2)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")


def calibration_ids(tokenizer_or_llm, text: str | None = None, n_samples: int = 16,
                    seq_len: int = 256) -> torch.Tensor:
    """Calibration windows for `llmlab.quant.quantize_awq`: the first n_samples * seq_len tokens of `text`, cut into
    n_samples consecutive, non-overlapping windows of seq_len tokens.

    Args:
        tokenizer_or_llm: an `LLM` (its `encode`), a `tokenizers.Tokenizer` or a Hugging Face tokenizer.
        text: any text; None = `heldout_text()`, the default model's held-out documents.
        n_samples: windows (rows). seq_len: tokens per window (the context the activations are collected at; at
            most the model's max_seq_len, which `quantize_awq` checks).

    Returns:
        LongTensor (n_samples, seq_len), on the CPU.

    Raises:
        ValueError: n_samples < 1 or seq_len < 2; a text shorter than one window (the message gives its token count
            and seq_len); a text shorter than n_samples windows (the message gives the sizes and how many windows
            it holds).
        TypeError: text is not a str; tokenizer_or_llm has no encode.
    """
    _check_sizes(n_samples, seq_len)
    n_samples, seq_len = int(n_samples), int(seq_len)
    ids = heldout_ids(tokenizer_or_llm, text)
    need = n_samples * seq_len
    if ids.numel() < seq_len:
        raise ValueError(f"the calibration text is {_tokens(ids.numel())} long, shorter than one window of seq_len = "
                         f"{seq_len} tokens (the context the activations are collected at): give a longer text, "
                         f"or a smaller seq_len (with LLM.quantize: calibration=llmlab.quant.calibration_ids(llm, "
                         f"text, n_samples=..., seq_len=...))")
    if ids.numel() < need:
        raise ValueError(f"the calibration text is {_tokens(ids.numel())} long; n_samples = {n_samples} windows of "
                         f"seq_len = {seq_len} need {need}: give a longer text, or n_samples <= "
                         f"{ids.numel() // seq_len} (with LLM.quantize: calibration=llmlab.quant.calibration_ids("
                         f"llm, text, n_samples={max(1, ids.numel() // seq_len)}))")
    return ids[:need].view(n_samples, seq_len).clone()


def _tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def evaluation_ids(tokenizer_or_llm, text: str | None = None, n_samples: int = 16,
                   seq_len: int = 256) -> torch.Tensor:
    """The tokens of `text` (default `heldout_text()`) AFTER the calibration windows that `calibration_ids` takes
    with the same n_samples and seq_len: (T - n_samples * seq_len,) int64, for a perplexity that never scores a
    calibration token. Raises ValueError (as `calibration_ids`) when the text does not hold more than the
    calibration windows."""
    _check_sizes(n_samples, seq_len)
    ids = heldout_ids(tokenizer_or_llm, text)
    need = int(n_samples) * int(seq_len)
    if ids.numel() < need + 2:
        raise ValueError(f"the text is {_tokens(ids.numel())} long; after n_samples * seq_len = {need} calibration "
                         f"tokens at least 2 must be left to measure perplexity on: give a longer text, or fewer "
                         f"calibration tokens")
    return ids[need:].clone()
