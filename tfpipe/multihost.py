"""Multi-process roles of the trainer: workers serve, the controller trains.

This is the glue between absl flags (or TF_CONFIG) and the cluster modules
(tfpipe.cluster_spec, tfpipe.servers), kept out of the trainer so that the
trainer needs two calls to run anywhere:

    if multihost.MaybeServe(FLAGS): return 0        # a worker never returns
    controller = multihost.SetUpController(FLAGS, params)
    ...
    controller.Run(trainer)                           # watchdog + checkpoint IO

A controller places replica r's cell k on a worker device (see
`device_names.WorkerDevices`), so only the controller's program creates
variables and runs steps; it also makes every checkpoint read and write go
through its own CPU (`experimental_io_device`), so the checkpoint files land
on the controller's file system whatever worker holds a variable.

Two facts of TensorFlow's runtime shape the controller's watch over its
workers:

* RPCs to a worker that is stopped or unreachable can hang for minutes, so
  the controller runs a `Watchdog` that probes every worker
  (servers.ProbeGrpc) and aborts the process with an error naming the task
  and its address when one stops answering. It starts before the controller
  connects and runs until the controller ends: connecting, creating the
  remote variables and restoring a checkpoint talk to the workers too.
* Tearing down an eager context whose workers died can hang too, so fatal
  cluster errors end the process at once (process_exit.ExitNow, status
  EXIT_WORKER_LOST).

`python -m tfpipe.multihost --job=worker --task=N --cluster_spec=...` is the
plain worker the launcher starts (the trainer's --job=worker does the same).
"""

import contextlib
import functools
import os
import sys
import threading

from tfpipe import cluster_spec
from tfpipe import device_names
from tfpipe import process_exit
from tfpipe import servers

# Exit status of a controller that lost a worker.
EXIT_WORKER_LOST = 3


def DefineFlags(controller_flags=True):
  """Defines --job, --task, --cluster_spec, --bind_address, ... .

  Args:
    controller_flags: also define the flags only a training controller
      reads (the watchdog's).
  """
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string(
      'job', '', 'Role in a multi-process job: "worker" (serve), '
      '"controller" (train on the workers), or empty for one process.')
  flags.DEFINE_integer('task', None, 'Task index within --job '
                       '(default: from TF_CONFIG, else 0).')
  flags.DEFINE_string(
      'cluster_spec', '', 'Cluster addresses, e.g. "controller=h0:2222;'
      'worker=h1:2222,h2:2222", or JSON; default: TF_CONFIG.')
  flags.DEFINE_string(
      'bind_address', '127.0.0.1', 'Interface the gRPC server is meant to '
      'serve on. TensorFlow always listens on all interfaces, so a loopback '
      'value requires a loopback-only network namespace (the launcher makes '
      'one); pass 0.0.0.0 to serve on the network on purpose.')
  flags.DEFINE_integer('devices_per_worker', 1,
                       'CPU devices each worker exposes.')
  flags.DEFINE_integer('intra_op_threads', 0,
                       'Threads one op may use in each worker (0: '
                       'TensorFlow\'s default); an emulated accelerator has '
                       'its own.', lower_bound=0)
  if controller_flags:
    flags.DEFINE_float('watchdog_interval_s', 2.0,
                       'Seconds between liveness probes of each worker.')
    flags.DEFINE_float('watchdog_timeout_s', 3.0,
                       'Seconds a worker has to answer one probe.')
    flags.DEFINE_integer('watchdog_max_failures', 2, 'Consecutive failed '
                         'probes after which a worker is declared lost.')


def ClusterFromFlags(flag_values, environ=None):
  """(ClusterSpec, job, task) from the flags or TF_CONFIG; None if neither."""
  environ = os.environ if environ is None else environ
  if not (flag_values.job or flag_values.cluster_spec or
          environ.get('TF_CONFIG')):
    return None
  resolved = cluster_spec.ResolveCluster(
      flag_values.cluster_spec, flag_values.job or None, flag_values.task,
      environ)
  if resolved is None:
    raise ValueError(f'--job={flag_values.job} needs --cluster_spec or '
                     'TF_CONFIG.')
  return resolved


def TfConfigNote(flag_values, environ=None):
  """A sentence naming TF_CONFIG if it, not --cluster_spec, gave the cluster.

  A TF_CONFIG left in the environment by another job turns a one-process
  trainer into a cluster task; its errors must say where that came from.

  Returns:
    The sentence, or '' when TF_CONFIG is not the source.
  """
  environ = os.environ if environ is None else environ
  text = environ.get('TF_CONFIG', '')
  if flag_values.cluster_spec or not text:
    return ''
  shown = text if len(text) <= 160 else text[:157] + '...'
  return (f'The cluster and this process\'s role come from TF_CONFIG in the '
          f'environment ({shown}): unset TF_CONFIG to train in one process, '
          'or correct it.')


