"""Device diagnosis (session 20, call CY): where the Gluon int4 GEMV waits at K = 14336 (16-warp programs, one per
SM). One launch each under Nsight Compute: the package kernel at 4096 x 14336 (13.0 us in the chain), call CT's
DIAG16 (the same without the cross-warp step, 11.1 us), and the package kernel on the same bytes as 16384 x 3584
(4-warp programs, 10.3 us in call CR)."""

import torch

from exp_int4_split import launch_diag16  # tools/ is the script's folder: on sys.path
from llmlab.kernels.dequant_matmul import int4_matmul, quantize_int4
from ncu_util import profile_once

calls = []
for N, K in ((4096, 14336), (16384, 3584)):
    w4, s4 = quantize_int4(torch.randn(N, K, device="cuda"), 128)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    calls.append(lambda x=x, w4=w4, s4=s4: int4_matmul(x, w4, s4))
    if K == 14336:
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        ws = torch.empty(N * 16, device="cuda")
        calls.append(lambda x=x, w4=w4, s4=s4, y=y, ws=ws: launch_diag16(x, w4, s4, y, ws))
profile_once(calls)
