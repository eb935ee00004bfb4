"""Model configuration: the numbers that fix a Llama-family decoder's shape.

A `ModelConfig` is built three ways:

* `ModelConfig.from_preset("llama-3.2-1b")` — the shape of a real model (for the speed labs, where only the
  shape matters; weights built from it are random);
* `ModelConfig.from_hf_config(dict)` — the `config.json` of a Hugging Face checkpoint (Llama, Mistral, Qwen2);
* directly, as a dataclass.

`to_hf_config()` writes the matching `config.json` so `transformers.AutoModelForCausalLM` can read what llmlab
saves. Field names follow gpt-fast / nanoGPT; the Hugging Face names are in the comments.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class ModelConfig:
    """The shape of a Llama-family decoder (field names follow Hugging Face's `LlamaConfig`, noted per field:
    <https://huggingface.co/docs/transformers/model_doc/llama#transformers.LlamaConfig>).

    Sizes are counts (tokens, channels, heads, layers); `norm_eps` is added to mean(x^2) in RMSNorm;
    `rope_theta` is RoPE's base (RoFormer, <https://arxiv.org/abs/2104.09864>). `n_kv_heads` < `n_heads` is
    grouped-query attention (<https://arxiv.org/abs/2305.13245>). `PRESETS` holds real models' shapes;
    `ModelConfig.from_preset(name, **overrides)` builds one.

    Raises:
        ValueError: a size that is not an int >= 1; dim not divisible by n_heads (without head_dim);
            n_heads not a multiple of n_kv_heads; an odd head_dim; a rope_scaling that is not a dict, of a type
            other than 'llama3', or a 'llama3' one lacking a key the model reads (factor, low_freq_factor,
            high_freq_factor, original_max_position_embeddings) or holding one that is not a finite number > 0
            (or high_freq_factor <= low_freq_factor); a norm_eps or rope_theta that is not a finite number > 0;
            a tie_embeddings or attention_bias that is not a bool; a sliding_window that is not None or an int >= 1.
    """

    vocab_size: int = 32000
    dim: int = 4096  # hidden_size: width of the residual stream
    n_layers: int = 32  # num_hidden_layers
    n_heads: int = 32  # num_attention_heads: query heads
    n_kv_heads: int | None = None  # num_key_value_heads: < n_heads is GQA, 1 is MQA; None means = n_heads (MHA)
    head_dim: int | None = None  # None means dim // n_heads
    intermediate_size: int = 11008  # width of the SwiGLU MLP
    norm_eps: float = 1e-5  # rms_norm_eps
    rope_theta: float = 10000.0  # RoPE base frequency
    # Llama-3 style frequency rescaling, e.g. {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
    # "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}; None means plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 4096  # max_position_embeddings: the context length
    tie_embeddings: bool = False  # tie_word_embeddings: lm_head shares the token embedding matrix
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2 has it, Llama does not)
    sliding_window: int | None = None  # Mistral-style local attention window; None means full attention
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    name: str = "custom"
    architecture: str = "LlamaForCausalLM"  # what to write into config.json

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "intermediate_size",
                     "max_seq_len"):
            value = getattr(self, name)
            if value is None and name in ("n_kv_heads", "head_dim"):
                continue  # derived below
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: model sizes must be whole numbers >= 1")
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.head_dim is None:
            if self.dim % self.n_heads != 0:
                raise ValueError(
                    f"dim={self.dim} is not divisible by n_heads={self.n_heads}; set head_dim explicitly"
                )
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}: grouped-query attention "
                f"shares each KV head among n_heads / n_kv_heads query heads, so that ratio must be a whole number"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even: RoPE rotates pairs of channels")
        for name, what in (("norm_eps", "RMSNorm's epsilon (rms_norm_eps), added to mean(x^2): e.g. 1e-5"),
                           ("rope_theta", "RoPE's base frequency: e.g. 10000 or 500000")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{name}={value!r}: {what}; it must be a finite number > 0 (otherwise the forward "
                                 f"pass can turn NaN and the model generates token 0 forever)")
        for name in ("tie_embeddings", "attention_bias"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} ({type(value).__name__}): it must be True or False (a string "
                                 f"such as 'false' is truthy and would silently count as True)")
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window={window!r}: the local attention window is a number of tokens >= 1 "
                             f"(e.g. 4096), or None for full attention; a window of 0 or less would mask every key")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, dict):
                raise ValueError(f"rope_scaling={self.rope_scaling!r}: it must be a dict such as {_LLAMA3_ROPE}, "
                                 f"or None for plain RoPE")
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise ValueError(
                    f"rope_scaling type {kind!r} is not supported by llmlab; supported: 'llama3' (or none)"
                )
            if kind == "llama3":
                _check_llama3_rope(self.rope_scaling, "rope_scaling")

    # -- derived sizes ----------------------------------------------------------------------------------
    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head (1 for MHA, n_heads for MQA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def o_proj_bias(self) -> bool:
        """transformers' Llama applies attention_bias to o_proj too; Qwen2 and Mistral do not."""
        return self.attention_bias and self.architecture == "LlamaForCausalLM"

    def num_params(self, include_embedding: bool = True) -> int:
        """Parameter count from the shape alone (matches `sum(p.numel())` of the built model)."""
        q = self.dim * self.n_heads * self.head_dim
        kv = 2 * self.dim * self.n_kv_heads * self.head_dim
        o = self.n_heads * self.head_dim * self.dim
        bias = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim if self.attention_bias else 0
        bias += self.dim if self.o_proj_bias else 0
        mlp = 3 * self.dim * self.intermediate_size
        norms = 2 * self.dim
        per_layer = q + kv + o + bias + mlp + norms
        embed = self.vocab_size * self.dim
        lm_head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        total = self.n_layers * per_layer + self.dim + lm_head
        return total + embed if include_embedding else total

    # -- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> "ModelConfig":
        """The shape of a well-known model. Weights built from a preset are RANDOM: use it for speed, not text.

        Raises:
            ValueError: unknown preset (the message lists the known ones and the nearest match).
            TypeError: a name that is not a string (e.g. None; the message lists the known presets); an override
                that is not a field of ModelConfig (the message lists the fields).
        """
        if not isinstance(name, str):
            raise TypeError(f"the preset name is {name!r} ({type(name).__name__}); give one of the known presets as "
                            f"a string: {', '.join(sorted(PRESETS))}")
        key = name.lower()
        if key not in PRESETS:
            close = difflib.get_close_matches(key, PRESETS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown preset {name!r}.{hint} Known presets: {', '.join(sorted(PRESETS))}")
        fields = {f.name for f in dataclasses.fields(cls)} - {"name"}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise TypeError(f"unknown ModelConfig field(s) {unknown} for preset {name!r}; the fields are "
                            f"{', '.join(sorted(fields))} (e.g. n_layers=2)")
        params = dict(PRESETS[key])
        params.update(overrides)
        return cls(name=key, **params)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], name: str = "custom", source: str = "config.json") -> "ModelConfig":
        """Read a Hugging Face `config.json` dict (Llama, Mistral, Qwen2 families).

        Handles both the transformers-4 keys (`rope_theta`, `rope_scaling`) and the transformers-5 key
        (`rope_parameters`). `"architectures"` may be a list of class names or a single name. The sliding window
        follows transformers: Mistral windows every layer; Qwen2 only with `use_sliding_window` true, and then only
        the layers from `max_window_layers` on (or those `layer_types` marks "sliding_attention"); Llama never.
        `source` names the file in error messages (`checkpoint.load_config` passes its path).

        Raises:
            ValueError: an architecture llmlab does not implement, a hidden_act other than silu, a missing required
                key; a count (vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
                head_dim, intermediate_size, max_position_embeddings) that is not an int >= 1; a boolean field
                (tie_word_embeddings, use_sliding_window, attention_bias) that is not true or false; a rope_scaling /
                rope_parameters that is not an object, or a 'llama3' one lacking a key or holding a bad value; a
                Qwen2 config whose sliding window covers some layers but not all (llmlab has one window for every
                layer); or a value `ModelConfig` refuses. Every message starts with `source`
                (`checkpoint.load_config` refuses a file that is not an object, naming it).
        """
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        if isinstance(archs, str):
            archs = [archs]  # one class name instead of a one-element list: read it as that list
        if not isinstance(archs, list):
            raise ValueError(f"{source}: \"architectures\" is {archs!r}; it must be a list of class names such as "
                             f"[\"LlamaForCausalLM\"]")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"{source}: architecture {arch!r} is not supported; llmlab implements "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"{source} has hidden_act {act!r}; llmlab's MLP is SwiGLU, silu(gate) * up: only "
                             f"'silu' models load")
        for key in _HF_COUNTS:
            if key not in hf:
                if key in _HF_REQUIRED:
                    raise ValueError(f"{source} is missing the required key {key!r}")
                continue
            value = hf[key]
            if value is None and key in ("num_key_value_heads", "head_dim"):
                continue  # null, as transformers writes it: derived from the head count below
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{source}: \"{key}\" is {value!r}; it must be a whole number >= 1 (e.g. "
                                 f"\"{key}\": {_HF_COUNT_EXAMPLES[key]}): copy config.json again from the model's "
                                 f"source")
        for key in ("tie_word_embeddings", "use_sliding_window", "attention_bias"):
            if key in hf and not isinstance(hf[key], bool):
                raise ValueError(f"{source}: \"{key}\" is {hf[key]!r} ({type(hf[key]).__name__}), not true or "
                                 f"false; write it unquoted, \"{key}\": true or \"{key}\": false (a quoted "
                                 f"\"false\" would count as true)")
        n_heads = hf["num_attention_heads"]
        dim = hf["hidden_size"]
        rope_key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        rope = hf.get(rope_key) or {}
        if not isinstance(rope, dict):
            raise ValueError(f"{source}: \"{rope_key}\" is {rope!r}; it must be an object such as "
                             f"{json.dumps(_LLAMA3_ROPE)}, or null for plain RoPE")
        rope = dict(rope)
        rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "llama3":
            _check_llama3_rope(rope, f"{source}: \"{rope_key}\"")
        sliding = _hf_sliding_window(hf, arch, source)
        try:
            return cls(
                vocab_size=hf["vocab_size"],
                dim=dim,
                n_layers=hf["num_hidden_layers"],
                n_heads=n_heads,
                n_kv_heads=hf.get("num_key_value_heads") or n_heads,
                head_dim=hf.get("head_dim") or dim // n_heads,
                intermediate_size=hf["intermediate_size"],
                norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=rope if kind != "default" else None,
                max_seq_len=hf.get("max_position_embeddings", 4096),
                tie_embeddings=hf.get("tie_word_embeddings", False),
                attention_bias=hf.get("attention_bias", arch == "Qwen2ForCausalLM"),
                sliding_window=sliding,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=hf.get("eos_token_id"),
                name=name,
                architecture=arch,
            )
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def to_hf_config(self) -> dict[str, Any]:
        """The `config.json` dict that transformers reads back into the same model."""
        rope = {"rope_type": "default"} if self.rope_scaling is None else dict(self.rope_scaling)
        rope["rope_theta"] = self.rope_theta
        model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
        hf: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": model_type[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_seq_len,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.rope_scaling is not None:
            hf["rope_scaling"] = dict(self.rope_scaling)
        if self.architecture == "Qwen2ForCausalLM":
            hf["use_sliding_window"] = self.sliding_window is not None
            if self.sliding_window is not None:
                hf["sliding_window"] = self.sliding_window
                hf["max_window_layers"] = 0  # Qwen2 windows the layers from this index on: all of them
        if self.architecture == "MistralForCausalLM":
            hf["sliding_window"] = self.sliding_window
        return hf

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# config.json's counts, each a whole number >= 1 (with an example for the error message); the first five are required
_HF_COUNT_EXAMPLES = {
    "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "intermediate_size": 11008, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 4096,
}
_HF_COUNTS = tuple(_HF_COUNT_EXAMPLES)
_HF_REQUIRED = _HF_COUNTS[:5]

