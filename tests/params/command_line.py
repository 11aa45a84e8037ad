"""Runs the trainer's command line in a subprocess, as a user would, for config tests.

Each config test declares its run when its module is imported (Declare).
Run serially, the first test that needs a run's output (Stdout) starts
every declared run that has not started, so they train side by side: a run
uses about one core while TensorFlow starts and traces, and CI has two. A
run nobody asked for (its test deselected) is killed when pytest exits.
Under pytest-xdist every worker imports every module but runs only some of
them, so a test starts its own run only: the workers are the side by side.
A run's logdir goes as soon as its output is read, not at exit, which an
xdist worker may not reach.
"""
# bazel: deps=//params,//tfpipe/trainer:__main__

import atexit
import os
import shutil
import tempfile

from tests import quiet_test

_TIMEOUT_S = 300
_DECLARED = {}  # name -> the run's trainer flags
_STARTED = {}  # name -> quiet_test.Started
_LOGDIRS = {}  # name -> the logdir of a run whose output is unread


def Declare(name, *flags):
  """Declares the run `name`: `python -m tfpipe.trainer --logdir=<fresh dir>
  --run_locally=cpu --log_interval_steps=1 <flags>`."""
  _DECLARED[name] = flags


def _Start(name):
  logdir = tempfile.mkdtemp(prefix=f'tfpipe_params_{name}_')
  _LOGDIRS[name] = logdir
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  _STARTED[name] = quiet_test.Started(
      '-m', 'tfpipe.trainer', f'--logdir={logdir}', '--run_locally=cpu',
      '--log_interval_steps=1', *_DECLARED[name], timeout=_TIMEOUT_S,
      env=env)


def Stdout(name):
  """The stdout of the declared run `name`, which must succeed."""
  side_by_side = 'PYTEST_XDIST_WORKER' not in os.environ
  for other in _DECLARED:
    if other not in _STARTED and (side_by_side or other == name):
      _Start(other)
  try:
    out = _STARTED[name].Result()
  finally:
    logdir = _LOGDIRS.pop(name, None)
    if logdir:
      shutil.rmtree(logdir, ignore_errors=True)
  assert out.returncode == 0, out.stdout + out.stderr
  return out.stdout


@atexit.register
def _Close():
  for started in _STARTED.values():
    started.Kill()
  for logdir in _LOGDIRS.values():
    shutil.rmtree(logdir, ignore_errors=True)


def FinalEval(stdout):
  """{metric: value} of the eval part of the trainer's `Final:` line."""
  final = [l for l in stdout.splitlines() if l.startswith('Final:')][-1]
  fields = final.split(' eval: ')[1].split()
  return {k: float(v) for k, v in (f.split('=') for f in fields)
          if k != 'train_time'}
