"""Freezing layers between steps, as fine-tuning does: gradients follow the
trainable set, in the trainer and on the tape path (tfpipe.keras has its own
in tests/keras/real_models_test.py)."""

import numpy as np
import tensorflow as tf

from tests.gpipe import tied_variables_test
from tfpipe.trainer import input_generator


def _Layers(task, names):
  return [layer for cell in task.pipe.cells for layer in cell.sub
          if layer.name in names]


def _Freeze(task):
  """A block, and the embedding that the softmax reads in another cell."""
  for layer in _Layers(task, ('emb', 'block_0')):
    layer.trainable = False


def _Batches():
  return list(input_generator.SequenceTaskInput.Params().Set(
      batch_size=8, seed=1, vocab_size=12, length=4,
      task='reverse').Instantiate().GetDataset(0).take(3))


def _AssertClose(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                               atol=1e-6)


def test_freezing_between_steps_in_the_trainer_and_on_the_tape_path():
  single = tied_variables_test._LmTask(1, 1)  # pylint: disable=protected-access
  piped = tied_variables_test._LmTask(2, 2)  # pylint: disable=protected-access
  first, second, third = _Batches()
  single.TrainStep(first)
  piped.TrainStep(first)
  for task in (single, piped):
    _Freeze(task)
  assert [v.path for v in piped.pipe.trainable_variables] == [
      v.path for v in single.pipe.trainable_variables]
  assert not any(v.path.startswith(('emb/', 'block_0/'))
                 for v in piped.pipe.trainable_variables)
  inputs, targets = second
  _AssertClose(piped._ComputeLossAndGradients(inputs, targets).gradients,  # pylint: disable=protected-access
               single._ComputeLossAndGradients(inputs, targets).gradients)  # pylint: disable=protected-access
  grads = []
  for task in (piped, single):
    with tf.GradientTape() as tape:
      loss = task.model.Loss(task.pipe(inputs, training=True), targets)[0]
    grads.append(tape.gradient(loss, task.pipe.trainable_variables))
  _AssertClose(*grads)
  frozen = [v.numpy() for layer in _Layers(piped, ('emb',))
            for v in layer.weights]
  np.testing.assert_allclose(piped.TrainStep(third)['loss'],
                             single.TrainStep(third)['loss'], rtol=1e-5)
  for before, v in zip(frozen, _Layers(piped, ('emb',))[0].weights):
    np.testing.assert_array_equal(v.numpy(), before)
