"""Tests of tfpipe.fork_server: fresh TensorFlow processes, forked.

Protected properties: a child starts TensorFlow's runtime fresh, under the
request's environment (its own allocator and thread pools, sized after
the server imported TensorFlow), as a new process would; one server serves
requests that differ only in such variables; a child's exit status, output
and errors come back; a child leaves no file of autograph's behind; a
child past its timeout is killed, even one whose pid comes after it; requests that may open a GPU, or with the server
turned off, run as plain subprocesses; and no child outlives its server's
client.
"""

import os
import subprocess
import sys
import time

import pytest

from tfpipe import fork_server
from tfpipe import process_exit

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODULE = 'tests.fork_server_test'


def _Main(argv):
  """A child's work, by argv[1]."""
  what = argv[1]
  if what == 'allocate':  # 16 MiB on the CPU; the peak, threads and pids.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    x = tf.zeros([4, 1024, 1024])
    peak = tf.config.experimental.get_memory_info('CPU:0')['peak']
    threads = len(os.listdir('/proc/self/task'))
    print(f'{x.shape[0]} {peak} {threads} {os.getpid()} {os.getppid()}')
  elif what == 'sleep':
    print(os.getpid(), flush=True)
    time.sleep(600)
  elif what == 'raise':
    raise ValueError('a bad request')
  elif what == 'autograph':  # Converts a function; names autograph's files.
    import tensorflow as tf  # pylint: disable=g-import-not-at-top

    @tf.function
    def Halve(x):
      while tf.reduce_sum(x) > 1.0:
        x = x / 2.0
      return x
    Halve(tf.constant([8.0]))
    for name, module in sys.modules.items():
      if name.startswith(process_exit.AUTOGRAPH_PREFIX):
        print(module.__file__)


def _Env(**variables):
  env = dict(os.environ, PYTHONPATH=_REPO_ROOT, CUDA_VISIBLE_DEVICES='',
             TF_CPP_MIN_LOG_LEVEL='2')
  env.pop(fork_server.ENABLE_ENV, None)
  env.update(variables)
  return {k: v for k, v in env.items() if v is not None}


@pytest.fixture
def servers():
  fork_server.Close()
  yield fork_server._servers  # pylint: disable=protected-access
  fork_server.Close()


def test_a_child_starts_tensorflow_fresh_under_its_own_environment(servers):
  """TensorFlow makes its allocator and thread pools when its runtime
  starts: in each child, anew, from the request's environment."""
  runs = [fork_server.Run(_MODULE, ['allocate'], _Env(
      TF_CPU_ALLOCATOR_USE_BFC='true', TF_NUM_INTRAOP_THREADS=str(n),
      TF_NUM_INTEROP_THREADS=str(n)), 120) for n in (1, 9)]
  assert all(run.returncode == 0 for run in runs), runs
  (size, peak, few, pid, parent), (_, _, many, _, _) = [
      map(int, run.stdout.split()) for run in runs]
  # The allocator has held this tensor only: no earlier child's.
  assert size == 4 and 16 * 2**20 <= peak < 17 * 2**20
  # 16 more pool threads asked for: most of them are there.
  assert many - few >= 12, (few, many)
  # Both were children of one server, not of this process.
  [server] = servers.values()
  assert parent == server._proc.pid != os.getpid() != pid  # pylint: disable=protected-access


def test_exit_status_output_and_errors_come_back(servers):
  del servers
  failed = fork_server.Run(_MODULE, ['raise'], _Env(), 120)
  assert failed.returncode == 1
  assert failed.stderr.strip().endswith('ValueError: a bad request')
  assert failed.stdout == ''


def test_a_child_leaves_none_of_autographs_files(servers):
  """A child ends with os._exit, which skips autograph's clean-up: it
  removes the files of the functions it converted itself."""
  del servers
  run = fork_server.Run(_MODULE, ['autograph'], _Env(), 120)
  assert run.returncode == 0, run.stderr[-2000:]
  files = run.stdout.split()
  assert files and not any(os.path.exists(f) for f in files), files


def test_a_child_past_its_timeout_is_killed(servers, tmp_path):
  del servers, tmp_path
  start = time.monotonic()
  with pytest.raises(subprocess.TimeoutExpired):
    fork_server.Run(_MODULE, ['sleep'], _Env(), 5)
  assert time.monotonic() - start < 60
  # The server is left serving.
  assert fork_server.Run(_MODULE, ['raise'], _Env(), 120).returncode == 1


def test_a_child_whose_pid_comes_after_its_timeout_is_killed_too():
  """The timeout can pass between the fork and the server's report of the
  child's pid: the child is killed when the pid arrives."""
  import queue  # pylint: disable=g-import-not-at-top
  child = subprocess.Popen([sys.executable, '-c', 'import time; '
                            'time.sleep(600)'])
  try:
    messages = queue.Queue()
    messages.put({'pid': child.pid})
    fork_server._KillOnTimeout(messages, None, grace_s=1)  # pylint: disable=protected-access
    assert child.wait(timeout=30) == -9
  finally:
    child.kill()
    child.wait()


@pytest.mark.parametrize('variables', [
    {'CUDA_VISIBLE_DEVICES': None}, {fork_server.ENABLE_ENV: '0'}],
                         ids=['a-gpu-may-be-opened', 'turned-off'])
def test_plain_subprocesses_where_a_fork_is_not_for_the_request(
    servers, variables):
  proc = fork_server.Run(_MODULE, ['raise'], _Env(**variables), 120)
  assert proc.returncode == 1 and 'a bad request' in proc.stderr
  assert not servers


_CLIENT = r"""
import os, signal, sys, threading, time
sys.path.insert(0, sys.argv[1])
from tfpipe import fork_server
from tfpipe import process_exit
from tests import fork_server_test
threading.Thread(target=fork_server.Run, daemon=True, args=(
    fork_server_test._MODULE, ['sleep'], fork_server_test._Env(), 300)).start()
while not fork_server._servers:
  time.sleep(0.1)
[server] = fork_server._servers.values()
children = []
while not children:
  children = fork_server_test._Children(server._proc.pid)
  time.sleep(0.1)
print(server._proc.pid, *children, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_no_child_outlives_the_servers_client():
  """Its client killed, the server kills the child it still runs, and
  ends."""
  client = subprocess.run([sys.executable, '-c', _CLIENT, _REPO_ROOT],
                          capture_output=True, text=True, timeout=180,
                          check=False, env=_Env())
  assert client.returncode == -9, client.stderr
  pids = [int(pid) for pid in client.stdout.split()]
  assert len(pids) == 2, client.stdout
  deadline = time.monotonic() + 30
  while (any(_Running(pid) for pid in pids) and
         time.monotonic() < deadline):
    time.sleep(0.2)
  assert not any(_Running(pid) for pid in pids)


def _Children(pid):
  found = []
  for task in os.listdir(f'/proc/{pid}/task'):
    with open(f'/proc/{pid}/task/{task}/children') as f:
      found += [int(c) for c in f.read().split()]
  return found


def _Running(pid):
  """Alive and not a zombie (an orphan's is reaped by init, in time)."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      return f.read().rsplit(')', 1)[1].split()[0] != 'Z'
  except FileNotFoundError:
    return False


if __name__ == '__main__':  # A plain subprocess's (fork_server.Run).
  _Main(sys.argv)
