"""labs/gpu-outputs/ holds the labs as executed on a GPU, outputs kept (tools/run_labs.py, tools/unpack_gpu_outputs.py):
a record, not tests. pytest does not collect them (nbval would run them again on this machine)."""

collect_ignore_glob = ["*.ipynb"]
