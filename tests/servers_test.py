"""Tests of tfpipe.servers that need no TensorFlow server.

A user relies on: a loopback bind never turning into a server on the network
(TensorFlow listens on 0.0.0.0, so it is refused outside a loopback-only
namespace); an empty, mistyped or foreign bind address being refused rather
than taken for the choice to serve on the network; the liveness probe
telling an answering server from a stopped one (which the kernel still
accepts connections for) and from a closed port; and waits that end, naming
the task that did not come up. Real servers are started by
tests/launcher_test.py. Everything here binds to 127.0.0.1 only.
"""

import re
import socket
import threading
import time

import pytest

from tfpipe import network_namespace
from tfpipe import servers

# A gRPC server's first answer: an empty SETTINGS frame (type 4).
SETTINGS_FRAME = b'\x00\x00\x00\x04\x00\x00\x00\x00\x00'


class SilentServer:
  """Accepts connections on 127.0.0.1, never answers: a stopped worker."""

  def __init__(self):
    self.sock = socket.socket()
    self.sock.bind(('127.0.0.1', 0))
    self.sock.listen(16)
    self.address = f'127.0.0.1:{self.sock.getsockname()[1]}'

  def close(self):
    self.sock.close()


class SettingsServer(SilentServer):
  """Answers every connection with a SETTINGS frame: a live gRPC server."""

  def __init__(self, frame=SETTINGS_FRAME):
    super().__init__()
    self.frame = frame
    self.sock.settimeout(0.1)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._Serve, daemon=True)
    self._thread.start()

  def _Serve(self):
    while not self._stop.is_set():
      try:
        connection, _ = self.sock.accept()
      except OSError:
        continue
      with connection:
        connection.sendall(self.frame)

  def Freeze(self):
    """Stops answering but keeps accepting: a worker stopped by SIGSTOP."""
    self._stop.set()
    self._thread.join(timeout=5)

  def close(self):
    self.Freeze()
    super().close()


def ClosedPortAddress():
  s = socket.socket()
  s.bind(('127.0.0.1', 0))
  address = f'127.0.0.1:{s.getsockname()[1]}'
  s.close()
  return address


def test_loopback_bind_is_refused_where_tensorflow_would_listen_on_the_network():
  with pytest.raises(ValueError, match='bind_address=0.0.0.0'):
    servers.CheckBindAddress('127.0.0.1', '10.0.0.1:2222',
                             '/job:worker/task:0')
  if network_namespace.OnlyLoopbackInterfaces():
    servers.CheckBindAddress('127.0.0.1', '127.0.0.1:2222', 'w')
  else:
    with pytest.raises(ValueError, match='tfpipe.launcher'):
      servers.CheckBindAddress('127.0.0.1', '127.0.0.1:2222', 'w')


@pytest.mark.parametrize('bind', ['127.0.0.2', '127.1', '[::1]', 'localhost.'])
def test_any_loopback_spelling_is_a_loopback_bind(bind):
  # A loopback bind is never mistaken for a deliberate network bind: it is
  # refused for a task on a routable address, as 127.0.0.1 is.
  with pytest.raises(ValueError, match=f'bind_address={re.escape(bind)}'):
    servers.CheckBindAddress(bind, '10.0.0.1:2222', '/job:worker/task:0')
  if not network_namespace.OnlyLoopbackInterfaces():
    with pytest.raises(ValueError, match='tfpipe.launcher'):
      servers.CheckBindAddress(bind, '127.0.0.3:2222', 'w')


def test_a_network_bind_is_allowed_with_a_warning(capsys):
  servers.CheckBindAddress('0.0.0.0', '10.0.0.1:2222', '/job:worker/task:0')
  assert 'no authentication' in capsys.readouterr().err


def test_a_task_missing_from_the_spec_is_named():
  jobs = {'worker': ['127.0.0.1:2']}
  with pytest.raises(ValueError, match='no /job:controller/task:0'):
    servers.ConnectToCluster(jobs)
  with pytest.raises(ValueError, match='no /job:worker/task:1'):
    servers.StartServer(jobs, 'worker', 1)


def test_probe_tells_an_answer_silence_and_refusal_apart():
  live = SettingsServer()
  silent = SilentServer()
  wrong = SettingsServer(frame=b'\x00\x00\x00\x07\x00\x00\x00\x00\x00')
  try:
    assert servers.ProbeGrpc(live.address, 2.0) is None
    assert 'no answer' in servers.ProbeGrpc(silent.address, 0.3)
    assert 'frame type 7' in servers.ProbeGrpc(wrong.address, 2.0)
  finally:
    for server in (live, silent, wrong):
      server.close()
  assert 'refused' in servers.ProbeGrpc(ClosedPortAddress(), 0.3).lower()


def test_wait_for_tasks_returns_once_every_task_answers():
  live = [SettingsServer(), SettingsServer()]
  try:
    start = time.monotonic()
    servers.WaitForTasks([(f'/job:worker/task:{i}', s.address)
                          for i, s in enumerate(live)], timeout_s=10)
    assert time.monotonic() - start < 5
  finally:
    for server in live:
      server.close()


def test_wait_for_tasks_times_out_naming_the_task():
  address = ClosedPortAddress()
  with pytest.raises(TimeoutError, match=f'/job:worker/task:0 at {address}'):
    servers.WaitForTasks([('/job:worker/task:0', address)], timeout_s=0.5)


def test_wait_for_tasks_names_a_process_that_exited_without_waiting_out():
  address = ClosedPortAddress()
  start = time.monotonic()
  with pytest.raises(RuntimeError, match=(
      f'/job:worker/task:0 at {address} exited with status 2 before '
      'serving. Read its log.')):
    servers.WaitForTasks([('/job:worker/task:0', address)], timeout_s=30,
                         exit_status=lambda name: 2, hint='Read its log.')
  assert time.monotonic() - start < 10


@pytest.mark.parametrize('bind, why', [
    ('', 'it is empty'), ('  ', 'it is empty'),
    ('locahost', 'neither an IP address nor a name that resolves'),
    ('127.0.0.l', 'neither an IP address nor a name that resolves'),
    ('192.0.2.123', 'it stands for 192.0.2.123, which no interface'),
    ('2001:db8::7', 'it stands for 2001:db8::7, which no interface')])
def test_a_bind_address_that_is_not_this_hosts_is_refused(bind, why, capsys):
  # These used to be taken for the choice to serve on every interface.
  with pytest.raises(ValueError) as e:
    servers.CheckBindAddress(bind, '127.0.0.1:2222', '/job:worker/task:0')
  assert str(e.value).startswith(
      f'/job:worker/task:0: --bind_address={bind!r} is not an address of '
      'this host (')
  assert why in str(e.value)
  assert '0.0.0.0' in str(e.value)
  assert not capsys.readouterr().err  # No "serving on the network" warning.


@pytest.mark.parametrize('bind', ['0.0.0.0', '::', '[::]'])
def test_every_interface_is_a_deliberate_network_bind(bind, capsys):
  servers.CheckBindAddress(bind, '127.0.0.1:2222', '/job:worker/task:0')
  assert 'no authentication' in capsys.readouterr().err


def test_an_address_of_this_host_is_a_deliberate_network_bind(capsys):
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
      s.connect(('192.0.2.1', 9))  # No packet is sent: this picks a route.
    except OSError:
      pytest.skip('no route off this host')
    own = s.getsockname()[0]
  if own.startswith('127.'):
    pytest.skip('no address of this host but loopback')
  servers.CheckBindAddress(own, '127.0.0.1:2222', '/job:worker/task:0')
  assert 'no authentication' in capsys.readouterr().err
