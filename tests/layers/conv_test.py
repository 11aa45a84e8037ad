"""Tests of Conv2DLayer against tf.nn.conv2d, and of its cost model."""

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import layers


@pytest.mark.parametrize('padding,stride', [('SAME', (1, 1)),
                                            ('VALID', (2, 2)),
                                            ('SAME', (2, 1))])
def test_conv_matches_tf_nn(padding, stride):
  p = layers.Conv2DLayer.Params().Set(
      name='conv', filter_shape=(3, 3, 2, 4), filter_stride=stride,
      padding=padding, activation='relu', random_seed=3)
  conv = p.Instantiate()
  conv.b.assign(np.linspace(-0.2, 0.2, 4).astype(np.float32))
  x = np.random.RandomState(0).randn(2, 7, 6, 2).astype(np.float32)
  want = tf.nn.relu(
      tf.nn.conv2d(x, conv.w.numpy(), strides=[1, *stride, 1],
                   padding=padding) + conv.b.numpy())
  got = conv(x)
  np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
  meta = layers.Conv2DLayer.FPropMeta(p, (None, 7, 6, 2))
  assert meta.output_shape == (None,) + tuple(got.shape[1:])
  positions = int(np.prod(got.shape[1:3]))
  assert meta.flops == 2 * positions * 3 * 3 * 2 * 4 + positions * 4
  assert meta.num_params == 3 * 3 * 2 * 4 + 4
  assert meta.activation_bytes == 4 * positions * 4


def test_conv_no_bias_matches_numpy():
  conv = layers.Conv2DLayer.Params().Set(
      name='conv', filter_shape=(1, 1, 3, 2), has_bias=False,
      activation='none').Instantiate()
  x = np.random.RandomState(1).randn(1, 2, 2, 3).astype(np.float32)
  want = np.einsum('bhwc,co->bhwo', x, conv.w.numpy()[0, 0])
  np.testing.assert_allclose(conv(x).numpy(), want, rtol=1e-5, atol=1e-6)


def test_conv_variables_on_device():
  with tf.device('/CPU:2'):
    conv = layers.Conv2DLayer.Params().Set(
        name='conv', filter_shape=(3, 3, 1, 1)).Instantiate()
  assert all(v.value.device.endswith('CPU:2') for v in conv.weights)
