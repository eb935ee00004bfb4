"""Batching: serving many requests with one read of the weights per step (the article's second main fix).

    one_at_a_time.py  no batching, the baseline: each prompt alone (batch 1), one after the other
    static.py      static batching: prompts of different lengths left-padded into one batch, an attention mask and
                   per-row position ids; the padding waste (padded vs useful tokens, and their time)
    scheduler.py   continuous (iteration-level) batching: waiting and running queues, admission by free KV blocks,
                   chunked prefill under a token budget, preemption by recompute
    paged_batch.py one step's KV cache view over the block pool: any sequences, each at its own positions (B, T)
    paged_graphs.py  the decode step on a GPU: the paged-attention kernel from static buffers, one CUDA graph per
                   batch-size bucket
    engine.py      the step loop that runs the scheduler's batches on the model and a paged KV cache
    prefill_graphs.py  the prefill passes at fixed (rows, tokens) buckets, replayed from CUDA graphs on a GPU
    overlap.py     overlapped steps: the next decode step launched before the last one's tokens are read back
    continuous.py  a list of prompts served by the engine, returned as one Generation (LLM.generate's
                   batching="continuous", the +continuous_batching rung)
    requests.py    the request API: submit, stream, cancel, per-request metrics; a background loop
    workload.py    arrival traces (Poisson) and request lengths for the serving benchmarks
    trace_runner.py  a trace served in real time (one at a time, static batches, continuous batching) and the
                   throughput-latency curve over arrival rates
    curve_file.py  the curve's JSON file (device, commit, versions): save, load, find the recorded ones

Importing this package imports no model code; each module is imported on first use.
"""
