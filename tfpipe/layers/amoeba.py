"""AmoebaNet-D's building blocks: its normal and reduction cells and their ops.

AmoebaNet (Real et al., 2019) is a stack of evolved cells. A cell reads the
outputs of the two cells before it, so a network of cells is not a plain
chain of tensors. Here every cell takes and returns the pair

    (output of the previous cell, output of the cell before that)

as one tuple, which makes the network a sequence of single-input layers that
the GPipe partitioner cuts along cell boundaries, as the paper does; the
pipeline carries the tuple across devices like any nested input.

A cell first brings both inputs to its width (`reduce_prev`, and
`reduce_prev_prev`, which also halves the resolution when the cell before
was a reduction cell), then computes five nodes, each the sum of two ops on
earlier states, and concatenates some of them along channels:

    states = [reduce_prev(prev), reduce_prev_prev(prev_prev)]
    node_j = op_2j(states[i_2j]) + op_2j+1(states[i_2j+1]),  j = 0..4
    output = concat(states[c] for c in CONCAT)

`NORMAL_CELL`, `REDUCTION_CELL` and the concat lists below are the
AmoebaNet-D genotype as GPipe used it (TensorFlow's TPU reference
implementation; torchgpipe's benchmark model is built from the same
genotype). In a reduction cell the ops that read the two inputs use stride
2, so the output has half the resolution.

Every layer here has an exact `FPropMeta`, so AmoebaNet-D(L, D) at any size
can be partitioned and its parameters counted without allocating anything.
"""

import math

import tensorflow as tf

from tfpipe import base_layer
from tfpipe.layers import conv
from tfpipe.layers import core
from tfpipe.layers import normalization

# (index of the state the op reads, op name), two ops per node.
NORMAL_CELL = (
    (1, 'conv_1x1'), (1, 'max_pool_3x3'),
    (1, 'none'), (0, 'conv_1x7_7x1'),
    (0, 'conv_1x1'), (0, 'conv_1x7_7x1'),
    (2, 'max_pool_3x3'), (2, 'none'),
    (1, 'avg_pool_3x3'), (5, 'conv_1x1'),
)
NORMAL_CONCAT = (0, 3, 4, 6)

REDUCTION_CELL = (
    (0, 'max_pool_2x2'), (0, 'max_pool_3x3'),
    (2, 'none'), (1, 'conv_3x3'),
    (2, 'conv_1x7_7x1'), (2, 'max_pool_3x3'),
    (3, 'none'), (1, 'max_pool_2x2'),
    (2, 'avg_pool_3x3'), (3, 'conv_1x1'),
)
REDUCTION_CONCAT = (4, 5, 6)

OPS = ('none', 'conv_1x1', 'conv_3x3', 'conv_1x7_7x1', 'max_pool_2x2',
       'max_pool_3x3', 'avg_pool_3x3')


def _OutSize(size, stride):
  return None if size is None else math.ceil(size / stride)


