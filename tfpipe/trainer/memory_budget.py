"""The trainer's per-device memory budget: its flags, and where it is used.

    --device_memory_mb=N   each device's memory: what --plan=auto plans for,
                           what --mode=inspect_model compares each device's
                           predicted peak with, and what an out-of-memory
                           error quotes. The launcher passes its own (each
                           worker's hard limit) to the controller.
    --plan=auto            let gpipe.planner choose K, R, the cut, M, the
                           remat policy and the schedule (auto_plan).
    --plan_headroom        the fraction of each device's memory the plan
                           leaves free for the memory model's error.
    --neighbour_bandwidth_mbps
                           the planner's transfer speed between devices.

Also here: the out-of-memory watch of this process (tfpipe.out_of_memory),
started before TensorFlow so that its warnings are logged, and the
Diagnosis a training run is wrapped in.
"""

import json
import os
import sys

from absl import flags

from tfpipe import cluster_spec
from tfpipe import device_names
from tfpipe import memory_limit
from tfpipe import multihost
from tfpipe import out_of_memory
from tfpipe import out_of_memory_reports
from tfpipe.trainer import out_of_memory as trainer_oom

MIB = 2**20


def DefineFlags():
  flags.DEFINE_integer(
      'device_memory_mb', None, 'Memory of each device in MiB: the budget '
      '--plan=auto plans for and --mode=inspect_model compares each '
      'device\'s predicted peak with (the launcher passes each worker\'s '
      'hard limit).', lower_bound=1)
  flags.DEFINE_enum('plan', 'none', ['none', 'auto'],
                    'auto: choose partitions, replicas, the cut, '
                    'micro-batches, remat policy and schedule that fit '
                    '--device_memory_mb and train fastest (gpipe.planner).')
  flags.DEFINE_float(
      'plan_headroom', 0.15, 'Fraction of each device\'s memory that '
      '--plan=auto leaves free: every predicted peak of the plan is within '
      '(1 - plan_headroom) x --device_memory_mb. The memory model\'s '
      'predictions have come out several percent below measured peaks; 0 '
      'plans to the last byte.', lower_bound=0.0, upper_bound=0.9)
  flags.DEFINE_integer(
      'memory_profile_runs', 3, 'Fresh processes that profile each remat '
      'mode and micro-batch size of each distinct cell on the CPU, for '
      '--plan=auto, --mode=inspect_model and an out-of-memory diagnosis; '
      'each measured quantity is their median. 1 is about three times '
      'faster and less steady: one process\'s allocator can pack a step '
      '15% above or below another\'s.', lower_bound=1)
  flags.DEFINE_float('neighbour_bandwidth_mbps', None,
                     'Bandwidth between neighbouring devices in MB/s, for '
                     'the planner\'s transfer times (default: free).',
                     lower_bound=0.001)


class _NoWatch:

  def Stop(self):
    pass

  def Records(self):
    return []


def WatchThisProcess(flag_values, show_startup_log):
  """Starts this process's out-of-memory watch; call before TensorFlow.

  A worker watches itself while it serves (multihost) and a controller asks
  its workers, so only a single-process run watches here.
  """
  role = _Role(flag_values)
  if role == cluster_spec.CONTROLLER_JOB:
    return _NoWatch()
  if role:
    report = out_of_memory_reports.StartWorkerReport(
        flag_values.job, flag_values.task, flag_values.cluster_spec,
        show_startup_log)
    return report or _NoWatch()
  hide = out_of_memory.KeepWarnings(show_startup_log)
  return out_of_memory_reports.ProcessWatch(
      hide_warnings=hide, on_crash=_SayCrashed).Start()


def _SayCrashed(record):
  """Run by the watch's reader process once this one has crashed."""
  print(f'ERROR: {trainer_oom.CrashedMessage(record)}', file=sys.stderr,
        flush=True)


def _Role(flag_values):
  """This process's job in a cluster ('' for none), without TensorFlow."""
  if flag_values.job:
    return flag_values.job
  try:
    config = json.loads(os.environ.get('TF_CONFIG') or '{}')
  except ValueError:
    return ''
  return (config.get('task') or {}).get('type', '') if config.get(
      'cluster') else ''


_LOCAL_HOSTS = ('127.0.0.1', 'localhost', '::1', '[::1]')


def _Devices(flag_values):
  """(number of devices, whether they compute at the same time, how many
  can at once: None for all) for a plan."""
  from tfpipe import devices as devices_lib  # pylint: disable=g-import-not-at-top
  resolved = multihost.ClusterFromFlags(flag_values)
  if resolved is not None:
    workers = cluster_spec.JobTasks(resolved[0], cluster_spec.WORKER_JOB)
    # Worker processes compute at the same time under either executor: one
    # graph over them is partitioned per worker, and the parts overlap;
    # but workers on this host (the launcher's) share its cores.
    at_once = None
    if all(address.rsplit(':', 1)[0] in _LOCAL_HOSTS
           for _, address in workers):
      from tfpipe.gpipe import plan_devices  # pylint: disable=g-import-not-at-top
      at_once = plan_devices.HostComputingAtOnce(_IntraOpThreads(flag_values))
    return len(workers) * flag_values.devices_per_worker, True, at_once
  device_type = devices_lib.ChooseDeviceType(flag_values.run_locally)
  if flag_values.num_devices:
    return flag_values.num_devices, device_type == 'GPU', None
  if device_type == 'GPU':
    return len(devices_lib.VisibleGpus()), True, None
  raise ValueError('--plan=auto needs the number of devices: pass '
                   '--num_devices (or run under tfpipe.launcher, whose '
                   'workers are the devices).')


