"""Tests of tfpipe.trainer.memory_budget: the trainer's memory flags.

Protected properties: the role is read without TensorFlow (a controller
watches nothing, a worker and a single process lower the log level to see
TensorFlow's out-of-memory warnings); --plan=auto asks for a budget and a
device count, naming the flags; inspect_model profiles the cells on the
pipeline's first device when it is a GPU of this process (its kernels'
memory is not a CPU's), and on a CPU otherwise, and --plan=auto profiles
on '/GPU:0' when it plans for this machine's GPUs (never a cluster's, whose
workers' CPUs it profiles as such: one op at a time, no build slack); the
limit quoted by an out-of-memory error is the capped process's own, shared
by its logical devices; a single process that crashes right after its
allocator refused memory (as some TensorFlow kernels crash) still says, in
one line, that it ran out of memory, and leaves no file behind.
"""

import os
import signal
import subprocess
import sys

from absl import flags
from absl.testing import flagsaver
import pytest

from tests import quiet_test
from tfpipe import memory_limit
from tfpipe import model_registry
from tfpipe import out_of_memory
from tfpipe import out_of_memory_reports
from tfpipe.trainer import memory_budget
from tfpipe.trainer import trainer  # pylint: disable=unused-import

FLAGS = flags.FLAGS


@pytest.fixture(autouse=True)
def parsed_flags(monkeypatch):
  if not FLAGS.is_parsed():
    FLAGS(['trainer'])
  monkeypatch.delenv('TF_CONFIG', raising=False)
  monkeypatch.delenv(out_of_memory.LOG_LEVEL_ENV, raising=False)
  yield


def test_cells_are_profiled_on_a_local_gpu_and_never_on_a_remote_one():
  # pylint: disable=protected-access
  local = '/job:localhost/replica:0/task:0/device:GPU:0'
  assert memory_budget._ProfileDevice([local, local[:-1] + '1']) == local
  assert memory_budget._ProfileDevice(['/device:GPU:2']) == '/device:GPU:2'
  assert memory_budget._ProfileDevice(
      ['/job:worker/replica:0/task:1/device:GPU:0']) is None
  assert memory_budget._ProfileDevice(['/device:CPU:0']) is None
  assert memory_budget._ProfileDevice([]) is None


@flagsaver.flagsaver(job='controller')
def test_a_controller_watches_nothing():
  watch = memory_budget.WatchThisProcess(FLAGS, False)
  assert watch.Records() == []
  assert out_of_memory.LOG_LEVEL_ENV not in os.environ


@flagsaver.flagsaver(job='worker', task=1,
                     cluster_spec='controller=127.0.0.1:1;worker=127.0.0.1:2,'
                     '127.0.0.1:3')
def test_a_worker_keeps_tensorflow_warnings_and_reports(tmp_path,
                                                        monkeypatch):
  paths = []
  monkeypatch.setattr(out_of_memory_reports, 'ReportPath', lambda *args: (
      paths.append(args) or str(tmp_path / 'report.jsonl')))
  watch = memory_budget.WatchThisProcess(FLAGS, False)
  try:
    assert os.environ[out_of_memory.LOG_LEVEL_ENV] == '1'
    assert paths == [('worker', 1, '127.0.0.1:3')]
    assert (tmp_path / 'report.jsonl').exists()
  finally:
    watch.Stop()
  # It recorded nothing, so nothing is left once its log has ended.
  assert not (tmp_path / 'report.jsonl').exists()


def test_plan_needs_a_budget_and_a_device_count():
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  with flagsaver.flagsaver(plan='auto'):
    with pytest.raises(ValueError, match='pass --device_memory_mb'):
      memory_budget.PlanIfAsked(p, FLAGS)
  with flagsaver.flagsaver(plan='auto', device_memory_mb=64, num_devices=0,
                           run_locally='cpu'):
    with pytest.raises(ValueError, match='pass --num_devices'):
      memory_budget.PlanIfAsked(p, FLAGS)
  with flagsaver.flagsaver(plan='none'):
    assert memory_budget.PlanIfAsked(p, FLAGS) is None


