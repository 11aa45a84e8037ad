"""Checks a model builder's layer list against its cost model, layer by layer.

Shared by the builders' tests. The partitioner balances cells and the
trainer reports sizes from `FPropMeta` alone, so every layer's cost model
must give the real output shape and the real number of weights: each layer
here is built and called on the previous one's output and compared.
"""

import numpy as np
import tensorflow as tf


def NumVariables(layer):
  """Number of trainable weights `layer` built."""
  return sum(int(np.prod(v.shape)) for v in layer.trainable_variables)


def _Shapes(structure):
  return tf.nest.map_structure(lambda t: tuple(t.shape), structure)


def RunAndCheckCostModel(model, inputs, training=False):
  """Runs `model`'s layers in turn on `inputs`; the cost model's last shape.

  Asserts for every layer that its FPropMeta gives the shape (nested, for
  layers that pass several tensors) and the weight count of the built layer,
  and that `model.NumParams()` is their sum.
  """
  x, shape, total = inputs, _Shapes(inputs), 0
  for lp in model.LayerParamsList():
    layer = lp.Instantiate()
    x = layer(x, training=training)
    meta = lp.target_cls.FPropMeta(lp, shape)
    shape = meta.output_shape
    assert _Shapes(x) == shape, lp.name
    assert meta.num_params == NumVariables(layer), lp.name
    total += meta.num_params
  assert model.NumParams() == total
  return shape