class ReluConvBn(base_layer.BaseLayer):
  """BN(conv(relu(x))) without a conv bias: the unit every AmoebaNet op is made of."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('in_channels', 0, 'Number of input channels.')
    p.Define('out_channels', 0, 'Number of output channels.')
    p.Define('kernel', (1, 1), 'Filter (height, width).')
    p.Define('stride', (1, 1), 'Stride (height, width).')
    p.Define('relu', True, 'Whether a ReLU precedes the conv (False in the stem).')
    p.Define('batch_norm_decay', 0.99,
             'Momentum of the batch norm\'s moving statistics.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    self.CheckPositive('in_channels', 'out_channels')
    for name, child in _ReluConvBnChildren(p):
      self.CreateChild(name, child)

  def FProp(self, inputs, training=None):
    x = tf.nn.relu(inputs) if self.p.relu else inputs
    return self.bn(self.conv(x), training=training)

  @classmethod
  def FPropMeta(cls, p, input_shape):
    (_, conv_p), (_, bn_p) = _ReluConvBnChildren(p)
    conv_meta = conv_p.target_cls.FPropMeta(conv_p, input_shape)
    bn_meta = bn_p.target_cls.FPropMeta(bn_p, conv_meta.output_shape)
    total = base_layer.SumCosts([conv_meta, bn_meta])
    if p.relu:
      total.flops += core.Elements(input_shape)
    total.activation_bytes = bn_meta.activation_bytes
    return total


def _ReluConvBnChildren(p):
  return [
      ('conv', conv.ConvBeforeBatchNormParams(
          'conv', p.kernel, p.in_channels, p.out_channels, p.stride).Set(
              random_seed=core.ChildSeed(p.random_seed, 1), dtype=p.dtype)),
      ('bn', _BatchNormParams(p)),
  ]


def _BatchNormParams(p):
  """The batch norm over the out_channels of ReluConvBn and FactorizedReduce."""
  return normalization.BatchNormLayer.Params().Set(
      name='bn', dim=p.out_channels, decay=p.batch_norm_decay, dtype=p.dtype)


class FactorizedReduce(base_layer.BaseLayer):
  """Halves the resolution without dropping pixels: BN(concat(conv(x), conv(x shifted))).

  A strided 1x1 conv alone would only ever see the even pixels; the second
  path sees the odd ones (x shifted by one pixel), and each path produces
  half of the output channels.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('in_channels', 0, 'Number of input channels.')
    p.Define('out_channels', 0, 'Number of output channels (even).')
    p.Define('batch_norm_decay', 0.99,
             'Momentum of the batch norm\'s moving statistics.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if p.in_channels <= 0 or p.out_channels <= 0 or p.out_channels % 2:
      raise ValueError(f'{p.name}: need in_channels > 0 and an even '
                       f'out_channels > 0; received {p.in_channels} and '
                       f'{p.out_channels}.')
    for name, child in _FactorizedReduceChildren(p):
      self.CreateChild(name, child)

  def FProp(self, inputs, training=None):
    x = tf.nn.relu(inputs)
    shifted = tf.pad(x[:, 1:, 1:, :], [[0, 0], [0, 1], [0, 1], [0, 0]])
    out = tf.concat([self.conv_even(x), self.conv_odd(shifted)], axis=-1)
    return self.bn(out, training=training)

  @classmethod
  def FPropMeta(cls, p, input_shape):
    (_, even_p), (_, odd_p), (_, bn_p) = _FactorizedReduceChildren(p)
    even = even_p.target_cls.FPropMeta(even_p, input_shape)
    odd = odd_p.target_cls.FPropMeta(odd_p, input_shape)
    out_shape = tuple(even.output_shape[:-1]) + (p.out_channels,)
    bn = bn_p.target_cls.FPropMeta(bn_p, out_shape)
    return base_layer.CostMeta(
        output_shape=out_shape,
        flops=even.flops + odd.flops + bn.flops + core.Elements(input_shape),
        num_params=even.num_params + odd.num_params + bn.num_params,
        activation_bytes=bn.activation_bytes)


def _FactorizedReduceChildren(p):
  def Conv(name, i):
    return conv.ConvBeforeBatchNormParams(
        name, (1, 1), p.in_channels, p.out_channels // 2, (2, 2)).Set(
            random_seed=core.ChildSeed(p.random_seed, i), dtype=p.dtype)
  return [('conv_even', Conv('conv_even', 1)), ('conv_odd', Conv('conv_odd', 2)),
          ('bn', _BatchNormParams(p))]


class Pool2DLayer(base_layer.BaseLayer):
  """Max or average pooling over NHWC inputs with SAME padding.

  Average pooling divides by the number of real (unpadded) pixels in each
  window, so borders are not darkened.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('pooling', 'max', 'max or avg.')
    p.Define('window', 3, 'Height and width of the pooling window.')
    p.Define('stride', 1, 'Stride in both spatial dims.')
    return p

  def __init__(self, params):
    super().__init__(params)
    if self.p.pooling not in ('max', 'avg'):
      raise ValueError(f'{self.p.name}: pooling must be max or avg; received '
                       f'{self.p.pooling!r}.')

  def FProp(self, inputs):
    p = self.p
    pool = tf.nn.max_pool2d if p.pooling == 'max' else tf.nn.avg_pool2d
    return pool(inputs, p.window, p.stride, 'SAME')

  @classmethod
  def FPropMeta(cls, p, input_shape):
    batch, height, width, channels = input_shape
    out_shape = (batch, _OutSize(height, p.stride), _OutSize(width, p.stride),
                 channels)
    return base_layer.CostMeta(
        output_shape=out_shape,
        flops=float(p.window * p.window * core.Elements(out_shape)),
        num_params=0,
        activation_bytes=core.OutputBytes(out_shape, p.dtype))


def OpParams(op, channels, stride, name, random_seed=None, dtype='float32',
             batch_norm_decay=0.99):
  """Params of AmoebaNet op `op` on `channels` channels, or None for identity.

  The conv ops are bottlenecks: 1x1 down to channels // 4, the spatial
  conv(s), 1x1 back up, each as ReLU-conv-BN.
  """
  if op not in OPS:
    raise ValueError(f'{name}: unknown AmoebaNet op {op!r}; use one of {OPS}.')
  if op == 'none':
    if stride == 1:
      return None
    return FactorizedReduce.Params().Set(
        name=name, in_channels=channels, out_channels=channels,
        batch_norm_decay=batch_norm_decay, random_seed=random_seed,
        dtype=dtype)
  if op.endswith('pool_3x3') or op.endswith('pool_2x2'):
    return Pool2DLayer.Params().Set(
        name=name, pooling=op.split('_')[0], window=int(op[-1]),
        stride=stride, dtype=dtype)

  def Unit(i, cin, cout, kernel=(1, 1), unit_stride=(1, 1)):
    return ReluConvBn.Params().Set(
        name=f'unit{i}', in_channels=cin, out_channels=cout, kernel=kernel,
        stride=unit_stride, batch_norm_decay=batch_norm_decay,
        random_seed=core.ChildSeed(random_seed, i + 1), dtype=dtype)
  if op == 'conv_1x1':
    return Unit(0, channels, channels, unit_stride=(stride, stride)).Set(
        name=name, random_seed=random_seed)
  narrow = max(1, channels // 4)
  if op == 'conv_3x3':
    units = [Unit(0, channels, narrow),
             Unit(1, narrow, narrow, (3, 3), (stride, stride)),
             Unit(2, narrow, channels)]
  else:  # conv_1x7_7x1
    units = [Unit(0, channels, narrow),
             Unit(1, narrow, narrow, (1, 7), (1, stride)),
             Unit(2, narrow, narrow, (7, 1), (stride, 1)),
             Unit(3, narrow, channels)]
  return core.SequentialLayer.Params().Set(name=name, sub=units, dtype=dtype)


class AmoebaCell(base_layer.BaseLayer):
  """An AmoebaNet-D normal or reduction cell: (prev, prev_prev) -> (out, prev).

  The input may also be a single tensor, which then serves as both prev and
  prev_prev (the first cell after the stem).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('prev_channels', 0, 'Channels of the previous cell\'s output.')
    p.Define('prev_prev_channels', 0,
             'Channels of the output of the cell before the previous one.')
    p.Define('channels', 0, 'Width of each node; the output has 4x (normal) '
             'or 3x (reduction) as many channels.')
    p.Define('reduction', False, 'Whether this is a reduction cell, which '
             'halves the resolution.')
    p.Define('reduction_prev', False, 'Whether the previous cell halved the '
             'resolution, so prev_prev is twice as large as prev.')
    p.Define('batch_norm_decay', 0.99,
             'Momentum of the moving statistics of every batch norm.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if min(p.prev_channels, p.prev_prev_channels, p.channels) <= 0:
      raise ValueError(
          f'{p.name}: prev_channels, prev_prev_channels and channels must be '
          f'> 0; received {p.prev_channels}, {p.prev_prev_channels} and '
          f'{p.channels}.')
    if p.channels % 2:
      raise ValueError(f'{p.name}: channels must be even (a factorized '
                       f'reduction splits them in two); received {p.channels}.')
    for name, child, _ in _CellChildren(p):
      if child is not None:
        self.CreateChild(name, child)

  def FProp(self, inputs, training=None):
    prev, prev_prev = _SplitStates(inputs)
    states = [self.reduce_prev(prev, training=training)]
    states.append(self._Apply('reduce_prev_prev', prev_prev, training))
    ops, concat = _Genotype(self.p)
    for j in range(0, len(ops), 2):
      states.append(
          self._Apply(f'op{j}_{ops[j][1]}', states[ops[j][0]], training) +
          self._Apply(f'op{j + 1}_{ops[j + 1][1]}', states[ops[j + 1][0]],
                      training))
    return (tf.concat([states[i] for i in concat], axis=-1), prev)

  def _Apply(self, child_name, x, training):
    """The child called `child_name` on x; identity when there is none."""
    child = self._children.get(child_name)
    return x if child is None else child(x, training=training)

  @classmethod
  def FPropMeta(cls, p, input_shape):
    prev_shape, prev_prev_shape = _SplitStates(input_shape, is_shape=True)
    ops, concat = _Genotype(p)
    children = {name: (child, index) for name, child, index in _CellChildren(p)}
    costs = []
    reduce_prev, _ = children['reduce_prev']
    costs.append(reduce_prev.target_cls.FPropMeta(reduce_prev, prev_shape))
    state_shapes = [costs[-1].output_shape]
    reduce_prev_prev, _ = children['reduce_prev_prev']
    if reduce_prev_prev is None:
      state_shapes.append(tuple(prev_prev_shape))
    else:
      costs.append(reduce_prev_prev.target_cls.FPropMeta(reduce_prev_prev,
                                                         prev_prev_shape))
      state_shapes.append(costs[-1].output_shape)
    add_flops = 0.0
    for j in range(0, len(ops), 2):
      out_shapes = []
      for i in (j, j + 1):
        child, index = children[f'op{i}_{ops[i][1]}']
        shape = state_shapes[index]
        if child is not None:
          costs.append(child.target_cls.FPropMeta(child, shape))
          shape = costs[-1].output_shape
        out_shapes.append(tuple(shape))
      if out_shapes[0] != out_shapes[1]:
        raise ValueError(f'{p.name}: node {len(state_shapes)} adds shapes '
                         f'{out_shapes[0]} and {out_shapes[1]}.')
      state_shapes.append(out_shapes[0])
      add_flops += core.Elements(out_shapes[0])
    out_shape = tuple(state_shapes[concat[0]][:-1]) + (
        sum(state_shapes[i][-1] for i in concat),)
    output_shape = (out_shape, tuple(prev_shape))
    total = base_layer.SumCosts(costs)
    return base_layer.CostMeta(
        output_shape=output_shape,
        flops=total.flops + add_flops,
        num_params=total.num_params,
        activation_bytes=core.OutputBytes(out_shape, p.dtype) +
        core.OutputBytes(prev_shape, p.dtype))


def CellOutputChannels(reduction, channels):
  """Channels of a cell's output: node width times the number concatenated."""
  return channels * len(REDUCTION_CONCAT if reduction else NORMAL_CONCAT)


def _Genotype(p):
  if p.reduction:
    return REDUCTION_CELL, REDUCTION_CONCAT
  return NORMAL_CELL, NORMAL_CONCAT


def _SplitStates(inputs, is_shape=False):
  """(prev, prev_prev) from a cell's input: a pair, or one tensor for both."""
  single = _IsShape(inputs) if is_shape else (
      not isinstance(inputs, (tuple, list)))
  if single:
    return inputs, inputs
  if len(inputs) != 2:
    raise ValueError('An AmoebaNet cell takes (prev, prev_prev); received '
                     f'{len(inputs)} inputs.')
  return inputs[0], inputs[1]


def _IsShape(shape):
  """Whether `shape` is one shape, rather than a pair of shapes."""
  return not any(isinstance(d, (tuple, list, tf.TensorShape)) for d in shape)


def _CellChildren(p):
  """(name, params or None, index of the state it reads) of each child."""
  decay = p.batch_norm_decay
  children = [('reduce_prev', ReluConvBn.Params().Set(
      name='reduce_prev', in_channels=p.prev_channels,
      out_channels=p.channels, batch_norm_decay=decay,
      random_seed=core.ChildSeed(p.random_seed, 1), dtype=p.dtype), None)]
  if p.reduction_prev:
    reduce_prev_prev = FactorizedReduce.Params().Set(
        name='reduce_prev_prev', in_channels=p.prev_prev_channels,
        out_channels=p.channels, batch_norm_decay=decay,
        random_seed=core.ChildSeed(p.random_seed, 2), dtype=p.dtype)
  elif p.prev_prev_channels != p.channels:
    reduce_prev_prev = ReluConvBn.Params().Set(
        name='reduce_prev_prev', in_channels=p.prev_prev_channels,
        out_channels=p.channels, batch_norm_decay=decay,
        random_seed=core.ChildSeed(p.random_seed, 2), dtype=p.dtype)
  else:
    reduce_prev_prev = None
  children.append(('reduce_prev_prev', reduce_prev_prev, None))
  ops, _ = _Genotype(p)
  for j, (index, op) in enumerate(ops):
    stride = 2 if p.reduction and index < 2 else 1
    name = f'op{j}_{op}'
    children.append((name, OpParams(
        op, p.channels, stride, name, core.ChildSeed(p.random_seed, 10 + j),
        p.dtype, decay), index))
  return children


class ClassifierHead(base_layer.BaseLayer):
  """Logits from the last cell's output: ReLU, global average pool, dropout, FC.

  Takes a cell's (output, prev) pair (or one NHWC tensor) and uses the output.
  Global pooling makes the parameter count independent of the image size.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('in_channels', 0, 'Channels of the last cell\'s output.')
    p.Define('num_classes', 0, 'Number of output classes.')
    p.Define('dropout_prob', 0.0, 'Dropout probability before the FC layer.')
    return p

  def __init__(self, params):
    super().__init__(params)
    for name, child in _HeadChildren(self.p):
      self.CreateChild(name, child)

  def FProp(self, inputs, training=None):
    x = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    x = tf.reduce_mean(tf.nn.relu(x), axis=[1, 2])
    return self.logits(self.dropout(x, training=training))

  @classmethod
  def FPropMeta(cls, p, input_shape):
    shape = input_shape if _IsShape(input_shape) else input_shape[0]
    pooled = (shape[0], shape[-1])
    (_, dropout_p), (_, fc_p) = _HeadChildren(p)
    dropout = dropout_p.target_cls.FPropMeta(dropout_p, pooled)
    fc = fc_p.target_cls.FPropMeta(fc_p, pooled)
    return base_layer.CostMeta(
        output_shape=fc.output_shape,
        flops=2.0 * core.Elements(shape) + dropout.flops + fc.flops,
        num_params=fc.num_params,
        activation_bytes=fc.activation_bytes)


def _HeadChildren(p):
  return [
      ('dropout', core.DropoutLayer.Params().Set(
          name='dropout', keep_prob=1.0 - p.dropout_prob,
          random_seed=core.ChildSeed(p.random_seed, 1), dtype=p.dtype)),
      ('logits', core.FCLayer.Params().Set(
          name='logits', input_dims=p.in_channels, output_dims=p.num_classes,
          activation='none', random_seed=core.ChildSeed(p.random_seed, 2),
          dtype=p.dtype)),
  ]
