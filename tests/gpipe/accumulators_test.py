"""Gradient accumulation: assign, then add; M=1 keeps the gradient; None stays None."""

import numpy as np
import tensorflow as tf

from tfpipe.gpipe import accumulators


def test_a_pass_assigns_then_adds_on_the_cell_device():
  with tf.device('/CPU:0'):
    v, w = tf.Variable(tf.zeros([3])), tf.Variable(tf.zeros([2]))
  buffers = accumulators.GradientAccumulators('/CPU:3')
  for _ in range(2):  # A second pass starts over.
    gradients = accumulators.PassGradients(buffers, [v, w], 2, True)
    first = gradients.Modes([0])
    assert first == ('first',)
    buffers.Add([v], [tf.ones([3])], first)
    gradients.Done([0], first, [])
    second = gradients.Modes([0])
    assert second == ('add',)
    buffers.Add([v], [tf.IndexedSlices(
        tf.ones([1]), tf.constant([1]), tf.constant([3]))], second)
    gradients.Done([0], second, [])
    read = gradients.Read(scale=0.5)
    np.testing.assert_allclose(read[0], [0.5, 1.0, 0.5])
    assert read[1] is None  # No micro-batch reached w.
  assert buffers.Buffer(v).device.endswith('CPU:3')
  only = accumulators.PassGradients(buffers, [v, w], 1, True)
  assert only.Modes([0, 1]) == ('only', 'only')  # M=1: no buffer.
