"""Batching: serving many requests with one read of the weights per step (the article's second main fix).

    static.py      static batching: prompts of different lengths left-padded into one batch, an attention mask and
                   per-row position ids; the padding waste (padded vs useful tokens, and their time)
    scheduler.py   continuous (iteration-level) batching: waiting and running queues, admission by free KV blocks,
                   chunked prefill under a token budget, preemption by recompute
    engine.py      the step loop that runs the scheduler's batches on the model and a paged KV cache
    requests.py    the request API: submit, stream, cancel, per-request metrics; a background loop
    workload.py    arrival traces (Poisson) and request lengths for the serving benchmarks

Importing this package imports no model code; each module is imported on first use.
"""
