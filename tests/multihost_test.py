"""Tests of tfpipe.multihost without starting any TensorFlow server or process.

Protected properties: the flags and their safe defaults (loopback bind, one
replica); which process serves (workers) and which trains (controller or no
cluster); that SetUpController validates before connecting, waits for the
workers before connecting, and places the R x K pipeline replica-major on
the workers; that R replicas compute the gradients of one pipeline over the
same batch; that the controller routes checkpoint IO through its own CPU;
that Run stops its watchdog; and that the watchdog reports a lost worker
(against sockets that accept but never answer, which is what a stopped
worker looks like) within its bound, from the moment the controller
connects. The server calls that would touch the
network are replaced by recorders (tests/launcher_test.py covers real
servers). Everything binds to 127.0.0.1 only.
"""

import functools
import json
import threading
import time

from absl import flags
import numpy as np
import pytest
import tensorflow as tf

from tests import servers_test
from tfpipe import cluster_spec
from tfpipe import hyperparams
from tfpipe import model_registry
from tfpipe import multihost
from tfpipe import servers

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
  """Replaces the servers' network calls with recorders."""
  monkeypatch.delenv('TF_CONFIG', raising=False)
  calls = []
  monkeypatch.setattr(servers, 'WaitForTasks', lambda tasks, timeout_s: (
      calls.append(('wait', list(tasks), timeout_s))))
  monkeypatch.setattr(servers, 'ConnectToCluster', lambda *args: (
      calls.append(('connect',) + args)))
  monkeypatch.setattr(servers, 'Serve', lambda *args, why='': (
      calls.append(('serve',) + args)))
  monkeypatch.setattr(multihost.Watchdog, 'Start', lambda self: (
      calls.append(('watchdog', self.tasks))))
  return calls


def _Params(num_partitions=2, num_replicas=1):
  pipeline = hyperparams.Params()
  pipeline.Define('num_partitions', num_partitions, '')
  pipeline.Define('devices', None, '')
  pipeline.Define('num_replicas', num_replicas, '')
  task = hyperparams.Params()
  task.Define('pipeline', pipeline, '')
  p = hyperparams.Params()
  p.Define('task', task, '')
  return p


def test_flag_defaults(monkeypatch):
  values = _FlagValues(monkeypatch)
  assert values.job == '' and values.task is None
  assert values.cluster_spec == '' and values.bind_address == '127.0.0.1'
  assert values.devices_per_worker == 1
  assert values.watchdog_timeout_s > 0 and values.watchdog_max_failures >= 1
  # --num_replicas is the trainer's (task.pipeline.num_replicas), not the
  # cluster's: it means the same with or without one.
  assert 'num_replicas' not in values
  worker = _FlagValues(monkeypatch, controller_flags=False)
  assert 'watchdog_interval_s' not in worker
  assert worker.bind_address == '127.0.0.1'


def test_cluster_from_flags(monkeypatch):
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


def test_only_workers_serve(monkeypatch, calls):
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


_STALE_TF_CONFIG = json.dumps(
    {'cluster': {'worker': ['host1:2222', 'host2:2222']},
     'task': {'type': 'worker', 'index': 0}})


def test_a_stale_tf_config_is_named_as_the_source(monkeypatch):
  # A TF_CONFIG left by another job made a one-process trainer a worker,
  # and its error never said why.
  monkeypatch.setenv('TF_CONFIG', _STALE_TF_CONFIG)
  with pytest.raises(ValueError) as e:
    multihost.MaybeServe(_FlagValues(monkeypatch))
  message = str(e.value)
  assert message.startswith('/job:worker/task:0 is at host1:2222, not a '
                            'loopback address')
  assert message.endswith(
      "The cluster and this process's role come from TF_CONFIG in the "
      f'environment ({_STALE_TF_CONFIG}): unset TF_CONFIG to train in one '
      'process, or correct it.')
  controller = json.dumps({'cluster': {'controller': ['127.0.0.1:1'],
                                       'worker': ['127.0.0.1:2']},
                           'task': {'type': 'controller'}})
  monkeypatch.setenv('TF_CONFIG', controller)

  def NoWorker(tasks, timeout_s):
    raise TimeoutError(f'1 task(s) did not start serving within {timeout_s}s.')
  monkeypatch.setattr(servers, 'WaitForTasks', NoWorker)
  with pytest.raises(TimeoutError, match=r'within 60.0s. The cluster and this '
                     r"process's role come from TF_CONFIG"):
    multihost.SetUpController(_FlagValues(monkeypatch), _Params())
  # A cluster given by the flags is not TF_CONFIG's, even with one set.
  flagged = _FlagValues(monkeypatch, ['--job=controller',
                                      f'--cluster_spec={_SPEC}'])
  assert multihost.TfConfigNote(flagged) == ''
  with pytest.raises(TimeoutError) as e:
    multihost.SetUpController(flagged, _Params())
  assert 'TF_CONFIG' not in str(e.value)


