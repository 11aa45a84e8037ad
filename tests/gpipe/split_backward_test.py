"""The cut: each part computes only its own share, and all is exact.

What makes a zero-bubble schedule pay off is that B (the input gradient)
and W (the weight gradients) together cost one backward: neither redoes
the other's work nor the forward. What bounds memory without
re-materialization is that F keeps only what the backward reads. These
tests count the kernels in each part, check what F keeps, and compare the
gradients with one GradientTape over the whole cell.
"""

import collections

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import gpipe
from tfpipe import layers
from tfpipe.gpipe import cell_runtime
from tfpipe.gpipe import split_backward

_MATMULS = ('MatMul', 'BatchMatMulV2', 'Einsum')


def _Cell(layer_params, batch_shape):
  cells = gpipe.PartitionSequentialLayers(layer_params, 1, balance='params')
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=1,
      devices=['/CPU:0']).Instantiate()
  pipe.build(batch_shape)
  return pipe.runtime.cells[0][0]


def _Inputs(x, loss=None):
  return cell_runtime.ActionInputs(x, tf.constant([1, 2], tf.int64),
                                   tf.constant(0, tf.int64), loss)


def _Split(cell, x, dy, need_dx=True, loss_fn=None, loss=None):
  """F keeping residuals, then B, then W; returns (F's outputs, dx, dW,
  F's record)."""
  variables = cell.Variables()
  gradients = cell.PassGradients(variables, 2, need_dx)  # Two: buffers.
  outputs, _, record = cell.Forward(_Inputs(x, loss), True, variables,
                                    'residuals', loss_fn, need_dx)
  assert isinstance(record, cell_runtime.KeptResiduals)
  dx, for_weights, _ = cell.Backward(record, dy, gradients, split=True)
  cell.WeightGradient(for_weights, gradients)
  return outputs, dx, gradients.Read(), record


def _Kernels(record, kind, need_dx=True):
  """The op types a part runs (its function and the ones it calls)."""
  graph_def = record.program.Cut(need_dx).Part(kind).function.graph.as_graph_def()
  return [n.op for n in graph_def.node] + [
      n.op for f in graph_def.library.function for n in f.node_def]


def _Kept(record):
  """Shapes of the float tensors F kept (not shapes or scalars)."""
  return sorted(tuple(t.shape) for t in record.tensors
                if t.dtype.is_floating and t.shape.rank)


def _TapeGradients(cell, x, dy):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = cell.cell(x, training=True)
  return y, tape.gradient(y, [x] + cell.Variables(), output_gradients=dy)


def _Count(op_types, kinds=_MATMULS):
  return sum(n for t, n in collections.Counter(op_types).items() if t in kinds)


def _FcLayers(num_layers, dim=8):
  return [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=dim, output_dims=dim, activation='tanh',
      random_seed=i) for i in range(num_layers)]


@pytest.mark.parametrize('need_dx', [True, False])
def test_dense_layers_b_has_the_input_matmuls_and_w_the_weight_matmuls(
    need_dx):
  cell = _Cell(_FcLayers(3), (5, 8))
  x = tf.random.stateless_normal([5, 8], seed=[1, 2])
  dy = [tf.random.stateless_normal([5, 8], seed=[3, 4])]
  y, dx, dw, record = _Split(cell, x, dy, need_dx)
  ref_y, ref = _TapeGradients(cell, x, dy)
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-7)
  if need_dx:
    np.testing.assert_allclose(dx[0], ref[0], rtol=1e-5, atol=1e-6)
  else:
    assert not dx
  for got, want in zip(dw, ref[1:]):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  forward = _Kernels(record, split_backward.FORWARD, need_dx)
  b = _Kernels(record, split_backward.INPUT_GRADIENT, need_dx)
  w = _Kernels(record, split_backward.WEIGHT_GRADIENT, need_dx)
  assert _Count(forward) == 3
  assert _Count(b + w, ('Tanh',)) == 0  # Nothing recomputed.
  if need_dx:
    # B: dh = dz W^T for each layer. W: dW = h^T dz and db = sum(dz),
    # reading dz from B.
    assert _Count(b) == 3 and 'TanhGrad' in b
    assert _Count(w) == 3 and w.count('Sum') == 3 and 'TanhGrad' not in w
  else:
    # The first cell: nobody waits for its input gradient, so B has nothing
    # to do and W runs the whole backward, once.
    assert _Count(b) == 0
    assert _Count(w) == 5 and w.count('TanhGrad') == 3
  # F keeps each layer's input and tanh output: what the backward reads.
  assert _Kept(record) == [(5, 8)] * 4


