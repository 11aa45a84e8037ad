"""Tests of tfpipe.network_namespace: re-executing into a loopback-only namespace.

A user relies on: the program (the launcher, a benchmark) coming back with
its own arguments in a namespace whose only interface is lo, with lo up, so
its servers can talk to each other and nothing else can reach them; and
clear errors instead of servers on the network when that cannot be done.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tfpipe import network_namespace

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PROBE = '''
import socket
import sys

from tfpipe import network_namespace

network_namespace.EnterLoopbackNamespace('namespace_probe', sys.argv)
print('interfaces', [name for _, name in socket.if_nameindex()])
print('args', sys.argv[1:])
listener = socket.socket()
listener.bind(('127.0.0.1', 0))
listener.listen(1)
socket.create_connection(listener.getsockname(), timeout=5).close()
print('loopback works')
'''


def _CanUnshare():
  unshare = shutil.which('unshare')
  if not unshare:
    return False
  return subprocess.run([unshare, '--net', '--map-root-user', 'true'],
                        capture_output=True, timeout=30,
                        check=False).returncode == 0


@pytest.mark.skipif(not _CanUnshare(),
                    reason='needs unshare and unprivileged user namespaces')
def test_the_program_comes_back_with_its_arguments_and_only_loopback(tmp_path):
  (tmp_path / 'namespace_probe.py').write_text(_PROBE)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), _ROOT]))
  env.pop(network_namespace.NAMESPACE_ENV, None)
  proc = subprocess.run(
      [sys.executable, '-m', 'namespace_probe', '--flag=1', 'x y'],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
      check=False)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines() == [
      "interfaces ['lo']", "args ['--flag=1', 'x y']", 'loopback works']


def test_a_namespace_that_keeps_other_interfaces_is_refused(monkeypatch):
  monkeypatch.setattr(network_namespace, 'OnlyLoopbackInterfaces',
                      lambda: False)
  monkeypatch.setenv(network_namespace.NAMESPACE_ENV, '1')
  with pytest.raises(RuntimeError, match='interfaces other than lo'):
    network_namespace.EnterLoopbackNamespace('tfpipe.launcher', ['prog'])


def test_missing_unshare_is_named(monkeypatch):
  monkeypatch.setattr(network_namespace, 'OnlyLoopbackInterfaces',
                      lambda: False)
  monkeypatch.delenv(network_namespace.NAMESPACE_ENV, raising=False)
  monkeypatch.setattr(shutil, 'which', lambda name: None)
  with pytest.raises(RuntimeError, match='util-linux'):
    network_namespace.EnterLoopbackNamespace('tfpipe.launcher', ['prog'])
  assert network_namespace.NAMESPACE_ENV not in os.environ
