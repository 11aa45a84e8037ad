"""Runs a benchmark script in a fresh process, as a user would (no test split).

Shared by the benchmark scripts' tests: each script configures its own
devices before TensorFlow starts, so it cannot run inside pytest's process.
"""

import functools
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# Markers of TensorFlow's C++ start-up lines (see tests/quiet_test.py).
STARTUP_MARKERS = ('absl::InitializeLog', 'oneDNN custom operations',
                   'Could not find cuda drivers', 'cuInit',
                   'cpu_feature_guard', 'To enable the following instructions')


def StartupLines(text):
  return [line for line in text.splitlines()
          if any(marker in line for marker in STARTUP_MARKERS)]


def Run(module, *args, expect_ok=True, timeout=240):
  """Runs `python -m module args` with a new user's environment."""
  env = dict(os.environ)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)
  proc = subprocess.run([sys.executable, '-m', module, *args], cwd=ROOT,
                        env=env, capture_output=True, text=True,
                        timeout=timeout, check=False)
  if expect_ok:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert StartupLines(proc.stdout + proc.stderr) == [], proc.stderr[-3000:]
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
