"""The stage runtime: what one cell does for one micro-batch, on its device."""

import numpy as np
import pytest
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tfpipe import layers
from tfpipe.gpipe import stage as stage_lib


def test_split_float_keeps_integer_leaves_in_place():
  structure = {'a': tf.ones([2]), 'b': (tf.zeros([2], tf.int32), tf.ones([1]))}
  floats, rebuild = stage_lib.SplitFloat(structure)
  assert len(floats) == 2
  rebuilt = rebuild([f * 2 for f in floats])
  assert rebuilt['b'][0].dtype == tf.int32
  assert float(rebuilt['a'][0]) == 2.0


def test_parse_loss_means_are_shares_of_the_batch_mean():
  parts = stage_lib.ParseLoss((tf.constant(2.0), {'acc': tf.constant(0.5)}),
                              scale=0.25, batch_size=8)
  assert not parts.is_sum
  assert float(parts.numerator) == 0.5 and float(parts.metrics['acc']) == 0.125
  per_example = stage_lib.ParseLoss(tf.constant([1.0, 3.0]), 0.25, 8)
  assert float(per_example.numerator) == 0.5  # (1 + 3) / 8.


def test_parse_loss_sums_keep_their_weight():
  parts = stage_lib.ParseLoss((tf.constant([1.0, 2.0]), tf.constant(3.0)),
                              scale=0.25, batch_size=8)
  assert parts.is_sum
  assert float(parts.numerator) == 3.0 and float(parts.weight) == 3.0
  with_metrics = stage_lib.ParseLoss(
      (tf.constant(4.0), 2, {'correct': tf.constant(1.0)}), 0.25, 8)
  assert with_metrics.is_sum and float(with_metrics.metrics['correct']) == 1.0


def test_accumulators_live_on_the_stage_device_and_add_up():
  with tf.device('/CPU:0'):
    v = tf.Variable(tf.zeros([3]))
  accumulators = stage_lib.GradientAccumulators([v], '/CPU:3')
  assert accumulators.buffers[0].device.endswith('CPU:3')
  accumulators.Add([tf.ones([3])], first=True)
  accumulators.Add([tf.IndexedSlices(tf.ones([1]), tf.constant([1]),
                                     tf.constant([3]))], first=False)
  np.testing.assert_allclose(accumulators.Read()[0], [1.0, 2.0, 1.0])
  np.testing.assert_allclose(accumulators.Read(scale=0.5)[0], [0.5, 1.0, 0.5])
  accumulators.Add([tf.ones([3])], first=True)  # A new step starts over.
  np.testing.assert_allclose(accumulators.Read()[0], [1.0, 1.0, 1.0])


@pytest.mark.parametrize('schedule,fused', [('1f1b', 4), ('gpipe', 1)])
def test_last_cell_fuses_forward_and_backward_when_adjacent(schedule, fused):
  """B(m, K-1) right after F(m, K-1): one call, no recompute, same result."""
  layer_params = plt_test._LayerParams(4)  # pylint: disable=protected-access
  x, y = plt_test._Data()  # pylint: disable=protected-access
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)  # pylint: disable=protected-access
  pipe = plt_test._Pipeline(layer_params, 2, 4, schedule=schedule)  # pylint: disable=protected-access
  out = pipe.ComputeLossAndGradients(x, y, plt_test._Loss)  # pylint: disable=protected-access
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  plt_test._AssertAllClose(out.gradients, ref_grads)  # pylint: disable=protected-access
  last = pipe.runtime.stages[0][-1]
  kinds = {key[0] for key in last._functions}  # pylint: disable=protected-access
  assert 'forward_loss_backward' in kinds
  assert ('forward_loss' in kinds) == (fused < 4)


def test_tf_variable_unwraps_keras_variables():
  layer = layers.FCLayer.Params().Set(name='fc', input_dims=2,
                                      output_dims=2).Instantiate()
  for v in layer.trainable_variables:
    assert isinstance(stage_lib.TfVariable(v), tf.Variable)
  plain = tf.Variable(1.0)
  assert stage_lib.TfVariable(plain) is plain
