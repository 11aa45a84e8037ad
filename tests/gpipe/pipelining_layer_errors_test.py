"""PipeliningLayer's errors: a bad setting or a cell that fails on its input
is named, with what it received and what would fix it.

Also what the pipeline does with a cell output of unknown rank (it crosses
cells; a cell that needs its static shape is told to use tf.ensure_shape).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import gpipe
from tfpipe import layers
from tests.gpipe import pipelining_layer_test as plt_test

DIM = plt_test.DIM


def _PipeParams(k=2, **kwargs):
  cells = gpipe.PartitionSequentialLayers(plt_test._LayerParams(4), k,
                                          balance='params')
  p = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells,
                                         num_micro_batches=2,
                                         devices=plt_test._Devices(k))
  return p.Set(**kwargs)


def test_error_num_micro_batches():
  with pytest.raises(ValueError, match='num_micro_batches=0'):
    _PipeParams(num_micro_batches=0).Instantiate()


def test_error_empty_cell_tpl():
  with pytest.raises(ValueError, match='cell_tpl is empty'):
    _PipeParams(cell_tpl=[]).Instantiate()


def test_error_unknown_device():
  with pytest.raises(ValueError, match="unknown device '/GPU:7'"):
    _PipeParams(devices=['/CPU:0', '/GPU:7']).Instantiate()


def test_error_fewer_devices_than_cells_suggests_round_robin():
  with pytest.raises(ValueError, match='round_robin_placement=True'):
    _PipeParams(k=4, devices=plt_test._Devices(2)).Instantiate()


def test_error_batch_smaller_than_micro_batches():
  pipe = _PipeParams(num_micro_batches=8).Instantiate()
  with pytest.raises(ValueError, match='fewer than num_micro_batches=8'):
    pipe.ComputeLossAndGradients(tf.ones([5, DIM]), tf.ones([5, DIM]),
                                 plt_test._Loss)


def test_error_cell_output_does_not_fit_next_cell():
  layer_params = [
      layers.FCLayer.Params().Set(name='fc0', input_dims=DIM, output_dims=8),
      layers.FCLayer.Params().Set(name='fc1', input_dims=DIM, output_dims=DIM)]
  cells = gpipe.PartitionSequentialLayers(layer_params, 2, balance=[1, 1])
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=2,
      devices=plt_test._Devices(2)).Instantiate()
  with pytest.raises(ValueError, match=r'cell 1 \(cell1\).*output of cell 0'):
    pipe(tf.ones([4, DIM]))


class _ReceiveFailsLayer(keras.layers.Layer):
  """Fails as a worker does when it cannot allocate a tensor sent to it."""

  def call(self, x):
    raise tf.errors.InvalidArgumentError(
        None, None, 'Unable to parse tensor proto')

  def compute_output_shape(self, input_shape):
    return input_shape


def test_error_a_cell_that_cannot_receive_its_input_says_memory():
  """A worker that cannot allocate its input fails with an error that never
  says memory; the cell's error says it, not "check the shapes"."""
  layer_params = [
      layers.FCLayer.Params().Set(name='fc0', input_dims=DIM, output_dims=DIM),
      layers.KerasLayer.Params().Set(name='receive', cls=_ReceiveFailsLayer)]
  cells = gpipe.PartitionSequentialLayers(layer_params, 2, balance=[1, 1])
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=2,
      devices=plt_test._Devices(2)).Instantiate()
  with pytest.raises(ValueError) as info:
    pipe(tf.ones([4, DIM]))
  text = str(info.value)
  assert ('pipe: cell 1 (cell1) could not receive the output of cell 0 '
          '(cell0)') in text, text
  assert 'ran out of memory' in text and "remat_policy='always'" in text
  assert 'Check that the cells' not in text
  assert 'Unable to parse tensor proto' in text  # The cause is kept.


class _UnknownRankLayer(keras.layers.Layer):
  """Doubles its input in a tf.py_function, whose output has unknown rank
  (Keras is told the shape, as a user's compute_output_shape would)."""

  def call(self, x):
    return tf.py_function(lambda t: 2.0 * t, [x], tf.float32)

  def compute_output_shape(self, input_shape):
    return input_shape


