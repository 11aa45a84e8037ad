"""A cluster of processes on this host, none of which outlives the program.

The launcher runs a training job as W worker processes and a controller on
this host; some benchmarks put each device in a worker process of its own,
so that each has its own allocator or its own threads. Both need the same
three things, which this module gives them:

  LocalClusterJobs(W)  a controller and W workers on free loopback ports.
  ChildProcesses       starts children that end with the program: each runs
      in its own process group, which Close() kills (SIGTERM, then SIGKILL,
      each wait bounded; SIGKILL at once for a child that survives SIGTERM),
      and each gets SIGKILL from the kernel when the program dies, even by
      SIGKILL (PR_SET_PDEATHSIG).
  StartWorkers         starts one process per worker task and waits, with a
      deadline, until every one serves; a worker that exits first is named.

The servers listen on every interface whatever the spec says (see
tfpipe.servers), so the program enters a loopback-only network namespace
(tfpipe.network_namespace) before it starts them.
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

from tfpipe import cluster_spec
from tfpipe import servers

_PR_SET_PDEATHSIG = 1
# Seconds Close() waits for the children after each signal.
KILL_WAIT_S = 5.0


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


def LocalClusterJobs(num_workers):
  """{job: [address]}: a controller and `num_workers` workers on 127.0.0.1."""
  if not isinstance(num_workers, int) or num_workers < 1:
    raise ValueError(f'num_workers={num_workers!r}; give at least 1.')
  ports = [f'127.0.0.1:{p}' for p in FreePorts(num_workers + 1)]
  return {cluster_spec.CONTROLLER_JOB: ports[:1],
          cluster_spec.WORKER_JOB: ports[1:]}


def _ChildSetup(ignore_sigterm=False):
  """A preexec_fn: the child gets SIGKILL when the program (its parent) dies,
  and with `ignore_sigterm` starts with SIGTERM ignored (an ignored signal
  stays ignored across exec).

  libc's prctl is looked up here, in the parent: after a fork, a child of a
  threaded program should call only what is already loaded.
  """
  parent = os.getpid()
  try:
    prctl = ctypes.CDLL(None, use_errno=True).prctl
  except (OSError, AttributeError):
    prctl = None

  def Setup():
    if ignore_sigterm:
      signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if prctl is None:
      return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # The parent died before prctl took effect.
      os._exit(1)  # pylint: disable=protected-access
  return Setup


def _KillGroup(proc, sig):
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass


class ChildProcesses:
  """The child processes of one program; Close() kills them all.

  The kernel's death signal follows the thread that started a child, so
  start them from the main thread.
  """

  def __init__(self, owner):
    """Args: owner: the program's name, which starts its log lines."""
    self.owner = owner
    self.children = []  # (name, Popen)
    self._survive_sigterm = set()  # pids

  def Start(self, name, argv, survives_sigterm=False, **popen_kwargs):
    """Starts `argv` as child `name`; popen_kwargs go to subprocess.Popen.

    `survives_sigterm`: the child ignores SIGTERM, and Close() ends it with
    SIGKILL. For a child with nothing of its own to save that another
    process still needs after a SIGTERM sent to every process of a job
    (SLURM's): the launcher's workers hold the variables that the
    controller saves then.
    """
    # pylint: disable-next=subprocess-popen-preexec-fn
    proc = subprocess.Popen(argv, start_new_session=True,
                            preexec_fn=_ChildSetup(survives_sigterm),
                            **popen_kwargs)
    self.children.append((name, proc))
    if survives_sigterm:
      self._survive_sigterm.add(proc.pid)
    print(f'{self.owner}: started {name} pid={proc.pid}', flush=True)
    return proc

  def Close(self):
    """SIGTERM to every child's group, then SIGKILL; each wait is bounded.
    A child that survives SIGTERM gets SIGKILL at once."""
    alive = [p for _, p in self.children if p.poll() is None]
    for p in alive:
      if p.pid in self._survive_sigterm:
        _KillGroup(p, signal.SIGKILL)
        continue
      _KillGroup(p, signal.SIGTERM)
      _KillGroup(p, signal.SIGCONT)  # A stopped process acts on it now.
    deadline = time.monotonic() + KILL_WAIT_S
    for p in alive:
      try:
        p.wait(timeout=max(deadline - time.monotonic(), 0.01))
      except subprocess.TimeoutExpired:
        pass
    for _, p in self.children:
      _KillGroup(p, signal.SIGKILL)  # Also what a child left in its group.
      try:
        p.wait(timeout=KILL_WAIT_S)
      except subprocess.TimeoutExpired:
        print(f'{self.owner}: pid {p.pid} did not exit after SIGKILL.',
              file=sys.stderr, flush=True)


def StartWorkers(children, jobs, worker_argv, timeout_s,
                 hint='See its log above.', each_step=None,
                 survives_sigterm=False, **popen_kwargs):
  """Starts one process per worker task of `jobs`; waits until all serve.

  Args:
    children: the ChildProcesses that owns the workers.
    jobs: {job: [address]}, e.g. from LocalClusterJobs.
    worker_argv: called with a worker's task index, returns its command line.
    timeout_s: how long the workers have to serve, all together.
    hint: what the user should do, ending the errors.
    each_step: called after each start and each round of waiting.
    survives_sigterm: see ChildProcesses.Start.
    **popen_kwargs: for subprocess.Popen (pipes, env, cwd).

  Returns:
    [(task name, address, Popen)] in task order.

  Raises:
    TimeoutError, RuntimeError: a worker did not serve in time, or exited
      first (servers.WaitForTasks).
  """
  workers = cluster_spec.JobTasks(jobs, cluster_spec.WORKER_JOB)
  started = []
  for i, (name, address) in enumerate(workers):
    proc = children.Start(f'worker {name} at {address}', worker_argv(i),
                          survives_sigterm=survives_sigterm, **popen_kwargs)
    started.append((name, address, proc))
    if each_step:
      each_step()
  processes = {name: proc for name, _, proc in started}
  servers.WaitForTasks(workers, timeout_s,
                       exit_status=lambda name: processes[name].poll(),
                       hint=hint, each_round=each_step)
  return started