@contextlib.contextmanager
def _NamingTfConfig(flag_values):
  """Adds TfConfigNote to the errors raised inside (same types)."""
  note = TfConfigNote(flag_values)
  try:
    yield note
  except (ValueError, RuntimeError, TimeoutError) as e:
    if not note:
      raise
    raise type(e)(f'{e.args[0] if e.args else e} {note}') from None


def MaybeServe(flag_values):
  """Serves forever if this process is a worker; False otherwise."""
  with _NamingTfConfig(flag_values) as note:
    resolved = ClusterFromFlags(flag_values)
    if resolved is None or resolved[1] == cluster_spec.CONTROLLER_JOB:
      return False
    spec, job, task = resolved
    threads = getattr(flag_values, 'intra_op_threads', 0)
    servers.Serve(spec, job, task, flag_values.bind_address,
                  flag_values.devices_per_worker, why=note,
                  **({'intra_op_threads': threads} if threads else {}))
  return True


class Controller:
  """What a training controller holds: the workers and its watchdog."""

  def __init__(self, flag_values, spec, job, task):
    self.spec = spec
    self.job = job
    self.task = task
    self.workers = cluster_spec.JobTasks(spec, cluster_spec.WORKER_JOB)
    # fn(task name, address) -> (message, exit status) or None: why a lost
    # worker was lost, when the trainer can tell (it ran out of memory).
    self.explain_lost = None
    self.watchdog = Watchdog(
        self.workers, interval_s=flag_values.watchdog_interval_s,
        timeout_s=flag_values.watchdog_timeout_s,
        max_failures=flag_values.watchdog_max_failures,
        on_lost=self._OnLost)

  def _OnLost(self, message):
    name, address = self.watchdog.lost_task
    EndForLostWorker(name, address, message, self.explain_lost)

  @property
  def io_device(self):
    return f'/job:{self.job}/replica:0/task:{self.task}/device:CPU:0'

  def UseControllerIo(self, trainer):
    """Makes the trainer's checkpoint saves and restores run on this CPU."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    options = tf.train.CheckpointOptions(experimental_io_device=self.io_device)
    trainer.manager.save = functools.partial(trainer.manager.save,
                                             options=options)
    trainer.checkpoint.restore = functools.partial(trainer.checkpoint.restore,
                                                   options=options)

  def Run(self, fn):
    """fn() under the watchdog; a lost worker ends the process clearly."""
    return RunController(fn, self.workers, self.watchdog,
                         explain=lambda *task: (self.explain_lost and
                                                self.explain_lost(*task)))


def SetUpController(flag_values, params):
  """Connects a --job=controller to its workers and places the pipeline.

  Sets params.task.pipeline.devices to its R*K worker devices
  (task.pipeline.num_replicas replicas of num_partitions cells), prints the
  device mesh, and returns a Controller whose watchdog already runs (it
  watches the connection itself); without a cluster returns None. Must run
  after the local devices are configured.
  """
  pipeline = params.task.pipeline
  num_replicas = pipeline.num_replicas
  with _NamingTfConfig(flag_values):
    resolved = ClusterFromFlags(flag_values)
    if resolved is None:
      return None
    spec, job, task = resolved
    workers = cluster_spec.JobTasks(spec, cluster_spec.WORKER_JOB)
    if not workers:
      raise ValueError(f'--cluster_spec has no "{cluster_spec.WORKER_JOB}" '
                       'job; list the workers the pipeline runs on.')
    servers.WaitForTasks(workers, timeout_s=60.0)
    controller = Controller(flag_values, spec, job, task)
    controller.watchdog.Start()
    try:
      servers.ConnectToCluster(spec, job, task, flag_values.bind_address)
    except BaseException:
      controller.watchdog.Stop()
      raise
  devices = device_names.WorkerDevices(
      pipeline.num_partitions, len(workers), num_replicas,
      devices_per_worker=flag_values.devices_per_worker)
  pipeline.devices = devices
  print(device_names.DeviceMeshText(devices, num_replicas), flush=True)
  return controller


# ---- the controller's watch over its workers ---------------------------------


def UnreachableMessage(task_name, address, reason):
  return (f'Worker {task_name} at {address} is unreachable ({reason}). '
          'Check that its process is running and its port is reachable, '
          'then restart the job: training resumes from the last checkpoint.')


class Watchdog:
  """Probes every worker on a thread; aborts the process when one is lost.

  A worker is declared lost after `max_failures` consecutive failed probes,
  so the bound on detection is `bound_s` = max_failures * (interval_s +
  timeout_s) after it stopped answering.
  """

  def __init__(self, tasks, interval_s=2.0, timeout_s=3.0, max_failures=2,
               on_lost=None):
    """Creates a stopped watchdog; Start() starts it.

    Args:
      tasks: [(task name, 'host:port')] to probe.
      interval_s: seconds between rounds of probes.
      timeout_s: seconds one probe may take.
      max_failures: consecutive failed probes that make a task lost.
      on_lost: called with the message when a task is lost; by default
        prints it and exits the process with EXIT_WORKER_LOST.
    """
    self.tasks = list(tasks)
    self.interval_s = interval_s
    self.timeout_s = timeout_s
    self.max_failures = max_failures
    self._on_lost = on_lost or AbortWorkerLost
    self._stop = threading.Event()
    self._thread = None
    self.lost = None
    self.lost_task = None  # (task name, address) of the lost worker.

  @property
  def bound_s(self):
    return self.max_failures * (self.interval_s + self.timeout_s)

  def CheckOnce(self, failures):
    """Probes all tasks, counting `failures`; a message if one is lost."""
    for name, address in self.tasks:
      reason = servers.ProbeGrpc(address, self.timeout_s)
      failures[name] = 0 if reason is None else failures.get(name, 0) + 1
      if failures[name] >= self.max_failures:
        self.lost_task = (name, address)
        return UnreachableMessage(name, address, reason)
    return None

  def _Run(self):
    failures = {}
    while not self._stop.wait(self.interval_s):
      message = self.CheckOnce(failures)
      if message and not self._stop.is_set():
        self.lost = message
        self._on_lost(message)
        return

  def Start(self):
    """Starts probing (once: a running watchdog is left as it is)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._Run,
                                      name='tfpipe-watchdog', daemon=True)
      self._thread.start()
    return self

  def Stop(self):
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=self.interval_s + self.timeout_s + 1)


