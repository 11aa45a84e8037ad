"""Softmax cross-entropy, as a function and as a loss layer.

The trainer computes the loss once per micro-batch and averages, so
`SoftmaxCrossEntropyLoss` returns a weighted mean (and accuracy) over every
example and token; `SoftmaxCrossEntropy` wraps it as a layer for models that
end in their loss.
"""

import tensorflow as tf

from tfpipe import base_layer
from tfpipe.layers import core


def SoftmaxCrossEntropyLoss(logits, labels, weights=None):
  """Mean softmax cross-entropy and accuracy of `logits` against `labels`.

  Args:
    logits: float [..., num_classes].
    labels: int class ids [...], or float probabilities [..., num_classes].
    weights: optional float [...] per-example (per-token) weights, e.g. 0 on
      padding; the means are weighted by them.

  Returns:
    (mean_loss, accuracy): float32 scalars.
  """
  logits = tf.cast(logits, tf.float32)
  labels = tf.convert_to_tensor(labels)
  if labels.dtype.is_floating and labels.shape.rank == logits.shape.rank:
    probs = tf.cast(labels, tf.float32)
    xent = tf.nn.softmax_cross_entropy_with_logits(labels=probs, logits=logits)
    class_ids = tf.argmax(probs, axis=-1, output_type=tf.int32)
  else:
    class_ids = tf.cast(labels, tf.int32)
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
        labels=class_ids, logits=logits)
  correct = tf.cast(
      tf.equal(tf.argmax(logits, axis=-1, output_type=tf.int32), class_ids),
      tf.float32)
  if weights is None:
    weights = tf.ones_like(xent)
  weights = tf.cast(weights, tf.float32)
  total = tf.maximum(tf.reduce_sum(weights), 1e-8)
  mean_loss = tf.reduce_sum(xent * weights) / total
  accuracy = tf.reduce_sum(correct * weights) / total
  return mean_loss, accuracy


class SoftmaxCrossEntropy(base_layer.BaseLayer):
  """Loss layer: (logits, labels[, weights]) -> scalar mean cross-entropy.

  The input may also be a dict with keys 'logits', 'labels' and optionally
  'weights'. Accuracy is available from `SoftmaxCrossEntropyLoss`.
  """

  def FProp(self, inputs):
    if isinstance(inputs, dict):
      logits, labels = inputs['logits'], inputs['labels']
      weights = inputs.get('weights')
    elif isinstance(inputs, (list, tuple)) and len(inputs) in (2, 3):
      logits, labels = inputs[0], inputs[1]
      weights = inputs[2] if len(inputs) == 3 else None
    else:
      raise ValueError(f'{self.p.name}: expected (logits, labels[, weights]) '
                       f'or a dict; received {type(inputs).__name__}.')
    loss, _ = SoftmaxCrossEntropyLoss(logits, labels, weights)
    return loss

  @classmethod
  def FPropMeta(cls, p, input_shape):
    if isinstance(input_shape, dict):
      logits_shape = input_shape['logits']
    else:
      logits_shape = input_shape[0]
    elements = core.Elements(logits_shape)
    return base_layer.CostMeta(
        output_shape=(),
        # exp, sum, log, subtract and max per logit.
        flops=5.0 * elements,
        num_params=0,
        activation_bytes=4.0)
