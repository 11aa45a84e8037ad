"""What each step of a Keras graph costs, for balancing the pipeline's cells.

The slowest cell sets the pace of the whole pipeline, so the partition
minimises the largest cell cost (`gpipe.BlockPartition`). The cost of a step
(one layer call) is, by `balance`:

  'time'    measured forward+backward seconds of the call, eagerly, on random
            inputs of `profile_batch_size` examples, on one device;
  'flops'   an estimate: 2 flops per parameter per output position for layers
            with weights, one per output element otherwise;
  'params'  trainable parameters (a shared layer counts once);
  'memory'  bytes of the output activation plus 4 copies of the parameters
            (weights, gradient, two optimizer slots).
"""

import time

import numpy as np
import tensorflow as tf

from tfpipe import base_layer
from tfpipe.keras import cell as cell_lib

BALANCE_METHODS = ('time', 'flops', 'params', 'memory')


def _NumParams(step):
  if not step.first_use:
    return 0
  return int(sum(np.prod(v.shape) for v in getattr(
      step.operation, 'trainable_variables', [])))


def _OutputShapes(step):
  return [tuple(t.shape) for t in tf.nest.flatten(step.node.outputs)]


def _Elements(shape, batch_size):
  return int(np.prod([batch_size if d is None else d for d in shape]))


def _Flops(step, batch_size):
  shapes = _OutputShapes(step)
  params = _NumParams(step)
  if params and len(shapes) == 1 and len(shapes[0]) >= 2:
    positions = _Elements(shapes[0][:-1], batch_size)
    return 2.0 * params * positions
  return float(sum(_Elements(s, batch_size) for s in shapes))


def _Memory(step, batch_size):
  out_bytes = sum(
      _Elements(tuple(t.shape), batch_size) * np.dtype(
          tf.as_dtype(t.dtype).as_numpy_dtype).itemsize
      for t in tf.nest.flatten(step.node.outputs))
  return float(out_bytes + 16 * _NumParams(step))


def StepCosts(graph, balance, profile_batch_size=8, device=None):
  """One cost per step of `graph` (see module docstring)."""
  if balance == 'params':
    return [float(_NumParams(s)) for s in graph.steps]
  if balance == 'flops':
    return [_Flops(s, profile_batch_size) for s in graph.steps]
  if balance == 'memory':
    return [_Memory(s, profile_batch_size) for s in graph.steps]
  if balance == 'time':
    return ProfileStepTimes(graph, profile_batch_size, device)
  raise ValueError(
      f'tfpipe.keras.pipeline: unknown balance {balance!r}; expected one of '
      f'{list(BALANCE_METHODS)} or a list of the number of layer calls per '
      f'cell. Received: balance={balance!r}')


def _RandomInput(keras_tensor, batch_size, seed):
  shape = [batch_size if d is None else d for d in keras_tensor.shape]
  dtype = tf.as_dtype(keras_tensor.dtype)
  if dtype.is_floating:
    return tf.random.stateless_uniform(shape, seed=[seed, 0], dtype=dtype)
  if dtype.is_integer:
    return tf.zeros(shape, dtype)
  return tf.zeros(shape, dtype)


class _Discard(base_layer.DeferredStatsCollector):

  def Add(self, layer, stats, count):
    del layer, stats, count


def ProfileStepTimes(graph, batch_size=8, device=None, repeats=3):
  """Median eager forward+backward seconds of each step.

  Batch norm statistics go to a discarding collector and dropout is seeded
  statelessly, so profiling leaves the model's state as it was.
  """
  cell = cell_lib.KerasCellLayer.Params().Set(
      name='profile', steps=graph.steps).Instantiate()
  values = {}
  device = device or _DefaultDevice()
  with tf.device(device), base_layer.CollectDeferredStats(
      _Discard()), base_layer.StepSeed(tf.constant([0, 0], tf.int64)):
    for i, (key, t) in enumerate(zip(graph.input_keys, graph.function.inputs)):
      values[key] = _RandomInput(t, batch_size, i)
    times = []
    for step in graph.steps:
      float_inputs = [values[k] for k in set(step.input_keys.values())
                      if values[k].dtype.is_floating]
      variables = list(getattr(step.operation, 'trainable_variables', []))
      samples = []
      for _ in range(repeats + 1):
        start = time.perf_counter()
        with tf.GradientTape() as tape:
          tape.watch(float_inputs)
          outputs = cell._RunStep(step, values, training=True)  # pylint: disable=protected-access
          flat = [o for o in tf.nest.flatten(outputs)
                  if o.dtype.is_floating]
          total = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32))
                            for o in flat]) if flat else None
        if total is not None and (float_inputs or variables):
          grads = tape.gradient(total, float_inputs + variables)
          for g in grads:
            if g is not None:
              _ = tf.convert_to_tensor(g).numpy()
        samples.append(time.perf_counter() - start)
      times.append(float(np.median(samples[1:])))
      for key, value in zip(step.output_keys, tf.nest.flatten(outputs)):
        values[key] = value
  return times


def _DefaultDevice():
  gpus = tf.config.list_logical_devices('GPU')
  return gpus[0].name if gpus else '/CPU:0'
