"""Runs a multi-process tfpipe job on this host: W workers and a controller.

  python -m tfpipe.launcher --num_workers=2 -- --model=lm.TinyTransformerLm \
      --logdir=/tmp/lm --num_partitions=2

Everything after `--` goes to the controller (`python -m tfpipe.trainer` by
default), which is given --job=controller and --cluster_spec. The workers
serve on free loopback ports.

TensorFlow's gRPC servers listen on every interface and have no
authentication, so the launcher first moves itself into a new network
namespace that holds only loopback (tfpipe.network_namespace: `unshare --net
--map-root-user`, no root needed): nothing it starts can be reached from, or
reach, the network. It keeps its process id in the namespace, so a SIGINT
or SIGTERM sent to it (by `timeout`, a scheduler or
`subprocess.terminate()`) stops the job. SIGTERM, what schedulers and
preemptions send, first lets the controller finish its step and save a
checkpoint (tfpipe.trainer.stop_signal), for at most --stop_grace_s.

Every wait is bounded and no child outlives the launcher
(tfpipe.local_cluster): children run in their own process groups, which are
killed on exit, on SIGINT/SIGTERM/SIGHUP and (through PR_SET_PDEATHSIG) when
the launcher itself is killed. The launcher exits with the controller's
status, 128 + the signal's number after a signal, or nonzero if a worker
failed to start or the controller did not stop after losing a worker.

With --device_memory_mb=N each worker's allocator is capped at N MiB (in
its environment only; tfpipe.memory_limit): the CPU stand-in for
accelerators of N MiB, each with its own memory, and --intra_op_threads
gives each its own op threads. The controller gets N as its budget
(--plan=auto, out-of-memory errors).

Its children hide TensorFlow's C++ start-up log (tfpipe.quiet); the
launcher's --verbosity=1 is passed on to the workers and, unless the
controller's arguments set their own, to the controller, and shows it.
"""

import atexit
import os
import signal
import sys
import time

from absl import app
from absl import flags

from tfpipe import cluster_spec
from tfpipe import command_line
from tfpipe import local_cluster
from tfpipe import multihost
from tfpipe import network_namespace
from tfpipe import out_of_memory_reports

flags.DEFINE_integer('num_workers', 2, 'Worker processes to start.')
multihost.DefineFlags(controller_flags=False)
flags.DEFINE_string('controller_module', 'tfpipe.trainer',
                    'Python module run as the controller (python -m).')
flags.DEFINE_float('startup_timeout_s', 180.0,
                   'Seconds to wait for all workers to serve.')
flags.DEFINE_float('grace_s', 45.0,
                   'Seconds the controller gets to stop after a worker '
                   'exited before the launcher kills it.')
flags.DEFINE_float('stop_grace_s', 25.0,
                   'After SIGTERM, seconds the controller gets to finish its '
                   'step and save a checkpoint before the launcher kills '
                   'the job; keep it below the scheduler\'s own grace '
                   'period (Kubernetes and SLURM give 30 s by default). 0: '
                   'stop at once, as on SIGINT.', lower_bound=0.0)
flags.DEFINE_float('timeout_s', 0.0,
                   'Kill the job after this many seconds; 0: no limit.')
flags.DEFINE_integer('device_memory_mb', None,
                     'Each worker\'s hard memory limit in MiB: its '
                     'allocator fails past it, as an accelerator of that '
                     'size does (the CPU stand-in for one; the trainer '
                     'also gets it as its budget). Default: no limit.',
                     lower_bound=1)

FLAGS = flags.FLAGS


# The first SIGINT/SIGTERM/SIGHUP received: the job is stopping.
_stop_signal = None
# When the job stops gracefully: the monotonic time SIGTERM was forwarded to
# the controller, which then saves and exits (trainer/stop_signal.py).
_graceful_since = None
# The controller's process, once started.
_controller = None


