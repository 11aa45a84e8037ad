"""Dispatchers change how actions are issued, never the result.

executor='threads' (a thread per device) must give the loss, gradients,
dropout masks, batch-norm statistics and replicas of executor='graph' (inline
in one graph), and so of the plain model. It must also fail cleanly: an error
in one device thread ends the step with the cell named, instead of leaving
the other threads waiting.
"""

import numpy as np
import pytest
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tfpipe import gpipe
from tfpipe import layers
from tfpipe import timeline
from tfpipe.gpipe import dispatch

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
  assert not tl.OrderViolations(tolerance=1e-4)


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


def test_error_unknown_executor():
  with pytest.raises(ValueError, match="Received: executor='thread'"):
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
  # A few programs per cell (17 examples make micro-batches of 4 and 3,
  # and the last cell traces with and without the loss), whatever M is.
  counts = [len(cell.programs) for cell in pipe.runtime.cells[0]]
  assert max(counts) <= 4, counts


def _RecordingStep(pipe):
  """A tf.function of (x, y) that returns the step's recorded times."""
  return tf.function(lambda x, y: pipe.ComputeLossAndGradients(
      x, y, _Loss, record_times=True).action_times)


def test_recorded_times_inside_tf_function():
  pipe = _Pipeline(_LayerParams(4), 2, 3, executor='threads')
  x, y = _Data()
  times = _RecordingStep(pipe)(x, y)
  tl = timeline.FromActionTimes(pipe.Schedule(3), times)
  assert len(tl.start_times) == 12
  _AssertStartsAfterInputs(tl)


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


def test_mailbox_failure_wakes_every_waiting_thread():
  pipe = _Pipeline(_LayerParams(4), 4, 2, executor='threads')
  x, y = _Data()

  def Failing(outputs, targets):
    raise ValueError('loss exploded')
  with pytest.raises(ValueError, match='loss exploded'):
    pipe.ComputeLossAndGradients(x, y, Failing)
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  assert np.isfinite(out.loss)


def test_auto_executor_by_device_kind_and_action_size():
  choose = dispatch.ChooseExecutor
  big = dispatch.THREADS_MIN_FORWARD_FLOPS * 2
  assert choose(['/GPU:0', '/GPU:1'], big) == 'graph'
  assert choose(['/job:localhost/task:0/device:TPU:0', '/TPU:1'], big) == (
      'graph')
  assert choose(['/CPU:0', '/CPU:1'], big) == 'threads'
  assert choose(['/job:localhost/replica:0/task:0/device:CPU:0',
                 '/job:localhost/replica:0/task:0/device:CPU:1'], big) == (
                     'threads')
  # Remote workers: a remote call per action cost more than it gained.
  assert choose(['/job:worker/task:0/device:CPU:0',
                 '/job:worker/task:1/device:CPU:0'], big) == 'graph'
  assert choose(['/CPU:0', '/CPU:1'], big / 100) == 'graph'
  assert choose(['/CPU:0', '/CPU:1'], None) == 'graph'
  assert choose(['/CPU:0', '/CPU:0'], big) == 'graph'


def test_recorded_times_do_not_order_devices_after_each_other():
  """A device's timestamps wait only for its own actions and their inputs.

  A bare tf.timestamp() in a tf.function is chained after every other one by
  the automatic control dependencies, across devices, which serialized the
  devices of a recorded step (and made its measured bubble an artifact); and
  a stamp that followed an action by a control edge ran before the action's
  outputs existed.
  """
  pipe = _Pipeline(_LayerParams(4), 2, 4, executor='graph')
  x, y = _Data()
  step = _RecordingStep(pipe)
  graph = step.get_concrete_function(x, y).graph

  def IsStamp(op):
    if op.type not in ('StatefulPartitionedCall', 'PartitionedCall'):
      return False
    return '_Stamp' in op.get_attr('f').name
  stamps = [op for op in graph.get_operations() if IsStamp(op)]
  assert len(stamps) == 2 * 2 * 2 * 4  # (start, end) x F, B x K x M.
  stamp_names = {op.name for op in stamps}
  devices = {tf.DeviceSpec.from_string(op.device).device_index
             for op in stamps}
  assert devices == {0, 1}
  for op in stamps:
    for dep in op.control_inputs:
      if dep.name in stamp_names:
        assert dep.device == op.device, (op.name, dep.name)
    # Besides the clock, each stamp reads what it follows: a control edge
    # from an inlined call would not wait for the call's outputs.
    assert len(op.inputs) >= 2, op.name
  _AssertStartsAfterInputs(
      timeline.FromActionTimes(pipe.Schedule(4), step(x, y)))


