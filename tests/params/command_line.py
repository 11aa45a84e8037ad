"""Runs the trainer's command line in a subprocess, as a user would, for config tests.

Each config test declares its run when its module is imported (Declare);
the first test that needs a run's output (Stdout) starts every declared
run that has not started, so they train side by side: a run uses about one
core while TensorFlow starts and traces, and CI has two. A run nobody asked
for (its test deselected) is killed when pytest exits.
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
_LOGDIRS = []


def Declare(name, *flags):
  """Declares the run `name`: `python -m tfpipe.trainer --logdir=<fresh dir>
  --run_locally=cpu --log_interval_steps=1 <flags>`."""
  _DECLARED[name] = flags


def _Start(name):
  logdir = tempfile.mkdtemp(prefix=f'tfpipe_params_{name}_')
  _LOGDIRS.append(logdir)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  _STARTED[name] = quiet_test.Started(
      '-m', 'tfpipe.trainer', f'--logdir={logdir}', '--run_locally=cpu',
      '--log_interval_steps=1', *_DECLARED[name], timeout=_TIMEOUT_S,
      env=env)


def Stdout(name):
  """The stdout of the declared run `name`, which must succeed."""
  for other in _DECLARED:
    if other not in _STARTED:
      _Start(other)
  out = _STARTED[name].Result()
  assert out.returncode == 0, out.stdout + out.stderr
  return out.stdout


@atexit.register
def _Close():
  for started in _STARTED.values():
    started.Kill()
  for logdir in _LOGDIRS:
    shutil.rmtree(logdir, ignore_errors=True)


def FinalEval(stdout):
  """{metric: value} of the eval part of the trainer's `Final:` line."""
  final = [l for l in stdout.splitlines() if l.startswith('Final:')][-1]
  fields = final.split(' eval: ')[1].split()
  return {k: float(v) for k, v in (f.split('=') for f in fields)
          if k != 'train_time'}
