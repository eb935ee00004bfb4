"""Write the trained model as a Hugging Face folder, check it by reloading, and document it.

`export` writes into the model folder:

* `config.json`, `model.safetensors` (bf16, tied lm_head stored once) — `llmlab.checkpoint.save_model`;
* `tokenizer.json`, `tokenizer_config.json` — `tokenizer.save_tokenizer`;
* `generation_config.json` — bos/eos ids and greedy decoding, for `transformers` `generate()`;
* `training.json` — every number below plus a subsampled loss curve (small: a few KB);
* `README.md` — the model card, written from the same numbers.

The held-out numbers in the card are measured on the SAVED file: the bf16 weights are reloaded with
`llmlab.checkpoint.load_model(folder, dtype=float32)` and evaluated without autocast or TF32, so the card
describes what a user downloads, not the training copy. Perplexity = exp(mean nats/token); bits per byte = total
nats / ln 2 / UTF-8 bytes of the scored target tokens (comparable across tokenizers).
"""

from __future__ import annotations

import json
import math
import platform
import re
import textwrap
import time
from pathlib import Path

import torch

from ..checkpoint import load_model, save_model
from .corpus import EOT
from .tokenizer import save_tokenizer
from .trainer import Data, TrainConfig, TrainResult, eval_windows, evaluate, resolve_device

MAX_FILE_MB = 20.0  # the repository's per-file size limit
SAMPLE_PROMPTS = ("The list", "def ", "class ")


@torch.no_grad()
def greedy(model, tokenizer, prompt: str, max_new_tokens: int = 48) -> str:
    """Greedy continuation of `prompt` by re-running the whole sequence each step (kv_cache=None: slow, simple).

    The prompt is encoded with the tokenizer's BOS (`<|endoftext|>`) in front, like every training document.
    Returns the continuation text only (stops early at `<|endoftext|>`).
    """
    device = next(model.parameters()).device
    eos, max_len = model.config.eos_token_id, model.config.max_seq_len
    prompt_ids = tokenizer.encode(prompt).ids
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        x = torch.tensor([ids[-max_len:]], device=device)  # (1, T)
        nxt = int(model(x, last_only=True)[0, -1].argmax())  # logits (1, 1, V) -> token id
        if nxt == eos:
            break
        ids.append(nxt)
    return tokenizer.decode(ids[len(prompt_ids):])


def bytes_per_token(tokenizer) -> torch.Tensor:
    """(V,) int64: UTF-8 bytes each token stands for (byte-level BPE: one symbol = one byte; specials = 0)."""
    vocab = tokenizer.get_vocab()
    table = torch.zeros(tokenizer.get_vocab_size(), dtype=torch.int64)
    for token, i in vocab.items():
        table[i] = 0 if token == EOT else len(token)
    return table


