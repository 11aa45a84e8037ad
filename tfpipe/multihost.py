"""Multi-process roles of the trainer: workers serve, the controller trains.

This is the glue between absl flags (or TF_CONFIG) and `tfpipe.cluster`, kept
out of the trainer so that the trainer needs two calls to run anywhere:

    if multihost.MaybeServe(FLAGS): return 0        # a worker never returns
    controller = multihost.SetUpController(FLAGS, params)
    ...
    controller.Run(trainer)                           # watchdog + checkpoint IO

A controller places replica r's stage k on a worker device (see
`cluster.PipelineDevices`), so only the controller's program creates
variables and runs steps; it also makes every checkpoint read and write go
through its own CPU (`experimental_io_device`), so the checkpoint files land
on the controller's file system whatever worker holds a variable.

`python -m tfpipe.multihost --job=worker --task=N --cluster_spec=...` is the
plain worker the launcher starts (the trainer's --job=worker does the same).
"""

import functools
import os
import sys

from tfpipe import cluster


def DefineFlags(controller_flags=True):
  """Defines --job, --task, --cluster_spec, --bind_address, ... .

  Args:
    controller_flags: also define the flags only a training controller
      reads (--num_replicas and the watchdog's).
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
  if controller_flags:
    flags.DEFINE_integer('num_replicas', 1, 'R: data-parallel pipeline '
                         'replicas; the pipeline then uses R*K devices.')
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
  resolved = cluster.ResolveCluster(flag_values.cluster_spec,
                                    flag_values.job or None, flag_values.task,
                                    environ)
  if resolved is None:
    raise ValueError(f'--job={flag_values.job} needs --cluster_spec or '
                     'TF_CONFIG.')
  return resolved


def MaybeServe(flag_values):
  """Serves forever if this process is a worker; False otherwise."""
  resolved = ClusterFromFlags(flag_values)
  if resolved is None or resolved[1] == cluster.CONTROLLER_JOB:
    return False
  spec, job, task = resolved
  cluster.Serve(spec, job, task, flag_values.bind_address,
                flag_values.devices_per_worker)
  return True


class Controller:
  """What a training controller holds: the workers and its watchdog."""

  def __init__(self, flag_values, spec, job, task):
    self.spec = spec
    self.job = job
    self.task = task
    self.workers = cluster.JobTasks(spec, cluster.WORKER_JOB)
    self.watchdog = cluster.Watchdog(
        self.workers, interval_s=flag_values.watchdog_interval_s,
        timeout_s=flag_values.watchdog_timeout_s,
        max_failures=flag_values.watchdog_max_failures)

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
    return cluster.RunController(fn, self.workers, self.watchdog)


def SetUpController(flag_values, params):
  """Connects a --job=controller to its workers and places the pipeline.

  Sets params.task.pipeline.devices to R*K worker devices and its
  num_replicas to --num_replicas, prints the device mesh, and returns a
  Controller; without a cluster only sets num_replicas and returns None.
  Must run after the local devices are configured.
  """
  pipeline = params.task.pipeline
  num_replicas = flag_values.num_replicas
  if num_replicas < 1:
    raise ValueError(f'--num_replicas={num_replicas}; give at least 1.')
  if num_replicas > 1 or 'num_replicas' in pipeline:
    if 'num_replicas' not in pipeline:
      raise ValueError('--num_replicas needs task.pipeline.num_replicas, '
                       'which this trainer does not define.')
    pipeline.num_replicas = num_replicas
  resolved = ClusterFromFlags(flag_values)
  if resolved is None:
    return None
  spec, job, task = resolved
  workers = cluster.JobTasks(spec, cluster.WORKER_JOB)
  if not workers:
    raise ValueError(f'--cluster_spec has no "{cluster.WORKER_JOB}" job; '
                     'list the workers the pipeline runs on.')
  cluster.WaitForTasks(workers, timeout_s=60.0)
  cluster.ConnectToCluster(spec, job, task, flag_values.bind_address)
  devices = cluster.PipelineDevices(
      pipeline.num_partitions, len(workers), num_replicas,
      devices_per_worker=flag_values.devices_per_worker)
  pipeline.devices = devices
  print(cluster.DeviceMeshText(devices, num_replicas), flush=True)
  return Controller(flag_values, spec, job, task)


def _WorkerMain(argv):
  """`python -m tfpipe.multihost --job=worker --task=N --cluster_spec=...`."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {" ".join(argv[1:])}.')
  try:
    if not MaybeServe(flags.FLAGS):
      raise ValueError('give --job=worker --task=N --cluster_spec=... '
                       '(or TF_CONFIG with a worker task).')
  except (ValueError, RuntimeError) as e:
    raise app.UsageError(str(e)) from None


if __name__ == '__main__':
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  from absl import app as _app  # pylint: disable=g-import-not-at-top
  DefineFlags(controller_flags=False)
  sys.exit(_app.run(_WorkerMain))
