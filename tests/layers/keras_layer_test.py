"""Tests of KerasLayer: params round trips, values, building and costs."""

import keras
import numpy as np
import tensorflow as tf

from tfpipe import layers


def _ConvParams():
  return layers.KerasLayer.Params().Set(
      name='conv', cls=keras.layers.Conv2D,
      args=dict(filters=8, kernel_size=3, activation='relu'))


def testParamsKeepKerasClassAndInstantiateWrapper():
  p = _ConvParams()
  assert p.cls is keras.layers.Conv2D
  assert p.target_cls is layers.KerasLayer
  assert isinstance(p.Instantiate(), layers.KerasLayer)


def testTextRoundTripAndCopy():
  p = _ConvParams()
  text = p.ToText()
  assert 'cls : keras.' in text and 'Conv2D' in text
  restored = layers.KerasLayer.Params().FromText(text)
  assert restored == p
  assert restored.cls is keras.layers.Conv2D
  assert restored.args == {'filters': 8, 'kernel_size': 3, 'activation': 'relu'}
  copy = p.Copy()
  assert copy == p and copy.cls is keras.layers.Conv2D
  copy.args['filters'] = 2
  assert p.args['filters'] == 8
  # Nested in a container the wrapper survives a round trip too.
  seq = layers.SequentialLayer.Params().Set(name='seq', sub=[p])
  again = seq.Copy().FromText(seq.ToText())
  assert again == seq


def testMatchesBareKerasLayer():
  wrapper = _ConvParams().Instantiate()
  wrapper.build((None, 6, 6, 3))
  bare = keras.layers.Conv2D(filters=8, kernel_size=3, activation='relu')
  bare.build((None, 6, 6, 3))
  rng = np.random.RandomState(0)
  for v in bare.weights:
    v.assign(rng.randn(*v.shape).astype(np.float32))
  wrapper.layer.set_weights(bare.get_weights())
  x = rng.randn(2, 6, 6, 3).astype(np.float32)
  np.testing.assert_allclose(wrapper(x).numpy(), bare(x).numpy(), rtol=1e-5)
  want = tf.nn.relu(tf.nn.conv2d(x, bare.kernel, 1, 'VALID') + bare.bias)
  np.testing.assert_allclose(wrapper(x).numpy(), want.numpy(), rtol=1e-5,
                             atol=1e-5)


def testTrainingIsPassedThrough():
  p = layers.KerasLayer.Params().Set(
      name='drop', cls=keras.layers.Dropout, args=dict(rate=0.5, seed=1))
  drop = p.Instantiate()
  x = np.ones((8, 16), np.float32)
  np.testing.assert_array_equal(drop(x, training=False).numpy(), x)
  assert (drop(x, training=True).numpy() == 0).any()


def testMetaMatchesOutputShapeAndParams():
  p = _ConvParams()
  meta = layers.KerasLayer.FPropMeta(p, (None, 6, 6, 3))
  assert meta.output_shape == (None, 4, 4, 8)
  assert meta.num_params == 3 * 3 * 3 * 8 + 8
  assert meta.flops == 2 * meta.num_params * 4 * 4
  assert meta.activation_bytes == 4 * 4 * 4 * 8
  layer = p.Instantiate()
  assert tuple(layer(np.ones((2, 6, 6, 3), np.float32)).shape) == (2, 4, 4, 8)
  flat = layers.KerasLayer.Params().Set(name='flat', cls=keras.layers.Flatten)
  flat_meta = layers.KerasLayer.FPropMeta(flat, (None, 4, 4, 8))
  assert flat_meta.output_shape == (None, 128)
  assert flat_meta.num_params == 0


def testBuildUnderDeviceScope():
  layer = _ConvParams().Instantiate()
  with tf.device('/CPU:4'):
    layer.build((None, 6, 6, 3))
  assert len(layer.weights) == 2
  assert all(v.value.device.endswith('CPU:4') for v in layer.weights)
