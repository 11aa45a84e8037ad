"""A character-level Transformer LM that reports bits per character.

The model is `transformer_lm.TransformerLm` over byte ids (0..255). What it
adds is the metric char LMs are compared by: bits per character, the
cross-entropy in bits summed over the targets and divided by the number of
characters among them. A character is a byte that starts one in UTF-8, so
the continuation bytes (0x80..0xBF) of a multi-byte character add their bits
to it but do not count as characters; on ASCII text it is bits per byte.
It is computed per example and averaged, so, like the loss (every window
has the same number of targets), it does not depend on how a batch is
split into micro-batches.
"""

import math

import tensorflow as tf

from models import transformer_lm


class CharTransformerLm(transformer_lm.TransformerLm):
  """Causal Transformer LM over bytes; reports accuracy and bits per character."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'char_lm'
    p.vocab_size = 256
    return p

  def Loss(self, outputs, targets):
    loss, metrics = transformer_lm.LmLoss(outputs, targets)
    metrics['bits_per_char'] = BitsPerChar(outputs, targets)
    return loss, metrics


def BitsPerChar(logits, targets):
  """Mean over examples of their bits per character.

  Args:
    logits: float [batch, length, 256].
    targets: int byte ids [batch, length]; targets < 0 are not scored.

  Returns:
    A float32 scalar.
  """
  targets = tf.cast(targets, tf.int32)
  scored = targets >= 0
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.maximum(targets, 0), logits=tf.cast(logits, tf.float32))
  bits = tf.reduce_sum(tf.where(scored, xent, 0.0), axis=1) / math.log(2.0)
  continuation = tf.logical_and(targets >= 0x80, targets < 0xC0)
  chars = tf.reduce_sum(tf.cast(
      tf.logical_and(scored, tf.logical_not(continuation)), tf.float32), axis=1)
  return tf.reduce_mean(bits / tf.maximum(chars, 1.0))