def test_a_capped_process_quotes_its_own_shared_limit(monkeypatch):
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  monkeypatch.setenv(memory_limit.BFC_ENV, 'true')
  monkeypatch.setenv(memory_limit.LIMIT_ENV, '12')
  diagnosis = memory_budget.Diagnosis(p, FLAGS, ['/CPU:0', '/CPU:1'], None,
                                      None, None, last_good=None)
  assert (diagnosis.limit_mb, diagnosis.shared_limit) == (12, True)
  assert diagnosis.plan_headroom is None  # Not a planned run.
  with flagsaver.flagsaver(plan='auto', plan_headroom=0.2):
    planned = memory_budget.Diagnosis(p, FLAGS, ['/CPU:0'], None, None, None,
                                      last_good=None)
  assert planned.plan_headroom == 0.2


@pytest.mark.parametrize('hosts, at_once', [
    (('127.0.0.1', 'localhost'), 2), (('127.0.0.1', 'h1.example'), None)])
def test_plan_lets_workers_on_this_host_take_turns_on_its_cores(
    monkeypatch, hosts, at_once):
  from tfpipe.gpipe import plan_devices  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import auto_plan  # pylint: disable=g-import-not-at-top
  chosen = []
  monkeypatch.setattr(auto_plan, 'Choose',
                      lambda p, devices, **unused: chosen.append(devices))
  monkeypatch.setattr(plan_devices.os, 'sched_getaffinity', lambda pid: {0, 1, 2, 3},
                      raising=False)
  spec = f'controller=127.0.0.1:1;worker={hosts[0]}:2,{hosts[1]}:3'
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  with flagsaver.flagsaver(plan='auto', device_memory_mb=64, job='controller',
                           cluster_spec=spec, intra_op_threads=2):
    memory_budget.PlanIfAsked(p, FLAGS)
  assert chosen[0].count == 2 and chosen[0].computing_at_once == at_once
  # Workers on this host send to each other at loopback speed.
  assert bool(chosen[0].bandwidth_bytes_per_s) == (at_once is not None)


def test_plan_leaves_the_headroom_asked_for(monkeypatch):
  from tfpipe.trainer import auto_plan  # pylint: disable=g-import-not-at-top
  chosen = []
  monkeypatch.setattr(auto_plan, 'Choose',
                      lambda p, devices, **unused: chosen.append(devices))
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  with flagsaver.flagsaver(plan='auto', device_memory_mb=64, num_devices=2):
    memory_budget.PlanIfAsked(p, FLAGS)
  with flagsaver.flagsaver(plan='auto', device_memory_mb=64, num_devices=2,
                           plan_headroom=0.25):
    memory_budget.PlanIfAsked(p, FLAGS)
  assert [d.plannable_bytes / 2**20 for d in chosen] == [
      pytest.approx(54.4), 48]
  with flagsaver.flagsaver():
    with pytest.raises(flags.IllegalFlagValueError, match='plan_headroom'):
      FLAGS.plan_headroom = 0.95


@pytest.mark.parametrize('device_type, cluster, expected', [
    ('GPU', False, '/GPU:0'), ('CPU', False, None), ('GPU', True, None)])
def test_plan_profiles_on_this_machines_gpu_only(monkeypatch, device_type,
                                                  cluster, expected):
  from tfpipe import devices as devices_lib  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import auto_plan  # pylint: disable=g-import-not-at-top
  chosen = []
  monkeypatch.setattr(auto_plan, 'Choose', lambda p, devices, **kwargs: (
      chosen.append((kwargs['profile_device'],
                     kwargs['single_threaded_calls']))))
  monkeypatch.setattr(devices_lib, 'ChooseDeviceType',
                      lambda *unused, **unused_kw: device_type)
  spec = 'controller=127.0.0.1:1;worker=127.0.0.1:2' if cluster else None
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  with flagsaver.flagsaver(plan='auto', device_memory_mb=64, num_devices=2,
                           job='controller' if cluster else None,
                           cluster_spec=spec):
    memory_budget.PlanIfAsked(p, FLAGS)
  # A cluster's cells run on its workers' CPUs, one op at a time per action.
  assert chosen == [(expected, cluster)]


