"""The runtime around the model: CUDA graphs captured per batch-size bucket and the generate loop that replays them.

    cuda_graphs.py    GraphDecoder: capture the decode step (and the prefill by length bucket) and replay it;
                      RunnerCache: the runners kept between requests (`LLM.runners`)
    fast_generate.py  generate_fast: the static-cache loop with GPU sampling, pinned copies and graph replay

The continuous-batching engine captures its own graphs over the paged cache: `llmlab/batching/paged_graphs.py`
(decode) and `llmlab/batching/prefill_graphs.py` (prefill).
"""
