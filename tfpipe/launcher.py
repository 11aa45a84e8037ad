"""Runs a multi-process tfpipe job on this host: W workers and a controller.

  python -m tfpipe.launcher --num_workers=2 -- --model=lm.TinyTransformerLm \
      --logdir=/tmp/lm --num_partitions=2

Everything after `--` goes to the controller (`python -m tfpipe.trainer` by
default), which is given --job=controller and --cluster_spec. The workers
serve on free loopback ports.

TensorFlow's gRPC servers listen on every interface and have no
authentication, so the launcher first moves itself into a new network
namespace that holds only loopback (`unshare --net --map-root-user`, no root
needed): nothing it starts can be reached from, or reach, the network.

Every wait is bounded and no child outlives the launcher: children run in
their own process groups, which are killed on exit, on SIGINT/SIGTERM/SIGHUP
and (through PR_SET_PDEATHSIG) when the launcher itself is killed. The
launcher exits with the controller's status, or nonzero if a worker failed
to start or the controller did not stop after losing a worker.
"""

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from absl import app
from absl import flags

from tfpipe import cluster
from tfpipe import multihost

flags.DEFINE_integer('num_workers', 2, 'Worker processes to start.')
multihost.DefineFlags(controller_flags=False)
flags.DEFINE_string('controller_module', 'tfpipe.trainer',
                    'Python module run as the controller (python -m).')
flags.DEFINE_float('startup_timeout_s', 180.0,
                   'Seconds to wait for all workers to serve.')
flags.DEFINE_float('grace_s', 45.0,
                   'Seconds the controller gets to stop after a worker '
                   'exited before the launcher kills it.')
flags.DEFINE_float('timeout_s', 0.0,
                   'Kill the job after this many seconds; 0: no limit.')

FLAGS = flags.FLAGS

# Set in the re-executed launcher so it knows it already is in a namespace.
_NAMESPACE_ENV = 'TFPIPE_LAUNCHER_NETNS'
_PR_SET_PDEATHSIG = 1
_KILL_WAIT_S = 5.0