# What `model.rope_inv_freq` reads from a 'llama3' rope_scaling, with Llama 3.2's values as examples
_LLAMA3_KEYS = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def _check_llama3_rope(rope: dict[str, Any], where: str) -> None:
    """Refuse a 'llama3' RoPE scaling that `model.rope_inv_freq` cannot compute from: a missing key (a bare KeyError
    at model build), or a value that is not a finite number > 0 (a string gives a TypeError about Tensor and str;
    0 divides by zero). `where` names it in the message ("rope_scaling", or the file and its key)."""
    example = ", ".join(f"{k!r}: {v}" for k, v in _LLAMA3_KEYS.items())
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise ValueError(f"{where} of type 'llama3' lacks {', '.join(map(repr, missing))}: llama3 RoPE needs all of "
                         f"{', '.join(_LLAMA3_KEYS)} (Llama 3.2's: {example}); copy them from the model's original "
                         f"config.json")
    for key, value in ((k, rope[k]) for k in _LLAMA3_KEYS):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{where} has {key}={value!r} ({type(value).__name__}); it must be a finite number > 0, "
                             f"e.g. {key}: {_LLAMA3_KEYS[key]} (unquoted in config.json)")
    if rope["high_freq_factor"] <= rope["low_freq_factor"]:
        raise ValueError(f"{where} has high_freq_factor={rope['high_freq_factor']} <= low_freq_factor="
                         f"{rope['low_freq_factor']}: llama3 RoPE blends the frequencies between the two, so "
                         f"high_freq_factor must be the larger (Llama 3's: 4.0 and 1.0)")


