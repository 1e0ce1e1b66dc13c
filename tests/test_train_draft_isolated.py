"""Runs tests/test_train_draft.py in a fresh Python process (see the note there: XLA's CPU compiler crashed on it
late in full runs of one process). Its tests, their output and their failures come back through this one test."""

import os
import subprocess
import sys


def test_train_draft_module_in_its_own_process():
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, LUCEBOX_TEST_CHILD="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                        os.path.join(here, "test_train_draft.py")],
                       cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-2000:])
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-2000:]
