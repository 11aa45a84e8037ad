"""What one cell does for one micro-batch: records, programs and gradients."""

import numpy as np
import pytest
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tfpipe import layers
from tfpipe.gpipe import cell_runtime

_Pipeline = plt_test._Pipeline  # pylint: disable=protected-access
_Data = plt_test._Data  # pylint: disable=protected-access
_Loss = plt_test._Loss  # pylint: disable=protected-access
_LayerParams = plt_test._LayerParams  # pylint: disable=protected-access


def test_split_float_keeps_integer_leaves_in_place():
  structure = {'a': tf.ones([2]), 'b': (tf.zeros([2], tf.int32), tf.ones([1]))}
  floats, rebuild = cell_runtime.SplitFloat(structure)
  assert len(floats) == 2
  rebuilt = rebuild([f * 2 for f in floats])
  assert rebuilt['b'][0].dtype == tf.int32
  assert float(rebuilt['a'][0]) == 2.0


def test_step_gradients_assign_then_add_on_the_cell_device():
  with tf.device('/CPU:0'):
    v, w = tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([2]))
  accumulators = cell_runtime.GradientAccumulators('/CPU:3')
  for _ in range(2):  # A second pass starts over.
    gradients = cell_runtime.StepGradients(accumulators, [v, w], 2)
    first = gradients.Modes([0])
    assert first == ('first',)
    accumulators.Add([v], [tf.ones([3])], first)
    gradients.Done([0], first, [])
    second = gradients.Modes([0])
    assert second == ('add',)
    accumulators.Add([v], [tf.IndexedSlices(
        tf.ones([1]), tf.constant([1]), tf.constant([3]))], second)
    gradients.Done([0], second, [])
    read = gradients.Read(scale=0.5)
    np.testing.assert_allclose(read[0], [0.5, 1.0, 0.5])
    assert read[1] is None  # No micro-batch reached w.
  assert accumulators.Buffer(v).device.endswith('CPU:3')
  only = cell_runtime.StepGradients(accumulators, [v, w], 1)
  assert only.Modes([0, 1]) == ('only', 'only')  # M=1: no buffer.


@pytest.mark.parametrize('schedule,fused', [('1f1b', 4), ('gpipe', 1)])
def test_last_cell_runs_forward_and_backward_as_one_call_when_adjacent(
    schedule, fused):
  """B(m, K-1) right after F(m, K-1): one call, no recompute, same result."""
  layer_params = _LayerParams(4)
  x, y = _Data()
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  pipe = _Pipeline(layer_params, 2, 4, schedule=schedule)
  calls = []
  last = pipe.runtime.cells[0][-1]
  for name in ('ForwardBackward', 'Backward'):
    original = getattr(last, name)
    setattr(last, name, lambda *a, original=original, name=name, **k: (
        calls.append(name), original(*a, **k))[1])
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  plt_test._AssertAllClose(out.gradients, ref_grads)  # pylint: disable=protected-access
  assert calls.count('ForwardBackward') == fused
  assert calls.count('Backward') == 4 - fused


def test_records_say_what_a_micro_batch_keeps():
  """Re-materialized: the input; otherwise the residuals, none of them the
  cell's input of another micro-batch or the weights."""
  x, _ = _Data()
  kept = {}
  for remat in ('always', 'never'):
    pipe = _Pipeline(_LayerParams(4), 2, 1, remat_policy=remat)
    pipe.build(x.shape)
    cell = pipe.runtime.cells[0][0]
    inputs = cell_runtime.ActionInputs(x, tf.constant([1, 2], tf.int64),
                                       tf.constant(0, tf.int64))
    keep = 'input' if remat == 'always' else 'residuals'
    _, _, record = cell.Forward(inputs, True, cell.Variables(), keep)
    kept[remat] = record
  assert isinstance(kept['always'], cell_runtime.KeptInput)
  assert kept['always'].tensors[0] is x
  assert isinstance(kept['never'], cell_runtime.KeptResiduals)
  # Two tanh layers: the input and each layer's output.
  assert sorted(tuple(t.shape) for t in kept['never'].tensors
                if t.dtype.is_floating and t.shape.rank) == [
                    (plt_test.BATCH, plt_test.DIM)] * 3


def test_tf_variable_unwraps_keras_variables():
  layer = layers.FCLayer.Params().Set(name='fc', input_dims=2,
                                      output_dims=2).Instantiate()
  for v in layer.trainable_variables:
    assert isinstance(cell_runtime.TfVariable(v), tf.Variable)
  plain = tf.Variable(1.0)
  assert cell_runtime.TfVariable(plain) is plain


# ---- caches -----------------------------------------------------------------


def test_changing_sequence_lengths_relax_shapes_instead_of_retracing():
  """ZB-H1 (and every schedule) traces a program per signature, relaxed."""
  params = [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=plt_test.DIM, output_dims=plt_test.DIM,
      activation='tanh', random_seed=i) for i in range(4)]
  pipe = _Pipeline(params, 2, 2, schedule='zb_h1', remat_policy='never',
                   executor='threads')
  loss_fn = lambda y, t: tf.reduce_mean(tf.square(y - t))
  plain = layers.SequentialLayer.Params().Set(name='plain',
                                              sub=params).Instantiate()
  for length in range(2, 10):
    x = tf.random.stateless_normal([4, length, plt_test.DIM], seed=[length, 1])
    out = pipe.ComputeLossAndGradients(x, x, loss_fn)
  with tf.GradientTape() as tape:
    loss = loss_fn(plain(x, training=True), x)
  np.testing.assert_allclose(out.loss, loss, rtol=1e-5)
  plt_test._AssertAllClose(  # pylint: disable=protected-access
      out.gradients, tape.gradient(loss, plain.trainable_variables))
  # The first length exactly, then one program with the length unknown.
  assert [len(cell.programs) for cell in pipe.runtime.cells[0]] == [2, 2]


def test_program_caches_are_bounded_and_follow_loss_fn_and_batch_changes():
  """A new loss_fn closure per step, and batch sizes that change, under
  the threads dispatcher: results stay right and programs are evicted."""
  layer_params = _LayerParams(4)
  x, y = _Data()
  pipe = _Pipeline(layer_params, 2, 2, executor='threads')
  for step in range(cell_runtime.MAX_PROGRAMS + 3):
    scale = 1.0 + step
    batch = plt_test.BATCH - step % 3
    loss_fn = lambda out, t, scale=scale: scale * _Loss(out, t)
    out = pipe.ComputeLossAndGradients(x[:batch], y[:batch], loss_fn)
    ref_loss, _ = plt_test._Reference(layer_params, x[:batch], y[:batch])  # pylint: disable=protected-access
    np.testing.assert_allclose(out.loss, scale * ref_loss, rtol=1e-5)
  assert len(pipe.runtime.cells[0][-1].programs) <= (
      cell_runtime.MAX_PROGRAMS)
