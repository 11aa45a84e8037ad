"""KerasLayer: puts any Keras layer class into a tfpipe params tree.

Users often have a Keras layer (a `keras.layers.Conv2D`, a layer of their own)
that has no tfpipe counterpart. Wrapping it as params lets it sit in a
`SequentialLayer`, print with `ToText`, be overridden with `FromText`, and be
placed on a pipeline device: the wrapped layer builds its variables lazily,
so the wrapper builds it explicitly in `build`, under whatever `tf.device`
scope the container's build runs in.

Inside a pipeline step the wrapped layer runs through
`keras_exact.ExactCalls`, so its dropout masks and noise are repeated by a
recompute and do not depend on the partition, its batch norms make one
merged update per step, and layers that cannot be made exact (stateful RNNs,
SpectralNormalization, ...) are refused when the wrapper is built, naming
the layer and what to use instead. See the README's table of Keras layers.
"""

import inspect

import keras
import numpy as np

from tfpipe import base_layer
from tfpipe.layers import core
from tfpipe.layers import keras_exact


class KerasLayer(base_layer.BaseLayer):
  """Wraps `p.cls(**p.args)`, a Keras layer, as a tfpipe layer."""

  @classmethod
  def Params(cls):
    p = super().Params()
    # A Define'd 'cls' shadows the InstantiableParams target class for
    # reading, so `p.cls` is the Keras class while Instantiate builds us.
    p.Define('cls', None, 'The Keras layer class to wrap.')
    p.Define('args', {}, 'Keyword arguments of the Keras layer constructor.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if not (isinstance(p.cls, type) and issubclass(p.cls, keras.layers.Layer)):
      raise TypeError(f'{p.name}: cls must be a keras.layers.Layer subclass; '
                      f'received {p.cls!r}.')
    kwargs = dict(p.args)
    kwargs.setdefault('name', p.name)
    kwargs.setdefault('dtype', p.dtype)
    self.layer = p.cls(**kwargs)
    self._CheckExact()
    self._layer_accepts_training = (
        'training' in inspect.signature(self.layer.call).parameters)

  def _CheckExact(self):
    cls = self.p.cls
    cls_name = (f'keras.layers.{cls.__name__}' if getattr(
        keras.layers, cls.__name__, None) is cls else cls.__name__)
    keras_exact.CheckLayer(self.layer,
                           f'{self.p.name}: KerasLayer(cls={cls_name})')

  def build(self, input_shape):
    if not self.layer.built:
      self.layer.build(input_shape)
      self._CheckExact()  # Sublayers made in build are checked too.

  def FProp(self, inputs, training=None):
    with keras_exact.ExactCalls(self.layer, self.SeedPath()):
      if self._layer_accepts_training:
        return self.layer(inputs, training=training)
      return self.layer(inputs)

  def compute_output_shape(self, input_shape):
    return _OutputShape(self.layer, input_shape)

  @classmethod
  def FPropMeta(cls, p, input_shape):
    wrapper = p.Instantiate()
    wrapper.build(input_shape)
    out_shape = _OutputShape(wrapper.layer, input_shape)
    num_params = int(
        sum(np.prod(v.shape) for v in wrapper.layer.trainable_weights))
    out_elements = base_layer.NumElements(out_shape,
                                          core.BatchSize(input_shape))
    if num_params:
      # Each output position applies the layer's weights once: 2 flops a MAC.
      flops = 2.0 * num_params * _NumOutputPositions(out_shape, input_shape)
    else:
      flops = float(out_elements)
    return base_layer.CostMeta(
        output_shape=out_shape,
        flops=flops,
        num_params=num_params,
        activation_bytes=float(core.DtypeBytes(p.dtype) * out_elements))


def _OutputShape(layer, input_shape):
  """The layer's output shape, via compute_output_shape or symbolic tracing."""
  try:
    shape = layer.compute_output_shape(input_shape)
  except NotImplementedError:
    spec = layer.compute_output_spec(keras.KerasTensor(input_shape))
    shape = _SpecShapes(spec)
  return base_layer.MapShapes(tuple, shape)


def _SpecShapes(spec):
  if isinstance(spec, dict):
    return {k: _SpecShapes(v) for k, v in spec.items()}
  if isinstance(spec, (list, tuple)):
    return type(spec)(_SpecShapes(v) for v in spec)
  return tuple(spec.shape)


def _NumOutputPositions(out_shape, input_shape):
  leaves = base_layer.LeafShapes(out_shape)
  if len(leaves) != 1 or not leaves[0]:
    return core.BatchSize(input_shape)
  return core.NumPositions(leaves[0])
