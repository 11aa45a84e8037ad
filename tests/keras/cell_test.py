"""KerasCellLayer: batch norm per micro-batch with deferred statistics, and
dropout that a re-materialized forward reproduces."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tests.keras import model_test

DEVICES = model_test.DEVICES


def _ConvBn(seed=0):
  keras.utils.set_random_seed(seed)
  i = keras.Input((6, 6, 3))
  h = keras.layers.Conv2D(4, 3, name='c1')(i)
  h = keras.layers.BatchNormalization(name='bn1', momentum=0.8)(h)
  h = keras.layers.ReLU(name='r1')(h)
  h = keras.layers.Conv2D(4, 3, padding='same', name='c2')(h)
  h = keras.layers.BatchNormalization(name='bn2', momentum=0.8)(h)
  h = keras.layers.GlobalAveragePooling2D(name='gap')(h)
  return keras.Model(i, keras.layers.Dense(2, name='out')(h))


def _Data(n=10, seed=0):
  rng = np.random.RandomState(seed)
  return (rng.randn(n, 6, 6, 3).astype(np.float32) * 2 + 1,
          rng.randn(n, 2).astype(np.float32))


def _Pipeline(model, remat='always', m=4, balance=(3, 4)):
  pm = tfpipe.keras.pipeline(model, num_partitions=2, num_micro_batches=m,
                             devices=DEVICES[:2], balance=list(balance),
                             remat_policy=remat)
  pm.compile(loss='mse', run_eagerly=True)
  return pm


def _Stats(model):
  return {l.name: (l.moving_mean.numpy(), l.moving_variance.numpy())
          for l in model.layers
          if isinstance(l, keras.layers.BatchNormalization)}


def test_batch_norm_uses_each_micro_batchs_statistics():
  model = _ConvBn()
  pm = _Pipeline(model)
  assert pm.cell_plans[1].steps[0].name == 'c2'
  x, y = _Data()
  model_test._AssertGradientsEqual(pm, model, x, y, model_test._Mse, 4)


def _ExpectedStats(reference, x, sizes, momentum=0.8):
  """Moving stats after one update with the merged micro-batch statistics.

  Each batch norm's input is computed micro-batch by micro-batch (earlier
  batch norms normalise per micro-batch), then reduced as one batch.
  """
  expected = {}
  for layer in reference.layers:
    if not isinstance(layer, keras.layers.BatchNormalization):
      continue
    sub = keras.Model(reference.inputs, layer.input)
    parts, start = [], 0
    for size in sizes:
      parts.append(sub(x[start:start + size], training=True).numpy())
      start += size
    inputs = np.concatenate(parts)
    axes = tuple(range(inputs.ndim - 1))
    expected[layer.name] = (
        (1 - momentum) * inputs.mean(axes),
        momentum + (1 - momentum) * inputs.var(axes))
  return expected


def _AssertStats(model, expected):
  got = _Stats(model)
  for name, want in expected.items():
    for g, w in zip(got[name], want):
      np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6, err_msg=name)


def test_moving_statistics_get_one_merged_update_per_step():
  """Remat recomputes both cells; the moving averages still move once, by
  the statistics of the whole batch as the micro-batches saw it."""
  piped, reference = _ConvBn(seed=1), _ConvBn(seed=1)
  x, y = _Data(seed=1)
  _Pipeline(piped, remat='always', m=4).ComputeLossAndGradients(x, y)
  _AssertStats(piped, _ExpectedStats(reference, x, [3, 3, 2, 2]))


def test_fit_then_inference_uses_the_merged_statistics():
  piped, reference = _ConvBn(seed=2), _ConvBn(seed=2)
  x, y = _Data(seed=2)
  pm = _Pipeline(piped, m=3)
  pm.compile(optimizer='sgd', loss='mse', run_eagerly=True)
  pm.fit(x, y, batch_size=10, epochs=1, verbose=0, shuffle=False)
  _AssertStats(piped, _ExpectedStats(reference, x, [4, 3, 3]))
  np.testing.assert_allclose(pm.predict(x, verbose=0),
                             piped.predict(x, verbose=0), rtol=1e-5,
                             atol=1e-6)


def test_outside_a_step_batch_norm_updates_at_once():
  model = _ConvBn(seed=3)
  pm = _Pipeline(model)
  cell = pm.pipe.cells[0]
  x, _ = _Data(seed=3)
  before = _Stats(model)['bn1']
  key = cell.p.input_keys[0]
  cell({key: tf.constant(x)}, training=True)
  assert not np.allclose(_Stats(model)['bn1'][0], before[0])


def _DropoutModel(seed=0):
  keras.utils.set_random_seed(seed)
  i = keras.Input((8,))
  h = keras.layers.Dense(16, activation='relu', name='d1')(i)
  h = keras.layers.Dropout(0.5, name='drop')(h)
  h = keras.layers.Dense(16, activation='relu', name='d2')(h)
  return keras.Model(i, keras.layers.Dense(2, name='out')(h))


def test_dropout_mask_is_the_same_when_recomputed():
  rng = np.random.RandomState(0)
  x = rng.randn(8, 8).astype(np.float32)
  y = rng.randn(8, 2).astype(np.float32)
  grads = {}
  for remat in ('always', 'never'):
    model = _DropoutModel()
    pm = _Pipeline(model, remat, m=2, balance=(2, 2))
    grads[remat] = pm.ComputeLossAndGradients(x, y)[1]
    no_dropout = model_test.PlainGradients(
        model, x, y, model_test._Mse, 2) if remat == 'never' else None
  for a, b in zip(grads['always'], grads['never']):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # Dropout really dropped something (the gradients differ from a run
  # without it only through the mask; this just guards against a no-op).
  assert not all(np.allclose(a, b) for a, b in zip(grads['never'],
                                                   no_dropout))


class _Block(keras.layers.Layer):
  """A custom layer calling a batch norm and a dropout of its own."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(6, name='dense')
    self.bn = keras.layers.BatchNormalization(momentum=0.8, name='inner_bn')
    self.drop = keras.layers.Dropout(0.5, name='inner_drop')

  def build(self, input_shape):
    self.dense.build(input_shape)
    self.bn.build(input_shape[:-1] + (6,))

  def call(self, x, training=None):
    return self.drop(self.bn(self.dense(x), training=training),
                     training=training)


