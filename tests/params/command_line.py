"""Runs the trainer's command line in a subprocess, as a user would, for config tests."""
# bazel: deps=//params,//tfpipe/trainer:__main__

import os
import subprocess
import sys


def RunTrainer(logdir, *flags, timeout=300):
  """Runs `python -m tfpipe.trainer --logdir=... <flags>` on CPU; its stdout."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  out = subprocess.run(
      [sys.executable, '-m', 'tfpipe.trainer', f'--logdir={logdir}',
       '--run_locally=cpu', '--log_interval_steps=1', *flags],
      capture_output=True, text=True, timeout=timeout, env=env, check=False)
  assert out.returncode == 0, out.stdout + out.stderr
  return out.stdout


def FinalEval(stdout):
  """{metric: value} of the eval part of the trainer's `Final:` line."""
  final = [l for l in stdout.splitlines() if l.startswith('Final:')][-1]
  fields = final.split(' eval: ')[1].split()
  return {k: float(v) for k, v in (f.split('=') for f in fields)
          if k != 'train_time'}
