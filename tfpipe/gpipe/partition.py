"""Cutting a sequence of layers into K balanced, contiguous cells.

`PartitionSequentialLayers` flattens nested sequential containers into one
list of layers, gives each layer a cost, and cuts the list into K contiguous
blocks that minimise the most expensive block: the slowest (or fullest) cell
sets the pace of the whole pipeline, so that is the quantity to minimise.

Costs (`balance=`):
  'params'  trainable parameters (from FPropMeta, no run needed);
  'flops'   forward flops (from FPropMeta, no run needed);
  'memory'  bytes a layer holds: its output activation plus 4 copies of its
            parameters (weights, gradient, two optimizer slots);
  'time'    forward+backward time measured on the real device;
  [n0, n1, ...] explicit numbers of layers per cell.

The cut is exact (dynamic programming over split points), like torchgpipe's
block partition, not a greedy approximation.
"""

import time

import numpy as np
import tensorflow as tf

from tfpipe import base_layer
from tfpipe.gpipe import cell as cell_lib
from tfpipe.layers import core as layers_core

BALANCE_METHODS = ('params', 'flops', 'memory', 'time')


def IsSequentialParams(p):
  """True for params of a sequential container whose `sub` can be flattened."""
  target = getattr(p, 'target_cls', None)
  return (target is not None and isinstance(target, type) and
          issubclass(target, cell_lib.SEQUENTIAL_CLASSES()) and 'sub' in p)


def FlattenSequentialLayers(layer_params_list):
  """Expands nested sequential containers into a flat list of layer params."""
  flat = []
  for p in layer_params_list:
    if IsSequentialParams(p):
      flat.extend(FlattenSequentialLayers(p.sub))
    else:
      flat.append(p)
  return flat


def BlockPartition(costs, num_partitions):
  """Splits `costs` into contiguous blocks minimising the largest block sum.

  Returns the number of items in each block. Ties prefer earlier, later-heavy
  cuts deterministically. O(K * N^2), fine for the hundreds of layers a
  model has.
  """
  n = len(costs)
  if num_partitions < 1:
    raise ValueError(f'num_partitions must be >= 1. Received: '
                     f'num_partitions={num_partitions}')
  if n < num_partitions:
    raise ValueError(
        f'Cannot cut {n} layers into num_partitions={num_partitions} '
        'non-empty cells; use at most as many partitions as layers.')
  prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, np.float64))])
  inf = float('inf')
  # best[j][i]: minimal max block cost splitting the first i items into j blocks.
  best = np.full((num_partitions + 1, n + 1), inf)
  cut = np.zeros((num_partitions + 1, n + 1), dtype=np.int64)
  best[0][0] = 0.0
  for j in range(1, num_partitions + 1):
    for i in range(j, n - (num_partitions - j) + 1):
      for s in range(j - 1, i):
        value = max(best[j - 1][s], prefix[i] - prefix[s])
        if value < best[j][i] - 1e-12 * max(1.0, abs(value)):
          best[j][i] = value
          cut[j][i] = s
  sizes = []
  i = n
  for j in range(num_partitions, 0, -1):
    s = cut[j][i]
    sizes.append(int(i - s))
    i = s
  return sizes[::-1]


def LayerCosts(layer_params_list, input_shape):
  """FPropMeta of each layer, chaining output shapes into the next input."""
  metas = []
  shape = input_shape
  for p in layer_params_list:
    try:
      meta = p.target_cls.FPropMeta(p, shape)
    except Exception as e:  # pylint: disable=broad-except
      raise ValueError(
          f'Cannot estimate the cost of layer {p.name!r} '
          f'({p.target_cls.__name__}) on input shape {shape}: {e}') from e
    metas.append(meta)
    shape = meta.output_shape
  return metas


def _RandomInput(shape, dtype):
  def Make(s, dt):
    dims = [1 if d is None else d for d in s]
    dt = tf.as_dtype(dt)
    if dt.is_integer:
      return tf.zeros(dims, dt)
    return tf.random.stateless_normal(dims, seed=[1, 2], dtype=dt)
  if isinstance(dtype, (dict, list, tuple)):
    return tf.nest.map_structure(
        Make, base_layer.MapShapes(lambda s: s, shape), dtype,
        check_types=False)
  return base_layer.MapShapes(lambda s: Make(s, dtype), shape)