def _IntraOpThreads(flag_values):
  """Each device's intra-op threads (--intra_op_threads; 0: TF's default),
  which the memory profiles run with: an action's working set follows how
  many ops run at once."""
  return getattr(flag_values, 'intra_op_threads', 0) or 0


def _SingleThreadedCalls(devices):
  """Whether the cells' devices are worker processes' CPUs, whose actions
  are calls on the single-threaded executor (gpipe/cell_runtime.py), as the
  memory profiles then run them: an action's working set follows how many
  of its ops run at once."""
  from tfpipe.gpipe import cell_runtime  # pylint: disable=g-import-not-at-top
  return any(cell_runtime.OnWorkerCpu(d) for d in devices or [])


def _ProfileDevice(devices):
  """The device to profile the cells on: the first of the pipeline's if it
  is a GPU of this process (a GPU's kernels and libraries take memory a CPU
  profile cannot see), else None (a CPU, in a process that counts bytes)."""
  if (devices and device_names.AllocatorName(devices[0]).startswith('GPU')
      and not device_names.OnOtherProcess(devices[0])):
    return devices[0]
  return None


def _PlanProfileDevice(flag_values):
  """'/GPU:0' when --plan=auto plans for this machine's GPUs: the layers
  are profiled there (in a subprocess: this process's devices are not set
  up yet). None for CPUs and for a cluster's workers."""
  from tfpipe import devices as devices_lib  # pylint: disable=g-import-not-at-top
  if multihost.ClusterFromFlags(flag_values) is not None:
    return None
  if devices_lib.ChooseDeviceType(flag_values.run_locally) == 'GPU':
    return '/GPU:0'
  return None


def PlanIfAsked(p, flag_values, log=print):
  """Applies --plan=auto to the params (before any device is set up).

  Raises:
    ValueError: no budget, or no device count.
    gpipe.planner.NoPlanError: nothing fits.
  """
  if flag_values.plan != 'auto':
    return None
  from tfpipe.gpipe import plan_devices  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import auto_plan  # pylint: disable=g-import-not-at-top
  if not flag_values.device_memory_mb:
    raise ValueError('--plan=auto plans for a per-device memory: pass '
                     '--device_memory_mb.')
  count, concurrent, at_once = _Devices(flag_values)
  bandwidth = flag_values.neighbour_bandwidth_mbps
  devices = plan_devices.Devices(
      count=count, memory_bytes=flag_values.device_memory_mb * MIB,
      bandwidth_bytes_per_s=bandwidth * 1e6 if bandwidth else None,
      concurrent=concurrent, computing_at_once=at_once,
      headroom=flag_values.plan_headroom)
  on_workers = multihost.ClusterFromFlags(flag_values) is not None
  if on_workers:
    # A controller drives the workers: each step pays remote calls.
    devices = plan_devices.RemoteWorkers(devices, same_host=at_once is not None)
  # A cluster's pipeline runs on its workers' CPUs
  # (multihost.SetUpController).
  return auto_plan.Choose(p, devices, log=log,
                          intra_op_threads=_IntraOpThreads(flag_values),
                          profile_device=_PlanProfileDevice(flag_values),
                          single_threaded_calls=on_workers,
                          profile_runs=flag_values.memory_profile_runs)


def _Modes(p):
  """The remat modes that p's peaks are walked in."""
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  return memory_report.RematModes(p.task.pipeline.remat_policy,
                                  p.task.pipeline.num_micro_batches)


def InspectLines(p, flag_values, devices):
  """inspect_model's memory section, when a budget is known (profiling the
  cells takes seconds, so it is not printed otherwise)."""
  budget = flag_values.device_memory_mb or memory_limit.LimitMb()
  if not budget:
    return []
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  example = memory_report.ExampleBatch(p)
  profiles = memory_report.Profile(memory_report.ProfileRequest(
      p, example=example, intra_op_threads=_IntraOpThreads(flag_values),
      single_threaded_calls=_SingleThreadedCalls(devices),
      device=_ProfileDevice(devices),
      profile_runs=flag_values.memory_profile_runs, modes=_Modes(p)))
  peaks = memory_report.PredictPeaks(p, profiles, example)
  return memory_report.BudgetLines(p, peaks, budget, devices,
                                   headroom=flag_values.plan_headroom)


def Diagnosis(p, flag_values, devices, controller, watch, split, last_good):
  """The trainer_oom.Diagnosis of a training run."""
  shared = False
  limit = flag_values.device_memory_mb
  if controller is None and memory_limit.LimitMb():
    limit, shared = memory_limit.LimitMb(), True
  elif split is not None and split.memory_limit_mb and not limit:
    limit = split.memory_limit_mb

  profile_runs = flag_values.memory_profile_runs

  def Predict():
    from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
    example = memory_report.ExampleBatch(p)
    profiles = memory_report.Profile(memory_report.ProfileRequest(
        p, example=example, intra_op_threads=_IntraOpThreads(flag_values),
        single_threaded_calls=_SingleThreadedCalls(devices),
        profile_runs=profile_runs, modes=_Modes(p)))
    return memory_report.PredictPeaks(p, profiles, example)
  return trainer_oom.Diagnosis(
      p, devices, limit_mb=limit, shared_limit=shared,
      workers=controller.workers if controller else None,
      watch=(watch if isinstance(watch, out_of_memory_reports.RecordFile)
             else None),
      predict=Predict, last_good=last_good,
      plan_headroom=(flag_values.plan_headroom
                     if flag_values.plan == 'auto' else None))
