"""Device check (session 16): the package's decode attention at 8K keys took 14.3 us in call CB and 18.0 us in
call CC (same commit, same harness). Is that the autotuner choosing a different split config in each process?
Prints the config chosen and the chained time; run it in a few fresh processes.

    python3 tools/exp_attention_autotune_spread.py
"""
import torch

from llmlab.kernels import decode_attention as da
from llmlab.kernels.bench_kernels import _graph_ms

B, H, Hkv, hd, S = 1, 32, 8, 128, 8192
sets = [(torch.randn(B, H, hd, device="cuda", dtype=torch.bfloat16),
         torch.randn(B, Hkv, S, hd, device="cuda", dtype=torch.bfloat16),
         torch.randn(B, Hkv, S, hd, device="cuda", dtype=torch.bfloat16)) for _ in range(6)]
t = _graph_ms([lambda s=s: da.decode_attention(*s) for s in sets])
print(f"8K: {t * 1e3:.2f} us; autotuner's choice {da._decode_split_tuned.best_config}", flush=True)
for cfg in da._decode_split_tuned.configs:  # every candidate, in the same chain
    try:
        t = _graph_ms([lambda s=s, c=cfg: da._decode(*s, None, hd ** -0.5, config=c) for s in sets])
        print(f"   {t * 1e3:6.2f} us  {cfg}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"   failed {cfg}: {type(e).__name__} {str(e)[:120]}", flush=True)
