"""Multi-head self-attention and the pre-layer-norm Transformer layer.

Written with plain TF ops and variables created from params in `__init__`,
so a Transformer stack can be cut into pipeline cells and every cell's
weights land on its device, and so the cost model has exact formulas.
"""

import math

import tensorflow as tf

from tfpipe import base_layer
from tfpipe.layers import core
from tfpipe.layers import normalization


class MultiHeadAttention(base_layer.BaseLayer):
  """Self-attention on [batch, time, input_dim] with optional causal masking."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Size of the last dim of input and output.')
    p.Define('num_heads', 1, 'Number of attention heads.')
    p.Define('hidden_dim', 0,
             'Total size of queries/keys/values over all heads; 0 means '
             'input_dim.')
    p.Define('causal', False,
             'Whether position t may only attend to positions <= t.')
    p.Define('atten_dropout_prob', 0.0,
             'Probability of dropping an attention weight in training.')
    p.Define('has_bias', True, 'Whether the projections have biases.')
    return p

  @classmethod
  def CheckHeads(cls, p):
    """Raises ValueError unless input_dim > 0 and num_heads > 0 divides the
    attention width, so that FPropMeta refuses what FProp could not run."""
    hidden = p.hidden_dim or p.input_dim
    if not p.input_dim > 0:
      raise ValueError(f'{p.name}: input_dim must be > 0; received '
                       f'input_dim={p.input_dim!r}.')
    if not (isinstance(p.num_heads, int) and p.num_heads > 0):
      raise ValueError(f'{p.name}: num_heads must be an int > 0; received '
                       f'num_heads={p.num_heads!r}.')
    if hidden % p.num_heads:
      raise ValueError(
          f'{p.name}: num_heads={p.num_heads} does not divide the attention '
          f'width {hidden} (hidden_dim, or input_dim when it is 0): each '
          'head takes an equal share of it.')
    return hidden

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    hidden = self.CheckHeads(p)
    self._hidden_dim = hidden
    for proj in ('q', 'k', 'v'):
      setattr(self, f'w_{proj}',
              self.CreateVariable(f'w_{proj}', (p.input_dim, hidden)))
    self.w_o = self.CreateVariable('w_o', (hidden, p.input_dim))
    if p.has_bias:
      for proj in ('q', 'k', 'v'):
        setattr(self, f'b_{proj}',
                self.CreateVariable(f'b_{proj}', (hidden,), 'zeros'))
      self.b_o = self.CreateVariable('b_o', (p.input_dim,), 'zeros')
    self.CreateChild('atten_dropout', core.DropoutLayer.Params().Set(
        keep_prob=1.0 - p.atten_dropout_prob, random_seed=p.random_seed,
        dtype=p.dtype))

  def _Project(self, x, proj):
    out = tf.einsum('btd,dh->bth', x, getattr(self, f'w_{proj}'))
    if self.p.has_bias:
      out += getattr(self, f'b_{proj}')
    return out

  def _SplitHeads(self, x):
    """[B, T, H] -> [B, N, T, H / N]."""
    p = self.p
    shape = tf.shape(x)
    x = tf.reshape(
        x, [shape[0], shape[1], p.num_heads, self._hidden_dim // p.num_heads])
    return tf.transpose(x, [0, 2, 1, 3])

  def FProp(self, inputs, training=None):
    p = self.p
    q = self._SplitHeads(self._Project(inputs, 'q'))
    k = self._SplitHeads(self._Project(inputs, 'k'))
    v = self._SplitHeads(self._Project(inputs, 'v'))
    head_dim = self._hidden_dim // p.num_heads
    logits = tf.einsum('bnth,bnsh->bnts', q, k) / math.sqrt(head_dim)
    if p.causal:
      length = tf.shape(inputs)[1]
      mask = tf.linalg.band_part(tf.ones([length, length], tf.bool), -1, 0)
      logits = tf.where(mask, logits, tf.cast(-1e9, logits.dtype))
    probs = tf.nn.softmax(logits, axis=-1)
    probs = self.atten_dropout(probs, training=training)
    context = tf.einsum('bnts,bnsh->bnth', probs, v)
    context = tf.transpose(context, [0, 2, 1, 3])
    shape = tf.shape(inputs)
    context = tf.reshape(context, [shape[0], shape[1], self._hidden_dim])
    out = tf.einsum('bth,hd->btd', context, self.w_o)
    if p.has_bias:
      out += self.b_o
    return out

  @classmethod
  def FPropMeta(cls, p, input_shape):
    _, length, dim = input_shape
    hidden = cls.CheckHeads(p)
    batch = core.BatchSize(input_shape)
    length = 1 if length is None else int(length)
    tokens = batch * length
    flops = (2.0 * tokens * dim * hidden * 3 +  # q, k, v projections.
             2.0 * 2 * batch * length * length * hidden +  # QK^T and PV.
             5.0 * batch * p.num_heads * length * length +  # softmax.
             2.0 * tokens * hidden * dim)  # output projection.
    num_params = 4 * dim * hidden + (3 * hidden + dim if p.has_bias else 0)
    return base_layer.CostMeta(
        output_shape=tuple(input_shape),
        flops=flops,
        num_params=num_params,
        activation_bytes=core.OutputBytes(input_shape, p.dtype))


class TransformerLayer(base_layer.BaseLayer):
  """Pre-layer-norm Transformer block: x + Attn(LN(x)), then x + FFN(LN(x))."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Model dim: size of the last dim of the input.')
    p.Define('num_heads', 1, 'Number of attention heads.')
    p.Define('hidden_dim', 0, 'Hidden size of the feed-forward network.')
    p.Define('causal', False,
             'Whether attention may only look at earlier positions.')
    p.Define('activation', 'gelu', 'Activation of the feed-forward network.')
    p.Define('atten_dropout_prob', 0.0,
             'Dropout probability of attention weights.')
    p.Define('residual_dropout_prob', 0.0,
             'Dropout probability of each block output before the residual.')
    p.Define('ffn_dropout_prob', 0.0,
             'Dropout probability of the feed-forward hidden activations.')
    p.Define('epsilon', 1e-6, 'Epsilon of the layer norms.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    self.CheckPositive('input_dim', 'hidden_dim')
    for name, child in _ChildParams(p):
      self.CreateChild(name, child)

  def FProp(self, inputs, training=None):
    x = inputs
    h = self.atten_ln(x)
    h = self.atten(h, training=training)
    x += self.atten_residual_dropout(h, training=training)
    h = self.ffn_ln(x)
    h = self.ffn_in(h)
    h = self.ffn_dropout(h, training=training)
    h = self.ffn_out(h)
    return x + self.ffn_residual_dropout(h, training=training)

  @classmethod
  def FPropMeta(cls, p, input_shape):
    hidden_shape = tuple(input_shape[:-1]) + (p.hidden_dim,)
    costs = []
    for name, child in _ChildParams(p):
      in_shape = hidden_shape if name in ('ffn_dropout', 'ffn_out') else (
          input_shape)
      costs.append(child.target_cls.FPropMeta(child, in_shape))
    total = base_layer.SumCosts(costs)
    elements = core.Elements(input_shape)
    return base_layer.CostMeta(
        output_shape=tuple(input_shape),
        flops=total.flops + 2.0 * elements,  # Plus the two residual adds.
        num_params=total.num_params,
        activation_bytes=core.OutputBytes(input_shape, p.dtype))


def _ChildParams(p):
  """(name, params) of the Transformer layer's children, in FProp order."""
  return [
      ('atten_ln', LayerNormParams(p, 'atten_ln')),
      ('atten', MultiHeadAttention.Params().Set(
          name='atten', input_dim=p.input_dim, num_heads=p.num_heads,
          causal=p.causal, atten_dropout_prob=p.atten_dropout_prob,
          random_seed=core.ChildSeed(p.random_seed, 1), dtype=p.dtype)),
      ('atten_residual_dropout', DropoutParams(
          p, 'atten_residual_dropout', p.residual_dropout_prob, 2)),
      ('ffn_ln', LayerNormParams(p, 'ffn_ln')),
      ('ffn_in', core.FCLayer.Params().Set(
          name='ffn_in', input_dims=p.input_dim, output_dims=p.hidden_dim,
          activation=p.activation, random_seed=core.ChildSeed(p.random_seed, 4),
          dtype=p.dtype)),
      ('ffn_dropout', DropoutParams(p, 'ffn_dropout', p.ffn_dropout_prob, 5)),
      ('ffn_out', core.FCLayer.Params().Set(
          name='ffn_out', input_dims=p.hidden_dim, output_dims=p.input_dim,
          activation='none', random_seed=core.ChildSeed(p.random_seed, 6),
          dtype=p.dtype)),
      ('ffn_residual_dropout', DropoutParams(
          p, 'ffn_residual_dropout', p.residual_dropout_prob, 7)),
  ]


def LayerNormParams(p, name):
  """A layer norm child of a Transformer block `p` (input_dim, epsilon).

  Shared with the encoder-decoder blocks of seq2seq.py, which normalize the
  same way.
  """
  return normalization.LayerNorm.Params().Set(
      name=name, input_dim=p.input_dim, epsilon=p.epsilon, dtype=p.dtype)


def DropoutParams(p, name, prob, i):
  """A dropout child of layer `p` that drops with `prob`, seeded as child i."""
  return core.DropoutLayer.Params().Set(
      name=name, keep_prob=1.0 - prob,
      random_seed=core.ChildSeed(p.random_seed, i), dtype=p.dtype)
