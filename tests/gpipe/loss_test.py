"""What a loss_fn returns becomes an exact share of the batch's loss."""

import pytest
import tensorflow as tf

from tfpipe.gpipe import loss as loss_lib


def test_parse_loss_means_are_shares_of_the_batch_mean():
  parts = loss_lib.ParseLoss((tf.constant(2.0), {'acc': tf.constant(0.5)}),
                             scale=0.25, batch_size=8)
  assert not parts.is_sum
  assert float(parts.numerator) == 0.5 and float(parts.metrics['acc']) == 0.125
  per_example = loss_lib.ParseLoss(tf.constant([1.0, 3.0]), 0.25, 8)
  assert float(per_example.numerator) == 0.5  # (1 + 3) / 8.


def test_parse_loss_sums_keep_their_weight():
  parts = loss_lib.ParseLoss((tf.constant([1.0, 2.0]), tf.constant(3.0)),
                             scale=0.25, batch_size=8)
  assert parts.is_sum
  assert float(parts.numerator) == 3.0 and float(parts.weight) == 3.0
  with_metrics = loss_lib.ParseLoss(
      (tf.constant(4.0), 2, {'correct': tf.constant(1.0)}), 0.25, 8)
  assert with_metrics.is_sum and float(with_metrics.metrics['correct']) == 1.0


def test_normalize_divides_sums_by_the_total_weight_once():
  parts = [loss_lib.ParseLoss((tf.constant(6.0), tf.constant(2.0),
                               {'n': tf.constant(1.0)}), 0.5, 4),
           loss_lib.ParseLoss((tf.constant(2.0), tf.constant(2.0),
                               {'n': tf.constant(3.0)}), 0.5, 4)]
  loss, metrics, scale = loss_lib.Normalize(parts)
  assert float(loss) == 2.0 and float(metrics['n']) == 1.0
  assert float(scale) == 0.25
  mixed = [parts[0], loss_lib.ParseLoss(tf.constant(1.0), 0.5, 4)]
  with pytest.raises(ValueError, match='one kind'):
    loss_lib.Normalize(mixed)


def test_loss_fn_runs_with_autograph_and_its_errors_stay_its_own():
  def WithPythonIf(y, targets):
    if tf.reduce_sum(y) > 0:  # A tensor in a Python `if`: autograph.
      return tf.reduce_mean(y - targets)
    return tf.reduce_mean(targets - y)

  @tf.function(autograph=False)
  def Run(y):
    return loss_lib.CallLossFn(WithPythonIf, y, tf.zeros([2]), 'here')
  assert float(Run(tf.ones([2]))) == 1.0
  assert float(Run(-tf.ones([2]))) == 1.0

  def Broken(y, targets):
    return tf.reduce_mean(y - tf.ones([3]))
  with pytest.raises(ValueError, match='Dimensions must be equal') as info:
    tf.function(lambda: loss_lib.CallLossFn(
        Broken, tf.ones([2]), None, 'the output of cell 1'),
                autograph=False)()
  assert 'Raised by loss_fn on the output of cell 1' in ''.join(
      info.value.__notes__)
