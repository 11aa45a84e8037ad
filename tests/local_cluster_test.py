"""Tests of tfpipe.local_cluster: ports, children that never outlive the program, workers.

A user relies on: a local spec whose tasks do not collide; no process left
behind, whether the program closes its children (a stopped one at once), or
is itself killed (even by SIGKILL, which runs no clean-up); and a worker
start-up that ends, naming a worker that exited before serving. The children
here are small Python processes (no TensorFlow), each bounded in time.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import servers_test
from tfpipe import cluster_spec
from tfpipe import local_cluster
from tfpipe import servers

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A stand-in worker: answers every connection on its port as gRPC does.
_FAKE_WORKER = f'''
import socket, sys
host, port = sys.argv[1].rsplit(':', 1)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((host, int(port)))
s.listen(8)
while True:
  c, _ = s.accept()
  c.sendall({servers_test.SETTINGS_FRAME!r})
  c.close()
'''

# Starts a grandchild that sleeps in the same process group; prints its pid.
_SPAWNER = '''
import subprocess, sys, time
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
print(child.pid, flush=True)
time.sleep(60)
'''

# A program that starts one child through ChildProcesses, then waits.
_PARENT = '''
import sys, time
from tfpipe import local_cluster
children = local_cluster.ChildProcesses('parent')
children.Start('sleeper', [sys.executable, '-c', 'import time; time.sleep(60)'])
time.sleep(60)
'''


def _Alive(pid):
  """False once `pid` has exited (a zombie left for its new parent counts)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] not in 'ZX'
  except FileNotFoundError:
    return False


def _WaitGone(pids, timeout_s=10):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and any(_Alive(p) for p in pids):
    time.sleep(0.05)
  return [p for p in pids if _Alive(p)]


def test_local_cluster_jobs_are_a_controller_and_workers_on_distinct_ports():
  jobs = local_cluster.LocalClusterJobs(3)
  assert sorted(jobs) == ['controller', 'worker']
  assert len(jobs['controller']) == 1 and len(jobs['worker']) == 3
  addresses = jobs['controller'] + jobs['worker']
  assert len(set(addresses)) == 4
  assert all(a.startswith('127.0.0.1:') for a in addresses)
  text = cluster_spec.FormatClusterSpec(jobs)
  assert cluster_spec.ParseClusterJobs(text) == jobs
  with pytest.raises(ValueError, match='num_workers=0'):
    local_cluster.LocalClusterJobs(0)


def test_close_ends_every_child_and_what_it_started(capsys):
  children = local_cluster.ChildProcesses('test')
  try:
    proc = children.Start('spawner', [sys.executable, '-c', _SPAWNER],
                          stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())
    assert _Alive(proc.pid) and _Alive(grandchild)
  finally:
    children.Close()
  assert proc.poll() is not None
  assert not _WaitGone([grandchild])
  assert f'test: started spawner pid={proc.pid}' in capsys.readouterr().out


# A child that cleans up on SIGTERM, as TensorFlow's processes do.
_TERM_HANDLER = '''
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *unused: sys.exit(0))
print('ready', flush=True)
time.sleep(60)
'''


def test_close_ends_a_stopped_child_at_once():
  # A worker stopped with SIGSTOP cannot act on SIGTERM: it used to take
  # the whole KILL_WAIT_S and a SIGKILL to end.
  children = local_cluster.ChildProcesses('test')
  try:
    proc = children.Start('stopped', [sys.executable, '-c', _TERM_HANDLER],
                          stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == 'ready\n'
    os.kill(proc.pid, signal.SIGSTOP)
    start = time.monotonic()
  finally:
    children.Close()
  assert time.monotonic() - start < local_cluster.KILL_WAIT_S / 2
  assert proc.returncode == 0  # Its own SIGTERM handler ended it.


_SLEEPER_SAYING_READY = """
import time
print('ready', flush=True)
time.sleep(60)
"""


def test_a_child_that_survives_sigterm_lives_on_until_close_kills_it():
  # SLURM sends SIGTERM to every process of a job; the launcher's workers
  # must outlive it, since they hold the variables the controller saves.
  children = local_cluster.ChildProcesses('test')
  try:
    proc = children.Start('worker', [sys.executable, '-c',
                                     _SLEEPER_SAYING_READY],
                          survives_sigterm=True, stdout=subprocess.PIPE,
                          text=True)
    assert proc.stdout.readline() == 'ready\n'
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    assert proc.poll() is None, 'SIGTERM ended it'
    start = time.monotonic()
  finally:
    children.Close()
  assert time.monotonic() - start < local_cluster.KILL_WAIT_S / 2
  assert proc.returncode == -signal.SIGKILL


def test_children_die_with_the_program_even_when_it_is_killed():
  parent = subprocess.Popen(
      [sys.executable, '-c', _PARENT], stdout=subprocess.PIPE, text=True,
      cwd=_ROOT, env=dict(os.environ, PYTHONPATH=_ROOT))
  try:
    line = parent.stdout.readline()
    assert line.startswith('parent: started sleeper pid='), line
    child = int(line.rsplit('=', 1)[1])
    assert _Alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    assert not _WaitGone([child]), 'the child outlived its killed parent'
  finally:
    if parent.poll() is None:
      parent.kill()
      parent.wait(timeout=10)


def test_start_workers_returns_once_every_worker_serves():
  jobs = local_cluster.LocalClusterJobs(2)
  children = local_cluster.ChildProcesses('test')
  try:
    workers = local_cluster.StartWorkers(
        children, jobs,
        lambda i: [sys.executable, '-c', _FAKE_WORKER, jobs['worker'][i]],
        timeout_s=30)
    assert [(n, a) for n, a, _ in workers] == cluster_spec.JobTasks(jobs)
    for _, address, proc in workers:
      assert proc.poll() is None
      assert servers.ProbeGrpc(address, 2.0) is None
  finally:
    children.Close()
  assert all(proc.poll() is not None for _, _, proc in workers)


def test_start_workers_names_a_worker_that_exited_before_serving():
  jobs = local_cluster.LocalClusterJobs(2)
  children = local_cluster.ChildProcesses('test')
  start = time.monotonic()
  try:
    with pytest.raises(RuntimeError, match=(
        r'/job:worker/task:1 at 127\.0\.0\.1:\d+ exited with status 3 '
        'before serving. See its log above.')):
      local_cluster.StartWorkers(
          children, jobs, lambda i: [
              sys.executable, '-c',
              _FAKE_WORKER if i == 0 else 'import sys; sys.exit(3)',
              jobs['worker'][i]],
          timeout_s=60)
  finally:
    children.Close()
  assert time.monotonic() - start < 30
