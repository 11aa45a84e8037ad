"""Tests of tfpipe.multihost without starting any server or process.

Protected properties: the flags and their safe defaults (loopback bind, one
replica); which process serves (workers) and which trains (controller or no
cluster); that SetUpController validates before connecting, waits for the
workers before connecting, and places the R x K pipeline replica-major on
the workers; that the controller routes checkpoint IO through its own CPU;
and that Run stops its watchdog. The cluster calls that would touch the
network are replaced by recorders (tests/cluster_test.py and
tests/launcher_test.py cover real servers).
"""

import functools
import json

from absl import flags
import pytest
import tensorflow as tf

from tfpipe import cluster
from tfpipe import hyperparams
from tfpipe import multihost

_SPEC = 'controller=127.0.0.1:1; worker=127.0.0.1:2,127.0.0.1:3'


def _FlagValues(monkeypatch, argv=(), controller_flags=True):
  """multihost's flags defined on a fresh FlagValues, parsed from argv."""
  values = flags.FlagValues()
  for name in ('DEFINE_string', 'DEFINE_integer', 'DEFINE_float'):
    monkeypatch.setattr(flags, name, functools.partial(
        getattr(flags, name), flag_values=values))
  multihost.DefineFlags(controller_flags=controller_flags)
  values(['prog', *argv])
  return values


@pytest.fixture(name='calls')
def _Calls(monkeypatch):
  """Replaces the cluster's network calls with recorders."""
  monkeypatch.delenv('TF_CONFIG', raising=False)
  calls = []
  monkeypatch.setattr(cluster, 'WaitForTasks', lambda tasks, timeout_s: (
      calls.append(('wait', list(tasks), timeout_s))))
  monkeypatch.setattr(cluster, 'ConnectToCluster', lambda *args: (
      calls.append(('connect',) + args)))
  monkeypatch.setattr(cluster, 'Serve', lambda *args: (
      calls.append(('serve',) + args)))
  return calls


def _Params(num_partitions=2, num_replicas=1, with_replicas=True):
  pipeline = hyperparams.Params()
  pipeline.Define('num_partitions', num_partitions, '')
  pipeline.Define('devices', None, '')
  if with_replicas:
    pipeline.Define('num_replicas', num_replicas, '')
  task = hyperparams.Params()
  task.Define('pipeline', pipeline, '')
  p = hyperparams.Params()
  p.Define('task', task, '')
  return p


def testFlagDefaults(monkeypatch):
  values = _FlagValues(monkeypatch)
  assert values.job == '' and values.task is None
  assert values.cluster_spec == '' and values.bind_address == '127.0.0.1'
  assert values.devices_per_worker == 1 and values.num_replicas == 1
  assert values.watchdog_timeout_s > 0 and values.watchdog_max_failures >= 1
  worker = _FlagValues(monkeypatch, controller_flags=False)
  assert 'num_replicas' not in worker and 'watchdog_interval_s' not in worker
  assert worker.bind_address == '127.0.0.1'


def testClusterFromFlags(monkeypatch):
  none = _FlagValues(monkeypatch)
  assert multihost.ClusterFromFlags(none, environ={}) is None
  job_only = _FlagValues(monkeypatch, ['--job=worker'])
  with pytest.raises(ValueError, match='--job=worker needs --cluster_spec'):
    multihost.ClusterFromFlags(job_only, environ={})
  spec, job, task = multihost.ClusterFromFlags(
      _FlagValues(monkeypatch, ['--job=worker', '--task=1',
                                f'--cluster_spec={_SPEC}']), environ={})
  assert (job, task) == ('worker', 1)
  assert spec.as_dict()['worker'] == ['127.0.0.1:2', '127.0.0.1:3']
  tf_config = json.dumps({'cluster': {'worker': ['127.0.0.1:4']},
                          'task': {'type': 'worker', 'index': 0}})
  _, job, task = multihost.ClusterFromFlags(
      none, environ={'TF_CONFIG': tf_config})
  assert (job, task) == ('worker', 0)


def testOnlyWorkersServe(monkeypatch, calls):
  assert not multihost.MaybeServe(_FlagValues(monkeypatch))
  controller = _FlagValues(monkeypatch, ['--job=controller',
                                         f'--cluster_spec={_SPEC}'])
  assert not multihost.MaybeServe(controller)
  assert not calls
  worker = _FlagValues(monkeypatch, [
      '--job=worker', '--task=1', f'--cluster_spec={_SPEC}',
      '--devices_per_worker=2'], controller_flags=False)
  assert multihost.MaybeServe(worker)
  [(what, spec, job, task, bind, devices)] = calls
  assert (what, job, task, bind, devices) == ('serve', 'worker', 1,
                                              '127.0.0.1', 2)
  assert spec.as_dict()['controller'] == ['127.0.0.1:1']


