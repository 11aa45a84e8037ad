"""Tests of tfpipe.quiet: TensorFlow's C++ start-up log hidden, nothing else.

The start-up lines are written by C++ to file descriptor 2, so each test
runs a fresh Python process (and, for the real thing, a fresh TensorFlow
import) and reads what reached its stderr.
"""

import os
import subprocess
import sys
import tempfile
import time

import pytest

from tfpipe import quiet

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Markers of the start-up lines, written out here rather than taken from
# quiet's own patterns, so a pattern that misses a line fails the test.
STARTUP_MARKERS = ('absl::InitializeLog', 'oneDNN custom operations',
                   'Could not find cuda drivers', 'cuInit',
                   'cpu_feature_guard', 'To enable the following instructions')


def StartupLines(text):
  """The lines of `text` that are TensorFlow start-up noise."""
  return [line for line in text.splitlines()
          if any(marker in line for marker in STARTUP_MARKERS)]


def UserEnv():
  """os.environ without the tests' TF_CPP_MIN_LOG_LEVEL (RunPython's)."""
  env = dict(os.environ)
  env.pop('TF_CPP_MIN_LOG_LEVEL', None)
  return env


def RunPython(*args, timeout=120):
  """Runs `python args` in the repository as a new user would: its result.

  The tests' TF_CPP_MIN_LOG_LEVEL is dropped, so only tfpipe.quiet stands
  between TensorFlow's start-up log and the process's stderr. Shared by the
  tests of the command lines that must start quietly.
  """
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=UserEnv(),
                        capture_output=True, text=True, timeout=timeout,
                        check=False)


class Started:
  """`python args` started now, in the repository; Result() waits for it.

  For several processes that a test needs at once: one that starts
  TensorFlow and traces uses about one core, and CI has two. Its output goes
  to temporary files, so it never waits for a pipe to be read. Unless `env`
  is given, it runs as RunPython runs it.
  """

  def __init__(self, *args, timeout=120, env=None):
    self.args = [sys.executable, *args]
    self._timeout = timeout
    self._deadline = time.monotonic() + timeout
    self._files = [tempfile.TemporaryFile('w+'),
                   tempfile.TemporaryFile('w+')]
    self._proc = subprocess.Popen(
        self.args, cwd=ROOT, env=UserEnv() if env is None else env,
        stdout=self._files[0], stderr=self._files[1], text=True)
    self._result = None

  def Result(self):
    """Its subprocess.CompletedProcess (text stdout and stderr).

    Raises:
      subprocess.TimeoutExpired: it ran past its timeout (it is killed).
    """
    if self._result is None:
      try:
        self._proc.wait(timeout=max(0.0, self._deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        self.Kill()
        raise subprocess.TimeoutExpired(self.args, self._timeout) from None
      out, err = self._ReadAndClose()
      self._result = subprocess.CompletedProcess(
          self.args, self._proc.returncode, out, err)
    return self._result

  def Kill(self):
    """Ends it if it still runs (a test that failed before Result)."""
    if self._proc.poll() is None:
      self._proc.kill()
      self._proc.wait()
    self._ReadAndClose()

  def _ReadAndClose(self):
    texts = []
    for f in self._files:
      if f.closed:
        return None, None
      f.seek(0)
      texts.append(f.read())
    for f in self._files:
      f.close()
    return tuple(texts)


def RunAll(*started):
  """The results of Started processes, in order; none is left running."""
  try:
    return [s.Result() for s in started]
  finally:
    for s in started:
      s.Kill()


def _Run(script, *args):
  return RunPython('-c', script, *args)


@pytest.mark.parametrize('line', [
    'WARNING: All log messages before absl::InitializeLog() is called are '
    'written to STDERR',
    'I0000 00:00:1795437401.667369   25062 port.cc:153] oneDNN custom '
    'operations are on.',
    'E0000 00:00:1795437402.735763   25062 cuda_platform.cc:52] failed call to '
    'cuInit: INTERNAL: CUDA error',
    'I1123 12:45:05.432299 140007400717184 tpu_cluster_resolver.py:34] Falling '
    'back to TensorFlow client',
    '2024-01-02 03:04:05.678901: E external/local_xla/xla/stream_executor/cuda/'
    'cuda_dnn.cc:9261] Unable to register cuDNN factory',
    'To enable the following instructions: AVX2 FMA, in other operations, '
    'rebuild TensorFlow with the appropriate compiler flags.'])
def test_cpp_log_lines_are_startup_noise(line):
  assert quiet.IsStartupNoise(line)


@pytest.mark.parametrize('line', [
    'Traceback (most recent call last):',
    '/x/site-packages/keras/src/export.py:12: DeprecationWarning: old',
    'ValueError: E0000 is not a log line here',
    'Training lm.TinyTransformerLm in /tmp/lm on 2 partition(s)'])
def test_other_lines_are_kept(line):
  assert not quiet.IsStartupNoise(line)


@pytest.mark.parametrize('argv, verbosity', [
    (['prog'], None), (['prog', '--verbosity=1'], 1),
    (['prog', '--verbosity', '2'], 2), (['prog', '-v=0'], 0),
    (['prog', '-v', '-1'], -1), (['prog', '--v=3'], 3),
    (['prog', '--verbosity=loud'], None),
    (['prog', '--', '--verbosity=1'], None),
    (['prog', '--verbosity_file=1'], None)])
def test_verbosity_from_argv(argv, verbosity):
  assert quiet.VerbosityFromArgv(argv) == verbosity


def test_only_verbosity_one_or_more_shows_the_startup_log():
  assert [quiet.ShowStartupLog(v) for v in (None, -1, 0, 1, 2)] == [
      False, False, False, True, True]


_REGION = r'''
import os, sys
from tfpipe import quiet
fail = sys.argv[1] == 'fail'
try:
  with quiet.QuietStderr():
    os.write(2, b'I0000 00:00:17.5   9 port.cc:153] oneDNN custom operations '
                b'are on.\n')
    sys.stderr.write('a Python warning\n')
    if fail:
      raise RuntimeError('import failed')
except RuntimeError:
  pass
os.write(2, b'E0000 00:00:18.1   9 foo.cc:1] a real error after start-up\n')
print('kept:', quiet.StartupLog())
'''


def test_region_drops_cpp_records_and_keeps_the_rest():
  proc = _Run(_REGION, 'ok')
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr.splitlines() == [
      'a Python warning',
      'E0000 00:00:18.1   9 foo.cc:1] a real error after start-up']
  assert 'oneDNN custom operations are on.' in proc.stdout


def test_region_that_raises_writes_everything_back():
  proc = _Run(_REGION, 'fail')
  assert proc.returncode == 0, proc.stderr
  lines = proc.stderr.splitlines()
  assert lines[0].endswith('oneDNN custom operations are on.')
  assert lines[1:] == [
      'a Python warning',
      'E0000 00:00:18.1   9 foo.cc:1] a real error after start-up']


_IMPORT = r'''
import sys
from tfpipe import quiet
tf = quiet.ImportTensorFlow(argv=sys.argv)
print(tf.reduce_sum(tf.ones([3])).numpy())
'''


def test_tensorflow_import_is_quiet_and_verbosity_one_brings_it_back():
  proc, shown = RunAll(Started('-c', _IMPORT),
                       Started('-c', _IMPORT, '--verbosity=1'))
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.strip() == '3.0'
  assert StartupLines(proc.stdout + proc.stderr) == []
  assert shown.returncode == 0, shown.stderr
  assert StartupLines(shown.stderr), shown.stderr
