"""Tests of gpipe.UnpipelinedReference: the plain model a pipeline must equal.

Protected properties: the reference starts from the pipeline's values
(trainable and not), even when the layers were seeded at random; it lists
its variables in the pipeline's order under the pipeline's paths, which name
the layers and not the cells, so they are unique and the same for any K; the
pipeline's loss and gradients equal the reference's; lazily built Keras
layers are matched once both are built; and a mismatch is refused, naming
the variables.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import gpipe
from tfpipe import layers

DIM = 8
BATCH = 6


def _Blocks(num_blocks=8):
  # No random_seed: every instantiation draws other initial values.
  return [layers.TransformerLayer.Params().Set(
      name=f'block_{i}', input_dim=DIM, num_heads=2, hidden_dim=16)
          for i in range(num_blocks)]


def _Pipeline(layer_params, k, m=2, balance='params', input_shape=None):
  cells = gpipe.PartitionSequentialLayers(layer_params, k, balance=balance)
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=m,
      devices=[f'/CPU:{i}' for i in range(k)]).Instantiate()
  if input_shape is not None:
    pipe.build(input_shape)
  return pipe


def _Loss(outputs, targets):
  return tf.reduce_mean(tf.square(outputs - targets))


def test_variable_paths_name_the_layers_and_do_not_depend_on_k():
  paths = {}
  for k in (1, 4):
    pipe = _Pipeline(_Blocks(), k)
    paths[k] = [v.path for v in pipe.trainable_variables]
  assert paths[1] == paths[4]
  assert len(set(paths[1])) == len(paths[1])
  # Each block's feed-forward weight once, named after its block.
  ffn = [p for p in paths[1] if p.endswith('ffn_in/w')]
  assert ffn == [f'block_{i}/ffn_in/w' for i in range(8)]


def test_reference_starts_from_the_pipelines_values_in_its_order():
  pipe = _Pipeline(_Blocks(), 4)
  ref = gpipe.UnpipelinedReference(pipe, device='/CPU:7')
  assert isinstance(ref, layers.SequentialLayer)
  assert [v.path for v in ref.trainable_variables] == [
      v.path for v in pipe.trainable_variables]
  for a, b in zip(ref.trainable_variables, pipe.trainable_variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert a.value.device.endswith('CPU:7'), a.path
  # A copy: changing the reference leaves the pipeline alone.
  ref.trainable_variables[0].assign_add(tf.ones_like(
      ref.trainable_variables[0]))
  assert not np.array_equal(ref.trainable_variables[0].numpy(),
                            pipe.trainable_variables[0].numpy())


def test_pipeline_loss_and_gradients_equal_the_reference():
  params = [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=DIM, output_dims=DIM, activation='tanh')
            for i in range(4)]
  pipe = _Pipeline(params, 2, m=3)
  ref = gpipe.UnpipelinedReference(pipe)
  x = tf.random.stateless_normal([BATCH, DIM], seed=[1, 2])
  y = tf.random.stateless_normal([BATCH, DIM], seed=[3, 4])
  out = pipe.ComputeLossAndGradients(x, y, _Loss)
  with tf.GradientTape() as tape:
    loss = _Loss(ref(x, training=True), y)
  grads = tape.gradient(loss, ref.trainable_variables)
  np.testing.assert_allclose(out.loss.numpy(), loss.numpy(), rtol=1e-5)
  assert len(out.gradients) == len(grads)
  for a, b, v in zip(out.gradients, grads, ref.trainable_variables):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6,
                               err_msg=v.path)


def test_statistics_and_lazily_built_keras_layers_are_copied():
  params = [
      layers.KerasLayer.Params().Set(
          name='dense', cls=keras.layers.Dense, args=dict(units=DIM)),
      layers.BatchNormLayer.Params().Set(name='bn', dim=DIM),
      layers.FCLayer.Params().Set(name='fc', input_dims=DIM, output_dims=DIM),
  ]
  pipe = _Pipeline(params, 2, balance=[1, 2], input_shape=(None, DIM))
  for v in pipe.non_trainable_variables:
    if 'moving_mean' in v.path:
      v.assign(tf.fill(v.shape, 3.0))
  with pytest.raises(ValueError, match=r"only in the pipeline: \['dense/"
                     r"dense/bias', 'dense/dense/kernel'\].*input_shape"):
    gpipe.UnpipelinedReference(pipe)
  ref = gpipe.UnpipelinedReference(pipe, input_shape=(None, DIM))
  assert [v.path for v in ref.variables] == [
      v.path for cell in pipe.cells for v in cell.variables]
  for a, b in zip(ref.variables, [v for c in pipe.cells for v in c.variables]):
    np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
  x = tf.random.stateless_normal([BATCH, DIM], seed=[5, 6])
  np.testing.assert_allclose(ref(x, training=False).numpy(),
                             pipe(x, training=False).numpy(), rtol=1e-5,
                             atol=1e-6)


def test_repeated_paths_are_refused_naming_them():
  params = [layers.FCLayer.Params().Set(name='fc', input_dims=DIM,
                                        output_dims=DIM) for _ in range(2)]
  pipe = _Pipeline(params, 2)
  with pytest.raises(ValueError, match="path 'fc/w' repeats; give the layers "
                     'unique names'):
    gpipe.UnpipelinedReference(pipe)
