"""Runs a benchmark script in a fresh process, as a user would (no test split).

Shared by the benchmark scripts' tests: each script configures its own
devices before TensorFlow starts, so it cannot run inside pytest's process.
"""

import functools
import subprocess
import sys

from tests import quiet_test

ROOT = quiet_test.ROOT


def Run(module, *args, expect_ok=True, timeout=240):
  """Runs `python -m module args` with a new user's environment."""
  proc = quiet_test.RunPython('-m', module, *args, timeout=timeout)
  if expect_ok:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert quiet_test.StartupLines(proc.stdout + proc.stderr) == [], (
        proc.stderr[-3000:])
  return proc


@functools.lru_cache(maxsize=None)
def HasGpu():
  probe = subprocess.run(
      [sys.executable, '-c', 'from tfpipe import quiet; tf = '
       "quiet.ImportTensorFlow(); print(len(tf.config.list_physical_devices"
       "('GPU')))"], cwd=ROOT, capture_output=True, text=True, timeout=120,
      check=False)
  return probe.stdout.strip() not in ('', '0')


def AssertGpuModeRefused(module, *args):
  """--device=gpu without a GPU: exit status 1, the flag named, no traceback."""
  import pytest  # pylint: disable=g-import-not-at-top
  if HasGpu():
    pytest.skip('This machine has a GPU.')
  proc = Run(module, *args, '--device=gpu', expect_ok=False)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert '--device=gpu but no GPU is visible; use --device=cpu' in proc.stderr
  assert 'Traceback' not in proc.stderr