@torch.no_grad()
def saved_model_eval(folder: Path, data: Data, cfg: TrainConfig, device: torch.device) -> dict:
    """Held-out loss, perplexity and bits/byte of the saved bf16 weights, reloaded in fp32 (no TF32, no autocast)."""
    model = load_model(folder, device=device, dtype=torch.float32)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        vx, vy = (t.to(device) for t in eval_windows(data.val_tokens, cfg.seq_len))
        loss = evaluate(model, vx, vy, cfg.batch_size, amp=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    n_bytes = int(bytes_per_token(data.tokenizer)[vy.cpu()].sum())
    return {
        "val_loss": round(loss, 4),
        "val_perplexity": round(math.exp(loss), 2),
        "val_bits_per_byte": round(loss * vy.numel() / math.log(2) / n_bytes, 4),
        "val_tokens_scored": vy.numel(),
        "val_bytes_scored": n_bytes,
        "precision": "bf16 weights from model.safetensors, computed in fp32",
    }, model


def _subsample(rows: list[dict], n: int = 60) -> list[dict]:
    if len(rows) <= n:
        return rows
    keep = sorted({round(i * (len(rows) - 1) / (n - 1)) for i in range(n)})
    return [rows[i] for i in keep]


def export(folder: str | Path, cfg: TrainConfig, data: Data, res: TrainResult, command: str, t_start: float,
           log=print) -> dict:
    """Save weights + tokenizer + configs, evaluate the saved file, write training.json and README.md.

    t_start: `time.perf_counter()` at the start of the run (for the total wall time, this export included).

    Returns:
        the facts written to training.json.

    Raises:
        RuntimeError: the weights file is larger than MAX_FILE_MB (would not fit the repository).
    """
    import tokenizers
    import transformers

    folder = Path(folder)
    device = resolve_device(cfg.device)
    model = res.model
    save_model(model, folder, dtype=torch.bfloat16)
    save_tokenizer(data.tokenizer, folder, model_max_length=model.config.max_seq_len)
    gen_cfg = {"bos_token_id": data.eot_id, "eos_token_id": data.eot_id, "pad_token_id": data.eot_id,
               "do_sample": False, "max_new_tokens": 128}
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    size_mb = (folder / "model.safetensors").stat().st_size / 1e6
    if size_mb > MAX_FILE_MB:
        raise RuntimeError(f"model.safetensors is {size_mb:.1f} MB > {MAX_FILE_MB} MB; shrink the model")

    ev, reloaded = saved_model_eval(folder, data, cfg, device)
    log(f"saved {folder} ({size_mb:.1f} MB); reloaded bf16 weights in fp32: held-out loss {ev['val_loss']:.4f}, "
        f"perplexity {ev['val_perplexity']:.2f}, {ev['val_bits_per_byte']:.3f} bits/byte")
    samples = [{"prompt": p, "completion": greedy(reloaded, data.tokenizer, p)} for p in SAMPLE_PROMPTS]
    for s in samples:  # runs of blank lines (an undertrained model's favourite token) squeezed in the log only
        text = re.sub(r"\n\s*\n(\s*\n)+", "\n\n", (s["prompt"] + s["completion"]).rstrip())
        log(f"--- greedy: {s['prompt']!r}\n{text}")

    st = data.stats
    facts = {
        "name": model.config.name,
        "parameters": res.n_params,
        "model_config": model.config.to_hf_config(),
        "weights_file_mb": round(size_mb, 2),
        "corpus": {
            **st.to_dict(),
            "train_tokens": len(data.train_tokens),
            "val_tokens": len(data.val_tokens),
            "val_documents": [d.name for d in data.val_docs],
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": data.tokenizer.get_vocab_size(),
                      "special_tokens": {EOT: data.eot_id}, "trained_on": "train split only"},
        "training": {
            "command": command,
            "recipe": cfg.to_dict(),
            "steps": res.steps_done,
            "planned_steps": res.planned_steps,
            "stop_reason": res.stop_reason,
            "best_step": res.best_step,
            "best_val_loss_training_precision": round(res.best_val_loss, 4),
            "tokens_seen": res.tokens_seen,
            "epochs_seen": round(res.tokens_seen / len(data.train_tokens), 2),
            "train_loop_s": round(res.train_s, 1),
            "corpus_s": round(data.corpus_s, 2),
            "tokenizer_s": round(data.tokenizer_s, 2),
            "encode_s": round(data.encode_s, 2),
            "total_wall_s": round(time.perf_counter() - t_start, 1),
            "device": res.device_name,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "seed": cfg.seed,
        },
        "eval_saved_weights": ev,
        "samples_greedy": samples,
        "loss_curve": _subsample(res.history),
    }
    (folder / "training.json").write_text(json.dumps(facts, indent=1) + "\n")
    (folder / "README.md").write_text(model_card(facts))
    return facts


def model_card(f: dict) -> str:
    """The README.md of the model folder, from the facts dict that `export` builds."""
    c, t, ev, mc = f["corpus"], f["training"], f["eval_saved_weights"], f["model_config"]
    r = t["recipe"]
    trailing = [f"`{s['prompt']!r}`" for s in f["samples_greedy"] if s["prompt"].endswith(" ")]
    spaces = "" if not trailing else (
        f"{' and '.join(trailing)} end{'s' if len(trailing) == 1 else ''} in a space. The tokenizer glues a space "
        f"to the word after it (`' json'` is one token), so a prompt that ends in a lone space token puts the model "
        f"where it rarely was in training, and the continuation suffers: the prompt-boundary problem that "
        f"\"token healing\" addresses. ")
    note = textwrap.fill(spaces + "Greedy decoding of a model this small also tends to fall into loops, repeating a "
                         "phrase; sampling with a temperature is the usual remedy.", width=115)
    optimizer = (f"AdamW, lr {r['lr']} (warmup {r['warmup_steps']} steps, cosine to {r['min_lr_ratio']} x), "
                 f"betas {tuple(r['betas'])}, weight decay {r['weight_decay']}, grad clip {r['grad_clip']}")
    steps = (f"{t['steps']} of {t['planned_steps']} planned ({t['stop_reason']}); "
             f"best held-out loss at step {t['best_step']}")
    wall = (f"{t['train_loop_s']} s training loop, {t['total_wall_s']} s in all "
            f"(corpus {t['corpus_s']} s, tokenizer {t['tokenizer_s']} s)")
    # inside a Markdown table a "|" must be escaped, even in a code span
    tokens = (f"{c['train_tokens']:,} train + {c['val_tokens']:,} held-out "
              f"(one `<\\|endoftext\\|>` before each document)")
    split = (f"{c['n_val_documents']} whole documents: those whose sha256(name) mod 10000 < "
             f"{round(c['val_fraction'] * 10000)}")
    samples = "\n\n".join(f"Prompt `{s['prompt']!r}`:\n\n```text\n{s['prompt']}{s['completion']}\n```"
                          for s in f["samples_greedy"])
    return f"""---
license: other
license_name: psf-2.0
license_link: https://docs.python.org/3/license.html
library_name: transformers
pipeline_tag: text-generation
tags: [llama, llmlab, toy, teaching]
---

# {f['name']}

A **toy** Llama-architecture language model, trained from scratch by llmlab's own script
(`llmlab/train/`) on documentation that ships inside every CPython installation. It exists so that llmlab's
inference labs (KV cache, batching, quantization, speculative decoding...) run on a real trained checkpoint that
fits in the repository and loads offline.

**What it is:** a {f['parameters'] / 1e6:.1f}M-parameter decoder that continues text in the style of Python's
`help()` pages and standard-library docstrings: `def module.name(signature)` headers followed by docstring prose,
reStructuredText-ish tables, grammar snippets.
**What it is not:** a chatbot, a code assistant, or a source of facts. It has seen well under a million tokens;
it makes up plausible-sounding nonsense, repeats itself, and knows nothing outside its corpus. Do not use it for
anything but learning how inference works.

## Architecture

Llama (`LlamaForCausalLM`): RMSNorm, RoPE, grouped-query attention, SwiGLU MLP, tied input/output embeddings.

| | |
| --- | --- |
| parameters | {f['parameters']:,} |
| layers | {mc['num_hidden_layers']} |
| hidden size (dim) | {mc['hidden_size']} |
| attention heads / KV heads | {mc['num_attention_heads']} / {mc['num_key_value_heads']} (head_dim {mc['head_dim']}) |
| MLP intermediate size | {mc['intermediate_size']} |
| vocabulary | {mc['vocab_size']} (byte-level BPE) |
| context length | {mc['max_position_embeddings']} |
| RoPE theta / RMSNorm eps | {mc['rope_theta']} / {mc['rms_norm_eps']} |
| weights | bf16 safetensors, {f['weights_file_mb']} MB |
| BOS = EOS | `<\\|endoftext\\|>` = id {mc['bos_token_id']} |

## Corpus

Built deterministically from the running interpreter by `llmlab/train/corpus.py` — no download:

1. `pydoc_data.topics.topics`: the {c['n_topics']} language-reference topics that `help("assert")` shows;
2. the docstrings of the standard library's `.py` files under `sysconfig.get_paths()["stdlib"]`, read by parsing
   the source with `ast` (modules are never imported): {c['n_docstrings']:,} docstrings from {c['n_modules']}
   modules, each prefixed with a header such as `def json.dumps(obj, *, skipkeys=False, ...)` or
   `class json.decoder.JSONDecoder(object)`. Skipped: `site-packages`, the test suites (`test`, `tests`,
   `idle_test`), build folders, `pydoc_data`, `_sysconfigdata_*`, and files that do not parse
   ({len(c['skipped_files'])} here).

| | |
| --- | --- |
| Python | {c['python_implementation']} {c['python_version']} |
| documents | {c['n_documents']} (one per topic, one per module) |
| characters | {c['chars']:,} |
| tokens | {tokens} |
| sha256 of the text | `{c['sha256']}` |
| held-out split | {split} |

The same Python version (with an unpatched standard library) gives the same sha256. The tokenizer was trained on
the train split only.

## Results

Held-out (never trained on) loss of the **saved bf16 weights**, reloaded with `llmlab.checkpoint.load_model` in
fp32: **{ev['val_loss']:.3f} nats/token, perplexity {ev['val_perplexity']:.1f}, {ev['val_bits_per_byte']:.3f}
bits/byte** over {ev['val_tokens_scored']:,} tokens.

Greedy continuations (`<|endoftext|>` prepended, at most 48 new tokens):

{samples}

{note}

## Training

```
{t['command']}
```

| | |
| --- | --- |
| steps | {steps} |
| tokens seen | {t['tokens_seen']:,} ({t['epochs_seen']} epochs of the train split) |
| batch | {r['batch_size']} windows x {r['seq_len']} tokens, random offsets in the packed stream |
| optimizer | {optimizer} |
| precision | fp32 weights, bf16 autocast on CUDA |
| early stopping | held-out loss every {r['eval_every']} steps, patience {r['patience']}, best weights kept |
| wall time | {wall} |
| device | {t['device']} |
| software | Python {t['python']}, torch {t['torch']}, transformers {t['transformers']}, tokenizers {t['tokenizers']} |
| seed | {t['seed']} |

`training.json` holds these numbers and the loss curve.

## Use

```python
from llmlab.checkpoint import load_model, load_tokenizer
model = load_model("data/models/{f['name']}")          # llmlab's own Transformer
tok = load_tokenizer("data/models/{f['name']}")

from transformers import AutoModelForCausalLM, AutoTokenizer
hf = AutoModelForCausalLM.from_pretrained("data/models/{f['name']}")
```

## License

The training text — the Python documentation topics and the standard library's docstrings — is Copyright (c)
Python Software Foundation and distributed under the PSF License Agreement
(https://docs.python.org/3/license.html). These weights are derived from that text and are distributed on the
same terms, with this notice.
"""
