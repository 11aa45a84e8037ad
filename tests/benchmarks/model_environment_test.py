"""benchmarks/model_environment.py: a benchmark model's processes' settings.

Protected properties: AmoebaNet's processes run TensorFlow with oneDNN's
kernels on any CPU, unless the user set TF_ENABLE_ONEDNN_OPTS; other models
run as the user's environment says; `Within` leaves os.environ as it was.
(That AmoebaNet-D L=3 then trains in its 32 MiB is in
largest_model_test.py.)
"""

import os
import subprocess
import sys

from benchmarks import model_environment

_ONEDNN = 'TF_ENABLE_ONEDNN_OPTS'
_MKL_ENABLED = ('from tensorflow.python.util import _pywrap_util_port; '
                'print(_pywrap_util_port.IsMklEnabled())')


def _OneDnnIn(env):
  env = dict(env, TF_CPP_MIN_LOG_LEVEL='3')
  proc = subprocess.run([sys.executable, '-c', _MKL_ENABLED], env=env,
                        capture_output=True, text=True, timeout=120,
                        check=True)
  return proc.stdout.strip()


def test_amoebanet_processes_run_onednn_unless_the_user_says_otherwise():
  base = {k: v for k, v in os.environ.items() if k != _ONEDNN}
  assert _OneDnnIn(model_environment.Environment('amoebanet', base)) == 'True'
  assert _OneDnnIn(model_environment.Environment(
      'amoebanet', dict(base, **{_ONEDNN: '0'}))) == 'False'
  assert _ONEDNN not in model_environment.Environment('transformer', base)
  assert not model_environment.Has('mlp')


def test_within_adds_the_settings_and_then_removes_them(monkeypatch):
  monkeypatch.delenv(_ONEDNN, raising=False)
  with model_environment.Within('amoebanet'):
    assert os.environ[_ONEDNN] == '1'
  assert _ONEDNN not in os.environ
  monkeypatch.setenv(_ONEDNN, '0')
  with model_environment.Within('amoebanet'):
    assert os.environ[_ONEDNN] == '0'
  assert os.environ[_ONEDNN] == '0'
