"""Measurement: the benchmark, the limits it compares against, and where the time goes.

    bench.py          llmlab bench: a workload on a model, each ladder rung and the peers timed, the file written
    workloads.py      the bench's named workloads (chat, batch, long) and their prompts
    peers.py          the bench's peer: Hugging Face generate on the same weights
    bench_metrics.py  what a timed run recorded, and its tokens/s, TTFT, TPOT, MBU and MFU
    bench_file.py     the bench file's format: write, read, validate and find bench files
    bench_table.py    what llmlab bench prints: the peaks line, the table of rows, the notes below it
    batch_sweep.py    one decode at growing batch sizes: where bandwidth-bound turns compute-bound
    roofline.py       bytes and FLOPs per step, the bandwidth/compute roofline, MBU and MFU
    peaks.py          the device's measured copy bandwidth and matmul rate (cached, with how far to trust them)
    peak_timing.py    timing the copy and matmul peaks, and judging whether the machine was quiet
    timing.py         timing decode steps (CUDA events or the host clock), and waiting for a device (sync)
    profiling.py      torch.profiler over decode steps: kernels, launches and idle gaps per token
    host_costs.py     what the host spends per token outside the GPU (tokenizer, sampling, Python)
    kv_costs.py       a KV cache's memory and decode time, measured with real caches
    model_bytes.py    the bytes of weights a decode step reads (computed), the bytes they occupy (allocated), and
                      the format they were loaded in (int8 / int4 from a quantized folder, else the dtype)
    diagnosis.py      which bottleneck is yours: the four classes, their rules, the controlled-experiment sweeps
    capstone.py       lab 09: the whole ladder on a loaded model, your switches measured as a rung, the recorded runs
    serving.py        serving metrics from request timestamps: queueing, TTFT, TPOT at p50/p90/p99, tokens/s
"""