def test_memory_profile_runs_reaches_every_profile_the_trainer_makes(
    monkeypatch):
  """--memory_profile_runs sets the processes per cell and mode of the
  plan's cells, inspect_model's and the out-of-memory prediction's."""
  from tfpipe.trainer import auto_plan  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  runs = []
  monkeypatch.setattr(auto_plan, 'Choose', lambda p, devices, **kwargs: (
      runs.append(('plan', kwargs['profile_runs']))))

  def Recorded(request, **unused):
    runs.append(('profile', request.profile_runs))
    raise RuntimeError('recorded')
  monkeypatch.setattr(memory_report, 'Profile', Recorded)
  p = model_registry.GetParams('mlp.TinyMlp', 'Train')
  with flagsaver.flagsaver(plan='auto', device_memory_mb=64, num_devices=2,
                           memory_profile_runs=1):
    memory_budget.PlanIfAsked(p, FLAGS)
    with pytest.raises(RuntimeError, match='recorded'):
      memory_budget.InspectLines(p, FLAGS, ['/CPU:0'])
    diagnosis = memory_budget.Diagnosis(p, FLAGS, ['/CPU:0'], None, None,
                                        None, last_good=None)
  with pytest.raises(RuntimeError, match='recorded'):
    diagnosis._predict()  # pylint: disable=protected-access
  with flagsaver.flagsaver(plan='auto', device_memory_mb=64, num_devices=2):
    memory_budget.PlanIfAsked(p, FLAGS)
  assert runs == [('plan', 1), ('profile', 1), ('profile', 1), ('plan', 3)]
  with flagsaver.flagsaver():
    with pytest.raises(flags.IllegalFlagValueError,
                       match='memory_profile_runs'):
      FLAGS.memory_profile_runs = 0


# The trainer's start (main, before TensorFlow), then what a capped process
# logs right before a kernel uses the tensor it was refused and crashes.
_CRASHING_TRAINER = r'''
import os
from absl import flags
from tfpipe.trainer import memory_budget
from tfpipe.trainer import trainer
flags.FLAGS(['tfpipe-train'])
watch = memory_budget.WatchThisProcess(flags.FLAGS, False)
print(watch.path, flush=True)
os.write(2, b'W0000 00:00:1795643264.907878    4852 bfc_allocator.cc:502] '
         b'Allocator (bfc_cpu_allocator_for_gpu) ran out of memory trying to '
         b'allocate 4.00MiB (rounded to 4194304)requested by op '
         b'cell1_1/fc_1/MatMul\n')
os.abort()
'''


def test_a_single_process_that_crashes_after_a_refusal_says_out_of_memory():
  env = {k: v for k, v in os.environ.items()
         if k not in (out_of_memory.LOG_LEVEL_ENV, 'TF_CONFIG')}
  env.update(memory_limit.CappedEnv(3))
  # run() waits for the process's stderr to close: for its reader too.
  proc = subprocess.run([sys.executable, '-c', _CRASHING_TRAINER],
                        cwd=quiet_test.ROOT, capture_output=True, text=True,
                        timeout=60, check=False, env=env)
  assert proc.returncode == -signal.SIGABRT, proc.stderr
  assert proc.stderr.splitlines() == [
      'ERROR: Out of memory in this process: it could not allocate 4.00MiB, '
      'for op cell1_1/fc_1/MatMul, and then crashed, as some TensorFlow '
      'kernels do when an allocation is refused, instead of failing the '
      'step. The process\'s limit is 3 MiB (TF_CPU_BFC_MEM_LIMIT_IN_MB). To '
      'fit, try more partitions (--num_partitions), --remat_policy=always, '
      'more micro-batches (--num_micro_batches), --balance=memory, or '
      '--plan=auto with --device_memory_mb. A checkpoint is written only '
      'after a step succeeds, so those in the logdir are intact.']
  assert not os.path.exists(proc.stdout.strip())


def test_a_single_process_that_ends_cleanly_says_nothing_more(tmp_path):
  # The reader keeps the refusal as soon as it reads it, not yet as a crash;
  # wait for it, since it reads on a process of its own.
  code = _CRASHING_TRAINER.replace('os.abort()', '''
import time
deadline = time.monotonic() + 30
while not watch.Records() and time.monotonic() < deadline:
  time.sleep(0.05)
print(','.join(str(r.crashed) for r in watch.Records()), flush=True)
watch.Stop()
''')
  env = {k: v for k, v in os.environ.items()
         if k not in (out_of_memory.LOG_LEVEL_ENV, 'TF_CONFIG')}
  proc = subprocess.run([sys.executable, '-c', code], cwd=quiet_test.ROOT,
                        capture_output=True, text=True, timeout=60,
                        check=False, env=env)
  assert proc.returncode == 0, proc.stderr
  path, crashed = proc.stdout.split()
  assert crashed == 'False'  # One refusal, and no crash after it.
  assert 'ERROR' not in proc.stderr
  assert not os.path.exists(path)
