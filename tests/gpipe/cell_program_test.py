"""A cell's traced programs: what is differentiable, and a bounded, relaxed cache."""

import types

import numpy as np
import pytest
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tests.gpipe import single_threaded_executor_test as ste_test
from tfpipe import layers
from tfpipe.gpipe import cell_program
from tfpipe.gpipe import cell_runtime

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


def test_program_cache_keeps_unknown_rank_when_relaxing():
  """A cell fed a tf.py_function's output (unknown rank): its signature is
  cached (this raised 'Cannot iterate over a shape with unknown rank'), the
  program traced for a known shape is not reused for it, and the relaxed
  program keeps the rank unknown and serves inputs of any rank."""
  cache = cell_program.ProgramCache()
  built = []

  def Build(specs):
    built.append(types.SimpleNamespace(specs=list(specs)))
    return built[-1]
  known = [tf.TensorSpec([4, plt_test.DIM], tf.float32)]
  unknown = [tf.TensorSpec(None, tf.float32)]
  assert cache.Get('key', known, Build) is built[0]
  relaxed = cache.Get('key', unknown, Build)
  assert relaxed is built[1]
  assert relaxed.specs[0].shape.rank is None
  for specs in (unknown, [tf.TensorSpec([2, 3, 5], tf.float32)]):
    assert cache.Get('key', specs, Build) is relaxed
  assert cache.Get('key', known, Build) is built[0]  # Exactly its own.
  assert len(built) == 2


def _PyFunctionProgram(device):
  cell = ste_test.PyFunctionLayer(seed=1, name='py_cell')
  x = plt_test._Data()[0]  # pylint: disable=protected-access
  cell(x)  # Builds it.
  inputs = cell_runtime.ActionInputs(x, tf.constant([1, 2], tf.int64),
                                     tf.constant(0, tf.int64))
  specs = [tf.TensorSpec(t.shape, t.dtype) for t in inputs.Present()]
  return cell_program.CellProgram(cell, 3, device, inputs.Structure(), specs,
                                  [], True, None)


@pytest.mark.parametrize('device', [
    '/job:worker/replica:0/task:1/device:CPU:0',
    '/job:worker/replica:0/task:0/device:GPU:1'])
def test_a_python_function_on_another_process_is_refused_when_traced(device):
  """Its Python code exists only here: a worker's CPU or GPU could never run
  it (the step failed late, or hung). This process's devices trace it."""
  with pytest.raises(cell_program.CellPlacementError,
                     match=r'cell 3 \(py_cell\) holds a Python function \(a '
                     r'EagerPyFunc op.* '
                     f'placed on {device}.*input pipeline'):
    _PyFunctionProgram(device).Forward()
  _PyFunctionProgram('/CPU:1').Forward()
