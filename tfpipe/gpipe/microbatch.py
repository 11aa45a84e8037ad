"""Splitting a mini-batch into micro-batches, and merging outputs back.

Inputs can be a tensor or any nested structure (dict, tuple, list) whose
leaves share one batch dimension. A batch of N examples split M ways gives
micro-batches whose sizes differ by at most one (the first N mod M get the
extra example), so no example is dropped or repeated.

Why the weights: the pipeline's loss is the mean over the whole batch, but a
loss function sees one micro-batch and returns that micro-batch's mean. With
uneven sizes a plain average of the M means is biased, so micro-batch m is
weighted by n_m / N, its share of the examples. Then

    sum_m (n_m / N) * mean_m(loss) = (1 / N) * sum_i loss_i

exactly, and so is its gradient, whatever M is.
"""

import math

import keras
import tensorflow as tf


def Leaves(structure):
  """The leaves of a structure, without its None leaves (absent inputs)."""
  return [t for t in tf.nest.flatten(structure) if t is not None]


# How ShapesText shows a leaf of unknown rank.
UNKNOWN_RANK = '<unknown rank>'


def ShapesText(structure):
  """A structure's shapes for a message: tuples, None for absent leaves.

  A leaf of unknown rank (a tf.py_function's output, unless its shape is
  set) is UNKNOWN_RANK: its shape cannot be made a tuple, and the error
  being described must not be replaced by that one.
  """
  def Text(t):
    if t is None:
      return None
    shape = tf.TensorShape(t.shape)
    return UNKNOWN_RANK if shape.rank is None else tuple(shape)
  return tf.nest.map_structure(Text, structure)


def _DescribePath(structure, index):
  """A readable path ('a/0') of the index-th non-None leaf."""
  paths = ['/'.join(str(k) for k in path) for path, leaf in
           keras.tree.flatten_with_path(structure) if leaf is not None]
  return paths[index] if index < len(paths) and paths[index] else 'inputs'


def StaticBatchSize(structure, batch_dim=0):
  """The batch size if every leaf's shape knows it, else None.

  Raises:
    ValueError: if leaves disagree on the batch size, or a leaf has no
      `batch_dim` axis.
  """
  leaves = Leaves(structure)
  if not leaves:
    raise ValueError('Cannot split an input with no tensors into micro-batches.')
  sizes = []
  for i, leaf in enumerate(leaves):
    shape = tf.TensorShape(leaf.shape)
    if shape.rank is not None and shape.rank <= batch_dim:
      raise ValueError(
          f'Input {_DescribePath(structure, i)!r} has shape {shape}, which has '
          f'no batch_dim={batch_dim} axis to split into micro-batches.')
    sizes.append(shape[batch_dim] if shape.rank is not None else None)
  known = {s for s in sizes if s is not None}
  if len(known) > 1:
    detail = ', '.join(f'{_DescribePath(structure, i)}: {s}'
                       for i, s in enumerate(sizes))
    raise ValueError('All inputs must share the batch dimension to be split '
                     f'into micro-batches; found sizes {detail}.')
  return known.pop() if known else None


def NumMicroBatches(batch_size, num_micro_batches=None, micro_batch_size=None):
  """Resolves M from either `num_micro_batches` or `micro_batch_size`.

  Both are checked (ints >= 1) by PipeliningLayer.CheckParams, once.
  """
  if micro_batch_size:
    if batch_size is None:
      raise ValueError(
          'micro_batch_size needs a static batch size; the input\'s batch '
          'dimension is unknown. Set num_micro_batches instead, or give the '
          'input a fixed batch size (e.g. drop_remainder=True in tf.data).')
    return max(1, math.ceil(batch_size / micro_batch_size))
  return num_micro_batches


def SplitSizes(batch_size, num_micro_batches, micro_batch_size=None):
  """Python list of micro-batch sizes for a static batch size."""
  if batch_size < num_micro_batches:
    raise ValueError(
        f'The batch has {batch_size} examples, fewer than '
        f'num_micro_batches={num_micro_batches}; every micro-batch needs at '
        'least one example. Use a larger batch or fewer micro-batches.')
  if micro_batch_size:
    sizes = [micro_batch_size] * (batch_size // micro_batch_size)
    if batch_size % micro_batch_size:
      sizes.append(batch_size % micro_batch_size)
    return sizes
  base, extra = divmod(batch_size, num_micro_batches)
  return [base + 1] * extra + [base] * (num_micro_batches - extra)


def _DynamicSizes(batch_size, num_micro_batches):
  base = batch_size // num_micro_batches
  extra = batch_size % num_micro_batches
  return tf.where(tf.range(num_micro_batches) < extra, base + 1, base)


def Split(structure, num_micro_batches, batch_dim=0, micro_batch_size=None):
  """Splits `structure` into micro-batches along `batch_dim`.

  Returns:
    (micro_batches, sizes, batch_size): a list of M structures like the input,
    the size of each (Python ints when the batch is static, else scalar int32
    tensors), and the whole batch size (int or tensor).
  """
  static = StaticBatchSize(structure, batch_dim)
  m = NumMicroBatches(static, num_micro_batches, micro_batch_size)
  leaves = tf.nest.flatten(structure)
  if static is not None:
    sizes = SplitSizes(static, m, micro_batch_size)
    batch_size = static
    size_list = sizes
  else:
    first = Leaves(structure)[0]
    batch_size = tf.shape(first)[batch_dim]
    tf.debugging.assert_greater_equal(
        batch_size, m, message=(
            f'The batch is smaller than num_micro_batches={m}; use a larger '
            'batch or fewer micro-batches.'))
    sizes = _DynamicSizes(batch_size, m)
    size_list = [sizes[i] for i in range(m)]
  pieces = []
  for leaf in leaves:
    if leaf is None:
      pieces.append([None] * m)
    else:
      pieces.append(SplitBySizes(leaf, size_list, batch_dim))
  micro_batches = [tf.nest.pack_sequence_as(structure, [p[i] for p in pieces])
                   for i in range(m)]
  return micro_batches, size_list, batch_size


def SplitBySizes(tensor, sizes, batch_dim=0):
  """Splits `tensor` along `batch_dim` into parts of `sizes` (ints or tensors)."""
  if len(sizes) == 1:
    return [tensor]
  if all(isinstance(n, int) for n in sizes):
    return tf.split(tensor, sizes, axis=batch_dim, num=len(sizes))
  return tf.split(tensor, tf.stack([tf.cast(n, tf.int32) for n in sizes]),
                  axis=batch_dim, num=len(sizes))


def Merge(micro_outputs, batch_dim=0):
  """Concatenates per-micro-batch outputs back into one batch."""
  if len(micro_outputs) == 1:
    return micro_outputs[0]
  return tf.nest.map_structure(
      lambda *xs: None if xs[0] is None else tf.concat(xs, axis=batch_dim),
      *micro_outputs)


def Weights(sizes, batch_size):
  """n_m / N for each micro-batch, as float32 scalars (see module docstring)."""
  total = tf.cast(batch_size, tf.float32)
  return [tf.cast(n, tf.float32) / total for n in sizes]
