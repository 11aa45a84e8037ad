"""Tests of tfpipe.command_line: a refusal is one ERROR line and status 1.

A user relies on seeing the reason first: absl printed the program's
docstring and flag list (some fifty lines) before it. Checked on the
programs themselves: the launcher (no TensorFlow) and a worker.
"""
# bazel: deps=//tfpipe:launcher,//tfpipe:multihost

import os
import subprocess
import sys

from absl import app
import pytest

from tfpipe import command_line

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_usage_error_is_one_line_and_status_1(monkeypatch, capsys):
  def Main(argv):
    del argv
    raise app.UsageError('--num_things=0; give at least 1.')
  monkeypatch.setattr(sys, 'argv', ['prog'])
  with pytest.raises(SystemExit) as e:
    command_line.Run(Main)
  assert e.value.code == 1
  captured = capsys.readouterr()
  assert captured.err == 'ERROR: --num_things=0; give at least 1.\n'
  assert not captured.out


def test_a_main_that_succeeds_keeps_its_status(monkeypatch):
  monkeypatch.setattr(sys, 'argv', ['prog'])
  with pytest.raises(SystemExit) as e:
    command_line.Run(lambda argv: 0)
  assert e.value.code == 0


@pytest.mark.parametrize('argv, error', [
    (['tfpipe.launcher', '--num_workers=0'],
     'ERROR: --num_workers=0; give at least 1.'),
    (['tfpipe.multihost', '--job=worker', '--task=0',
      '--cluster_spec=controller=127.0.0.1:1;worker=127.0.0.1:2',
      '--bind_address=locahost'],
     "ERROR: /job:worker/task:0: --bind_address='locahost' is not an "
     'address of this host')], ids=['launcher', 'worker'])
def test_the_programs_refuse_in_one_line(argv, error):
  env = dict(os.environ, PYTHONPATH=_ROOT, TF_CPP_MIN_LOG_LEVEL='3')
  env.pop('TF_CONFIG', None)
  out = subprocess.run([sys.executable, '-m', *argv], capture_output=True,
                       text=True, timeout=120, env=env, cwd=_ROOT,
                       check=False)
  assert out.returncode == 1
  lines = (out.stdout + out.stderr).strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(error), lines