def _OnSignal(signum, unused_frame):
  """Stops the job: raises SystemExit(128 + signum) where the launcher is.

  Except SIGTERM once the controller runs (and --stop_grace_s > 0): it is
  forwarded to the controller, which finishes its step, saves a checkpoint
  and exits, while the workers, which hold the variables, keep serving;
  _Supervise then ends the job (and kills it after --stop_grace_s).

  Python runs a handler wherever the main thread is, and some places print
  and drop what it raises: a signal that lands while subprocess.Popen forks
  runs it inside an at-fork callback (logging's), and the job trained on.
  So the signal is also recorded, and every wait checks it
  (_ExitIfStopping). A later signal stops the job at once, unless a stop
  has already begun: raising again would cut short the cleanup it started.
  """
  global _stop_signal, _graceful_since
  if _stop_signal is not None:
    if _graceful_since is None:
      return
    _graceful_since = None  # A second signal: no more waiting.
    print(f'launcher: {signal.Signals(signum).name} received again; '
          'stopping every process now.', file=sys.stderr, flush=True)
    raise SystemExit(128 + _stop_signal)
  _stop_signal = signum
  if (signum == signal.SIGTERM and FLAGS.stop_grace_s > 0 and
      _controller is not None and _controller.poll() is None):
    _controller.send_signal(signum)
    _graceful_since = time.monotonic()
    print(f'launcher: {signal.Signals(signum).name} received; the '
          'controller saves a checkpoint after its step, then every process '
          f'stops (in at most --stop_grace_s={FLAGS.stop_grace_s:g}s).',
          file=sys.stderr, flush=True)
    return
  print(f'launcher: {signal.Signals(signum).name} received; stopping every '
        'process of the job.', file=sys.stderr, flush=True)
  raise SystemExit(128 + signum)


def StopOnSignals():
  """SIGINT, SIGTERM and SIGHUP stop the job (_OnSignal)."""
  for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, _OnSignal)


def _ExitIfStopping():
  """Raises SystemExit(128 + signal) once a signal asked the job to stop,
  unless the controller is still given time to save (--stop_grace_s)."""
  if _stop_signal is None:
    return
  if _graceful_since is not None and (
      time.monotonic() - _graceful_since <= FLAGS.stop_grace_s):
    return
  if _graceful_since is not None:
    print(f'launcher: the controller did not stop within --stop_grace_s='
          f'{FLAGS.stop_grace_s:g}s; killing the job.', file=sys.stderr,
          flush=True)
  raise SystemExit(128 + _stop_signal)


def VerbosityArgs(controller_args=()):
  """['--verbosity=N'] if the launcher was given it (and the child lacks it)."""
  from tfpipe import quiet  # pylint: disable=g-import-not-at-top
  if not FLAGS['verbosity'].present:
    return []
  if quiet.VerbosityFromArgv(['controller', *controller_args]) is not None:
    return []
  return [f'--verbosity={FLAGS.verbosity}']


def WorkerEnvironment():
  """The workers' environment: with --device_memory_mb, each one's own
  allocator capped at that many MiB (tfpipe.memory_limit); only theirs."""
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  if FLAGS.device_memory_mb is None:
    return None
  return memory_limit.CappedEnv(FLAGS.device_memory_mb)


def DeviceArgs(controller_args=()):
  """Flags of the devices' shape that workers and the controller share."""
  args = [f'--devices_per_worker={FLAGS.devices_per_worker}']
  given = ' '.join(controller_args)
  if FLAGS.intra_op_threads and '--intra_op_threads' not in given:
    args.append(f'--intra_op_threads={FLAGS.intra_op_threads}')
  return args


def ControllerMemoryArgs(controller_args):
  """--device_memory_mb for the trainer: the budget its plans and errors
  use, unless its own arguments set one."""
  if (FLAGS.device_memory_mb is None or
      FLAGS.controller_module != 'tfpipe.trainer' or
      any(a.startswith('--device_memory_mb') for a in controller_args)):
    return []
  return [f'--device_memory_mb={FLAGS.device_memory_mb}']


