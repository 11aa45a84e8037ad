"""The B/W split: each part computes only its own share, and all is exact.

What makes a zero-bubble schedule pay off is that B (the input gradient)
and W (the weight gradients) together cost one backward: neither redoes
the other's work nor the forward. These tests count the kernels in each
part and compare the gradients with one GradientTape over the whole cell.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import gpipe
from tfpipe import layers

_MATMULS = ('MatMul', 'BatchMatMulV2', 'Einsum')


def _Stage(layer_params, batch_shape):
  cells = gpipe.PartitionSequentialLayers(layer_params, 1, balance='params')
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=1,
      devices=['/CPU:0']).Instantiate()
  pipe.build(batch_shape)
  return pipe.runtime.stages[0][0]


def _Split(stage, x, dy, need_dx=True):
  seed = tf.constant([1, 2], tf.int64)
  offset = tf.constant(0, tf.int64)
  y, _, recorded = stage.SplitForward(x, seed, offset, True, need_dx)
  dx, state, _ = stage.InputGradient(recorded, dy)
  return y, dx, recorded.program.WeightGradient(state), recorded.program


def _TapeGradients(stage, x, dy):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = stage.cell(x, training=True)
  return y, tape.gradient(y, [x] + stage.variables, output_gradients=dy)


def _Count(op_types, kinds=_MATMULS):
  return sum(n for t, n in collections.Counter(op_types).items() if t in kinds)


def _FcLayers(num_layers, dim=8):
  return [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=dim, output_dims=dim, activation='tanh',
      random_seed=i) for i in range(num_layers)]


@pytest.mark.parametrize('need_dx', [True, False])
def test_dense_layers_b_has_the_input_matmuls_and_w_the_weight_matmuls(
    need_dx):
  stage = _Stage(_FcLayers(3), (5, 8))
  x = tf.random.stateless_normal([5, 8], seed=[1, 2])
  dy = [tf.random.stateless_normal([5, 8], seed=[3, 4])]
  y, dx, dw, program = _Split(stage, x, dy, need_dx)
  ref_y, ref = _TapeGradients(stage, x, dy)
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-7)
  if need_dx:
    np.testing.assert_allclose(dx[0], ref[0], rtol=1e-5, atol=1e-6)
  else:
    assert not dx
  for got, want in zip(dw, ref[1:]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  ops = program.OpTypes()
  assert _Count(ops['F']) == 3
  # dh = dz W^T for each layer; the first layer's only when dx is wanted.
  assert _Count(ops['B']) == (3 if need_dx else 2)
  assert 'TanhGrad' in ops['B'] and 'TanhGrad' not in ops['W']
  # dW = h^T dz and db = sum(dz), reading dz from B: nothing recomputed.
  assert _Count(ops['W']) == 3 and ops['W'].count('Sum') == 3
  assert _Count(ops['B'] + ops['W'], ('Tanh',)) == 0


def test_transformer_block_b_and_w_together_run_one_backward():
  params = [layers.TransformerLayer.Params().Set(
      name='xf', input_dim=8, num_heads=2, hidden_dim=16)]
  stage = _Stage(params, (2, 3, 8))
  x = tf.random.stateless_normal([2, 3, 8], seed=[1, 2])
  dy = [tf.random.stateless_normal([2, 3, 8], seed=[3, 4])]
  y, dx, dw, program = _Split(stage, x, dy)
  ref_y, ref = _TapeGradients(stage, x, dy)
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dx[0], ref[0], rtol=1e-4, atol=1e-6)
  for got, want in zip(dw, ref[1:]):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)

  @tf.function
  def Whole():
    return _TapeGradients(stage, x, dy)
  whole = Whole.get_concrete_function().graph.get_operations()
  ops = program.OpTypes()
  # The tape's backward has as many matmuls as B and W together: no part
  # repeats another's (the forward's are F's).
  assert (_Count(ops['F']) + _Count(ops['B']) + _Count(ops['W']) ==
          _Count([op.type for op in whole]))
  assert _Count(ops['W']) > 0 and _Count(ops['B']) > 0


def test_the_last_cell_applies_the_loss_in_f_and_starts_b_from_it():
  stage = _Stage(_FcLayers(2), (6, 8))
  x = tf.random.stateless_normal([6, 8], seed=[5, 6])
  targets = tf.random.stateless_normal([6, 8], seed=[7, 8])
  loss_fn = lambda y, t: tf.reduce_mean(tf.square(y - t))
  seed, offset = tf.constant([1, 2], tf.int64), tf.constant(0, tf.int64)
  parts, _, recorded = stage.SplitForward(
      x, seed, offset, True, True,
      loss=(targets, tf.constant(0.5), tf.constant(12.0), loss_fn))
  dx, state, _ = stage.InputGradient(recorded, None)
  dw = recorded.program.WeightGradient(state)
  with tf.GradientTape() as tape:
    tape.watch(x)
    loss = 0.5 * loss_fn(stage.cell(x, training=True), targets)
  ref = tape.gradient(loss, [x] + stage.variables)
  np.testing.assert_allclose(parts.numerator, loss, rtol=1e-6)
  np.testing.assert_allclose(dx[0], ref[0], rtol=1e-5, atol=1e-7)
  for got, want in zip(dw, ref[1:]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_a_cell_with_integer_inputs_and_an_embedding():
  params = [
      layers.EmbeddingLayer.Params().Set(name='emb', vocab_size=11,
                                         embedding_dim=8, random_seed=1),
      layers.FCLayer.Params().Set(name='fc', input_dims=8, output_dims=8,
                                  random_seed=2)]
  stage = _Stage(params, (4, 3))
  ids = tf.constant([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 0, 1]])
  dy = [tf.random.stateless_normal([4, 3, 8], seed=[1, 2])]
  _, dx, dw, _ = _Split(stage, ids, dy)
  assert not dx  # Nothing to differentiate in integer ids.
  with tf.GradientTape() as tape:
    y = stage.cell(ids, training=True)
  ref = tape.gradient(y, stage.variables, output_gradients=dy)
  for got, want in zip(dw, ref):
    np.testing.assert_allclose(tf.convert_to_tensor(got),
                               tf.convert_to_tensor(want), rtol=1e-5,
                               atol=1e-7)
