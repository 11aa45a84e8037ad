"""A cell's traced programs: what is differentiable, and a bounded, relaxed cache."""

import numpy as np
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tfpipe import layers
from tfpipe.gpipe import cell_program

_Pipeline = plt_test._Pipeline  # pylint: disable=protected-access
_Data = plt_test._Data  # pylint: disable=protected-access
_Loss = plt_test._Loss  # pylint: disable=protected-access
_LayerParams = plt_test._LayerParams  # pylint: disable=protected-access


def test_split_float_keeps_integer_leaves_in_place():
  structure = {'a': tf.ones([2]), 'b': (tf.zeros([2], tf.int32), tf.ones([1]))}
  floats, rebuild = cell_program.SplitFloat(structure)
  assert len(floats) == 2
  rebuilt = rebuild([f * 2 for f in floats])
  assert rebuilt['b'][0].dtype == tf.int32
  assert float(rebuilt['a'][0]) == 2.0


def test_changing_sequence_lengths_relax_shapes_instead_of_retracing():
  """ZB-H1 (and every schedule) traces a program per signature, relaxed."""
  params = [layers.FCLayer.Params().Set(
      name=f'fc{i}', input_dims=plt_test.DIM, output_dims=plt_test.DIM,
      activation='tanh', random_seed=i) for i in range(4)]
  pipe = _Pipeline(params, 2, 2, schedule='zb_h1', remat_policy='never',
                   executor='threads')
  loss_fn = lambda y, t: tf.reduce_mean(tf.square(y - t))
  plain = layers.SequentialLayer.Params().Set(name='plain',
                                              sub=params).Instantiate()
  for length in range(2, 10):
    x = tf.random.stateless_normal([4, length, plt_test.DIM], seed=[length, 1])
    out = pipe.ComputeLossAndGradients(x, x, loss_fn)
  with tf.GradientTape() as tape:
    loss = loss_fn(plain(x, training=True), x)
  np.testing.assert_allclose(out.loss, loss, rtol=1e-5)
  plt_test._AssertAllClose(  # pylint: disable=protected-access
      out.gradients, tape.gradient(loss, plain.trainable_variables))
  # The first length exactly, then one program with the length unknown.
  assert [len(cell.programs) for cell in pipe.runtime.cells[0]] == [2, 2]


def test_program_caches_are_bounded_and_follow_loss_fn_and_batch_changes():
  """A new loss_fn closure per step, and batch sizes that change the number
  of micro-batches, under the threads dispatcher: results stay right (this
  raised KeyError) and old programs are evicted."""
  layer_params = _LayerParams(4)
  x, y = _Data()
  pipe = _Pipeline(layer_params, 2, 1, executor='threads', micro_batch_size=9)
  for step in range(cell_program.MAX_PROGRAMS + 3):
    scale = 1.0 + step
    batch = (plt_test.BATCH, 9)[step % 2]  # M=2, then M=1.
    loss_fn = lambda out, t, scale=scale: scale * _Loss(out, t)
    out = pipe.ComputeLossAndGradients(x[:batch], y[:batch], loss_fn)
    ref_loss, _ = plt_test._Reference(layer_params, x[:batch], y[:batch])  # pylint: disable=protected-access
    np.testing.assert_allclose(out.loss, scale * ref_loss, rtol=1e-5)
  assert len(pipe.runtime.cells[0][-1].programs) <= cell_program.MAX_PROGRAMS
