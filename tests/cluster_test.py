"""Tests of tfpipe.cluster and tfpipe.multihost that need no other process.

Cluster specs, device layouts, the loopback guard, the gRPC liveness probe
and the watchdog (against sockets that accept but never answer, which is
what a stopped worker looks like), and the R x K replica equivalence on
logical CPU devices. Everything binds to 127.0.0.1 only.
"""

import socket
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import cluster
from tfpipe import model_registry
from tfpipe import multihost


def testParseCompactAndJson():
  jobs = cluster.ParseClusterJobs(
      'controller=127.0.0.1:1000; worker=127.0.0.1:1001,127.0.0.1:1002')
  assert jobs == {'controller': ['127.0.0.1:1000'],
                  'worker': ['127.0.0.1:1001', '127.0.0.1:1002']}
  assert cluster.ParseClusterJobs(cluster.FormatClusterSpec(jobs)) == jobs
  spec = cluster.ParseClusterSpec('{"worker": ["127.0.0.1:5"]}')
  assert spec.as_dict() == {'worker': ['127.0.0.1:5']}
  assert cluster.JobTasks(jobs) == [
      ('/job:worker/task:0', '127.0.0.1:1001'),
      ('/job:worker/task:1', '127.0.0.1:1002')]


@pytest.mark.parametrize('text,match', [
    ('', 'is empty'), ('worker', 'job=host:port'),
    ('worker=127.0.0.1', 'not host:port'), ('{"worker": []}', 'needs a list'),
    ('{bad', 'invalid JSON')])
def testParseErrorsNameTheFlag(text, match):
  with pytest.raises(ValueError, match=match) as e:
    cluster.ParseClusterJobs(text)
  assert '--cluster_spec' in str(e.value)


def testResolveClusterFromTfConfigAndFlags():
  env = {'TF_CONFIG': '{"cluster": {"worker": ["127.0.0.1:7", '
                      '"127.0.0.1:8"]}, "task": {"type": "worker", '
                      '"index": 1}}'}
  spec, job, task = cluster.ResolveCluster('', None, None, env)
  assert (job, task) == ('worker', 1)
  assert spec.num_tasks('worker') == 2
  _, job, task = cluster.ResolveCluster('', 'worker', 0, env)
  assert task == 0
  assert cluster.ResolveCluster('', None, None, {}) is None
  with pytest.raises(ValueError, match='--task=5'):
    cluster.ResolveCluster('', 'worker', 5, env)
  with pytest.raises(ValueError, match="--job='ps'"):
    cluster.ResolveCluster('', 'ps', 0, env)


def testPipelineDevices():
  assert cluster.PipelineDevices(2, 2) == [
      '/job:worker/replica:0/task:0/device:CPU:0',
      '/job:worker/replica:0/task:1/device:CPU:0']
  devices = cluster.PipelineDevices(2, 4, num_replicas=2)
  assert [d.split('/')[3] for d in devices] == [
      'task:0', 'task:1', 'task:2', 'task:3']
  shared = cluster.PipelineDevices(4, 2, devices_per_worker=2)
  assert [d.split('/', 3)[3] for d in shared] == [
      'task:0/device:CPU:0', 'task:1/device:CPU:0', 'task:0/device:CPU:1',
      'task:1/device:CPU:1']
  text = cluster.DeviceMeshText(devices, 2)
  assert '2 replica(s) x 2 stage(s)' in text and 'replica 1:' in text
  with pytest.raises(ValueError, match='num_workers'):
    cluster.PipelineDevices(2, 0)


def testLoopbackBindIsRefusedWhereTensorFlowWouldListenOnTheNetwork():
  with pytest.raises(ValueError, match='bind_address=0.0.0.0'):
    cluster.CheckBindAddress('127.0.0.1', '10.0.0.1:2222', '/job:worker/task:0')
  if cluster.OnlyLoopbackInterfaces():
    cluster.CheckBindAddress('127.0.0.1', '127.0.0.1:2222', 'w')
  else:
    with pytest.raises(ValueError, match='tfpipe.launcher'):
      cluster.CheckBindAddress('127.0.0.1', '127.0.0.1:2222', 'w')


class _SilentServer:
  """Accepts connections on 127.0.0.1, never answers: a stopped worker."""

  def __init__(self):
    self.sock = socket.socket()
    self.sock.bind(('127.0.0.1', 0))
    self.sock.listen(16)
    self.address = f'127.0.0.1:{self.sock.getsockname()[1]}'

  def close(self):
    self.sock.close()


def _ClosedPortAddress():
  s = socket.socket()
  s.bind(('127.0.0.1', 0))
  address = f'127.0.0.1:{s.getsockname()[1]}'
  s.close()
  return address


def testProbeTellsSilenceAndRefusalApart():
  server = _SilentServer()
  try:
    assert 'no answer' in cluster.ProbeGrpc(server.address, 0.3)
  finally:
    server.close()
  assert 'refused' in cluster.ProbeGrpc(_ClosedPortAddress(), 0.3).lower()


@pytest.mark.parametrize('stopped', [True, False])
def testWatchdogReportsTheLostWorkerWithinItsBound(stopped):
  server = _SilentServer() if stopped else None
  address = server.address if stopped else _ClosedPortAddress()
  lost = []
  done = threading.Event()
  watchdog = cluster.Watchdog(
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


def testWaitForTasksTimesOutNamingTheTask():
  address = _ClosedPortAddress()
  with pytest.raises(TimeoutError, match=f'/job:worker/task:0 at {address}'):
    cluster.WaitForTasks([('/job:worker/task:0', address)], timeout_s=0.5)


TINY_LM = ('task.model.num_layers: 1; task.model.model_dim: 16; '
           'task.model.hidden_dim: 32; task.model.num_heads: 2; '
           'input.batch_size: 8; eval_input.batch_size: 8; '
           'task.eval.num_batches: 1; task.pipeline.num_partitions: 2; '
           'task.pipeline.num_micro_batches: 2')


def _TinyTaskParams(num_replicas, devices):
  p = model_registry.GetParams('lm.TinyTransformerLm', 'Train')
  p.FromText(TINY_LM)
  p.task.pipeline.Set(num_replicas=num_replicas, devices=devices)
  return p


def testReplicasGiveTheGradientsOfOnePipelineOverTheSameBatch():
  """R=2 x K=2 on four logical CPUs == R=1 x K=2 over the same global batch."""
  p1 = _TinyTaskParams(1, ['/CPU:0', '/CPU:1'])
  p2 = _TinyTaskParams(2, ['/CPU:0', '/CPU:1', '/CPU:2', '/CPU:3'])
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


def testSetUpControllerWithoutClusterOnlySetsReplicas(monkeypatch):
  monkeypatch.delenv('TF_CONFIG', raising=False)

  class _Flags:
    job = ''
    cluster_spec = ''
    task = None
    num_replicas = 2

  p = _TinyTaskParams(1, None)
  assert multihost.SetUpController(_Flags(), p) is None
  assert p.task.pipeline.num_replicas == 2
