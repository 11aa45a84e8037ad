"""FeatureExtractionLayer: one pipeline cell, a contiguous run of layers.

A cell is a sequential container whose layers all live on one device. It is
built explicitly, layer by layer, with each layer's input shape computed from
the previous layer's cost model (`SequentialLayer.build`). Building it under
`tf.device(d)` therefore puts every variable on `d`, including those of Keras
layers that would otherwise build lazily on first call, wherever that call
happens.
"""

from tfpipe import layers


class FeatureExtractionLayer(layers.SequentialLayer):
  """Runs its `sub` layers in order; the unit the pipeline places on a device."""


def SEQUENTIAL_CLASSES():  # pylint: disable=invalid-name
  """Container classes whose `sub` list the partitioner flattens."""
  return (layers.SequentialLayer,)
