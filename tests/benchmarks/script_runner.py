"""Runs a benchmark script in a fresh process, as a user would (no test split).

Shared by the benchmark scripts' tests: each script configures its own
devices before TensorFlow starts, so it cannot run inside pytest's process.
A script's run uses about one core while TensorFlow starts and traces, so a
test file whose tests read several runs starts them together (Start) in a
module-scoped fixture, and each test checks its own (Finished).
"""

import functools

from tests import quiet_test

ROOT = quiet_test.ROOT


def Start(module, *args, timeout=240):
  """Starts `python -m module args` with a new user's environment."""
  return quiet_test.Started('-m', module, *args, timeout=timeout)


def StartWritingJson(module, path, *args, timeout=240):
  """(run, path): `python -m module args --output_json=path` started."""
  return Start(module, *args, f'--output_json={path}', timeout=timeout), path


def KillAfter(runs):
  """A module fixture's body (`yield from`): yields `runs`, {name: (run or
  None, json path or None)}, then kills the runs still going (those whose
  tests failed or were deselected)."""
  try:
    yield runs
  finally:
    for run, _ in runs.values():
      if run is not None:
        run.Kill()


def Finished(started, expect_ok=True):
  """The started run's result; by default checked as Run checks it."""
  proc = started.Result()
  if expect_ok:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert quiet_test.StartupLines(proc.stdout + proc.stderr) == [], (
        proc.stderr[-3000:])
  return proc


def Run(module, *args, expect_ok=True, timeout=240):
  """Runs `python -m module args` with a new user's environment."""
  return Finished(Start(module, *args, timeout=timeout), expect_ok)


@functools.lru_cache(maxsize=None)
def HasGpu():
  """Whether TensorFlow sees a GPU (as the scripts' processes would)."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return bool(tf.config.list_physical_devices('GPU'))


def StartGpuMode(module, *args):
  """--device=gpu started, or None on a machine with a GPU."""
  if HasGpu():
    return None
  return Start(module, *args, '--device=gpu')


def AssertGpuModeRefused(module_or_started, *args):
  """--device=gpu without a GPU: exit status 1, the flag named, no traceback.

  `module_or_started`: the script's module (run here with `args`), or its
  StartGpuMode run.
  """
  import pytest  # pylint: disable=g-import-not-at-top
  started = (StartGpuMode(module_or_started, *args)
             if isinstance(module_or_started, str) else module_or_started)
  if started is None:
    pytest.skip('This machine has a GPU.')
  proc = Finished(started, expect_ok=False)
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert '--device=gpu but no GPU is visible; use --device=cpu' in proc.stderr
  assert 'Traceback' not in proc.stderr
