"""The GPipe Transformer language model as a list of layers.

embedding -> learned positions -> N causal TransformerLayers -> final layer
norm -> logits. Each block is a separate list entry so the partitioner can
cut between any two blocks; the embedding and softmax sit at the two ends,
which is why balancing by flops or parameters (not layer count) matters.
"""

import keras
import tensorflow as tf

import models
from tfpipe import base_layer
from tfpipe import layers
from tfpipe.layers import core


class PositionalEmbeddingLayer(base_layer.BaseLayer):
  """Adds a learned embedding of each position to x [batch, length, dim]."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('max_length', 0, 'Largest sequence length the layer accepts.')
    p.Define('embedding_dim', 0, 'Size of the last dim of the input.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if p.max_length <= 0 or p.embedding_dim <= 0:
      raise ValueError(f'{p.name}: max_length and embedding_dim must be > 0.')
    self.pos_emb = self.CreateVariable(
        'pos_emb', (p.max_length, p.embedding_dim),
        keras.initializers.RandomNormal(stddev=0.02, seed=p.random_seed))

  def FProp(self, inputs):
    length = tf.shape(inputs)[1]
    return inputs + self.pos_emb[tf.newaxis, :length, :]

  @classmethod
  def FPropMeta(cls, p, input_shape):
    elements = base_layer.NumElements(input_shape, core.BatchSize(input_shape))
    return base_layer.CostMeta(
        output_shape=tuple(input_shape),
        flops=float(elements),
        num_params=p.max_length * p.embedding_dim,
        activation_bytes=core.OutputBytes(input_shape, p.dtype))


class TransformerLm(models.BaseModel):
  """Causal Transformer LM over int token ids; targets of -1 carry no loss."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'lm'
    p.Define('vocab_size', 16, 'Number of token ids.')
    p.Define('sequence_length', 16, 'Length of the input token sequences.')
    p.Define('model_dim', 64, 'Width of the embeddings and Transformer blocks.')
    p.Define('num_layers', 2, 'Number of Transformer blocks.')
    p.Define('num_heads', 4, 'Number of attention heads of each block.')
    p.Define('hidden_dim', 256, 'Hidden size of each block\'s feed-forward net.')
    p.Define('dropout_prob', 0.0,
             'Dropout probability of residual and attention activations.')
    p.Define('tie_embeddings', False, 'Whether the logits layer uses the '
             'input embedding table, transposed, as its weight.')
    return p

  def LayerParamsList(self):
    p = self.p
    result = [
        layers.EmbeddingLayer.Params().Set(
            name='emb', vocab_size=p.vocab_size, embedding_dim=p.model_dim,
            scale_sqrt_depth=False),
        PositionalEmbeddingLayer.Params().Set(
            name='pos_emb', max_length=p.sequence_length,
            embedding_dim=p.model_dim),
    ]
    for i in range(p.num_layers):
      result.append(layers.TransformerLayer.Params().Set(
          name=f'block_{i}', input_dim=p.model_dim, num_heads=p.num_heads,
          hidden_dim=p.hidden_dim, causal=True,
          atten_dropout_prob=p.dropout_prob,
          residual_dropout_prob=p.dropout_prob))
    result.append(layers.LayerNorm.Params().Set(
        name='final_ln', input_dim=p.model_dim))
    result.append(layers.FCLayer.Params().Set(
        name='logits', input_dims=p.model_dim, output_dims=p.vocab_size,
        activation='none', tied_embedding='emb' if p.tie_embeddings else None))
    return result

  def InputShape(self):
    return (None, self.p.sequence_length)

  def InputDtype(self):
    return 'int32'

  def Loss(self, outputs, targets):
    return LmLoss(outputs, targets)


def LmLoss(logits, targets):
  """Token cross-entropy and accuracy over the positions with targets >= 0."""
  targets = tf.cast(targets, tf.int32)
  weights = tf.cast(targets >= 0, tf.float32)
  loss, accuracy = layers.SoftmaxCrossEntropyLoss(
      logits, tf.maximum(targets, 0), weights)
  return loss, {'accuracy': accuracy}
