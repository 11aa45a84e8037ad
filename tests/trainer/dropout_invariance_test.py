"""With dropout on, the loss curve does not depend on the partition or the split.

A training step is one synchronous update of the full batch, so the only way
K (partitions) or M (micro-batches) could change the curve is through the
dropout masks. Masks are drawn per example from (step, the layer's path
inside its cell, global example index, element), so every configuration
drops the same units, and the curves agree up to float rounding (rtol 1e-6).

The runs use the registered tiny LM (lm.TinyTransformerLm) with dropout
switched on through its params, one block, a smaller width and a batch of
10, for 100 steps (the loss falls from 3.43 to 2.26). Each configuration
costs mostly its tracing: about 40 s in all on 2 CPU cores. Measured over
K in {1, 2, 4} x M in {1, 3, 4}: the curves at M=1 are identical, the
others differ by at most 1.9e-7 relative (float rounding of the split).
"""

import numpy as np
import pytest

from tfpipe import model_registry

NUM_STEPS = 100
BATCH_SIZE = 10  # Uneven over M=3 and M=4 (sizes 4,3,3 and 3,3,2,2).


def _Params(num_partitions, num_micro_batches):
  p = model_registry.GetParams('lm.TinyTransformerLm')
  p.input.batch_size = BATCH_SIZE
  p.task.model.Set(dropout_prob=0.2, num_layers=1, model_dim=32,
                   hidden_dim=64)
  p.task.pipeline.Set(num_partitions=num_partitions,
                      num_micro_batches=num_micro_batches, balance='params')
  p.task.train.Set(max_steps=NUM_STEPS)
  p.task.train.lr_schedule.Set(warmup_steps=5, decay_steps=NUM_STEPS)
  return p


def _Losses(num_partitions, num_micro_batches):
  p = _Params(num_partitions, num_micro_batches)
  task = p.task.Instantiate()
  assert len(task.pipe.cells) == num_partitions
  losses = []
  for batch in p.input.Instantiate().GetDataset(0).take(NUM_STEPS):
    losses.append(float(task.TrainStep(batch)['loss']))
  return np.array(losses)


@pytest.fixture(scope='module')
def reference():
  """K=1, M=1: the curve every other configuration must reproduce."""
  return _Losses(1, 1)


def test_dropout_changes_the_loss(reference):
  """Guards the test itself: without dropout the curve would differ."""
  p = _Params(1, 1)
  p.task.model.dropout_prob = 0.0
  task = p.task.Instantiate()
  batch = next(iter(p.input.Instantiate().GetDataset(0)))
  assert not np.isclose(float(task.TrainStep(batch)['loss']), reference[0],
                        rtol=1e-4)


@pytest.mark.parametrize('num_partitions,num_micro_batches',
                         [(2, 1), (1, 3), (4, 4)])
def test_loss_curve_does_not_depend_on_partitions_or_micro_batches(
    reference, num_partitions, num_micro_batches):
  np.testing.assert_allclose(
      _Losses(num_partitions, num_micro_batches), reference, rtol=1e-6)
