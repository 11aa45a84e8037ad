"""The thread-per-device executor computes what the graph executor computes.

executor='threads' changes how the schedule is dispatched, never the result:
loss, gradients, dropout masks, batch-norm statistics and replicas must equal
the graph executor's (and so the plain model's). It must also fail cleanly:
an error in one device thread ends the step with the cell named, instead of
leaving the other threads waiting.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tfpipe import gpipe
from tfpipe import layers
from tfpipe import timeline
from tfpipe.gpipe import threaded_executor

_Pipeline = plt_test._Pipeline  # pylint: disable=protected-access
_Data = plt_test._Data  # pylint: disable=protected-access
_Loss = plt_test._Loss  # pylint: disable=protected-access
_LayerParams = plt_test._LayerParams  # pylint: disable=protected-access
_AssertAllClose = plt_test._AssertAllClose  # pylint: disable=protected-access


@pytest.mark.parametrize('k,m,schedule', [
    (1, 1, 'gpipe'), (2, 3, 'gpipe'), (2, 4, '1f1b'), (4, 5, '1f1b'),
    (4, 8, 'gpipe')])
def test_equals_plain_model(k, m, schedule):
  layer_params = _LayerParams()
  x, y = _Data()
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  pipe = _Pipeline(layer_params, k, m, schedule=schedule, executor='threads')
  for _ in range(2):  # The second step reuses the traced functions.
    out = pipe.ComputeLossAndGradients(x, y, _Loss)
    np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
    _AssertAllClose(out.gradients, ref_grads)


def test_dropout_masks_equal_the_graph_executors():
  layer_params = _LayerParams(6, keep_prob=0.5)
  x, y = _Data()
  graph = _Pipeline(layer_params, 2, 4).ComputeLossAndGradients(
      x, y, _Loss, step=7)
  threads = _Pipeline(layer_params, 2, 4, executor='threads')
  out = threads.ComputeLossAndGradients(x, y, _Loss, step=7)
  np.testing.assert_allclose(out.loss, graph.loss, rtol=1e-6)
  _AssertAllClose(out.gradients, graph.gradients)
  other = threads.ComputeLossAndGradients(x, y, _Loss, step=8)
  assert not np.allclose(other.loss, out.loss)


@pytest.mark.parametrize('traced', [False, True])
def test_batch_norm_statistics_equal_the_graph_executors(traced):
  layer_params = plt_test._BatchNormParams()  # pylint: disable=protected-access
  x, y = _Data()
  x = x * 3.0 + 1.0
  graph = _Pipeline(layer_params, 2, 4)
  threads = _Pipeline(layer_params, 2, 4, executor='threads', schedule='1f1b')
  step = lambda x, y: threads.ComputeLossAndGradients(x, y, _Loss)
  if traced:
    step = tf.function(step)
  for _ in range(2):
    ref = graph.ComputeLossAndGradients(x, y, _Loss)
    out = step(x, y)
  _AssertAllClose(out.gradients, ref.gradients)
  graph_stats = [v.numpy() for v in graph.non_trainable_variables
                 if 'moving' in v.path]
  thread_stats = [v.numpy() for v in threads.non_trainable_variables
                  if 'moving' in v.path]
  assert len(thread_stats) == 4
  _AssertAllClose(thread_stats, graph_stats)


def test_nested_inputs_with_integer_leaves():
  layer_params = [plt_test._DictLayer.Params().Set(name=f'd{i}')  # pylint: disable=protected-access
                  for i in range(4)]
  x, y = _Data()
  mask = tf.constant([i % 3 != 0 for i in range(plt_test.BATCH)], tf.int32)
  inputs = {'h': x, 'mask': mask}
  loss_fn = lambda out, t: _Loss(out['h'], t)
  ref = _Pipeline(layer_params, 4, 3).ComputeLossAndGradients(
      inputs, y, loss_fn)
  out = _Pipeline(layer_params, 4, 3, executor='threads',
                  round_robin_placement=True).ComputeLossAndGradients(
                      inputs, y, loss_fn)
  np.testing.assert_allclose(out.loss, ref.loss, rtol=1e-6)
  _AssertAllClose(out.gradients, ref.gradients)


def test_replicas_and_round_robin_give_the_full_batch_gradient():
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  cells = gpipe.PartitionSequentialLayers(layer_params, 4, balance='params')
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=3, num_replicas=2,
      devices=['/CPU:0', '/CPU:1', '/CPU:2', '/CPU:3'],
      round_robin_placement=True, executor='threads').Instantiate()
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  _AssertAllClose(out.gradients, ref_grads)


def test_metrics_and_per_example_losses_are_weighted_exactly():
  layer_params = _LayerParams(4)
  x, y = _Data()

  def LossFn(out, targets):
    per_example = tf.reduce_mean(tf.square(out - targets), axis=-1)
    return per_example, {'mean_abs': tf.reduce_mean(tf.abs(out))}
  ref = _Pipeline(layer_params, 2, 4).ComputeLossAndGradients(x, y, LossFn)
  out = _Pipeline(layer_params, 2, 4, executor='threads'
                  ).ComputeLossAndGradients(x, y, LossFn)
  np.testing.assert_allclose(out.loss, ref.loss, rtol=1e-6)
  np.testing.assert_allclose(out.metrics['mean_abs'], ref.metrics['mean_abs'],
                             rtol=1e-6)
  _AssertAllClose(out.gradients, ref.gradients)


def test_recorded_times_cover_every_action_in_dependency_order():
  layer_params = _LayerParams(4)
  x, y = _Data()
  pipe = _Pipeline(layer_params, 2, 4, executor='threads')
  tl = timeline.RecordStep(pipe, x, y, _Loss)
  assert len(tl.start_times) == len(tl.end_times) == 2 * 2 * 4
  assert not timeline.DependencyViolations(tl, tolerance=1e-4)


def test_error_in_a_device_thread_names_the_cell_and_does_not_hang():
  pipe = _Pipeline(_LayerParams(4), 2, 2, executor='threads')
  x, y = _Data()
  pipe.ComputeLossAndGradients(x, y, _Loss)
  bad = tf.ones([plt_test.BATCH, plt_test.DIM + 1])
  with pytest.raises(ValueError, match=r'pipe: cell 0 \(cell0\)'):
    pipe.ComputeLossAndGradients(bad, y, _Loss)
  # The executor is still usable after a failed step.
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  assert np.isfinite(out.loss)


def test_error_threads_need_remat_always():
  with pytest.raises(ValueError, match="remat_policy='always'"):
    _Pipeline(_LayerParams(2), 2, 2, executor='threads', remat_policy='never')


def test_error_unknown_executor():
  with pytest.raises(ValueError, match="unknown executor 'thread'"):
    _Pipeline(_LayerParams(2), 2, 2, executor='thread')


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_inside_tf_function_emits_the_cell_functions_into_one_graph(schedule):
  """No threads inside a trace, but the same results and O(K) functions."""
  layer_params = _LayerParams(6, keep_prob=0.5)
  x, y = _Data()
  ref = _Pipeline(layer_params, 3, 5, schedule=schedule
                  ).ComputeLossAndGradients(x, y, _Loss, step=2)
  pipe = _Pipeline(layer_params, 3, 5, schedule=schedule, executor='threads')

  @tf.function
  def Step(x, y):
    out = pipe.ComputeLossAndGradients(x, y, _Loss, step=2)
    return out.loss, out.gradients
  for _ in range(2):
    loss, grads = Step(x, y)
    np.testing.assert_allclose(loss, ref.loss, rtol=1e-6)
    _AssertAllClose(grads, ref.gradients)
  eager = pipe.ComputeLossAndGradients(x, y, _Loss, step=2)
  np.testing.assert_allclose(eager.loss, ref.loss, rtol=1e-6)
  # One forward and one backward function per cell, whatever M is.
  assert len(pipe.ThreadedExecutor(5)._functions) == 3  # pylint: disable=protected-access


def test_recorded_times_inside_tf_function():
  pipe = _Pipeline(_LayerParams(4), 2, 3, executor='threads')
  x, y = _Data()

  @tf.function
  def Step(x, y):
    return pipe.ComputeLossAndGradients(x, y, _Loss,
                                        record_times=True).action_times
  times = Step(x, y)
  tl = timeline.FromActionTimes(pipe.ThreadedExecutor(3).schedule, times)
  assert len(tl.start_times) == 12
  assert not timeline.DependencyViolations(tl, tolerance=1e-4)


def test_error_serialize_device_ops_with_too_few_inter_op_threads():
  if (tf.config.threading.get_inter_op_parallelism_threads() or
      os.cpu_count()) >= threaded_executor.InterOpThreadsNeeded(8):
    pytest.skip('This machine has enough inter-op threads.')
  pipe = _Pipeline(_LayerParams(8), 8, 2, executor='threads',
                   serialize_device_ops=True)
  x, y = _Data()
  with pytest.raises(ValueError, match=r'set_inter_op_parallelism_threads\(17\)'):
    pipe.ComputeLossAndGradients(x, y, _Loss)


def test_error_serialize_device_ops_with_replicas_names_the_variable(
    monkeypatch):
  monkeypatch.setattr(threaded_executor, 'InterOpThreadsNeeded', lambda n: 1)
  cells = gpipe.PartitionSequentialLayers(_LayerParams(2), 2,
                                          balance='params')
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=2, num_replicas=2,
      devices=['/CPU:0', '/CPU:1', '/CPU:2', '/CPU:3'], executor='threads',
      serialize_device_ops=True).Instantiate()
  x, y = _Data()
  with pytest.raises(ValueError, match=r'cell 0 \(cell0\) runs on /CPU:2 and '
                     r'its variable .*fc0.* lives on .*CPU:0'):
    pipe.ComputeLossAndGradients(x, y, _Loss)


_SERIALIZED_PROBE = r'''
import json, os, sys
os.environ['TF_CPP_MIN_LOG_LEVEL'] = '2'
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(5)
cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from tfpipe import gpipe, layers
params = [layers.FCLayer.Params().Set(name=f'fc{i}', input_dims=32,
                                      output_dims=32, random_seed=i)
          for i in range(4)]
cells = gpipe.PartitionSequentialLayers(params, 2, balance='params')
x = tf.random.stateless_normal([64, 32], seed=[1, 2])
loss = lambda out, t: tf.reduce_mean(tf.square(out))
losses = {}
for executor, serialize in (('graph', False), ('threads', True)):
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=4, schedule='1f1b',
      devices=['/CPU:0', '/CPU:1'], executor=executor,
      serialize_device_ops=serialize).Instantiate()
  out = [float(pipe.ComputeLossAndGradients(x, None, loss).loss)
         for _ in range(30)]
  losses[executor] = out
print(json.dumps(losses))
'''


def test_serialized_device_ops_run_many_steps_without_starving():
  """Regression: 2 inter-op threads for 2 serialized devices used to hang."""
  proc = subprocess.run(
      [sys.executable, '-c', _SERIALIZED_PROBE], capture_output=True,
      text=True, timeout=240,
      cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  assert proc.returncode == 0, proc.stderr[-3000:]
  losses = json.loads(proc.stdout.strip().splitlines()[-1])
  np.testing.assert_allclose(losses['threads'], losses['graph'], rtol=1e-6)


@pytest.mark.parametrize('executor', ['graph', 'threads'])
def test_loss_fn_runs_once_per_micro_batch(executor):
  """loss_fn may update metrics, so the backward must not call it again."""
  calls = tf.Variable(0, dtype=tf.int32)

  def CountingLoss(out, targets):
    calls.assign_add(1)
    return _Loss(out, targets)
  pipe = _Pipeline(_LayerParams(4), 2, 4, executor=executor)
  x, y = _Data()
  pipe.ComputeLossAndGradients(x, y, CountingLoss)
  assert int(calls.numpy()) == 4
