"""Encoder-decoder Transformer layers that pass one nested state down a pipeline.

Every decoder layer attends to the encoder's output, so an encoder-decoder
is not a chain of single tensors. As in Lingvo's GPipe Transformer, each
layer here takes and returns one dict,

    {'encoded': [batch, source_len, dim],        # the encoder's stream
     'source_paddings': [batch, source_len],     # int32, 1 at padding
     'decoded': [batch, target_len, dim]}        # the decoder's stream

so encoder layers transform 'encoded' and carry the target embeddings along,
and decoder layers transform 'decoded' and carry the encoder output along.
The model is then a flat list of layers that the partitioner may cut
anywhere; the pipeline moves the dict between devices like any nested input
(the int32 paddings cross without a gradient).

    Seq2SeqEmbedding -> TransformerEncoderLayer x L -> TransformerDecoderLayer x L
                     -> DecoderLogits

The blocks are pre-layer-norm, like `attention.TransformerLayer`, and build
their norms and dropouts with its helpers; the last encoder layer normalizes
its output for the decoder (`final_layer_norm`).
Every layer has an exact `FPropMeta`.
"""

import math

import tensorflow as tf

from tfpipe import base_layer
from tfpipe.layers import attention
from tfpipe.layers import core
from tfpipe.layers import embedding

PAD_ID = 0


def _StateBytes(shapes, dtype):
  """Bytes of a state dict: its float streams and the int32 paddings."""
  total = 0.0
  for key, shape in shapes.items():
    total += core.OutputBytes(shape, 'int32' if key == 'source_paddings'
                              else dtype)
  return total


