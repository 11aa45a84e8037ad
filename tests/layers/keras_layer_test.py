"""Tests of KerasLayer: params round trips, values, building, costs, and exact
randomness and batch-norm statistics inside a pipeline."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import base_layer
from tfpipe import gpipe
from tfpipe import layers


def _ConvParams():
  return layers.KerasLayer.Params().Set(
      name='conv', cls=keras.layers.Conv2D,
      args=dict(filters=8, kernel_size=3, activation='relu'))


def test_params_keep_keras_class_and_instantiate_wrapper():
  p = _ConvParams()
  assert p.cls is keras.layers.Conv2D
  assert p.target_cls is layers.KerasLayer
  assert isinstance(p.Instantiate(), layers.KerasLayer)


def test_text_round_trip_and_copy():
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


def test_matches_bare_keras_layer():
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


def test_training_is_passed_through():
  p = layers.KerasLayer.Params().Set(
      name='drop', cls=keras.layers.Dropout, args=dict(rate=0.5, seed=1))
  drop = p.Instantiate()
  x = np.ones((8, 16), np.float32)
  np.testing.assert_array_equal(drop(x, training=False).numpy(), x)
  assert (drop(x, training=True).numpy() == 0).any()


def test_meta_matches_output_shape_and_params():
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


def test_build_under_device_scope():
  layer = _ConvParams().Instantiate()
  with tf.device('/CPU:4'):
    layer.build((None, 6, 6, 3))
  assert len(layer.weights) == 2
  assert all(v.value.device.endswith('CPU:4') for v in layer.weights)


# ---- inside a pipeline: randomness and state stay exact ----------------------


def _Fc(name, dims, seed):
  return layers.FCLayer.Params().Set(name=name, input_dims=dims,
                                     output_dims=dims, activation='none',
                                     random_seed=seed)


def _TwoCellPipe(first_layer, executor='graph', remat_policy='always',
                 num_micro_batches=2, dims=8):
  """[first_layer, fc0] on /CPU:0 | [fc1] on /CPU:1."""
  cells = [
      gpipe.FeatureExtractionLayer.Params().Set(
          name='cell0', sub=[first_layer, _Fc('fc0', dims, 1)]),
      gpipe.FeatureExtractionLayer.Params().Set(
          name='cell1', sub=[_Fc('fc1', dims, 2)])]
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches,
      devices=['/CPU:0', '/CPU:1'], remat_policy=remat_policy,
      executor=executor).Instantiate()
  pipe.build((None, dims))
  return pipe


def _Mse(outputs, targets):
  return tf.reduce_mean(tf.square(outputs - targets))


@pytest.mark.parametrize('executor', ['graph', 'threads'])
def test_wrapped_dropout_gradient_is_exact_under_remat(executor):
  """x -> Dropout -> FC0 (W0 = I) | FC1: dL/dW0 = dL/dW1 @ W1^T exactly.

  FC0 sees the dropped-out x and FC1 sees FC0's output, which is the same
  tensor since W0 = I; the identity holds only if the recomputed forward
  drops the same units as the first one (a new mask gave a relative error
  of 0.9).
  """
  drop = layers.KerasLayer.Params().Set(
      name='drop', cls=keras.layers.Dropout, args=dict(rate=0.5))
  pipe = _TwoCellPipe(drop, executor)
  fc0, fc1 = pipe.cells[0].sub[1], pipe.cells[1].sub[0]
  fc0.w.assign(np.eye(8, dtype=np.float32))
  rng = np.random.RandomState(0)
  x = rng.randn(6, 8).astype(np.float32)
  y = rng.randn(6, 8).astype(np.float32)
  out = pipe.ComputeLossAndGradients(x, y, _Mse)
  grads = {id(v): g for v, g in zip(pipe.trainable_variables, out.gradients)}
  want = np.asarray(grads[id(fc1.w)]) @ fc1.w.numpy().T
  np.testing.assert_allclose(np.asarray(grads[id(fc0.w)]), want, rtol=1e-5,
                             atol=1e-6 * np.abs(want).max())
  # The mask dropped something (else the identity holds trivially).
  no_drop = x @ fc1.w.numpy()
  assert not np.isclose(float(out.loss), float(_Mse(no_drop, y)), rtol=1e-3)


def test_wrapped_batch_norm_makes_one_full_batch_update_per_step():
  """M=3 with remat: the moving statistics move once, by the full batch's."""
  bn = layers.KerasLayer.Params().Set(
      name='bn', cls=keras.layers.BatchNormalization, args=dict(momentum=0.8))
  pipe = _TwoCellPipe(bn, num_micro_batches=3)
  layer = pipe.cells[0].sub[0].layer
  x = np.random.RandomState(1).randn(10, 8).astype(np.float32) * 3 + 2
  pipe.ComputeLossAndGradients(x, np.zeros_like(x), _Mse)
  np.testing.assert_allclose(layer.moving_mean.numpy(), 0.2 * x.mean(0),
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(layer.moving_variance.numpy(),
                             0.8 + 0.2 * x.var(0), rtol=1e-5)


def test_wrapped_random_layer_draws_the_same_in_any_cell():
  """The seed path leaves the cell out, so K does not change the draws."""
  def Draw(cell_name, seq_name):
    p = layers.SequentialLayer.Params().Set(name=cell_name, sub=[
        layers.SequentialLayer.Params().Set(name=seq_name, sub=[
            layers.KerasLayer.Params().Set(
                name='noise', cls=keras.layers.GaussianNoise,
                args=dict(stddev=1.0))])])
    cell = p.Instantiate()
    assert cell.sub[0].sub[0].SeedPath() == 'noise'
    with base_layer.StepSeed(tf.constant([3, 0], tf.int64), 0):
      return cell(tf.zeros((4, 5)), training=True).numpy()
  np.testing.assert_array_equal(Draw('cell0', 'a'), Draw('cell3', 'b'))
