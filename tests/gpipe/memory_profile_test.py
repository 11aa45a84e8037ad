"""Tests of gpipe.memory_profile: one profiled step per distinct cell.

The profile runs in a subprocess with TensorFlow's counting (BFC) CPU
allocator, as the trainer runs it. Protected properties: variables and
Adam's slots are counted exactly; without remat a forward keeps
activations that grow with the micro-batch, with remat (on a cell that is
not last) nothing beyond its input; the last cell,
profiled with the model's loss, keeps the loss's gradient when
re-materialized; equal cells are profiled once; and a process without the
counting allocator is told how to get one.
"""

import numpy as np
import pytest

from tfpipe.gpipe import cell as cell_lib
from tfpipe.gpipe import memory_model
from tfpipe.gpipe import memory_profile
from tfpipe.trainer import optimizer as optimizer_lib

_DIM = 256


def _Cell(name, activation='relu'):
  from tfpipe import layers  # pylint: disable=g-import-not-at-top
  return cell_lib.FeatureExtractionLayer.Params().Set(name=name, sub=[
      layers.FCLayer.Params().Set(name=f'{name}_fc{i}', input_dims=_DIM,
                                  output_dims=_DIM, activation=activation)
      for i in range(2)])


def _Loss(outputs, targets):
  del targets
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  return tf.reduce_mean(tf.square(outputs))


@pytest.fixture(scope='module')
def profiles():
  request = memory_profile.ProfileRequest(
      [_Cell('a'), _Cell('b'), _Cell('c', activation='none')],
      [(None, _DIM)] * 3,
      np.random.RandomState(0).normal(size=(64, _DIM)).astype(np.float32),
      None, _Loss, [8, 32], optimizer_lib.OptimizerParams())
  return memory_profile.ProfileInSubprocess(request, timeout_s=240)


def test_variables_and_adam_slots_are_counted_exactly(profiles):
  cell = profiles[0].At(8)
  assert cell.variable_bytes == 2 * (_DIM * _DIM + _DIM) * 4
  assert cell.optimizer_bytes == 2 * cell.variable_bytes
  assert cell.input_bytes == cell.output_bytes == 8 * _DIM * 4


def test_what_a_forward_keeps_grows_with_the_micro_batch(profiles):
  small, large = profiles[0].At(8), profiles[0].At(32)
  assert large.kept['never'] > 2 * small.kept['never'] > 0
  # Re-materialized, a cell that is not last keeps nothing but its input
  # (a view of the batch here), give or take a few small tensors of the
  # step (seen: 8 KiB once in three runs, against 64 KiB of activations).
  assert large.kept['always'] < 0.05 * large.kept['never'] + 16 * 1024
  assert min(large.backward_peak.values()) > 0
  assert large.fused_peak > 0 and large.update_peak > 0


def test_equal_cells_are_profiled_once_and_the_last_keeps_its_loss(profiles):
  assert profiles[1].ToDict() == profiles[0].ToDict()
  last = profiles[2].At(32)
  assert last.is_last and not profiles[0].At(32).is_last
  assert last.kept['always'] >= last.output_gradient_bytes
  assert memory_model.CellProfile.FromDict(profiles[2].ToDict()).At(32) == last


def test_profiling_needs_the_counting_allocator(monkeypatch):
  monkeypatch.delenv('TF_CPU_ALLOCATOR_USE_BFC', raising=False)
  with pytest.raises(RuntimeError, match='TF_CPU_ALLOCATOR_USE_BFC=true'):
    memory_profile.CheckAllocatorCounts()
