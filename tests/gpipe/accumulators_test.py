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


def _Ancestors(op):
  seen, stack = set(), [op]
  while stack:
    op = stack.pop()
    if op.name not in seen:
      seen.add(op.name)
      stack.extend([t.op for t in op.inputs] + list(op.control_inputs))
  return seen


def test_one_at_a_time_makes_each_gradient_after_the_last_addition():
  """The single-threaded executor's one fixed order made several weight
  gradients before adding any; the chain makes it add each before making
  the next, and the buffers still hold the exact gradients."""
  # Each weight gradient (8 x 8) outweighs what making it reads (2 x 8 twice).
  weights = [tf.Variable(tf.random.normal([8, 8], seed=i)) for i in range(3)]
  buffers = accumulators.GradientAccumulators('/CPU:0')
  x = tf.random.normal([2, 8], seed=7)
  graphs = []

  @tf.function(autograph=False)
  def Step():
    with tf.GradientTape() as tape:
      h = x
      for w in weights:
        h = tf.nn.relu(tf.matmul(h, w))
      loss = tf.reduce_sum(h)
    grads = tape.gradient(loss, weights)
    updates, _ = buffers.Add(weights, [tf.identity(g) for g in grads],
                             (accumulators.FIRST,) * 3, one_at_a_time=True)
    graphs.append((grads, updates))
    with tf.control_dependencies(updates):
      return tf.constant(True)

  Step()
  grads, updates = graphs[0]
  # The backward makes the last layer's gradient first.
  for i in (2, 1):
    assert updates[i].name in _Ancestors(grads[i - 1].op), i
  assert updates[0].name not in _Ancestors(grads[2].op)
  with tf.GradientTape() as tape:
    h = x
    for w in weights:
      h = tf.nn.relu(tf.matmul(h, w))
    loss = tf.reduce_sum(h)
  for w, g in zip(weights, tape.gradient(loss, weights)):
    np.testing.assert_allclose(buffers.Buffer(w).numpy(), g, rtol=1e-6)
