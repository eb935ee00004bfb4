"""labs/student/ holds the labs as students get them (tools/make_student_labs.py): every exercise raises
NotImplementedError until it is written, so the notebooks cannot pass nbval as they are. pytest does not collect
them; tests/test_lab04.py checks that they match their labs with the answers taken out."""

collect_ignore_glob = ["*.ipynb"]
