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
            n_heads not a multiple of n_kv_heads; an odd head_dim; a rope_scaling type other than 'llama3';
            a norm_eps or rope_theta that is not a finite number > 0.
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
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise ValueError(
                    f"rope_scaling type {kind!r} is not supported by llmlab; supported: 'llama3' (or none)"
                )

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
            TypeError: an override that is not a field of ModelConfig (the message lists the fields).
        """
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
    def from_hf_config(cls, hf: dict[str, Any], name: str = "custom") -> "ModelConfig":
        """Read a Hugging Face `config.json` dict (Llama, Mistral, Qwen2 families).

        Handles both the transformers-4 keys (`rope_theta`, `rope_scaling`) and the transformers-5 key
        (`rope_parameters`).

        Raises:
            ValueError: an architecture llmlab does not implement, a hidden_act other than silu, a missing required
                key, or a value `ModelConfig` refuses (`checkpoint.load_config` refuses a file that is not an
                object, naming it).
        """
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported; llmlab implements {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"config.json has hidden_act {act!r}; llmlab's MLP is SwiGLU, silu(gate) * up: only "
                             f"'silu' models load")
        try:
            n_heads = hf["num_attention_heads"]
            dim = hf["hidden_size"]
            rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
            rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
            kind = rope.get("rope_type", rope.get("type", "default"))
            sliding = hf.get("sliding_window") if hf.get("use_sliding_window", arch == "MistralForCausalLM") else None
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
        except KeyError as e:
            raise ValueError(f"config.json is missing the required key {e.args[0]!r}") from None

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
            hf["use_sliding_window"] = False
        if self.architecture == "MistralForCausalLM":
            hf["sliding_window"] = self.sliding_window
        return hf

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

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
