"""2-D convolution with eagerly created filters.

Keras' Conv2D infers its input channels at first call; here the whole filter
shape is a param, so the variables exist as soon as the layer is constructed
(on the device it was constructed under) and the cost model needs no tracing.
"""

import math

import tensorflow as tf

from tfpipe import base_layer
from tfpipe.layers import core


class Conv2DLayer(base_layer.BaseLayer):
  """act(conv2d(x, w) + b) on NHWC inputs."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('filter_shape', (0, 0, 0, 0),
             'Filter shape (height, width, in_channels, out_channels).')
    p.Define('filter_stride', (1, 1), 'Stride (height, width).')
    p.Define('padding', 'SAME', 'Padding: "SAME" or "VALID".')
    p.Define('has_bias', True, 'Whether to add a learned per-channel bias.')
    p.Define('activation', 'relu', 'Name of the activation (see ACTIVATIONS).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if len(p.filter_shape) != 4 or min(p.filter_shape) <= 0:
      raise ValueError(f'{p.name}: filter_shape must be 4 positive dims; '
                       f'received {p.filter_shape}.')
    if p.padding not in ('SAME', 'VALID'):
      raise ValueError(f'{p.name}: padding must be SAME or VALID.')
    self._act = core.Activation(p.activation)
    self.w = self.CreateVariable('w', tuple(p.filter_shape))
    self.b = (self.CreateVariable('b', (p.filter_shape[3],), 'zeros')
              if p.has_bias else None)

  def FProp(self, inputs):
    p = self.p
    out = tf.nn.conv2d(inputs, self.w, strides=[1, *p.filter_stride, 1],
                       padding=p.padding)
    if self.b is not None:
      out = tf.nn.bias_add(out, self.b)
    return self._act(out)

  @classmethod
  def FPropMeta(cls, p, input_shape):
    batch, height, width, _ = input_shape
    kh, kw, cin, cout = p.filter_shape
    sh, sw = p.filter_stride
    out_shape = (batch, _OutDim(height, kh, sh, p.padding),
                 _OutDim(width, kw, sw, p.padding), cout)
    positions = core.NumPositions(out_shape)
    flops = 2.0 * positions * kh * kw * cin * cout
    if p.has_bias:
      flops += positions * cout
    return base_layer.CostMeta(
        output_shape=out_shape,
        flops=flops,
        num_params=kh * kw * cin * cout + (cout if p.has_bias else 0),
        activation_bytes=core.OutputBytes(out_shape, p.dtype))


def ConvBeforeBatchNormParams(name, kernel, in_channels, out_channels,
                              stride=(1, 1)):
  """Params of a conv that a batch norm follows: no bias and no activation.

  The batch norm's beta does the bias's work, and any activation belongs
  after the normalization. `kernel` and `stride` are (height, width).
  """
  return Conv2DLayer.Params().Set(
      name=name, filter_shape=(*kernel, in_channels, out_channels),
      filter_stride=tuple(stride), padding='SAME', has_bias=False,
      activation='none')


def _OutDim(size, kernel, stride, padding):
  """Output length of one spatial dim, as tf.nn.conv2d computes it."""
  if size is None:
    return None
  if padding == 'SAME':
    return math.ceil(size / stride)
  return math.ceil((size - kernel + 1) / stride)
