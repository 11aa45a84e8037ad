"""A small ResNet-style image classifier, with batch norm, as a list of layers.

stem conv-BN-ReLU -> stages of residual blocks (the first block of each later
stage halves the resolution and doubles the width) -> global average pool ->
logits. Each residual block is one list entry, so a pipeline cuts only between
blocks and the skip connections stay inside a cell. Batch norm is what makes
this model interesting for GPipe: its statistics are per micro-batch and its
moving averages must be merged once per step (see BatchNormLayer).
"""

import tensorflow as tf

import models
from models import mlp
from tfpipe import base_layer
from tfpipe import layers
from tfpipe.layers import conv
from tfpipe.layers import core


class ConvBnLayer(base_layer.BaseLayer):
  """act(BN(conv(x))): the conv net's basic unit."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('kernel', 3, 'Height and width of the square filter.')
    p.Define('in_channels', 0, 'Number of input channels.')
    p.Define('out_channels', 0, 'Number of output channels.')
    p.Define('stride', 1, 'Stride in both spatial dims.')
    p.Define('activation', 'relu', 'Activation after batch norm.')
    return p

  def __init__(self, params):
    super().__init__(params)
    for name, child in _ConvBnChildren(self.p):
      self.CreateChild(name, child)
    self._act = core.Activation(self.p.activation)

  def FProp(self, inputs, training=None):
    return self._act(self.bn(self.conv(inputs), training=training))

  @classmethod
  def FPropMeta(cls, p, input_shape):
    conv_name, conv_p = _ConvBnChildren(p)[0]
    del conv_name
    conv_meta = conv_p.target_cls.FPropMeta(conv_p, input_shape)
    bn_p = _ConvBnChildren(p)[1][1]
    bn = bn_p.target_cls.FPropMeta(bn_p, conv_meta.output_shape)
    total = base_layer.SumCosts([conv_meta, bn])
    total.activation_bytes = bn.activation_bytes
    return total


def _ConvBnChildren(p):
  conv_p = conv.ConvBeforeBatchNormParams(
      'conv', (p.kernel, p.kernel), p.in_channels, p.out_channels,
      (p.stride, p.stride)).Set(random_seed=core.ChildSeed(p.random_seed, 1),
                                dtype=p.dtype)
  bn = layers.BatchNormLayer.Params().Set(name='bn', dim=p.out_channels,
                                          dtype=p.dtype)
  return [('conv', conv_p), ('bn', bn)]


class ResidualBlock(base_layer.BaseLayer):
  """relu(x' + BN(conv(relu(BN(conv(x)))))), x' a strided 1x1 projection if needed."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('in_channels', 0, 'Number of input channels.')
    p.Define('out_channels', 0, 'Number of output channels.')
    p.Define('stride', 1, 'Stride of the first conv (2 halves the resolution).')
    return p

  def __init__(self, params):
    super().__init__(params)
    for name, child in _BlockChildren(self.p):
      self.CreateChild(name, child)

  def FProp(self, inputs, training=None):
    h = self.conv1(inputs, training=training)
    h = self.conv2(h, training=training)
    shortcut = inputs
    if 'proj' in self.children:
      shortcut = self.proj(inputs, training=training)
    return tf.nn.relu(h + shortcut)

  @classmethod
  def FPropMeta(cls, p, input_shape):
    costs = []
    shape = input_shape
    for name, child in _BlockChildren(p):
      in_shape = input_shape if name == 'proj' else shape
      cost = child.target_cls.FPropMeta(child, in_shape)
      if name != 'proj':
        shape = cost.output_shape
      costs.append(cost)
    total = base_layer.SumCosts(costs)
    total.output_shape = shape
    total.activation_bytes = costs[1].activation_bytes
    return total


def _BlockChildren(p):
  children = [
      ('conv1', ConvBnLayer.Params().Set(
          name='conv1', in_channels=p.in_channels, out_channels=p.out_channels,
          stride=p.stride, random_seed=core.ChildSeed(p.random_seed, 1),
          dtype=p.dtype)),
      ('conv2', ConvBnLayer.Params().Set(
          name='conv2', in_channels=p.out_channels,
          out_channels=p.out_channels, activation='none',
          random_seed=core.ChildSeed(p.random_seed, 2), dtype=p.dtype)),
  ]
  if p.stride != 1 or p.in_channels != p.out_channels:
    children.append(('proj', ConvBnLayer.Params().Set(
        name='proj', kernel=1, in_channels=p.in_channels,
        out_channels=p.out_channels, stride=p.stride, activation='none',
        random_seed=core.ChildSeed(p.random_seed, 3), dtype=p.dtype)))
  return children


class GlobalAveragePoolLayer(base_layer.BaseLayer):
  """Means NHWC inputs over height and width: [batch, channels]."""

  def FProp(self, inputs):
    return tf.reduce_mean(inputs, axis=[1, 2])

  @classmethod
  def FPropMeta(cls, p, input_shape):
    out_shape = (input_shape[0], input_shape[-1])
    return base_layer.CostMeta(
        output_shape=out_shape,
        flops=float(base_layer.NumElements(input_shape,
                                           core.BatchSize(input_shape))),
        num_params=0,
        activation_bytes=core.OutputBytes(out_shape, p.dtype))


class ImageClassifier(models.BaseModel):
  """Base of the classifiers of NHWC float images; targets are int class ids.

  What the image models (this one and models/amoebanet.py) have in common:
  the image params, which params/image.py sets from its input's, the input
  shape and the cross-entropy loss.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('image_size', 16, 'Height and width of the input images.')
    p.Define('channels', 3, 'Number of channels of the input images.')
    p.Define('num_classes', 10, 'Number of output classes.')
    return p

  def InputShape(self):
    p = self.p
    return (None, p.image_size, p.image_size, p.channels)

  def Loss(self, outputs, targets):
    return mlp.ClassificationLoss(outputs, targets)


class ConvClassifier(ImageClassifier):
  """Residual conv net over NHWC float images; targets are int class ids."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.name = 'convnet'
    p.Define('base_width', 16, 'Channels of the stem and the first stage.')
    p.Define('blocks_per_stage', [1, 1], 'Residual blocks of each stage.')
    return p

  def LayerParamsList(self):
    p = self.p
    width = p.base_width
    result = [ConvBnLayer.Params().Set(
        name='stem', in_channels=p.channels, out_channels=width)]
    for stage, num_blocks in enumerate(p.blocks_per_stage):
      for i in range(num_blocks):
        stride = 2 if stage > 0 and i == 0 else 1
        out = width * 2 if stage > 0 and i == 0 else width
        result.append(ResidualBlock.Params().Set(
            name=f'stage{stage}_block{i}', in_channels=width,
            out_channels=out, stride=stride))
        width = out
    result.append(GlobalAveragePoolLayer.Params().Set(name='pool'))
    result.append(layers.FCLayer.Params().Set(
        name='logits', input_dims=width, output_dims=p.num_classes,
        activation='none'))
    return result
