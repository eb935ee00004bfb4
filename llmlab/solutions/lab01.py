"""Lab 01 reference answer: the tokens/s ceiling of a decode from the bytes it must read per token."""

from __future__ import annotations

from llmlab.config import ModelConfig


def tokens_per_s_ceiling(config: ModelConfig, bandwidth_gb_s: float, bytes_per_param: float = 2,
                         context_len: float = 0, batch: int = 1, kv_bytes_per_elem: float = 2) -> float:
    """The fastest a decode can go if every step must read all weights once plus each sequence's KV cache.

    bytes per step = weights read (every parameter except an untied model's input embedding table, which is only
    looked up; a tied matrix counts once, for the lm_head) x bytes_per_param
                   + batch x context_len x (2 x layers x KV heads x head_dim x kv_bytes_per_elem)
    tokens/s = batch x bandwidth / bytes per step, bandwidth in GB/s (1e9 bytes/s).
    """
    weights = config.num_params(include_embedding=config.tie_embeddings) * bytes_per_param
    kv_per_token = 2 * config.n_layers * config.n_kv_heads * config.head_dim * kv_bytes_per_elem
    step_bytes = weights + batch * context_len * kv_per_token
    return batch * bandwidth_gb_s * 1e9 / step_bytes
