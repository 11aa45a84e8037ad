"""The cost model: what a layer costs, from params and an input shape.

The partitioner balances cells by it, `executor='auto'` reads the flops of
one action from it, and `--mode=inspect_model` prints it. It needs no data
and no device: shapes only, with the batch dimension possibly unknown.
"""

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf


@dataclasses.dataclass
class CostMeta:
  """What a layer costs, estimated from params and an input shape.

  Attributes:
    output_shape: the output shape (nested like the output), batch dim kept.
    flops: floating point operations of one forward pass for that input.
    num_params: number of trainable scalars.
    activation_bytes: bytes of the output activation (what crosses a cell
      boundary, and what a layer keeps for backward without remat).
  """
  output_shape: Any
  flops: float = 0.0
  num_params: int = 0
  activation_bytes: float = 0.0


def LeafShapes(shape):
  """The leaf shapes of a nested structure of shapes, as tuples (None
  leaves, absent inputs, have none)."""
  if shape is None:
    return []
  if _IsShape(shape):
    return [tuple(shape)]
  values = shape.values() if isinstance(shape, dict) else shape
  return [leaf for v in values for leaf in LeafShapes(v)]


def NumElements(shape, batch_size=1):
  """Number of elements in a (possibly nested) shape; None dims count as batch_size."""
  total = 0
  for s in LeafShapes(shape):
    dims = [batch_size if d is None else int(d) for d in s]
    total += int(np.prod(dims)) if dims else 1
  return total


def _IsShape(x):
  return isinstance(x, (tuple, list, tf.TensorShape)) and all(
      d is None or isinstance(d, (int, np.integer)) for d in x)


def MapShapes(fn, shape):
  """Applies fn to every leaf shape of a nested structure of shapes."""
  if _IsShape(shape):
    return fn(tuple(shape))
  if isinstance(shape, dict):
    return {k: MapShapes(fn, v) for k, v in shape.items()}
  if isinstance(shape, (list, tuple)):
    return type(shape)(MapShapes(fn, v) for v in shape)
  raise TypeError(f'Not a shape or nested structure of shapes: {shape!r}')


def BatchDim(shape):
  """The leading dim of the first leaf shape (None if unknown)."""
  leaves = LeafShapes(shape)
  return leaves[0][0] if leaves and leaves[0] else None


def _BatchSize(shape):
  first = BatchDim(shape)
  return 1 if first is None else int(first)


def _LastDims(shape):
  if _IsShape(shape):
    return int(shape[-1]) if len(shape) and shape[-1] is not None else 1
  return 1


def _OutputShapeByTracing(layer, input_shape):
  """Output shape of `layer` by tracing it symbolically on `input_shape`."""
  def Spec(s):
    return tf.TensorSpec([None if i == 0 else d for i, d in enumerate(s)],
                         tf.float32)
  specs = MapShapes(Spec, input_shape)

  @tf.function(input_signature=[specs])
  def Trace(x):
    return layer(x, training=False)

  out_structure = Trace.get_concrete_function().structured_outputs
  batch = BatchDim(input_shape)

  def Shape(t):
    dims = list(t.shape)
    if dims:
      dims[0] = batch
    return tuple(dims)
  return tf.nest.map_structure(Shape, out_structure)


def SumCosts(costs):
  """Adds up flops/params/activation bytes of a list of CostMeta."""
  return CostMeta(
      output_shape=costs[-1].output_shape if costs else None,
      flops=sum(c.flops for c in costs),
      num_params=sum(c.num_params for c in costs),
      activation_bytes=sum(c.activation_bytes for c in costs))


def MeasuredCost(layer, input_shape):
  """The cost of a built `layer`, read from its variables and traced output.

  Flops count one multiply-add per parameter per input position (2 flops),
  exact for dense and convolution-like layers and an estimate otherwise.
  """
  num_params = int(sum(np.prod(v.shape) for v in layer.trainable_variables))
  output_shape = _OutputShapeByTracing(layer, input_shape)
  batch = _BatchSize(input_shape)
  return CostMeta(
      output_shape=output_shape,
      flops=2.0 * num_params * NumElements(input_shape, batch) / max(
          1, _LastDims(input_shape)),
      num_params=num_params,
      activation_bytes=4.0 * NumElements(output_shape, batch))
