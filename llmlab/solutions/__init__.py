"""Reference solutions to the labs' exercises. A lab imports its answer from here only to check yours.

    lab00.py ... lab09.py   one file per lab (lab07, whose answers are Triton kernels, has none here: its
                            reference kernels are `llmlab/kernels/lab07_solutions.py`), each with the lab's
                            `check_*` functions and the reference answers they compare with
"""