def _NestedModel(seed=0):
  keras.utils.set_random_seed(seed)
  i = keras.Input((5,))
  h = keras.layers.Dense(5, name='first')(i)
  h = _Block(name='block')(h)
  return keras.Model(i, keras.layers.Dense(2, name='out')(h))


def test_nested_batch_norm_and_dropout_are_exact_under_remat():
  """Inside a custom layer too: one merged update, the same recomputed mask."""
  rng = np.random.RandomState(4)
  x = rng.randn(10, 5).astype(np.float32)
  y = rng.randn(10, 2).astype(np.float32)
  grads, stats = {}, {}
  for remat in ('always', 'never'):
    model = _NestedModel()
    pm = _Pipeline(model, remat, m=3, balance=(2, 1))
    grads[remat] = pm.ComputeLossAndGradients(x, y)[1]
    bn = model.get_layer('block').bn
    stats[remat] = bn.moving_mean.numpy()
    # One update with the full batch's statistics of the bn's input.
    bn_input = model.get_layer('block').dense(model.get_layer('first')(x))
    np.testing.assert_allclose(stats[remat], 0.2 * np.mean(bn_input, 0),
                               rtol=1e-4, atol=1e-6)
  # atol: the bias of the dense layer before the batch norm has a zero
  # gradient (the norm subtracts it); both sides are float32 noise near 1e-7.
  for a, b in zip(grads['always'], grads['never']):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('layer', [
    lambda: keras.layers.GaussianDropout(0.3, name='rand'),
    lambda: keras.layers.AlphaDropout(0.3, name='rand'),
    lambda: keras.layers.SpatialDropout1D(0.3, name='rand'),
    lambda: keras.layers.LSTM(4, dropout=0.3, recurrent_dropout=0.3,
                              return_sequences=True, name='rand'),
    lambda: keras.layers.MultiHeadAttention(2, 2, dropout=0.3, name='rand'),
])
def test_random_layers_give_the_same_gradients_with_and_without_remat(layer):
  rng = np.random.RandomState(5)
  x = rng.randn(6, 3, 4).astype(np.float32)
  y = rng.randn(6, 2).astype(np.float32)
  grads = {}
  for remat in ('always', 'never'):
    keras.utils.set_random_seed(1)
    i = keras.Input((3, 4))
    random_layer = layer()
    h = keras.layers.Dense(4, name='before')(i)
    h = (random_layer(h, h) if isinstance(
        random_layer, keras.layers.MultiHeadAttention) else random_layer(h))
    h = keras.layers.Flatten(name='flat')(h)
    model = keras.Model(i, keras.layers.Dense(2, name='out')(h))
    pm = _Pipeline(model, remat, m=2, balance=(2, 2))
    grads[remat] = pm.ComputeLossAndGradients(x, y)[1]
  for a, b in zip(grads['always'], grads['never']):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