class _StaticWidthLayer(keras.layers.Layer):
  """Reads its input's static last dimension, which unknown rank lacks."""

  def call(self, x):
    return tf.matmul(x, tf.ones([x.shape[-1], DIM]))

  def compute_output_shape(self, input_shape):
    return input_shape


def _UnknownRankPipeline(layer_params, remat_policy='always'):
  """Two cells; cell 0 ends in _UnknownRankLayer."""
  layer_params = (layer_params[:1] + [layers.KerasLayer.Params().Set(
      name='unknown_rank', cls=_UnknownRankLayer)] + layer_params[1:])
  cells = gpipe.PartitionSequentialLayers(
      layer_params, 2, balance=[2, len(layer_params) - 2])
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=3,
      devices=plt_test._Devices(2), remat_policy=remat_policy).Instantiate()
  return pipe, layer_params


@pytest.mark.parametrize('remat', ['always', 'never'])
def test_a_cell_output_of_unknown_rank_feeds_the_next_cell(remat):
  """A Python function's output (unknown rank) crosses cells on this
  process's devices: the step equals the plain model's."""
  pipe, layer_params = _UnknownRankPipeline(plt_test._LayerParams(3), remat)
  x, y = plt_test._Data()
  ref_loss, ref_grads = plt_test._Reference(layer_params, x, y)
  out = pipe.ComputeLossAndGradients(x, y, plt_test._Loss)
  np.testing.assert_allclose(out.loss, ref_loss, rtol=1e-5)
  plt_test._AssertAllClose(out.gradients, ref_grads)


def test_error_on_an_input_of_unknown_rank_names_the_cell():
  pipe, _ = _UnknownRankPipeline([
      layers.FCLayer.Params().Set(name='fc0', input_dims=DIM, output_dims=DIM),
      layers.KerasLayer.Params().Set(name='static', cls=_StaticWidthLayer)])
  with pytest.raises(ValueError, match=r'cell 1 \(cell1\) failed on the '
                     r'output of cell 0 \(cell0\) with shapes <unknown rank>'
                     r'.*tf.ensure_shape'):
    pipe(tf.ones([4, DIM]))
  # The last cell's output has unknown rank too (FCLayer keeps it): an
  # error of a loss_fn reading its static width stays the loss_fn's own.
  pipe, _ = _UnknownRankPipeline(plt_test._LayerParams(2))
  with pytest.raises((ValueError, TypeError)) as info:
    pipe.ComputeLossAndGradients(
        tf.ones([4, DIM]), tf.ones([4, DIM]),
        lambda out, t: plt_test._Loss(tf.reshape(out, [-1, out.shape[-1]]), t))
  assert 'output shapes <unknown rank>' in ''.join(info.value.__notes__)


def test_error_unknown_remat_policy_and_schedule():
  with pytest.raises(ValueError, match="pipe.remat_policy must be one of .*"
                     "Received: remat_policy='sometimes'"):
    _PipeParams(remat_policy='sometimes').Instantiate()
  with pytest.raises(ValueError, match="zb_h1.*--schedule.*Received: "
                     "schedule='interleaved'"):
    _PipeParams(schedule='interleaved').Instantiate()


@pytest.mark.parametrize('change, message', [
    ({'num_replicas': 0}, r'pipe.num_replicas must be an int >= 1'),
    ({'micro_batch_size': 0}, r'pipe.micro_batch_size must be an int'),
    ({'executor': 'fibers'}, r"Received: executor='fibers'"),
    ({'balance': 'luck'}, r"pipe.balance must be one of .*Received: "
     r"balance='luck'"),
    ({'balance': [1, 0]}, r'one layer count >= 1 per cell'),
    ({'num_partitions': 3}, r'cell_tpl holds 2 cells but num_partitions=3'),
])
def test_check_params_names_the_setting_and_what_it_received(change, message):
  """One check, used by the layer and (before TensorFlow starts) the trainer."""
  with pytest.raises(ValueError, match=message):
    gpipe.PipeliningLayer.CheckParams(_PipeParams(**change))
  with pytest.raises(ValueError, match=message):
    _PipeParams(**change).Instantiate()


