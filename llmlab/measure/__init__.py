"""Measurement: the benchmark, the limits it compares against, and where the time goes.

    bench.py       llmlab bench: workloads, the ladder's rungs and peers timed, the bench file written
    roofline.py    bytes and FLOPs per step, the bandwidth/compute roofline, MBU and MFU
    peaks.py       the device's measured copy bandwidth and matmul rate (cached, with how far to trust them)
    timing.py      TTFT / TPOT / tokens-per-second arithmetic
    profiling.py   torch.profiler over decode steps: kernels, launches and idle gaps per token
    host_costs.py  what the host spends per token outside the GPU (tokenizer, sampling, Python)
    kv_costs.py    a KV cache's memory and decode time, measured with real caches
"""
