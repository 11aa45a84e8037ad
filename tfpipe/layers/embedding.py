"""Token embedding lookup with an eagerly created table.

The table shape comes from params, so it lives on the device the layer was
constructed under, which is what a pipeline's first cell needs.
"""

import math

import keras
import tensorflow as tf

from tfpipe import base_layer
from tfpipe.layers import core


class EmbeddingLayer(base_layer.BaseLayer):
  """Maps int ids [...] to vectors [..., embedding_dim]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Number of rows of the embedding table.')
    p.Define('embedding_dim', 0, 'Size of each embedding vector.')
    p.Define('scale_sqrt_depth', False,
             'Whether to multiply embeddings by sqrt(embedding_dim), as '
             'Transformers do so they match positional encodings in scale.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    self.CheckPositive('vocab_size', 'embedding_dim')
    # Unit-variance outputs after the optional sqrt(depth) scaling.
    initializer = keras.initializers.RandomNormal(
        stddev=1.0 / math.sqrt(p.embedding_dim), seed=p.random_seed)
    self.emb = self.CreateVariable('emb', (p.vocab_size, p.embedding_dim),
                                   initializer)

  def FProp(self, inputs):
    out = tf.gather(self.emb, tf.cast(inputs, tf.int32))
    if self.p.scale_sqrt_depth:
      out *= math.sqrt(self.p.embedding_dim)
    return out

  @classmethod
  def FPropMeta(cls, p, input_shape):
    out_shape = tuple(input_shape) + (p.embedding_dim,)
    elements = base_layer.NumElements(out_shape, core.BatchSize(input_shape))
    return base_layer.CostMeta(
        output_shape=out_shape,
        flops=float(elements) if p.scale_sqrt_depth else 0.0,
        num_params=p.vocab_size * p.embedding_dim,
        activation_bytes=core.OutputBytes(out_shape, p.dtype))