def Launch(controller_args):
  """Starts the workers, then the controller; returns the exit status."""
  global _controller
  code = None
  num_workers = FLAGS.num_workers
  if num_workers < 1:
    raise app.UsageError(f'--num_workers={num_workers}; give at least 1.')
  jobs = local_cluster.LocalClusterJobs(num_workers)
  spec_text = cluster_spec.FormatClusterSpec(jobs)
  print(f'launcher: pid={os.getpid()} cluster {spec_text}', flush=True)
  children = local_cluster.ChildProcesses('launcher')
  atexit.register(children.Close)
  StopOnSignals()
  try:
    workers = local_cluster.StartWorkers(
        children, jobs, lambda i: [
            sys.executable, '-m', 'tfpipe.multihost',
            f'--job={cluster_spec.WORKER_JOB}', f'--task={i}',
            f'--cluster_spec={spec_text}', *DeviceArgs(),
            *VerbosityArgs()],
        FLAGS.startup_timeout_s,
        hint='See its log above; --startup_timeout_s sets the wait.',
        each_step=_ExitIfStopping, env=WorkerEnvironment(),
        # A SIGTERM to every process of the job (SLURM's) must leave the
        # variables to the controller, which saves them first.
        survives_sigterm=True)
    if FLAGS.device_memory_mb:
      print(f'launcher: {num_workers} worker(s), each an emulated '
            f'accelerator of {FLAGS.device_memory_mb} MiB (its own capped '
            'allocator).', flush=True)
    controller = _controller = children.Start('controller', [
        sys.executable, '-m', FLAGS.controller_module,
        f'--job={cluster_spec.CONTROLLER_JOB}', f'--cluster_spec={spec_text}',
        *DeviceArgs(controller_args), *ControllerMemoryArgs(controller_args),
        *VerbosityArgs(controller_args)] + list(controller_args))
    code = _Supervise(controller, workers)
    return code
  finally:
    children.Close()
    _RemoveReports(jobs, code)


def _RemoveReports(jobs, code):
  """Removes the workers' out-of-memory reports and names those kept."""
  for path in out_of_memory_reports.RemoveAfterRun(jobs, code):
    print(f'launcher: a worker\'s allocator refused memory; its records '
          f'are kept in {path}.', flush=True)


def _Supervise(controller, workers):
  """Waits for the controller; bounds its life after a worker exits."""
  start = time.monotonic()
  worker_lost_at = None
  while True:
    _ExitIfStopping()
    code = controller.poll()
    if code is not None:
      print(f'launcher: controller exited with status {code}.', flush=True)
      if _stop_signal is not None:
        return 128 + _stop_signal  # It saved and stopped when asked.
      return code
    now = time.monotonic()
    if worker_lost_at is None:
      for name, address, proc in workers:
        worker_code = proc.poll()
        if worker_code is not None:
          print(f'launcher: worker {name} at {address} exited with status '
                f'{_Status(worker_code)}; the controller has '
                f'{FLAGS.grace_s:g}s to stop.', file=sys.stderr, flush=True)
          worker_lost_at = now
          break
    elif now - worker_lost_at > FLAGS.grace_s:
      print('launcher: the controller did not stop after losing a worker; '
            'killing the job.', file=sys.stderr, flush=True)
      return multihost.EXIT_WORKER_LOST
    if FLAGS.timeout_s and now - start > FLAGS.timeout_s:
      print(f'launcher: --timeout_s={FLAGS.timeout_s:g} expired; killing the '
            'job.', file=sys.stderr, flush=True)
      return 124
    time.sleep(0.2)


def _Status(code):
  """'-6 (SIGABRT)' for a process a signal ended, else the code."""
  if code >= 0:
    return str(code)
  try:
    return f'{code} ({signal.Signals(-code).name})'
  except ValueError:
    return str(code)


def main(argv):
  try:
    network_namespace.EnterLoopbackNamespace('tfpipe.launcher', sys.argv)
    return Launch(argv[1:])
  except (RuntimeError, TimeoutError, ValueError) as e:
    print(f'ERROR: {e}', file=sys.stderr, flush=True)
    return 1


def run():
  command_line.Run(main)


if __name__ == '__main__':
  run()
