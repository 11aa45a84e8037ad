"""FeatureExtractionLayer: one pipeline cell, a contiguous run of layers.

A cell is a sequential container whose layers all live on one device. It is
built explicitly, layer by layer, with each layer's input shape computed from
the previous layer's cost model. Building it under `tf.device(d)` therefore
puts every variable on `d`, including those of Keras layers that would
otherwise build lazily on first call, wherever that call happens.
"""

from tfpipe import base_layer


def SEQUENTIAL_CLASSES():  # pylint: disable=invalid-name
  """Container classes whose `sub` list the partitioner flattens."""
  classes = [FeatureExtractionLayer]
  try:
    from tfpipe import layers  # pylint: disable=g-import-not-at-top
    if hasattr(layers, 'SequentialLayer'):
      classes.append(layers.SequentialLayer)
  except ImportError:
    pass
  return tuple(classes)


class FeatureExtractionLayer(base_layer.BaseLayer):
  """Runs its `sub` layers in order; the unit the pipeline places on a device."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('sub', [], 'Params of the layers this cell runs, in order.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChildren('sub', self.p.sub)

  def build(self, input_shape):
    shape = input_shape
    for i, layer in enumerate(self.sub):
      if not layer.built:
        layer.build(shape)
      if all(l.built for l in self.sub[i + 1:]):
        break
      shape = layer.compute_output_shape(shape)

  def FProp(self, inputs, training=None):
    x = inputs
    for layer in self.sub:
      x = layer(x, training=training)
    return x

  @classmethod
  def FPropMeta(cls, p, input_shape):
    metas = []
    shape = input_shape
    for sub in p.sub:
      meta = sub.target_cls.FPropMeta(sub, shape)
      metas.append(meta)
      shape = meta.output_shape
    if not metas:
      return base_layer.CostMeta(output_shape=input_shape)
    return base_layer.SumCosts(metas)