class MaskedAttention(base_layer.BaseLayer):
  """Multi-head attention of queries over a memory, ignoring padded positions.

  Input: a dict with 'query' [batch, time, input_dim] and optionally
  'memory' [batch, source_len, memory_dim] (absent: self-attention over the
  query) and 'memory_paddings' [batch, source_len] (nonzero at positions to
  ignore). `causal` also hides later positions (decoder self-attention).
  Output: [batch, time, input_dim].
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Size of the last dim of the query and output.')
    p.Define('memory_dim', 0, 'Size of the last dim of the memory; 0 means '
             'input_dim.')
    p.Define('num_heads', 1, 'Number of attention heads.')
    p.Define('hidden_dim', 0, 'Total size of queries, keys and values over '
             'all heads; 0 means input_dim.')
    p.Define('causal', False, 'Whether query t may only see memory <= t.')
    p.Define('atten_dropout_prob', 0.0,
             'Probability of dropping an attention weight in training.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    hidden = p.hidden_dim or p.input_dim
    memory_dim = p.memory_dim or p.input_dim
    if p.input_dim <= 0 or p.num_heads <= 0 or hidden % p.num_heads:
      raise ValueError(f'{p.name}: need input_dim > 0 and hidden_dim '
                       f'({hidden}) divisible by num_heads ({p.num_heads}).')
    self._hidden_dim = hidden
    self.w_q = self.CreateVariable('w_q', (p.input_dim, hidden))
    self.w_k = self.CreateVariable('w_k', (memory_dim, hidden))
    self.w_v = self.CreateVariable('w_v', (memory_dim, hidden))
    self.w_o = self.CreateVariable('w_o', (hidden, p.input_dim))
    self.b_q = self.CreateVariable('b_q', (hidden,), 'zeros')
    self.b_k = self.CreateVariable('b_k', (hidden,), 'zeros')
    self.b_v = self.CreateVariable('b_v', (hidden,), 'zeros')
    self.b_o = self.CreateVariable('b_o', (p.input_dim,), 'zeros')
    self.CreateChild('atten_dropout', core.DropoutLayer.Params().Set(
        keep_prob=1.0 - p.atten_dropout_prob, random_seed=p.random_seed,
        dtype=p.dtype))

  def _Heads(self, x, w, b):
    """[B, T, D] -> [B, N, T, H / N]."""
    heads = self.p.num_heads
    x = tf.einsum('btd,dh->bth', x, w) + b
    shape = tf.shape(x)
    x = tf.reshape(x, [shape[0], shape[1], heads, self._hidden_dim // heads])
    return tf.transpose(x, [0, 2, 1, 3])

  def FProp(self, inputs, training=None):
    p = self.p
    query = inputs['query']
    memory = inputs.get('memory', query)
    q = self._Heads(query, self.w_q, self.b_q)
    k = self._Heads(memory, self.w_k, self.b_k)
    v = self._Heads(memory, self.w_v, self.b_v)
    logits = tf.einsum('bnth,bnsh->bnts', q, k) / math.sqrt(
        self._hidden_dim // p.num_heads)
    visible = None
    paddings = inputs.get('memory_paddings')
    if paddings is not None:
      visible = tf.equal(paddings, 0)[:, tf.newaxis, tf.newaxis, :]
    if p.causal:
      length = tf.shape(memory)[1]
      causal = tf.linalg.band_part(tf.ones([tf.shape(query)[1], length],
                                           tf.bool), -1, 0)
      visible = causal if visible is None else tf.logical_and(visible, causal)
    if visible is not None:
      logits = tf.where(visible, logits, tf.cast(-1e9, logits.dtype))
    probs = self.atten_dropout(tf.nn.softmax(logits, axis=-1),
                               training=training)
    context = tf.transpose(tf.einsum('bnts,bnsh->bnth', probs, v),
                           [0, 2, 1, 3])
    shape = tf.shape(query)
    context = tf.reshape(context, [shape[0], shape[1], self._hidden_dim])
    return tf.einsum('bth,hd->btd', context, self.w_o) + self.b_o

  @classmethod
  def FPropMeta(cls, p, input_shape):
    query_shape = tuple(input_shape['query'])
    memory_shape = tuple(input_shape.get('memory', query_shape))
    hidden = p.hidden_dim or p.input_dim
    memory_dim = p.memory_dim or p.input_dim
    batch = core.BatchSize(query_shape)
    time = 1 if query_shape[1] is None else int(query_shape[1])
    source = 1 if memory_shape[1] is None else int(memory_shape[1])
    flops = (2.0 * batch * time * p.input_dim * hidden +  # Queries.
             2.0 * 2 * batch * source * memory_dim * hidden +  # Keys, values.
             2.0 * 2 * batch * time * source * hidden +  # QK^T and PV.
             5.0 * batch * p.num_heads * time * source +  # Softmax.
             2.0 * batch * time * hidden * p.input_dim)  # Output projection.
    num_params = (p.input_dim * hidden + 2 * memory_dim * hidden +
                  hidden * p.input_dim + 3 * hidden + p.input_dim)
    return base_layer.CostMeta(
        output_shape=query_shape, flops=flops, num_params=num_params,
        activation_bytes=core.OutputBytes(query_shape, p.dtype))


def _Positions(length, dim, dtype):
  """Sinusoidal position encodings [length, dim]: sines, then cosines."""
  half = dim // 2
  position = tf.cast(tf.range(length), tf.float32)[:, tf.newaxis]
  rates = tf.exp(-math.log(10000.0) * tf.range(half, dtype=tf.float32) /
                 max(half - 1, 1))
  angles = position * rates[tf.newaxis, :]
  return tf.cast(tf.concat([tf.sin(angles), tf.cos(angles)], axis=1), dtype)


class Seq2SeqEmbedding(base_layer.BaseLayer):
  """Packed ids [batch, source_length + target_length] -> the state dict.

  The model's input is one int tensor, the source ids followed by the
  decoder's input ids, because one tensor is what the trainer, its
  inspection and the input pipeline expect of a model input; this first
  layer unpacks it. Token embeddings are scaled by sqrt(dim) and added to
  sinusoidal position encodings. Source ids equal to `pad_id` become the
  source paddings.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Number of token ids.')
    p.Define('embedding_dim', 0, 'Model dim (even).')
    p.Define('source_length', 0, 'Number of source ids at the start of each '
             'input row; the rest are the decoder\'s input ids.')
    p.Define('shared_embedding', True, 'One table for source and target ids '
             '(a shared vocabulary, as multilingual models use).')
    p.Define('pad_id', PAD_ID, 'Source id that marks padding.')
    p.Define('dropout_prob', 0.0, 'Dropout probability of the embeddings.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if p.embedding_dim <= 0 or p.embedding_dim % 2:
      raise ValueError(f'{p.name}: embedding_dim must be even and > 0; '
                       f'received {p.embedding_dim}.')
    self.CheckPositive('source_length')
    for name, child in _EmbeddingChildren(p):
      self.CreateChild(name, child)

  def FProp(self, inputs, training=None):
    p = self.p
    source, target = inputs[:, :p.source_length], inputs[:, p.source_length:]
    target_emb = self.source_emb if p.shared_embedding else self.target_emb

    def Embed(emb, dropout, ids):
      x = emb(ids) + _Positions(tf.shape(ids)[1], p.embedding_dim,
                                self.compute_dtype)
      return dropout(x, training=training)
    return {'encoded': Embed(self.source_emb, self.source_dropout, source),
            'source_paddings': tf.cast(tf.equal(source, p.pad_id), tf.int32),
            'decoded': Embed(target_emb, self.target_dropout, target)}

  @classmethod
  def FPropMeta(cls, p, input_shape):
    batch, length = input_shape
    if length is not None and length <= p.source_length:
      raise ValueError(
          f'{p.name}: inputs of length {length} hold no target ids after the '
          f'source_length={p.source_length} source ids.')
    source = (batch, p.source_length)
    target = (batch, None if length is None else length - p.source_length)
    out = {'encoded': source + (p.embedding_dim,),
           'source_paddings': source,
           'decoded': target + (p.embedding_dim,)}
    elements = core.Elements(out['encoded']) + core.Elements(out['decoded'])
    return base_layer.CostMeta(
        output_shape=out,
        # Scaling, adding positions and dropout.
        flops=float(4 * elements),
        num_params=(1 if p.shared_embedding else 2) * p.vocab_size *
        p.embedding_dim,
        activation_bytes=_StateBytes(out, p.dtype))


def _EmbeddingChildren(p):
  def Table(name, i):
    return embedding.EmbeddingLayer.Params().Set(
        name=name, vocab_size=p.vocab_size, embedding_dim=p.embedding_dim,
        scale_sqrt_depth=True, random_seed=core.ChildSeed(p.random_seed, i),
        dtype=p.dtype)
  children = [('source_emb', Table('source_emb', 1))]
  if not p.shared_embedding:
    children.append(('target_emb', Table('target_emb', 2)))
  for i, side in enumerate(('source', 'target')):
    children.append((f'{side}_dropout', attention.DropoutParams(
        p, f'{side}_dropout', p.dropout_prob, 3 + i)))
  return children


class _Seq2SeqBlock(base_layer.BaseLayer):
  """Params, children and cost model shared by encoder and decoder layers."""

  STREAM = None  # 'encoded' or 'decoded': the stream the layer transforms.

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Model dim: size of the last dim of the streams.')
    p.Define('num_heads', 1, 'Number of attention heads.')
    p.Define('hidden_dim', 0, 'Hidden size of the feed-forward network.')
    p.Define('activation', 'relu', 'Activation of the feed-forward network.')
    p.Define('atten_dropout_prob', 0.0,
             'Dropout probability of attention weights.')
    p.Define('residual_dropout_prob', 0.0,
             'Dropout probability of each sub-block output before the '
             'residual add.')
    p.Define('epsilon', 1e-6, 'Epsilon of the layer norms.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    self.CheckPositive('input_dim', 'hidden_dim')
    for name, child in self._Children(p):
      self.CreateChild(name, child)

  @classmethod
  def _AttentionChildren(cls, p):
    """(name, params) of the attention sub-blocks, in FProp order."""
    raise NotImplementedError(f'{cls.__name__} must define its attention.')

  @classmethod
  def _Children(cls, p):
    children = []
    i = 0
    for name, atten in cls._AttentionChildren(p):
      i += 1
      children += [
          (f'{name}_ln', attention.LayerNormParams(p, f'{name}_ln')),
          (name, atten.Set(name=name, random_seed=core.ChildSeed(
              p.random_seed, i), dtype=p.dtype)),
          (f'{name}_dropout', attention.DropoutParams(
              p, f'{name}_dropout', p.residual_dropout_prob, 10 + i))]
    children += [
        ('ffn_ln', attention.LayerNormParams(p, 'ffn_ln')),
        ('ffn_in', core.FCLayer.Params().Set(
            name='ffn_in', input_dims=p.input_dim, output_dims=p.hidden_dim,
            activation=p.activation,
            random_seed=core.ChildSeed(p.random_seed, 20), dtype=p.dtype)),
        ('ffn_out', core.FCLayer.Params().Set(
            name='ffn_out', input_dims=p.hidden_dim, output_dims=p.input_dim,
            activation='none', random_seed=core.ChildSeed(p.random_seed, 21),
            dtype=p.dtype)),
        ('ffn_dropout', attention.DropoutParams(
            p, 'ffn_dropout', p.residual_dropout_prob, 22))]
    return children

  def _AttentionInputs(self, name, normed, state):
    """The dict the attention sub-block `name` reads."""
    raise NotImplementedError(f'{type(self).__name__} must define it.')

  def FProp(self, inputs, training=None):
    x = inputs[self.STREAM]
    for name, _ in self._AttentionChildren(self.p):
      h = self._children[f'{name}_ln'](x)
      h = self._children[name](self._AttentionInputs(name, h, inputs),
                               training=training)
      x += self._children[f'{name}_dropout'](h, training=training)
    h = self.ffn_out(self.ffn_in(self.ffn_ln(x)))
    x += self.ffn_dropout(h, training=training)
    out = dict(inputs)
    out[self.STREAM] = x
    return out

  @classmethod
  def _AttentionShape(cls, name, input_shape):
    raise NotImplementedError(f'{cls.__name__} must define it.')

  @classmethod
  def FPropMeta(cls, p, input_shape):
    stream = tuple(input_shape[cls.STREAM])
    hidden = stream[:-1] + (p.hidden_dim,)
    children = dict(cls._Children(p))
    costs = []
    for name, _ in cls._AttentionChildren(p):
      for part in (f'{name}_ln', name, f'{name}_dropout'):
        shape = cls._AttentionShape(name, input_shape) if part == name else (
            stream)
        costs.append(children[part].target_cls.FPropMeta(children[part],
                                                         shape))
    for part, shape in (('ffn_ln', stream), ('ffn_in', stream),
                        ('ffn_out', hidden), ('ffn_dropout', stream)):
      costs.append(children[part].target_cls.FPropMeta(children[part], shape))
    total = base_layer.SumCosts(costs)
    num_adds = len(cls._AttentionChildren(p)) + 1
    out = dict(input_shape)
    return base_layer.CostMeta(
        output_shape=out,
        flops=total.flops + num_adds * core.Elements(stream),
        num_params=total.num_params,
        activation_bytes=_StateBytes(out, p.dtype))


class TransformerEncoderLayer(_Seq2SeqBlock):
  """'encoded' + SelfAttn(LN('encoded')) over unpadded positions, then + FFN."""

  STREAM = 'encoded'

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('final_layer_norm', False, 'Normalize the output stream: set on '
             'the last encoder layer, whose output the decoder reads.')
    return p

  def __init__(self, params):
    super().__init__(params)
    if self.p.final_layer_norm:
      self.CreateChild('final_ln',
                       attention.LayerNormParams(self.p, 'final_ln'))

  @classmethod
  def _AttentionChildren(cls, p):
    return [('self_atten', MaskedAttention.Params().Set(
        input_dim=p.input_dim, num_heads=p.num_heads,
        atten_dropout_prob=p.atten_dropout_prob))]

  def _AttentionInputs(self, name, normed, state):
    return {'query': normed, 'memory_paddings': state['source_paddings']}

  @classmethod
  def _AttentionShape(cls, name, input_shape):
    return {'query': input_shape['encoded'],
            'memory_paddings': input_shape['source_paddings']}

  def FProp(self, inputs, training=None):
    out = super().FProp(inputs, training=training)
    if self.p.final_layer_norm:
      out['encoded'] = self.final_ln(out['encoded'])
    return out

  @classmethod
  def FPropMeta(cls, p, input_shape):
    meta = super().FPropMeta(p, input_shape)
    if p.final_layer_norm:
      norm = attention.LayerNormParams(p, 'final_ln')
      ln = norm.target_cls.FPropMeta(norm, input_shape['encoded'])
      meta.flops += ln.flops
      meta.num_params += ln.num_params
    return meta


class TransformerDecoderLayer(_Seq2SeqBlock):
  """'decoded' + causal SelfAttn, + attention over 'encoded', + FFN."""

  STREAM = 'decoded'

  @classmethod
  def _AttentionChildren(cls, p):
    return [
        ('self_atten', MaskedAttention.Params().Set(
            input_dim=p.input_dim, num_heads=p.num_heads, causal=True,
            atten_dropout_prob=p.atten_dropout_prob)),
        ('cross_atten', MaskedAttention.Params().Set(
            input_dim=p.input_dim, num_heads=p.num_heads,
            atten_dropout_prob=p.atten_dropout_prob)),
    ]

  def _AttentionInputs(self, name, normed, state):
    if name == 'self_atten':
      return {'query': normed}
    return {'query': normed, 'memory': state['encoded'],
            'memory_paddings': state['source_paddings']}

  @classmethod
  def _AttentionShape(cls, name, input_shape):
    if name == 'self_atten':
      return {'query': input_shape['decoded']}
    return {'query': input_shape['decoded'], 'memory': input_shape['encoded'],
            'memory_paddings': input_shape['source_paddings']}


class DecoderLogits(base_layer.BaseLayer):
  """Logits [batch, target_len, vocab] from LN('decoded'): the last layer."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Model dim.')
    p.Define('vocab_size', 0, 'Number of target ids.')
    p.Define('epsilon', 1e-6, 'Epsilon of the layer norm.')
    return p

  def __init__(self, params):
    super().__init__(params)
    for name, child in _LogitsChildren(self.p):
      self.CreateChild(name, child)

  def FProp(self, inputs):
    return self.logits(self.final_ln(inputs['decoded']))

  @classmethod
  def FPropMeta(cls, p, input_shape):
    (_, ln_p), (_, fc_p) = _LogitsChildren(p)
    decoded = tuple(input_shape['decoded'])
    ln = ln_p.target_cls.FPropMeta(ln_p, decoded)
    fc = fc_p.target_cls.FPropMeta(fc_p, decoded)
    return base_layer.CostMeta(
        output_shape=fc.output_shape, flops=ln.flops + fc.flops,
        num_params=ln.num_params + fc.num_params,
        activation_bytes=fc.activation_bytes)


def _LogitsChildren(p):
  return [
      ('final_ln', attention.LayerNormParams(p, 'final_ln')),
      ('logits', core.FCLayer.Params().Set(
          name='logits', input_dims=p.input_dim, output_dims=p.vocab_size,
          activation='none', random_seed=core.ChildSeed(p.random_seed, 1),
          dtype=p.dtype)),
  ]