def test_transformer_block_b_and_w_together_run_one_backward():
  params = [layers.TransformerLayer.Params().Set(
      name='xf', input_dim=8, num_heads=2, hidden_dim=16)]
  cell = _Cell(params, (2, 3, 8))
  x = tf.random.stateless_normal([2, 3, 8], seed=[1, 2])
  dy = [tf.random.stateless_normal([2, 3, 8], seed=[3, 4])]
  y, dx, dw, record = _Split(cell, x, dy)
  ref_y, ref = _TapeGradients(cell, x, dy)
  np.testing.assert_allclose(y, ref_y, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dx[0], ref[0], rtol=1e-4, atol=1e-6)
  for got, want in zip(dw, ref[1:]):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)

  @tf.function
  def Whole():
    return _TapeGradients(cell, x, dy)
  whole = Whole.get_concrete_function().graph.get_operations()
  f, b, w = [_Kernels(record, kind) for kind in (
      split_backward.FORWARD, split_backward.INPUT_GRADIENT,
      split_backward.WEIGHT_GRADIENT)]
  # The tape's backward has as many matmuls as B and W together: no part
  # repeats another's (the forward's are F's).
  assert _Count(f) + _Count(b) + _Count(w) == _Count(
      [op.type for op in whole])
  assert _Count(w) > 0 and _Count(b) > 0


def test_forward_keeps_what_the_backward_reads_not_every_activation():
  """Not the output, not the weights: only what the gradient ops read."""
  params = [layers.FCLayer.Params().Set(
      name='fc', input_dims=8, output_dims=32, activation='gelu',
      random_seed=1)]
  cell = _Cell(params, (4, 8))
  x = tf.random.stateless_normal([4, 8], seed=[1, 2])
  y, _, _, record = _Split(cell, x, [tf.ones([4, 32])])
  # The input (for dW) and the three GELU intermediates its gradient reads;
  # the output and the kernel (read again by B) are not kept.
  assert _Kept(record) == [(4, 8)] + [(4, 32)] * 3
  assert not any(v is y or np.array_equal(v, y) for v in record.tensors
                 if tuple(v.shape) == (4, 32))


def test_the_last_cell_applies_the_loss_in_f_and_starts_b_from_it():
  cell = _Cell(_FcLayers(2), (6, 8))
  x = tf.random.stateless_normal([6, 8], seed=[5, 6])
  targets = tf.random.stateless_normal([6, 8], seed=[7, 8])
  loss_fn = lambda y, t: tf.reduce_mean(tf.square(y - t))
  parts, dx, dw, _ = _Split(
      cell, x, None, loss_fn=loss_fn,
      loss=(targets, tf.constant(0.5), tf.constant(12.0)))
  with tf.GradientTape() as tape:
    tape.watch(x)
    loss = 0.5 * loss_fn(cell.cell(x, training=True), targets)
  ref = tape.gradient(loss, [x] + cell.Variables())
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
  cell = _Cell(params, (4, 3))
  ids = tf.constant([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 0, 1]])
  dy = [tf.random.stateless_normal([4, 3, 8], seed=[1, 2])]
  _, dx, dw, _ = _Split(cell, ids, dy)
  assert not dx  # Nothing to differentiate in integer ids.
  with tf.GradientTape() as tape:
    y = cell.cell(ids, training=True)
  ref = tape.gradient(y, cell.Variables(), output_gradients=dy)
  for got, want in zip(dw, ref):
    np.testing.assert_allclose(tf.convert_to_tensor(got),
                               tf.convert_to_tensor(want), rtol=1e-5,
                               atol=1e-7)