def _hf_sliding_window(hf: dict[str, Any], arch: str, source: str) -> Any:
    """The sliding window transformers applies to every layer of this config.json, or None (full attention).

    Mistral windows every layer (`MistralConfig` has no use_sliding_window); Llama none. Qwen2 windows only with
    `use_sliding_window` true, and then the layers that `layer_types` marks "sliding_attention", by default those
    with index >= `max_window_layers` (28 when absent: `Qwen2Config`'s default). llmlab's layers share one window,
    so a Qwen2 config that windows some layers but not others is refused. The window itself is checked by
    ModelConfig (None or an int >= 1). Counts and booleans are checked before this runs.
    """
    if arch == "MistralForCausalLM":
        return hf.get("sliding_window")
    window = hf.get("sliding_window")
    if arch != "Qwen2ForCausalLM" or not hf.get("use_sliding_window", False) or window is None:
        return None  # Qwen2Config drops sliding_window unless use_sliding_window is true; LlamaConfig has none
    n_layers = hf["num_hidden_layers"]
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = hf.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise ValueError(f"{source}: \"max_window_layers\" is {first!r}; it must be a whole number >= 0 (the "
                             f"index of the first layer with a sliding window)")
        layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        which = f"max_window_layers={first} with num_hidden_layers={n_layers}"
    elif not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ValueError(f"{source}: \"layer_types\" is {layer_types!r}; it must be a list of num_hidden_layers="
                         f"{n_layers} entries, each \"full_attention\" or \"sliding_attention\"")
    else:
        which = "its layer_types list"
    windowed = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
    if not windowed:
        return None
    if len(windowed) == n_layers:
        return window
    raise ValueError(f"{source}: use_sliding_window is true and {which} gives {len(windowed)} of the {n_layers} "
                     f"layers (from layer {windowed[0]}) a sliding window of {window} tokens and the others "
                     f"full attention; llmlab applies one attention kind to every layer, so this per-layer mix is not "
                     f"supported. The window changes nothing while prompt plus output stay within {window} tokens: "
                     f"for those, set \"use_sliding_window\": false (full attention on every layer)")


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Shapes of real checkpoints (from their config.json files on the Hugging Face hub).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, intermediate_size=8192,
        norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_seq_len=131072, tie_embeddings=True,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-3.2-3b": dict(
        vocab_size=128256, dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, intermediate_size=8192,
        norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, max_seq_len=131072, tie_embeddings=True,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-3.1-8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
        norm_eps=1e-5, rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}, max_seq_len=131072,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-2-7b": dict(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, intermediate_size=11008,
        norm_eps=1e-5, max_seq_len=4096, bos_token_id=1, eos_token_id=2,
    ),
    "mistral-7b": dict(
        vocab_size=32768, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate_size=14336,
        norm_eps=1e-5, rope_theta=1000000.0, max_seq_len=32768, bos_token_id=1, eos_token_id=2,
        architecture="MistralForCausalLM",
    ),
    "qwen2.5-0.5b": dict(
        vocab_size=151936, dim=896, n_layers=24, n_heads=14, n_kv_heads=2, intermediate_size=4864,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768, tie_embeddings=True, attention_bias=True,
        bos_token_id=151643, eos_token_id=151643, architecture="Qwen2ForCausalLM",
    ),
    "qwen2.5-7b": dict(
        vocab_size=152064, dim=3584, n_layers=28, n_heads=28, n_kv_heads=4, intermediate_size=18944,
        norm_eps=1e-6, rope_theta=1000000.0, max_seq_len=32768, attention_bias=True,
        bos_token_id=151643, eos_token_id=151645, architecture="Qwen2ForCausalLM",
    ),
    "smollm2-135m": dict(
        vocab_size=49152, dim=576, n_layers=30, n_heads=9, n_kv_heads=3, intermediate_size=1536,
        norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    "smollm2-360m": dict(
        vocab_size=49152, dim=960, n_layers=32, n_heads=15, n_kv_heads=5, intermediate_size=2560,
        norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
}