def AbortWorkerLost(message, exit_status=EXIT_WORKER_LOST):
  """Prints the message and ends the process now (no hanging teardown)."""
  print(f'ERROR: {message}', file=sys.stderr, flush=True)
  process_exit.ExitNow(exit_status)


# Seconds a lost worker's explanation may take before the plain message is
# given instead: the launcher kills a controller that has not stopped 45 s
# (its --grace_s) after a worker exited, and the watchdog takes up to 10 s
# (its default bound) to notice.
EXPLAIN_TIMEOUT_S = 30.0


def EndForLostWorker(name, address, message, explain=None):
  """Ends the process for lost worker `name`: with explain(name, address)'s
  (message, exit status) when it has one in time, else `message` and
  EXIT_WORKER_LOST."""
  found = []
  if explain is not None:
    def Explain():
      try:
        found.append(explain(name, address))
      except Exception as e:  # pylint: disable=broad-except
        print(f'(could not tell why {name} was lost: {type(e).__name__}: '
              f'{e})', file=sys.stderr, flush=True)
    thread = threading.Thread(target=Explain, daemon=True,
                              name='tfpipe-explain-lost')
    thread.start()
    thread.join(EXPLAIN_TIMEOUT_S)
  if found and found[0]:
    AbortWorkerLost(*found[0])
  else:
    AbortWorkerLost(message)


def RunController(fn, tasks, watchdog=None, explain=None):
  """Runs fn() with a watchdog; a lost worker ends the process clearly.

  The watchdog is started if it is not running yet. Connection errors
  raised by TensorFlow (UnavailableError and friends) are traced to the
  worker that no longer answers, reported, and the process exits with
  EXIT_WORKER_LOST, or as `explain` says (EndForLostWorker).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  watchdog = watchdog or Watchdog(tasks)
  watchdog.Start()
  try:
    return fn()
  except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
          tf.errors.AbortedError, tf.errors.CancelledError,
          tf.errors.InternalError):
    for name, address in tasks:
      reason = servers.ProbeGrpc(address, watchdog.timeout_s)
      if reason is not None:
        EndForLostWorker(name, address,
                         UnreachableMessage(name, address, reason), explain)
    raise
  finally:
    watchdog.Stop()


def _WorkerMain(argv):
  """`python -m tfpipe.multihost --job=worker --task=N --cluster_spec=...`."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  from tfpipe import quiet  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {" ".join(argv[1:])}.')
  from tfpipe import out_of_memory_reports  # pylint: disable=g-import-not-at-top
  verbosity = (flags.FLAGS.verbosity if flags.FLAGS['verbosity'].present
               else None)
  # Before TensorFlow starts: its out-of-memory records are warnings, which
  # the worker reports for its controller to ask for.
  out_of_memory_reports.StartWorkerReport(
      flags.FLAGS.job, flags.FLAGS.task, flags.FLAGS.cluster_spec,
      quiet.ShowStartupLog(verbosity))
  quiet.ImportTensorFlow(quiet.ShowStartupLog(verbosity))
  try:
    if not MaybeServe(flags.FLAGS):
      raise ValueError('give --job=worker --task=N --cluster_spec=... '
                       '(or TF_CONFIG with a worker task).')
  except (ValueError, RuntimeError) as e:
    raise app.UsageError(str(e)) from None


if __name__ == '__main__':
  from tfpipe import command_line  # pylint: disable=g-import-not-at-top
  DefineFlags(controller_flags=False)
  command_line.Run(_WorkerMain)
