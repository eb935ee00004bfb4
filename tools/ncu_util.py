"""Shared by the Nsight Compute scripts (tools/ncu_*.py, run under `ncu --profile-from-start off`)."""

import torch


def profile_once(calls, warmups: int = 3) -> None:
    """Warm each call up (compile, autotune) outside the profiler, then run each ONCE between
    cudaProfilerStart/Stop, so ncu records one launch per call."""
    for fn in calls:
        for _ in range(warmups):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", len(calls), "calls")