def test_set_up_controller_places_replicas_on_workers(monkeypatch, calls, capsys):
  values = _FlagValues(monkeypatch, [
      '--job=controller', f'--cluster_spec={_SPEC}',
      '--devices_per_worker=2'])
  p = _Params(num_partitions=2, num_replicas=2)
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
  # Wait, watch, then connect: the watchdog covers the connection onward.
  assert [c[0] for c in calls] == ['wait', 'watchdog', 'connect']
  assert calls[0][1] == workers and 0 < calls[0][2] <= 120
  assert calls[1][1] == workers
  assert calls[2][2:] == ('controller', 0, '127.0.0.1')
  assert controller.workers == workers
  assert controller.io_device == '/job:controller/replica:0/task:0/device:CPU:0'
  assert controller.watchdog.tasks == workers
  assert 'device mesh: 2 replica(s) x 2 cell(s)' in capsys.readouterr().out


def test_set_up_controller_validates_before_connecting(monkeypatch, calls):
  no_workers = _FlagValues(monkeypatch, [
      '--job=controller', '--cluster_spec=controller=127.0.0.1:1'])
  with pytest.raises(ValueError, match='no "worker" job'):
    multihost.SetUpController(no_workers, _Params())
  assert not calls
  # Without a cluster nothing connects and nothing is placed.
  p = _Params()
  assert multihost.SetUpController(_FlagValues(monkeypatch), p) is None
  assert p.task.pipeline.devices is None and not calls


def test_controller_checkpoint_io_goes_through_its_cpu(monkeypatch, tmp_path):
  values = _FlagValues(monkeypatch)
  spec = cluster_spec.ParseClusterSpec(
      'localhost=127.0.0.1:1;worker=127.0.0.1:2')
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


def test_run_returns_and_stops_the_watchdog(monkeypatch):
  values = _FlagValues(monkeypatch, ['--watchdog_interval_s=60'])
  spec = cluster_spec.ParseClusterSpec(_SPEC)
  controller = multihost.Controller(values, spec, 'controller', 0)
  assert controller.watchdog.interval_s == 60
  assert controller.Run(lambda: 'done') == 'done'
  thread = controller.watchdog._thread  # pylint: disable=protected-access
  assert thread is not None and not thread.is_alive()
  assert controller.watchdog.lost is None


@pytest.mark.parametrize('stopped', [True, False])
def test_watchdog_reports_the_lost_worker_within_its_bound(stopped):
  server = servers_test.SilentServer() if stopped else None
  address = server.address if stopped else servers_test.ClosedPortAddress()
  lost = []
  done = threading.Event()
  watchdog = multihost.Watchdog(
      [('/job:worker/task:1', address)], interval_s=0.2, timeout_s=0.3,
      max_failures=2, on_lost=lambda m: (lost.append(m), done.set()))
  start = time.monotonic()
  watchdog.Start()
  try:
    assert done.wait(watchdog.bound_s + 2)
  finally:
    watchdog.Stop()
    if server:
      server.close()
  assert time.monotonic() - start <= watchdog.bound_s + 1
  assert lost[0].startswith(
      f'Worker /job:worker/task:1 at {address} is unreachable')


@pytest.mark.parametrize('frozen_at', ['connecting', 'before the first step'])
def test_a_worker_frozen_after_the_controller_connects_ends_the_run(
    monkeypatch, frozen_at):
  # A worker stopped while the controller connected, built its remote
  # variables or restored a checkpoint hung the launcher for minutes: the
  # watchdog started only with the first step.
  monkeypatch.delenv('TF_CONFIG', raising=False)
  worker = servers_test.SettingsServer()  # Answers as a live server does.
  lost = []
  ended = threading.Event()
  monkeypatch.setattr(multihost, 'AbortWorkerLost',
                      lambda message: (lost.append(message), ended.set()))
  values = _FlagValues(monkeypatch, [
      '--job=controller', '--cluster_spec=controller=127.0.0.1:1;'
      f'worker={worker.address}', '--watchdog_interval_s=0.2',
      '--watchdog_timeout_s=0.3', '--watchdog_max_failures=2'])
  bound_s = 2 * (0.2 + 0.3)

  def Hang():  # What TensorFlow's call to a stopped worker does.
    worker.Freeze()
    frozen[0] = time.monotonic()
    assert ended.wait(bound_s + 5), 'the watchdog did not end the run'
  frozen = [None]
  monkeypatch.setattr(servers, 'ConnectToCluster', lambda *args: (
      Hang() if frozen_at == 'connecting' else None))
  try:
    controller = multihost.SetUpController(values, _Params(num_partitions=1))
    if frozen_at != 'connecting':
      Hang()  # Building the trainer, or restoring its checkpoint.
    controller.watchdog.Stop()
  finally:
    worker.close()
  assert time.monotonic() - frozen[0] <= bound_s + 1
  assert lost[0].startswith(f'Worker /job:worker/task:0 at {worker.address} '
                            'is unreachable (no answer within 0.3s)')


