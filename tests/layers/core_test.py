"""Tests of FCLayer, DropoutLayer and SequentialLayer (values, costs, fit)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import base_layer
from tfpipe import layers


def _Fc(name, din, dout, act='relu', **kw):
  return layers.FCLayer.Params().Set(
      name=name, input_dims=din, output_dims=dout, activation=act,
      random_seed=1, **kw)


@pytest.mark.parametrize('act,fn', [
    ('relu', lambda x: np.maximum(x, 0)),
    ('tanh', np.tanh),
    ('none', lambda x: x),
])
def test_fc_matches_numpy(act, fn):
  fc = _Fc('fc', 3, 4, act).Instantiate()
  fc.b.assign(np.arange(4, dtype=np.float32) * 0.1)
  x = np.random.RandomState(0).randn(2, 5, 3).astype(np.float32)
  want = fn(x @ fc.w.numpy() + fc.b.numpy())
  np.testing.assert_allclose(fc(x).numpy(), want, rtol=1e-5, atol=1e-6)


def test_fc_no_bias_and_meta():
  p = _Fc('fc', 3, 4, has_bias=False)
  fc = p.Instantiate()
  assert fc.b is None and len(fc.trainable_weights) == 1
  x = np.ones((2, 3), np.float32)
  np.testing.assert_allclose(fc(x).numpy(), np.maximum(x @ fc.w.numpy(), 0),
                             rtol=1e-6)
  meta = layers.FCLayer.FPropMeta(p, (None, 7, 3))
  assert meta.output_shape == (None, 7, 4)
  assert meta.num_params == 12
  assert meta.flops == 2 * 7 * 3 * 4
  assert meta.activation_bytes == 4 * 7 * 4
  assert tuple(fc(np.ones((2, 7, 3), np.float32)).shape) == (2, 7, 4)


def test_dropout_identity_outside_training():
  d = layers.DropoutLayer.Params().Set(name='d', keep_prob=0.5).Instantiate()
  x = np.ones((4, 8), np.float32)
  np.testing.assert_array_equal(d(x).numpy(), x)
  np.testing.assert_array_equal(d(x, training=False).numpy(), x)


def test_dropout_stateless_mask_is_deterministic():
  d = layers.DropoutLayer.Params().Set(name='d', keep_prob=0.5).Instantiate()
  x = np.ones((16, 32), np.float32)
  with base_layer.StepSeed(tf.constant([1, 2])):
    a = d(x, training=True).numpy()
    b = d(x, training=True).numpy()
  with base_layer.StepSeed(tf.constant([3, 4])):
    c = d(x, training=True).numpy()
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  # Kept values are scaled by 1/keep_prob; about half are kept.
  assert set(np.unique(a)) <= {0.0, 2.0}
  assert 0.3 < (a > 0).mean() < 0.7


def test_dropout_without_step_seed_varies_and_is_seedable():
  def Masks(seed):
    d = layers.DropoutLayer.Params().Set(
        name='d', keep_prob=0.5, random_seed=seed).Instantiate()
    x = np.ones((16, 32), np.float32)
    return d(x, training=True).numpy(), d(x, training=True).numpy()
  a1, a2 = Masks(5)
  b1, _ = Masks(5)
  assert not np.array_equal(a1, a2)  # The generator advances.
  np.testing.assert_array_equal(a1, b1)  # Same random_seed, same masks.


def test_dropout_recompute_grad_matches():
  d = layers.DropoutLayer.Params().Set(name='d', keep_prob=0.5).Instantiate()
  x = tf.Variable(np.random.RandomState(0).randn(8, 16).astype(np.float32))

  def Fn(inputs):
    return tf.reduce_sum(tf.square(d(tf.sin(inputs), training=True)))

  with base_layer.StepSeed(tf.constant([7, 9])):
    with tf.GradientTape() as tape:
      plain = Fn(x)
    plain_grad = tape.gradient(plain, x)
    with tf.GradientTape() as tape:
      remat = tf.recompute_grad(Fn)(x)
    remat_grad = tape.gradient(remat, x)
  np.testing.assert_allclose(remat.numpy(), plain.numpy(), rtol=1e-6)
  np.testing.assert_allclose(remat_grad.numpy(), plain_grad.numpy(),
                             rtol=1e-6)


def test_dropout_meta():
  p = layers.DropoutLayer.Params().Set(name='d', keep_prob=0.9)
  meta = layers.DropoutLayer.FPropMeta(p, (None, 3))
  assert meta.output_shape == (None, 3) and meta.num_params == 0


def _Mlp():
  return layers.SequentialLayer.Params().Set(name='mlp', sub=[
      _Fc('fc0', 4, 8), _Fc('fc1', 8, 2, 'none')])


def test_sequential_matches_composition():
  mlp = _Mlp().Instantiate()
  x = np.random.RandomState(1).randn(3, 4).astype(np.float32)
  fc0, fc1 = mlp.sub
  h = np.maximum(x @ fc0.w.numpy() + fc0.b.numpy(), 0)
  want = h @ fc1.w.numpy() + fc1.b.numpy()
  np.testing.assert_allclose(mlp(x).numpy(), want, rtol=1e-5, atol=1e-6)


def test_sequential_meta_sums_children():
  p = _Mlp()
  meta = layers.SequentialLayer.FPropMeta(p, (None, 4))
  assert meta.output_shape == (None, 2)
  assert meta.num_params == 4 * 8 + 8 + 8 * 2 + 2
  assert meta.flops == (layers.FCLayer.FPropMeta(p.sub[0], (None, 4)).flops +
                        layers.FCLayer.FPropMeta(p.sub[1], (None, 8)).flops)
  mlp = p.Instantiate()
  assert meta.num_params == sum(
      int(np.prod(v.shape)) for v in mlp.trainable_weights)
  assert tuple(mlp(np.ones((5, 4), np.float32)).shape) == (5, 2)


def test_sequential_places_variables_on_device():
  p = layers.SequentialLayer.Params().Set(name='seq', sub=[
      layers.KerasLayer.Params().Set(
          name='conv', cls=keras.layers.Conv2D,
          args=dict(filters=4, kernel_size=3, padding='same')),
      layers.KerasLayer.Params().Set(name='flat', cls=keras.layers.Flatten),
      _Fc('fc', 6 * 6 * 4, 3),
      layers.KerasLayer.Params().Set(
          name='dense', cls=keras.layers.Dense, args=dict(units=2)),
  ])
  with tf.device('/CPU:1'):
    seq = p.Instantiate()
    seq.build((None, 6, 6, 3))
  assert len(seq.weights) == 6
  for v in seq.weights:
    assert v.value.device.endswith('CPU:1'), (v.path, v.value.device)
  out = seq(np.ones((2, 6, 6, 3), np.float32))
  assert tuple(out.shape) == (2, 2)
  assert layers.SequentialLayer.FPropMeta(p, (None, 6, 6, 3)).output_shape == (
      None, 2)


def test_base_layer_model_trains_with_fit():
  keras.utils.set_random_seed(0)
  model = keras.Sequential([_Mlp().Instantiate()])
  model.compile(optimizer=keras.optimizers.Adam(0.05), loss='mse')
  rng = np.random.RandomState(0)
  x = rng.randn(64, 4).astype(np.float32)
  y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * 0.5], axis=1)
  history = model.fit(x, y, epochs=15, batch_size=16, verbose=0)
  losses = history.history['loss']
  assert losses[-1] < 0.5 * losses[0], losses


def _DropoutInStep(layer, x, step=1, micro_batch=0, offset=0):
  with base_layer.StepSeed(tf.constant([step, micro_batch], tf.int64),
                           offset):
    return layer(x, training=True).numpy()


def test_dropout_mask_does_not_depend_on_the_micro_batch_split():
  """Per-example masks: any split with the right offsets gives the same mask."""
  d = layers.DropoutLayer.Params().Set(name='d', keep_prob=0.5).Instantiate()
  x = np.ones((10, 3, 4), np.float32)
  whole = _DropoutInStep(d, x)
  for sizes in ([10], [4, 3, 3], [1, 9], [3, 3, 2, 2]):
    parts, start = [], 0
    for m, size in enumerate(sizes):
      parts.append(_DropoutInStep(d, x[start:start + size], micro_batch=m,
                                  offset=start))
      start += size
    np.testing.assert_array_equal(np.concatenate(parts), whole,
                                  err_msg=str(sizes))
  assert not np.array_equal(_DropoutInStep(d, x, step=2), whole)
  # Without an offset the mask is drawn per micro-batch (still repeatable).
  with base_layer.StepSeed(tf.constant([1, 0], tf.int64)):
    a = d(x, training=True).numpy()
    b = d(x, training=True).numpy()
  np.testing.assert_array_equal(a, b)


def test_dropout_mask_is_the_same_in_any_cell():
  """Masks follow the layer's path inside its cell, not the cell's name."""
  def Mask(cell_name):
    cell = layers.SequentialLayer.Params().Set(name=cell_name, sub=[
        layers.DropoutLayer.Params().Set(name='drop', keep_prob=0.5)
    ]).Instantiate()
    return _DropoutInStep(cell, np.ones((4, 6), np.float32))
  np.testing.assert_array_equal(Mask('cell0'), Mask('cell2'))
  other = layers.DropoutLayer.Params().Set(name='other', keep_prob=0.5)
  assert not np.array_equal(
      _DropoutInStep(other.Instantiate(), np.ones((4, 6), np.float32)),
      Mask('cell0'))
