"""Setup for the whole test session, tests/ and labs/ alike (tests/conftest.py applies to tests/ only).

The measured device peaks (`llmlab.measure.peaks.measure_peaks`) go to a temporary cache file for the session, not to the
user's ~/.cache/llmlab/peaks.json: the tests and labs 02, 05 and 07 measure them, and numbers measured while the
test suite loads the machine read low and would be kept for every later `llmlab bench` run. It is set here, at
import time, in the environment, so the notebook kernels nbval starts (subprocesses) inherit it too. It replaces a
LLMLAB_PEAKS_CACHE set outside, for the same reason.
"""

import atexit
import os
import shutil
import tempfile

_peaks_dir = tempfile.mkdtemp(prefix="llmlab-test-peaks-")
os.environ["LLMLAB_PEAKS_CACHE"] = os.path.join(_peaks_dir, "peaks.json")
atexit.register(shutil.rmtree, _peaks_dir, ignore_errors=True)