def ProfileLayerTimes(layer_params_list, input_shape, input_dtype='float32',
                      device=None, repeats=3):
  """Median forward+backward seconds of each layer, measured on `device`."""
  times = []
  x = None
  profiled = []
  with tf.device(device or _DefaultDevice()):
    x = _RandomInput(input_shape, input_dtype)
    for p in layer_params_list:
      layer = p.Instantiate()
      profiled.append(layer)
      # A tied softmax reads an embedding profiled before it.
      layers_core.BindTiedEmbeddings(profiled)
      if not layer.built:
        layer.build(base_layer.MapShapes(lambda s: s,
                                         tf.nest.map_structure(
                                             lambda t: tuple(t.shape), x)))

      @tf.function
      def Step(inputs, layer=layer):
        with tf.GradientTape() as tape:
          tape.watch([t for t in tf.nest.flatten(inputs) if t.dtype.is_floating])
          y = layer(inputs, training=True)
          loss = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32))
                           for t in tf.nest.flatten(y)])
        grads = tape.gradient(loss, layer.trainable_variables)
        return y, grads

      y, _ = Step(x)  # Trace and warm up.
      samples = []
      for _ in range(repeats):
        start = time.perf_counter()
        out = Step(x)
        # An embedding's gradient is IndexedSlices, which has no numpy().
        tf.nest.map_structure(
            lambda t: None if t is None else tf.convert_to_tensor(t).numpy(),
            out)
        samples.append(time.perf_counter() - start)
      times.append(float(np.median(samples)))
      x = y
  return times


def _DefaultDevice():
  gpus = tf.config.list_logical_devices('GPU')
  return gpus[0].name if gpus else '/CPU:0'


def ComputeCosts(layer_params_list, balance, input_shape=None,
                 input_dtype='float32', device=None):
  """One cost per layer for the given balance method."""
  if balance not in BALANCE_METHODS:
    raise ValueError(f'Unknown balance {balance!r}; expected one of '
                     f'{list(BALANCE_METHODS)} or a list of layer counts. '
                     f'Received: balance={balance!r}')
  if balance == 'time':
    if input_shape is None:
      raise ValueError("balance='time' profiles each layer and needs "
                       'input_shape (e.g. input_shape=(8, 128)).')
    return ProfileLayerTimes(layer_params_list, input_shape, input_dtype,
                             device)
  if input_shape is None:
    if balance != 'params':
      raise ValueError(f'balance={balance!r} needs input_shape to run the cost '
                       'model, e.g. input_shape=(None, 128).')
    counts = []
    for p in layer_params_list:
      layer = p.Instantiate()
      counts.append(float(sum(np.prod(v.shape)
                              for v in layer.trainable_variables)))
    return counts
  metas = LayerCosts(layer_params_list, input_shape)
  if balance == 'params':
    return [float(m.num_params) for m in metas]
  if balance == 'flops':
    return [float(m.flops) for m in metas]
  return [float(m.activation_bytes + 16 * m.num_params) for m in metas]


def PartitionSequentialLayers(layer_params_list, num_partitions,
                              balance='flops', input_shape=None,
                              input_dtype='float32', cell_name_prefix='cell',
                              profile_device=None):
  """Cuts a list of layer params into `num_partitions` cell params.

  Args:
    layer_params_list: layer params; sequential containers are flattened.
    num_partitions: K, the number of cells.
    balance: 'params', 'flops', 'memory', 'time', or a list of K layer counts.
    input_shape: the pipeline input's shape (nested allowed, batch dim may be
      None); needed by every method except 'params' and explicit counts.
    input_dtype: dtype(s) of the input, for 'time' profiling.
    cell_name_prefix: cells are named `<prefix><k>`.
    profile_device: where 'time' profiles (default: first GPU, else CPU:0).

  Returns:
    A list of K `FeatureExtractionLayer` params, each holding a contiguous run
    of layers in `sub`.
  """
  flat = FlattenSequentialLayers(list(layer_params_list))
  if not flat:
    raise ValueError('layer_params_list is empty; there is nothing to partition.')
  if isinstance(balance, (list, tuple)):
    counts = [int(c) for c in balance]
    if len(counts) != num_partitions or any(c < 1 for c in counts) or sum(
        counts) != len(flat):
      raise ValueError(
          f'An explicit balance lists the number of layers of each of the '
          f'num_partitions={num_partitions} cells: {num_partitions} positive '
          f'numbers summing to {len(flat)} layers. Received: balance={balance}')
  else:
    costs = ComputeCosts(flat, balance, input_shape, input_dtype,
                         profile_device)
    counts = BlockPartition(costs, num_partitions)
  cells = []
  start = 0
  for k, count in enumerate(counts):
    cells.append(cell_lib.FeatureExtractionLayer.Params().Set(
        name=f'{cell_name_prefix}{k}',
        sub=[p.Copy() for p in flat[start:start + count]]))
    start += count
  return cells