def testSetUpControllerPlacesReplicasOnWorkers(monkeypatch, calls, capsys):
  values = _FlagValues(monkeypatch, [
      '--job=controller', f'--cluster_spec={_SPEC}', '--num_replicas=2',
      '--devices_per_worker=2'])
  p = _Params(num_partitions=2)
  controller = multihost.SetUpController(values, p)
  pipeline = p.task.pipeline
  assert pipeline.num_replicas == 2
  # Replica-major: slot r*K + k on worker (slot % W), device (slot // W).
  assert pipeline.devices == [
      '/job:worker/replica:0/task:0/device:CPU:0',
      '/job:worker/replica:0/task:1/device:CPU:0',
      '/job:worker/replica:0/task:0/device:CPU:1',
      '/job:worker/replica:0/task:1/device:CPU:1']
  workers = [('/job:worker/task:0', '127.0.0.1:2'),
             ('/job:worker/task:1', '127.0.0.1:3')]
  assert [c[0] for c in calls] == ['wait', 'connect']  # Wait, then connect.
  assert calls[0][1] == workers and 0 < calls[0][2] <= 120
  assert calls[1][2:] == ('controller', 0, '127.0.0.1')
  assert controller.workers == workers
  assert controller.io_device == '/job:controller/replica:0/task:0/device:CPU:0'
  assert controller.watchdog.tasks == workers
  assert 'device mesh: 2 replica(s) x 2 stage(s)' in capsys.readouterr().out


def testSetUpControllerValidatesBeforeConnecting(monkeypatch, calls):
  with pytest.raises(ValueError, match='--num_replicas=0'):
    multihost.SetUpController(
        _FlagValues(monkeypatch, ['--num_replicas=0']), _Params())
  with pytest.raises(ValueError, match='needs task.pipeline.num_replicas'):
    multihost.SetUpController(
        _FlagValues(monkeypatch, ['--num_replicas=2']),
        _Params(with_replicas=False))
  no_workers = _FlagValues(monkeypatch, [
      '--job=controller', '--cluster_spec=controller=127.0.0.1:1'])
  with pytest.raises(ValueError, match='no "worker" job'):
    multihost.SetUpController(no_workers, _Params())
  assert not calls
  # Without a cluster: only the replica count is set; nothing connects.
  p = _Params(with_replicas=False)
  assert multihost.SetUpController(_FlagValues(monkeypatch), p) is None
  assert p.task.pipeline.devices is None and not calls


def testControllerCheckpointIoGoesThroughItsCpu(monkeypatch, tmp_path):
  values = _FlagValues(monkeypatch)
  spec = cluster.ParseClusterSpec('localhost=127.0.0.1:1;worker=127.0.0.1:2')
  controller = multihost.Controller(values, spec, 'localhost', 0)
  # job:localhost task 0 is this process, so the io device really exists.
  assert controller.io_device == '/job:localhost/replica:0/task:0/device:CPU:0'

  class Trainer:
    pass

  trainer = Trainer()
  with tf.device('/CPU:4'):
    v = tf.Variable([1.0, 2.0])
  trainer.checkpoint = tf.train.Checkpoint(v=v)
  trainer.manager = tf.train.CheckpointManager(trainer.checkpoint,
                                               str(tmp_path), max_to_keep=1)
  seen = []
  real_save = trainer.manager.save
  trainer.manager.save = lambda **kw: seen.append(kw) or real_save(**kw)
  controller.UseControllerIo(trainer)
  path = trainer.manager.save(checkpoint_number=1)
  assert seen[0]['options'].experimental_io_device == controller.io_device
  v.assign([0.0, 0.0])
  trainer.checkpoint.restore(path).assert_consumed()
  assert v.numpy().tolist() == [1.0, 2.0]


def testRunReturnsAndStopsTheWatchdog(monkeypatch):
  values = _FlagValues(monkeypatch, ['--watchdog_interval_s=60'])
  spec = cluster.ParseClusterSpec(_SPEC)
  controller = multihost.Controller(values, spec, 'controller', 0)
  assert controller.watchdog.interval_s == 60
  assert controller.Run(lambda: 'done') == 'done'
  thread = controller.watchdog._thread  # pylint: disable=protected-access
  assert thread is not None and not thread.is_alive()
  assert controller.watchdog.lost is None
