r"""K emulated accelerators: one worker process per device, each with its own
allocator, memory limit and threads, and a way to read their memory.

Logical CPU devices in one process share one allocator and one thread
pool, so they can show neither where memory lands nor what a device's
limit does. Here each device is a single-device `tf.distribute.Server`
process started with TF_CPU_ALLOCATOR_USE_BFC=true and, if asked,
TF_CPU_BFC_MEM_LIMIT_IN_MB=N (tfpipe.memory_limit): an allocation beyond N
MiB fails with ResourceExhaustedError there, as on an accelerator of N MiB.
Its intra-op threads are its own (--intra_op_threads).

Each worker also answers on its stdin, one line per command:
  reset    starts a new peak (prints OK);
  memory   prints get_memory_info('CPU:0') as JSON: current and peak bytes.
So a benchmark reads each device's peak of a step, and checks that a
device's memory is back to what it was between measurements.

The servers listen on every interface (tfpipe.servers), so a benchmark that
uses them first enters a loopback-only network namespace
(tfpipe.network_namespace.EnterLoopbackNamespace); the workers are
tfpipe.local_cluster children, killed with the benchmark.

    workers = capped_workers.CappedWorkers(4, memory_mb=64)
    workers.Connect()             # this process becomes their controller
    ... build on workers.devices, run a step ...
    workers.Reset(); step(); peaks = workers.Peaks()
"""

import json
import os
import subprocess
import sys

from tfpipe import cluster_spec
from tfpipe import local_cluster
from tfpipe import memory_limit
from tfpipe import out_of_memory
from tfpipe import servers

# Threads one op may use in a worker unless asked otherwise: one, as on a
# device that runs one op at a time (the memory profiles match it).
INTRA_OP_THREADS = 1
# Each worker is another process's CPU, whose actions are calls on the
# single-threaded executor (gpipe/cell_runtime.py): the memory profiles run
# them so (memory_profile.ProfileRequest.single_threaded_calls).
SINGLE_THREADED_CALLS = True

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def RunWorker(cluster_text, task, intra_op_threads=INTRA_OP_THREADS,
              inter_op_threads=0):
  """Serves one device and answers 'reset' and 'memory' on stdin."""
  from tfpipe import out_of_memory_reports  # pylint: disable=g-import-not-at-top
  from tfpipe import quiet  # pylint: disable=g-import-not-at-top
  # Before TensorFlow: a worker that crashes right after its allocator
  # refused memory (some kernels do) leaves the refusal in its report
  # (Refusals), so a crash can be told from running out of memory.
  out_of_memory_reports.StartWorkerReport(cluster_spec.WORKER_JOB, task,
                                          cluster_text, show_all=False)
  tf = quiet.ImportTensorFlow()
  spec = cluster_spec.ParseClusterSpec(cluster_text)
  server = servers.StartServer(spec, cluster_spec.WORKER_JOB, task,
                               intra_op_threads=intra_op_threads,
                               inter_op_threads=inter_op_threads)
  for line in sys.stdin:
    command = line.strip()
    if command == 'reset':
      tf.config.experimental.reset_memory_stats('CPU:0')
      print('OK', flush=True)
    elif command == 'memory':
      print(json.dumps(tf.config.experimental.get_memory_info('CPU:0')),
            flush=True)
    else:
      break
  del server


