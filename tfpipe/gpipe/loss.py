"""What a loss_fn returns, and how micro-batch losses add up to the batch's.

The pipeline never sees the whole batch's output: the last cell applies the
user's `loss_fn` to one micro-batch at a time. Each result is reduced here to
a numerator of the batch's loss, so that adding the numerators (and their
gradients) over micro-batches gives the batch's loss (and gradient) exactly,
whatever the split:

    loss                          the micro-batch's mean loss (a scalar), or
                                  per-example losses (a vector);
    (loss, {'name': metric})      the same, with metrics of the same kind;
    (loss_sum, weight)            a sum and the weight it is a sum over (e.g.
                                  the number of unpadded tokens);
    (loss_sum, weight, metrics)   the same, with metrics that are sums too.

A mean is weighted by the micro-batch's share n_m / N of the examples, and
per-example values are summed and divided by N. Sums add up as they are, and
the step divides the total (and the gradients) by the total weight at its
end: exact for any split, and nothing has to be known before the first
backward.

The user's loss_fn runs converted by autograph (a Python `if` on a tensor
works, as in any tf.function), and an error it raises is reported as its own,
with a note naming where it ran, never as a cell's.
"""

import collections

import tensorflow as tf

from tfpipe import base_layer
from tfpipe.gpipe import microbatch

LossAndGradients = collections.namedtuple(
    'LossAndGradients', ['loss', 'gradients', 'metrics', 'action_times'],
    defaults=[None])
LossAndGradients.__doc__ = (
    'Result of a pipelined training step: the exact full-batch loss, '
    'gradients aligned with the pipeline\'s trainable_variables at the time '
    'of the call (None for a variable no loss reaches), metrics, and (when '
    'recorded) {Action: (start, end)} timestamps.')


class LossParts(collections.namedtuple(
    'LossParts', ['numerator', 'metrics', 'weight', 'is_sum'])):
  """One micro-batch's loss, reduced to a numerator of the batch's loss.

  Attributes:
    numerator: float32 scalar; the numerators of all micro-batches add up to
      the batch's loss (means), or to its sum (is_sum).
    metrics: {name: float32 scalar}, reduced like the loss.
    weight: what a sum is a sum over (0 for means).
    is_sum: whether loss_fn returned (sum, weight): the step divides by the
      total weight at its end.
  """


def ParseLoss(output, scale, batch_size):
  """LossParts of a loss_fn's output for a micro-batch of share `scale`.

  Args:
    output: what loss_fn returned (see the module docstring).
    scale: n_m / N, the micro-batch's share of the batch's examples.
    batch_size: N, by which per-example losses are divided.
  """
  if isinstance(output, (tuple, list)) and len(output) == 3 and isinstance(
      output[2], dict):
    return _SumParts(output[0], output[1], output[2])
  if isinstance(output, (tuple, list)) and len(output) == 2:
    if isinstance(output[1], dict):
      return _MeanParts(output[0], output[1], scale, batch_size)
    return _SumParts(output[0], output[1], {})
  return _MeanParts(output, {}, scale, batch_size)


def _MeanShare(value, scale, batch_size):
  value = tf.convert_to_tensor(value)
  if value.shape.rank == 0:
    return tf.cast(value, tf.float32) * scale
  return tf.reduce_sum(tf.cast(value, tf.float32)) / tf.cast(batch_size,
                                                               tf.float32)


def _MeanParts(loss, metrics, scale, batch_size):
  return LossParts(
      _MeanShare(loss, scale, batch_size),
      {name: _MeanShare(v, scale, batch_size) for name, v in metrics.items()},
      tf.zeros([], tf.float32), False)


def _SumParts(loss_sum, weight, metrics):
  def Total(value):
    return tf.reduce_sum(tf.cast(value, tf.float32))
  return LossParts(Total(loss_sum),
                   {name: Total(v) for name, v in metrics.items()},
                   Total(weight), True)


def Normalize(parts):
  """The whole batch's (loss, metrics) from all micro-batches' LossParts.

  Raises:
    ValueError: if some micro-batches returned sums and others means.
  """
  if len({p.is_sum for p in parts}) > 1:
    raise ValueError(
        'loss_fn returned a (sum, weight) pair for some micro-batches and a '
        'mean for others; return one kind.')
  loss = tf.add_n([p.numerator for p in parts])
  metrics = {name: tf.add_n([p.metrics[name] for p in parts])
             for name in parts[0].metrics}
  scale = None
  if parts[0].is_sum:
    scale = 1.0 / tf.add_n([p.weight for p in parts])
    loss *= scale
    metrics = {name: value * scale for name, value in metrics.items()}
  return loss, metrics, scale


def BatchSize(structure, batch_dim=0):
  """N of a batch (static int, else a scalar tensor), from its first leaf."""
  leaf = next(t for t in tf.nest.flatten(structure) if t is not None)
  static = tf.TensorShape(leaf.shape)[batch_dim]
  return static if static is not None else tf.shape(leaf)[batch_dim]


def CallLossFn(loss_fn, outputs, targets, where):
  """loss_fn(outputs, targets), autograph-converted; its errors stay its own.

  Args:
    loss_fn: the user's loss function.
    outputs: the last cell's output for one micro-batch.
    targets: that micro-batch's targets.
    where: a few words saying where it ran, added as a note to an error.
  """
  try:
    return base_layer.Autograph(loss_fn)(outputs, targets)
  except Exception as e:  # pylint: disable=broad-except
    shapes = microbatch.ShapesText(outputs)
    e.add_note(f'Raised by loss_fn on {where} (output shapes {shapes}).')
    e.loss_fn_error = True
    raise
