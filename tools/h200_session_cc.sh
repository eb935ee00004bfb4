#!/usr/bin/env bash
# Device call CC (session 16): as call CB, with two diagnosis modes (no cluster merge; streaming only). Decode attention with the split partials merged inside a thread-block cluster
# (DSMEM, CUDA C++: tools/exp_attention_cluster.cu), next to the package's Triton kernel and a plain read of the
# same bytes, at 1K-32K keys. Issue 5's "next idea" for its 8K figure (57% of copy; target 70%).
set -uo pipefail
DEADLINE_S=${DEADLINE_S:-400}
source "$(dirname "$0")/h200_lib.sh"
step build 60 nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -shared -Xcompiler -fPIC \
  -o /tmp/libclattn.so tools/exp_attention_cluster.cu
step cluster_attention 200 python3 tools/exp_attention_cluster.py "$OUT/r/call-cc_attention_cluster.json" /tmp/libclattn.so
finish
