"""Tests of AmoebaNet-D's cells and ops: shapes, exact cost model, wiring."""

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import layers
from tfpipe.layers import amoeba


def _NumVariables(layer):
  return sum(int(np.prod(v.shape)) for v in layer.trainable_variables)


def _Shapes(structure):
  return tf.nest.map_structure(lambda t: tuple(t.shape), structure)


@pytest.mark.parametrize('reduction, reduction_prev, size', [
    (False, False, 6), (False, True, 5), (True, False, 5), (True, True, 6)])
def test_cell_shapes_and_cost_model_match_the_built_cell(
    reduction, reduction_prev, size):
  prev_prev_size = 2 * size if reduction_prev else size
  p = layers.AmoebaCell.Params().Set(
      name='cell', prev_channels=12, prev_prev_channels=6, channels=8,
      reduction=reduction, reduction_prev=reduction_prev, random_seed=1)
  cell = p.Instantiate()
  inputs = (tf.random.stateless_normal((2, size, size, 12), [1, 2]),
            tf.random.stateless_normal((2, prev_prev_size, prev_prev_size, 6),
                                       [3, 4]))
  out, prev = cell(inputs, training=True)
  np.testing.assert_array_equal(prev, inputs[0])  # prev becomes prev_prev.
  out_size = -(-size // 2) if reduction else size
  assert out.shape == (2, out_size, out_size, 24 if reduction else 32)
  assert layers.AmoebaCell.FPropMeta(
      p, _Shapes(inputs)).output_shape == _Shapes((out, prev))
  meta = layers.AmoebaCell.FPropMeta(p, ((None, size, size, 12),
                                         (None, prev_prev_size,
                                          prev_prev_size, 6)))
  assert meta.num_params == _NumVariables(cell)
  assert meta.output_shape[0] == (None,) + tuple(out.shape[1:])
  assert meta.activation_bytes == 4 * (np.prod(out.shape[1:]) +
                                       np.prod(inputs[0].shape[1:]))
  assert meta.flops > 0


def _NormalCell(channels, random_seed):
  """A normal cell whose inputs and nodes all have `channels` channels."""
  return layers.AmoebaCell.Params().Set(
      name='cell', prev_channels=channels, prev_prev_channels=channels,
      channels=channels, random_seed=random_seed).Instantiate()


def test_first_cell_takes_one_tensor_as_both_inputs():
  cell = _NormalCell(8, random_seed=2)
  x = tf.random.stateless_normal((1, 4, 4, 8), [5, 6])
  np.testing.assert_allclose(cell(x, training=False)[0],
                             cell((x, x), training=False)[0])
  assert 'reduce_prev_prev' not in cell.children  # Same width: identity.


def test_cell_reads_both_previous_outputs():
  """The cell's output depends on prev and on prev_prev: the skip is wired."""
  cell = _NormalCell(4, random_seed=3)
  prev = tf.random.stateless_normal((1, 4, 4, 4), [1, 1])
  prev_prev = tf.random.stateless_normal((1, 4, 4, 4), [2, 2])
  base = cell((prev, prev_prev), training=False)[0]
  for changed in ((prev + 1.0, prev_prev), (prev, prev_prev + 1.0)):
    assert not np.allclose(cell(changed, training=False)[0], base)


def test_factorized_reduce_sees_every_pixel():
  p = layers.FactorizedReduce.Params().Set(
      name='fr', in_channels=3, out_channels=4, random_seed=4)
  layer = p.Instantiate()
  x = np.abs(np.random.RandomState(0).randn(1, 5, 5, 3)).astype(np.float32)
  out = layer(x, training=True)
  assert out.shape == (1, 3, 3, 4)
  assert layers.FactorizedReduce.FPropMeta(p, (None, 5, 5, 3)).output_shape == (
      None, 3, 3, 4)
  for pixel in ((0, 0), (1, 1)):  # An even and an odd pixel.
    changed = x.copy()
    changed[0][pixel] += 3.0
    assert not np.allclose(layer(changed, training=False),
                           layer(x, training=False))
  assert layers.FactorizedReduce.FPropMeta(
      p, (None, 5, 5, 3)).num_params == _NumVariables(layer)


def test_average_pool_ignores_padding_and_max_pool_matches_tf():
  avg = layers.Pool2DLayer.Params().Set(name='avg', pooling='avg',
                                        window=3).Instantiate()
  np.testing.assert_allclose(avg(tf.ones((1, 4, 4, 2))), np.ones((1, 4, 4, 2)))
  p = layers.Pool2DLayer.Params().Set(name='max', window=2, stride=2)
  x = np.random.RandomState(1).randn(2, 5, 5, 3).astype(np.float32)
  want = tf.nn.max_pool2d(x, 2, 2, 'SAME')
  np.testing.assert_array_equal(p.Instantiate()(x), want)
  assert layers.Pool2DLayer.FPropMeta(p, (None, 5, 5, 3)).output_shape == (
      None, 3, 3, 3)


@pytest.mark.parametrize('op', amoeba.OPS)
def test_every_op_keeps_channels_and_costs_match(op):
  for stride in (1, 2):
    p = amoeba.OpParams(op, 8, stride, name=op, random_seed=5)
    x = tf.random.stateless_normal((2, 6, 6, 8), [7, 8])
    if p is None:
      assert op == 'none' and stride == 1
      continue
    layer = p.Instantiate()
    y = layer(x, training=True)
    assert y.shape == (2, 6 // stride, 6 // stride, 8)
    meta = p.target_cls.FPropMeta(p, (2, 6, 6, 8))
    assert meta.output_shape == tuple(y.shape)
    assert meta.num_params == _NumVariables(layer)


def test_head_pools_the_cell_output():
  p = layers.ClassifierHead.Params().Set(name='head', in_channels=6,
                                         num_classes=3, random_seed=6)
  head = p.Instantiate()
  out = tf.random.stateless_normal((2, 3, 3, 6), [9, 9])
  logits = head((out, tf.zeros((2, 6, 6, 4))), training=False)
  want = tf.reduce_mean(tf.nn.relu(out), [1, 2]) @ head.logits.w + (
      head.logits.b)
  np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-6)
  meta = layers.ClassifierHead.FPropMeta(
      p, ((None, 3, 3, 6), (None, 6, 6, 4)))
  assert meta.output_shape == (None, 3)
  assert meta.num_params == _NumVariables(head) == 6 * 3 + 3


@pytest.mark.parametrize('layer_params, message', [
    (layers.FactorizedReduce.Params().Set(in_channels=4, out_channels=3),
     'even out_channels'),
    (layers.Pool2DLayer.Params().Set(pooling='min'),
     'pooling must be max or avg'),
    (layers.AmoebaCell.Params().Set(prev_channels=4, prev_prev_channels=4,
                                    channels=5), 'channels must be even'),
    (layers.ReluConvBn.Params().Set(in_channels=0, out_channels=3),
     'in_channels and out_channels must be > 0'),
])
def test_bad_params_name_the_param(layer_params, message):
  with pytest.raises(ValueError, match=message):
    layer_params.Set(name='bad').Instantiate()
