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

  Returns the number of items in each block. Among equally good cuts it
  takes the one whose every cut point is earliest (later blocks heavier),
  deterministically.

  Dynamic programming: best[j][i] is the least largest block of the first
  i items in j blocks, min over s of max(best[j-1][s], sum(costs[s:i])).
  With costs >= 0, best[j-1][s] grows with s and sum(costs[s:i]) shrinks,
  so the minimum sits where they cross, which a binary search finds:
  O(K N log N) rather than O(K N^2), so a 1,663-layer model cuts into 128
  cells at once.
  """
  n = len(costs)
  if num_partitions < 1:
    raise ValueError(f'num_partitions must be >= 1. Received: '
                     f'num_partitions={num_partitions}')
  if n < num_partitions:
    raise ValueError(
        f'Cannot cut {n} layers into num_partitions={num_partitions} '
        'non-empty cells; use at most as many partitions as layers.')
  costs = np.asarray(costs, np.float64)
  if np.any(costs < 0) or not np.all(np.isfinite(costs)):
    raise ValueError(f'Layer costs must be finite and >= 0. Received: '
                     f'costs={costs.tolist()}')
  prefix = np.concatenate([[0.0], np.cumsum(costs)])
  k = num_partitions
  best = prefix.copy()  # One block: the first i items.
  cuts = []
  for j in range(2, k + 1):
    # Blocks j-1 end at s in [j-1, n-k+j-1]; block j ends at i in [j, n-k+j].
    s_lo, s_hi = j - 1, n - k + j - 1
    i = np.arange(j, n - k + j + 1)
    rising = best[s_lo:s_hi + 1] + prefix[s_lo:s_hi + 1]
    # First s where best[j-1][s] >= sum(costs[s:i]); at most i-1.
    cross = np.minimum(np.searchsorted(rising, prefix[i], side='left') + s_lo,
                       i - 1)
    before = np.maximum(cross - 1, s_lo)
    last_block = prefix[i] - prefix[before]
    # Earliest s whose last block is as light: skips zero-cost items.
    first_equal = np.maximum(
        np.searchsorted(prefix, prefix[before], side='left'), s_lo)
    at_cross = np.maximum(best[cross], prefix[i] - prefix[cross])
    take_before = (cross > s_lo) & (
        last_block <= at_cross * (1 + 1e-12) + 1e-300)
    chosen = np.where(take_before, first_equal, cross)
    new_best = np.full(n + 1, np.inf)
    new_best[i] = np.maximum(best[chosen], prefix[i] - prefix[chosen])
    cut = np.zeros(n + 1, np.int64)
    cut[i] = chosen
    best = new_best
    cuts.append(cut)
  sizes = []
  end = n
  for cut in reversed(cuts):
    start = int(cut[end])
    sizes.append(end - start)
    end = start
  sizes.append(end)
  return sizes[::-1]


def LayerCosts(layer_params_list, input_shape):
  """FPropMeta of each layer, chaining output shapes into the next input.

  A model is mostly N equal blocks that differ only in their names and
  seeds, which no cost model reads: each distinct (layer, input shape) is
  costed once, so sizing a 1,663-block model costs a handful of calls.
  """
  metas = []
  shape = input_shape
  known = {}
  for p in layer_params_list:
    key = (_CostKey(p), repr(shape))
    meta = known.get(key)
    if meta is None:
      try:
        meta = p.target_cls.FPropMeta(p, shape)
      except Exception as e:  # pylint: disable=broad-except
        raise ValueError(
            f'Cannot estimate the cost of layer {p.name!r} '
            f'({p.target_cls.__name__}) on input shape {shape}: {e}') from e
      known[key] = meta
    metas.append(meta)
    shape = meta.output_shape
  return metas


_NOT_COSTED = ('name', 'random_seed')


def _CostKey(p):
  """What a layer's cost model may read: its class and params but names and seeds."""
  return (p.target_cls, tuple(
      (key, _HashableValue(value)) for key, value, _ in p.Leaves()
      if key.rsplit('.', 1)[-1] not in _NOT_COSTED))


def _HashableValue(value):
  """Literals and containers of them by value; any other object by identity."""
  if value is None or isinstance(value, (bool, int, float, str, type)):
    return (type(value).__name__, value)  # True, 1 and 1.0 stay apart.
  if isinstance(value, (list, tuple)):
    return (type(value).__name__,) + tuple(_HashableValue(v) for v in value)
  if isinstance(value, dict):
    return ('dict',) + tuple((repr(k), _HashableValue(v))
                             for k, v in value.items())
  return ('object', id(value))


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