class CappedWorkers:
  """K single-device worker processes; this process is their controller."""

  def __init__(self, num_workers, memory_mb=None,
               intra_op_threads=INTRA_OP_THREADS,
               inter_op_threads=0, startup_timeout_s=180, owner='benchmark',
               wait=True):
    """Starts the workers and (with `wait`) waits until they serve.

    Args:
      num_workers: K.
      memory_mb: each worker's hard limit in MiB; None: no limit (the
        allocator still counts).
      intra_op_threads: threads one op may use in each worker.
      inter_op_threads: ops one worker runs at once (0: TF's default).
      startup_timeout_s: how long they have to serve.
      owner: names this program in the children's log lines.
      wait: False starts them and returns at once; call WaitUntilServing
        before using them (so the next set can start while this one works).
        Start them from the main thread: a child dies with the thread that
        started it (local_cluster).
    """
    self.num_workers = num_workers
    self.memory_mb = memory_mb
    self.jobs = local_cluster.LocalClusterJobs(num_workers)
    self.spec_text = cluster_spec.FormatClusterSpec(self.jobs)
    self._children = local_cluster.ChildProcesses(owner)
    env = memory_limit.CappedEnv(memory_mb)
    # Warnings, for the allocator's refusals to reach the worker's report;
    # its stderr goes nowhere.
    env[out_of_memory.LOG_LEVEL_ENV] = '1'
    env['PYTHONPATH'] = os.pathsep.join(
        [_REPO_ROOT] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep)
                        if p])
    self._timeout_s = startup_timeout_s
    self._tasks = cluster_spec.JobTasks(self.jobs, cluster_spec.WORKER_JOB)
    try:
      self._procs = [
          self._children.Start(
              f'worker {name} at {address}',
              [sys.executable, '-m', 'benchmarks.capped_workers',
               f'--cluster={self.spec_text}', f'--task={k}',
               f'--intra_op_threads={intra_op_threads}',
               f'--inter_op_threads={inter_op_threads}'],
              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
              stderr=subprocess.DEVNULL, text=True, cwd=_REPO_ROOT, env=env)
          for k, (name, address) in enumerate(self._tasks)]
      if wait:
        self.WaitUntilServing()
    except BaseException:
      self.Close()
      raise

  def WaitUntilServing(self):
    """Waits until every worker serves (local_cluster.StartWorkers' wait)."""
    processes = dict(zip([name for name, _ in self._tasks], self._procs))
    try:
      servers.WaitForTasks(self._tasks, self._timeout_s,
                           exit_status=lambda name: processes[name].poll())
    except BaseException:
      self.Close()
      raise

  @property
  def devices(self):
    return [f'/job:{cluster_spec.WORKER_JOB}/replica:0/task:{k}/device:CPU:0'
            for k in range(self.num_workers)]

  def Connect(self):
    """Makes this process the workers' controller (again, for a new set:
    TensorFlow then drops its contexts on the previous workers)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    servers.ConnectToCluster(tf.train.ClusterSpec(self.jobs))

  def _Ask(self, proc, command):
    proc.stdin.write(command + '\n')
    proc.stdin.flush()
    answer = proc.stdout.readline().strip()
    if not answer:
      raise RuntimeError(f'A worker did not answer {command!r}; it exited '
                         f'with status {proc.poll()}.')
    return answer

  def Reset(self):
    """Starts a new peak on every worker."""
    for proc in self._procs:
      self._Ask(proc, 'reset')

  def Memory(self):
    """[{'current': bytes, 'peak': bytes}] per worker."""
    return [json.loads(self._Ask(proc, 'memory')) for proc in self._procs]

  def Peaks(self):
    """Each worker's peak bytes since the last Reset."""
    return [m['peak'] for m in self.Memory()]

  def Current(self):
    """Each worker's bytes in use now."""
    return [m['current'] for m in self.Memory()]

  def Alive(self):
    return not self.Exited()

  def Exited(self):
    """[(task, exit status)] of the workers that have exited."""
    statuses = [(k, proc.poll()) for k, proc in enumerate(self._procs)]
    return [(k, status) for k, status in statuses if status is not None]

  def Refusals(self, k):
    """The records of the allocations worker k's allocator refused
    (OutOfMemoryRecords: each refusal as logged, then the error's full
    record where one followed), from its report: for a worker that exited,
    whether it ran out of memory."""
    from tfpipe import out_of_memory_reports  # pylint: disable=g-import-not-at-top
    name, address = self._tasks[k]
    return out_of_memory_reports.LocalReport(name, address)

  def Close(self):
    """Ends the workers; their reports go too (Refusals read them)."""
    from tfpipe import out_of_memory_reports  # pylint: disable=g-import-not-at-top
    self._children.Close()
    out_of_memory_reports.RemoveReports(self.jobs, keep_records=False)


def _Main():
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string('cluster', None, 'The cluster spec.')
  flags.DEFINE_integer('task', None, 'This worker\'s task index.')
  flags.DEFINE_integer('intra_op_threads', INTRA_OP_THREADS,
                       'Threads one op may use.')
  flags.DEFINE_integer('inter_op_threads', 0, 'Ops run at once (0: '
                       'TensorFlow\'s default).')

  def Main(argv):
    del argv
    RunWorker(flags.FLAGS.cluster, flags.FLAGS.task,
              flags.FLAGS.intra_op_threads, flags.FLAGS.inter_op_threads)
  app.run(Main)


if __name__ == '__main__':
  _Main()
