"""Byte-level BPE tokenizer for the shipped model, trained with the Hugging Face `tokenizers` library.

Byte-level BPE (GPT-2, Radford et al. 2019; BPE: Sennrich et al. 2016, https://arxiv.org/abs/1508.07909) starts
from the 256 byte values and merges the most frequent adjacent pairs until the vocabulary is full. Because every
byte is in the base alphabet, any text encodes (no unknown token) and decodes back byte for byte — indentation,
tabs and newlines of code included.

One special token, `<|endoftext|>` (id 0), is both BOS and EOS: the training stream is
`<|endoftext|> doc1 <|endoftext|> doc2 ...`, and the tokenizer's post-processor puts it in front of every encoded
text (`add_special_tokens=True`, the default), so a prompt starts the way every training document did. Encode
training text with `add_special_tokens=False` and add the separators yourself.

Files written (what `transformers.AutoTokenizer.from_pretrained(folder)` reads):
`tokenizer.json` (the whole tokenizer) and `tokenizer_config.json` (class PreTrainedTokenizerFast, special tokens,
model_max_length). Docs: https://huggingface.co/docs/tokenizers/api/trainers
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from .corpus import EOT

VOCAB_SIZE = 8192


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE tokenizer on `texts` (train documents only: the held-out ones stay unseen).

    Args:
        texts: the documents, one string each (a BPE merge never crosses a document boundary).
        vocab_size: final size including the 256 byte tokens and `<|endoftext|>`.
        min_frequency: a pair must occur this often to be merged.

    Returns:
        the tokenizer; `<|endoftext|>` has id 0 and is prepended by `encode(text)` (see the module docstring).

    Raises:
        ValueError: vocab_size too small to hold the byte alphabet and the special token.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size={vocab_size} < {len(alphabet) + 1}: need the 256 bytes and {EOT}")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: "def f" and "\ndef f" keep their exact bytes; the GPT-2 regex splits words/spaces.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eot = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B:1", special_tokens=[(EOT, eot)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, folder: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json into `folder` (created if missing).

    model_max_length: the model's context length (max_seq_len); transformers warns beyond it.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "unk_token": None,
        "pad_token": None,  # no padding token: pass the attention mask, or pad with eos when batching
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,  # would alter text (" ," -> ","): byte-exact round trip matters
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