def FreePorts(n):
  """n distinct free TCP ports on 127.0.0.1."""
  sockets = []
  try:
    for _ in range(n):
      s = socket.socket()
      s.bind(('127.0.0.1', 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def _ChildSetup():
  """In the child: own process group; SIGKILL when the launcher dies."""
  os.setsid()
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    pass


class Job:
  """The child processes of one launch; kills them all on Close()."""

  def __init__(self):
    self.children = []  # (name, Popen)

  def Start(self, name, argv):
    # pylint: disable-next=subprocess-popen-preexec-fn
    proc = subprocess.Popen(argv, preexec_fn=_ChildSetup)
    self.children.append((name, proc))
    print(f'launcher: started {name} pid={proc.pid}', flush=True)
    return proc

  def Close(self):
    """SIGTERM to every child group, then SIGKILL; waits a bounded time."""
    alive = [(n, p) for n, p in self.children if p.poll() is None]
    for _, p in alive:
      _KillGroup(p, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_WAIT_S
    for _, p in alive:
      try:
        p.wait(timeout=max(deadline - time.monotonic(), 0.01))
      except subprocess.TimeoutExpired:
        pass
    for _, p in self.children:
      _KillGroup(p, signal.SIGKILL)
      try:
        p.wait(timeout=_KILL_WAIT_S)
      except subprocess.TimeoutExpired:
        print(f'launcher: pid {p.pid} did not exit after SIGKILL.',
              file=sys.stderr, flush=True)


def _KillGroup(proc, sig):
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


def _EnterLoopbackNamespace(argv):
  """Re-executes the launcher in a loopback-only network namespace."""
  if cluster.OnlyLoopbackInterfaces():
    cluster.BringUpLoopback()
    return
  if os.environ.get(_NAMESPACE_ENV):
    raise app.UsageError('launcher: the new network namespace still has '
                         'interfaces other than lo; refusing to start.')
  unshare = shutil.which('unshare')
  if not unshare:
    raise app.UsageError(
        'launcher: `unshare` (util-linux) is needed to keep the gRPC servers '
        'on loopback (TensorFlow binds 0.0.0.0); install util-linux.')
  os.environ[_NAMESPACE_ENV] = '1'
  sys.stdout.flush()
  sys.stderr.flush()
  os.execv(unshare, [unshare, '--net', '--map-root-user',
                     '--kill-child=SIGTERM', sys.executable, '-m',
                     'tfpipe.launcher'] + argv[1:])


def _OnSignal(signum, unused_frame):
  raise SystemExit(128 + signum)


def Launch(controller_args):
  """Starts the workers, then the controller; returns the exit status."""
  num_workers = FLAGS.num_workers
  if num_workers < 1:
    raise app.UsageError(f'--num_workers={num_workers}; give at least 1.')
  ports = FreePorts(num_workers + 1)
  spec_text = (f'{cluster.CONTROLLER_JOB}=127.0.0.1:{ports[0]};'
               f'{cluster.WORKER_JOB}=' +
               ','.join(f'127.0.0.1:{p}' for p in ports[1:]))
  workers = cluster.JobTasks(cluster.ParseClusterJobs(spec_text),
                             cluster.WORKER_JOB)
  print(f'launcher: pid={os.getpid()} cluster {spec_text}', flush=True)
  job = Job()
  atexit.register(job.Close)
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, _OnSignal)
  try:
    procs = {}
    for i, (name, address) in enumerate(workers):
      procs[name] = job.Start(f'worker {name} at {address}', [
          sys.executable, '-m', 'tfpipe.multihost',
          f'--job={cluster.WORKER_JOB}', f'--task={i}',
          f'--cluster_spec={spec_text}',
          f'--devices_per_worker={FLAGS.devices_per_worker}'])
    _WaitForWorkers(workers, procs, FLAGS.startup_timeout_s)
    controller = job.Start('controller', [
        sys.executable, '-m', FLAGS.controller_module,
        f'--job={cluster.CONTROLLER_JOB}', f'--cluster_spec={spec_text}',
        f'--devices_per_worker={FLAGS.devices_per_worker}'] +
                           list(controller_args))
    return _Supervise(controller, workers, procs)
  finally:
    job.Close()


def _WaitForWorkers(workers, procs, timeout_s):
  deadline = time.monotonic() + timeout_s
  for name, address in workers:
    while cluster.ProbeGrpc(address, 1.0) is not None:
      code = procs[name].poll()
      if code is not None:
        raise RuntimeError(f'launcher: worker {name} at {address} exited with '
                           f'status {code} before serving; see its log above.')
      if time.monotonic() > deadline:
        raise TimeoutError(
            f'launcher: worker {name} at {address} did not serve within '
            f'{timeout_s:g}s (--startup_timeout_s); see its log above.')
      time.sleep(0.25)


def _Supervise(controller, workers, procs):
  """Waits for the controller; bounds its life after a worker exits."""
  start = time.monotonic()
  worker_lost_at = None
  while True:
    code = controller.poll()
    if code is not None:
      print(f'launcher: controller exited with status {code}.', flush=True)
      return code
    now = time.monotonic()
    if worker_lost_at is None:
      for name, address in workers:
        worker_code = procs[name].poll()
        if worker_code is not None:
          print(f'launcher: worker {name} at {address} exited with status '
                f'{worker_code}; the controller has {FLAGS.grace_s:g}s to '
                'stop.', file=sys.stderr, flush=True)
          worker_lost_at = now
          break
    elif now - worker_lost_at > FLAGS.grace_s:
      print('launcher: the controller did not stop after losing a worker; '
            'killing the job.', file=sys.stderr, flush=True)
      return cluster.EXIT_WORKER_LOST
    if FLAGS.timeout_s and now - start > FLAGS.timeout_s:
      print(f'launcher: --timeout_s={FLAGS.timeout_s:g} expired; killing the '
            'job.', file=sys.stderr, flush=True)
      return 124
    time.sleep(0.2)


def main(argv):
  _EnterLoopbackNamespace(sys.argv)
  try:
    return Launch(argv[1:])
  except (RuntimeError, TimeoutError, ValueError) as e:
    print(f'ERROR: {e}', file=sys.stderr, flush=True)
    return 1


def run():
  app.run(main)


if __name__ == '__main__':
  run()