def _AssertStartsAfterInputs(tl):
  """Each device runs its actions one after another, in the schedule's order.

  Across devices an action waits for its input, not for the timestamp that
  ends the action producing it: both stamps wait for the same tensor (in
  either order), and a backward hands on its input gradient before it has
  added its weight gradients.
  """
  device_of = tl.schedule.device_of_cell
  for action, prerequisite, _ in tl.OrderViolations(tolerance=1e-4):
    assert device_of[action.cell] != device_of[prerequisite.cell], (
        action, prerequisite)
    assert action.micro_batch == prerequisite.micro_batch, (action,
                                                             prerequisite)


def test_a_device_waits_for_the_outputs_of_its_previous_pure_forward():
  """OrderAfter's edge comes from a read of the previous action's output.

  A control edge on the output of an inlined, stateless function call waits
  for nothing once Grappler inlines it, so the next action on the device
  must depend on something that consumes the output's data.
  """
  forward = tf.function(lambda x: tf.tanh(tf.matmul(x, x)))
  captured = {}

  @tf.function
  def Step(x):
    y = forward(x)
    with dispatch.OrderAfter([y]):
      z = tf.identity(x)
    captured['y'], captured['z'] = y, z
    return z

  Step.get_concrete_function(tf.TensorSpec([4, 4], tf.float32))
  y, z = captured['y'], captured['z']

  def Consumes(op, tensor, depth=3):
    return any(t is tensor or (depth and Consumes(t.op, tensor, depth - 1))
               for t in op.inputs)

  assert z.op.control_inputs, 'no ordering edge'
  assert all(Consumes(op, y) for op in z.op.control_inputs), [
      op.type for op in z.op.control_inputs]


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b'])
def test_a_gradient_is_sent_on_only_once_its_taker_is_due(schedule):
  """In one graph a receive pulls a tensor as soon as it is made, so a
  device whose backwards are the slower would hold every gradient its
  neighbour has sent. Each gradient handed to another device passes
  through an identity on its sender that waits for data of the taker's
  action before the one before its use."""
  m = 4
  pipe = _Pipeline(_LayerParams(4), 2, m, schedule=schedule)
  x, y = _Data()
  ref = pipe.ComputeLossAndGradients(x, y, _Loss)
  step = tf.function(lambda x, y: pipe.ComputeLossAndGradients(x, y, _Loss))
  graph = step.get_concrete_function(x, y).graph
  devices = [cell.device for cell in pipe.runtime.cells[0]]
  gated = [op for op in graph.get_operations()
           if op.type == 'Identity' and op.control_inputs and
           tf.DeviceSpec.from_string(op.device) ==
           tf.DeviceSpec.from_string(devices[1])]
  assert len(gated) == m, [op.name for op in gated]
  for op in gated:
    # Reads (OrderAfter's) of outputs of cell 0's device, placed there.
    assert all(tf.DeviceSpec.from_string(c.device) ==
               tf.DeviceSpec.from_string(devices[0])
               for c in op.control_inputs), [c.device for c in op.control_inputs]
  out = step(x, y)  # The same step, traced: exact as eager.
  np.testing.assert_allclose(out.loss, ref.loss, rtol=1e-6)
  _AssertAllClose(out.gradients, ref.gradients)