@pytest.mark.parametrize('found_by', ['watchdog', 'error'])
@pytest.mark.parametrize('explained', [True, False])
def test_a_lost_worker_ends_the_run_as_its_explanation_says(
    monkeypatch, found_by, explained):
  # A capped worker that crashed after running out of memory is lost to
  # the controller; the trainer's explanation (its report on this host)
  # turns "unreachable" into "out of memory", whether the watchdog found
  # the loss or a step's connection error did.
  ended = []
  done = threading.Event()
  monkeypatch.setattr(multihost, 'AbortWorkerLost', lambda message, status=(
      multihost.EXIT_WORKER_LOST): (ended.append((message, status)),
                                    done.set()))
  interval = '0.2' if found_by == 'watchdog' else '60'
  values = _FlagValues(monkeypatch, [
      f'--watchdog_interval_s={interval}', '--watchdog_timeout_s=0.3',
      '--watchdog_max_failures=2'])
  address = servers_test.ClosedPortAddress()
  controller = multihost.Controller(
      values, cluster_spec.ParseClusterSpec(
          f'controller=127.0.0.1:1; worker={address}'), 'controller', 0)
  asked = []
  controller.explain_lost = lambda name, at: (
      asked.append((name, at)) or (('Out of memory on worker 0.', 4)
                                   if explained else None))
  if found_by == 'watchdog':
    controller.watchdog.Start()
    try:
      assert done.wait(controller.watchdog.bound_s + 5)
    finally:
      controller.watchdog.Stop()
  else:
    def Step():
      raise tf.errors.UnavailableError(None, None, 'Socket closed')
    with pytest.raises(tf.errors.UnavailableError):  # AbortWorkerLost is
      controller.Run(Step)                            # patched to return.
  assert asked == [('/job:worker/task:0', address)]
  message, status = ended[0]
  if explained:
    assert (message, status) == ('Out of memory on worker 0.', 4)
  else:
    assert message.startswith(f'Worker /job:worker/task:0 at {address} is '
                              'unreachable')
    assert status == multihost.EXIT_WORKER_LOST


def test_watchdog_leaves_an_answering_worker_alone():
  server = servers_test.SettingsServer()
  lost = []
  watchdog = multihost.Watchdog(
      [('/job:worker/task:0', server.address)], interval_s=0.05,
      timeout_s=1.0, max_failures=1, on_lost=lost.append)
  try:
    failures = {}
    for _ in range(3):
      assert watchdog.CheckOnce(failures) is None
    assert failures == {'/job:worker/task:0': 0}
  finally:
    server.close()
  assert not lost


TINY_LM = ('task.model.num_layers: 1; task.model.model_dim: 16; '
           'task.model.hidden_dim: 32; task.model.num_heads: 2; '
           'input.batch_size: 8; eval_input.batch_size: 8; '
           'task.eval.num_batches: 1; task.pipeline.num_partitions: 2; '
           'task.pipeline.num_micro_batches: 2')


def TinyTaskParams(num_replicas, devices):
  """The tiny LM's params with R replicas on `devices` (shared with tests)."""
  p = model_registry.GetParams('lm.TinyTransformerLm', 'Train')
  p.FromText(TINY_LM)
  p.task.pipeline.Set(num_replicas=num_replicas, devices=devices)
  return p


def test_replicas_give_the_gradients_of_one_pipeline_over_the_same_batch():
  """R=2 x K=2 on four logical CPUs == R=1 x K=2 over the same global batch."""
  p1 = TinyTaskParams(1, ['/CPU:0', '/CPU:1'])
  p2 = TinyTaskParams(2, ['/CPU:0', '/CPU:1', '/CPU:2', '/CPU:3'])
  batch = next(iter(p1.input.Instantiate().GetDataset(0)))
  results = []
  for p in (p1, p2):
    task = p.task.Instantiate()
    assert task.pipe.num_replicas == p.task.pipeline.num_replicas
    out = task.pipe.ComputeLossAndGradients(*batch, task.model.Loss,
                                            step=tf.constant(0, tf.int64))
    results.append((out.loss.numpy(), [g.numpy() for g in out.gradients]))
  np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
  assert len(results[0][1]) == len(results[1][1])
  for g1, g2 in zip(results[0][1], results[1][1]):
    np.testing.assert_allclose(g2, g1, rtol=1e-5, atol=1e-7)


def test_num_replicas_is_a_pipeline_setting_with_or_without_a_cluster():
  """--num_replicas overrides task.pipeline.num_replicas like --num_partitions.

  It is the trainer's flag: without a cluster the R replicas go to local
  devices; with one, SetUpController places them on the workers.
  """
  from tfpipe.trainer import trainer  # pylint: disable=g-import-not-at-top
  flags.FLAGS.unparse_flags()
  flags.FLAGS(['trainer', '--model=lm.TinyTransformerLm', '--num_replicas=2',
               '--num_partitions=2'])
  try:
    p = trainer.BuildParams()
    assert p.task.pipeline.num_replicas == 2
    assert trainer.NumDevicesNeeded(p)[0] == 4
  finally:
    flags.FLAGS.unparse_flags()
