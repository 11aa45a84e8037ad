"""Tests of BatchNormLayer (including deferred statistics) and LayerNorm."""

import numpy as np
import tensorflow as tf

from tfpipe import base_layer
from tfpipe import layers


def _Bn(**kw):
  return layers.BatchNormLayer.Params().Set(
      name='bn', dim=3, decay=0.9, epsilon=1e-3, **kw)


def _Data(shape, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(*shape) * 2.0 + 1.5).astype(np.float32)


def test_batch_norm_training_matches_numpy():
  bn = _Bn().Instantiate()
  bn.gamma.assign([1.0, 2.0, 0.5])
  bn.beta.assign([0.0, -1.0, 0.3])
  x = _Data((4, 5, 3))
  mean = x.mean(axis=(0, 1))
  var = x.var(axis=(0, 1))
  want = (x - mean) / np.sqrt(var + 1e-3) * bn.gamma.numpy() + bn.beta.numpy()
  np.testing.assert_allclose(bn(x, training=True).numpy(), want, rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(bn.moving_mean.numpy(), 0.1 * mean, rtol=1e-5)
  np.testing.assert_allclose(bn.moving_variance.numpy(), 0.9 + 0.1 * var,
                             rtol=1e-5)


def test_batch_norm_eval_uses_moving_stats():
  bn = _Bn().Instantiate()
  bn.moving_mean.assign([1.0, 2.0, 3.0])
  bn.moving_variance.assign([4.0, 1.0, 0.25])
  x = _Data((6, 3))
  want = (x - [1.0, 2.0, 3.0]) / np.sqrt(np.array([4.0, 1.0, 0.25]) + 1e-3)
  for training in (None, False):
    np.testing.assert_allclose(bn(x, training=training).numpy(), want,
                               rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(bn.moving_mean.numpy(), [1.0, 2.0, 3.0])


def test_deferred_batch_norm_equals_full_batch_update():
  x = _Data((8, 2, 3), seed=2)
  full = _Bn().Instantiate()
  full(x, training=True)

  piped = _Bn().Instantiate()
  collector = base_layer.DeferredStatsCollector()
  # Unequal micro-batches check that counts weigh the merge.
  slices = [x[:1], x[1:4], x[4:6], x[6:]]
  with base_layer.CollectDeferredStats(collector):
    outs = [piped(s, training=True) for s in slices]
  # Nothing is updated until the collector is applied.
  np.testing.assert_array_equal(piped.moving_mean.numpy(), np.zeros(3))
  assert len(collector) == 1
  collector.Apply()
  np.testing.assert_allclose(piped.moving_mean.numpy(),
                             full.moving_mean.numpy(), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(piped.moving_variance.numpy(),
                             full.moving_variance.numpy(), rtol=1e-5)
  # Each micro-batch is normalized with its own statistics.
  s = slices[1]
  want = (s - s.mean((0, 1))) / np.sqrt(s.var((0, 1)) + 1e-3)
  np.testing.assert_allclose(outs[1].numpy(), want, rtol=1e-4, atol=1e-5)


def test_deferred_batch_norm_in_tf_function():
  x = _Data((8, 3), seed=3)
  full = _Bn().Instantiate()
  full(x, training=True)
  piped = _Bn().Instantiate()

  @tf.function
  def Step(inputs):
    collector = base_layer.DeferredStatsCollector()
    with base_layer.CollectDeferredStats(collector):
      for s in tf.split(inputs, 4):
        piped(s, training=True)
    updates = collector.Apply()
    # In graph mode the update is an op (a tf.function runs it regardless).
    assert len(updates) == 1 and isinstance(updates[0], tf.Operation)

  Step(x)
  np.testing.assert_allclose(piped.moving_variance.numpy(),
                             full.moving_variance.numpy(), rtol=1e-5)


def test_batch_norm_meta():
  p = _Bn()
  meta = layers.BatchNormLayer.FPropMeta(p, (None, 4, 3))
  assert meta.output_shape == (None, 4, 3)
  assert meta.num_params == 6 == sum(
      int(np.prod(v.shape)) for v in p.Instantiate().trainable_weights)


def test_layer_norm_matches_numpy():
  p = layers.LayerNorm.Params().Set(name='ln', input_dim=4, epsilon=1e-6)
  ln = p.Instantiate()
  ln.scale.assign([1.0, 2.0, 3.0, 0.5])
  ln.bias.assign([0.1, 0.0, -0.1, 0.2])
  x = _Data((2, 3, 4))
  mean = x.mean(-1, keepdims=True)
  var = x.var(-1, keepdims=True)
  want = (x - mean) / np.sqrt(var + 1e-6) * ln.scale.numpy() + ln.bias.numpy()
  got = ln(x)
  np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-5)
  meta = layers.LayerNorm.FPropMeta(p, (None, 3, 4))
  assert meta.output_shape == (None,) + tuple(got.shape[1:])
  assert meta.num_params == 8


def _Image(seed=0):
  return _Data((4, 5, 6, 3), seed)


def test_fused_batch_norm_equals_unfused_forward_gradients_and_stats():
  """Images take the fused kernel; outputs, gradients and moving averages
  are the separate ops' (its Bessel-corrected variance is undone)."""
  x = tf.constant(_Image(4))
  weights = tf.constant(_Data((4, 5, 6, 3), seed=7))
  results = []
  for fused in (True, False):
    bn = _Bn(fused=fused).Instantiate()
    bn.gamma.assign([1.0, 2.0, 0.5])
    bn.beta.assign([0.0, -1.0, 0.3])
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = bn(x, training=True)
      loss = tf.reduce_sum(y * y * weights)
    grads = tape.gradient(loss, [x, bn.gamma.value, bn.beta.value])
    results.append([y] + grads + [bn.moving_mean, bn.moving_variance,
                                  bn(x, training=False)])
  for fused, unfused in zip(*results):
    np.testing.assert_allclose(np.asarray(fused), np.asarray(unfused),
                               rtol=1e-4, atol=1e-5)


def test_fused_batch_norm_is_one_op_each_way():
  bn = _Bn().Instantiate()

  @tf.function
  def Step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = bn(x, training=True)
    return tape.gradient(y, x)
  ops = [op.type for op in Step.get_concrete_function(
      tf.TensorSpec([2, 4, 4, 3])).graph.get_operations()]
  assert ops.count('FusedBatchNormV3') == 1
  assert ops.count('FusedBatchNormGradV3') == 1
  assert 'Mean' not in ops  # No separate moments.


def test_fused_deferred_batch_norm_equals_full_batch_update():
  x = _Image(5)
  full = _Bn().Instantiate()
  full(x, training=True)
  piped = _Bn().Instantiate()
  collector = base_layer.DeferredStatsCollector()
  with base_layer.CollectDeferredStats(collector):
    for s in (x[:1], x[1:3], x[3:]):
      piped(s, training=True)
  collector.Apply()
  np.testing.assert_allclose(piped.moving_mean.numpy(),
                             full.moving_mean.numpy(), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(piped.moving_variance.numpy(),
                             full.moving_variance.numpy(), rtol=1e-5)
  np.testing.assert_allclose(
      full.moving_variance.numpy(), 0.9 + 0.1 * x.var(axis=(0, 1, 2)),
      rtol=1e-5)


def test_batch_norm_of_one_element_per_channel_has_zero_variance():
  """A single element per channel: the kernel would return its corrected
  variance; the layer normalizes with separate ops, as unfused."""
  bn = _Bn().Instantiate()
  bn(tf.ones([1, 1, 1, 3]), training=True)
  np.testing.assert_allclose(bn.moving_variance.numpy(), [0.9] * 3)


def test_merge_moments_of_unequal_parts_equals_the_whole_batch():
  """Parts of 1, 3 and 6 rows merge into the whole batch's moments, each
  part weighted by its count; the merge's ops do not grow with the parts."""
  x = _Data((10, 3))
  rows = [(0, 1), (1, 4), (4, 10)]
  records = [(float(b - a),
              {'mean': x[a:b].mean(0), 'variance': x[a:b].var(0)})
             for a, b in rows]
  mean, variance = layers.normalization.MergeMoments(records)
  np.testing.assert_allclose(mean.numpy(), x.mean(0), rtol=1e-5)
  np.testing.assert_allclose(variance.numpy(), x.var(0), rtol=1e-5)

  def NumOps(parts):
    def Merge():
      part = {'mean': tf.zeros([3]), 'variance': tf.ones([3])}
      return layers.normalization.MergeMoments(
          [(tf.constant(1.0), part)] * parts)
    graph = tf.function(Merge).get_concrete_function().graph
    return sum(op.type not in ('Const', 'Pack')
               for op in graph.get_operations())
  assert NumOps(2) == NumOps(16)
