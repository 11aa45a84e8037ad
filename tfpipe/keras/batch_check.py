"""Batches smaller than M, refused before fit, evaluate or predict run.

The pipeline splits every batch into num_micro_batches micro-batches, and
each needs an example. A smaller batch fails inside the traced step, as
TensorFlow's InvalidArgumentError at the end of a long traceback, after the
batches before it have trained. Keras' last batch of an epoch is the smaller
one when the batch size does not divide the data, so a fit that starts well
used to stop near the end of its first epoch.

`CallProblem` works out the sizes of the batches Keras will make before
anything runs: exactly for arrays and tensors (Keras slices them into
batch_size rows and a remainder, after taking off validation_split), and
from the element spec for a tf.data.Dataset with a static batch size, and
says why a batch smaller than M is refused, naming batch_size and
num_micro_batches. A dataset batched without drop_remainder (or a generator)
has sizes known only as it runs; for those `ShortRuntimeErrors` turns the
runtime failure into a one-line error.
"""

import contextlib
import math

import keras
import tensorflow as tf

DEFAULT_BATCH_SIZE = 32  # Keras' default for arrays.

# The message of the engine's runtime check (gpipe/microbatch.py).
_RUNTIME_MESSAGE = 'The batch is smaller than num_micro_batches'


def _Rows(x):
  """The number of examples of array-like data, or None if it is not one."""
  leaves = [leaf for leaf in keras.tree.flatten(x) if leaf is not None]
  if not leaves or isinstance(x, tf.data.Dataset):
    return None
  shapes = [getattr(leaf, 'shape', None) for leaf in leaves]
  if any(s is None or not len(s) or s[0] is None for s in shapes):
    return None
  return int(shapes[0][0])


def _ArrayBatches(rows, batch_size):
  """{size: why} of the batches of `rows` examples in `batch_size` rows."""
  if rows <= 0:
    return {}
  if rows <= batch_size:
    return {rows: f'all {rows} examples in one batch (batch_size='
                  f'{batch_size})'}
  sizes = {batch_size: f'batch_size={batch_size}'}
  if rows % batch_size:
    sizes[rows % batch_size] = (
        f'the last batch of {rows} examples in batches of batch_size='
        f'{batch_size}')
  return sizes


def _DatasetBatches(dataset):
  """{size: why} of a dataset with a static batch size, or None."""
  leaves = tf.nest.flatten(dataset.element_spec)
  dims = [leaf.shape[0] if leaf.shape.rank else None for leaf in leaves
          if isinstance(leaf, tf.TensorSpec)]
  if not dims or dims[0] is None:
    return None
  return {int(dims[0]): 'the dataset\'s batch size'}


def BatchSizes(x, batch_size=None, validation_split=0.0, part='train'):
  """{size: why} of the batches Keras makes of `x`; None if known only later.

  Args:
    x: what is passed to fit/evaluate/predict (arrays, tensors, a dict or
      list of them, or a tf.data.Dataset).
    batch_size: their batch_size argument (None: Keras' default, 32).
    validation_split: fit's; 'train' and 'validation' take its two parts.
    part: 'train' or 'validation'.
  """
  if isinstance(x, tf.data.Dataset):
    return _DatasetBatches(x)
  rows = _Rows(x)
  if rows is None:
    return None
  if validation_split:
    split_at = int(math.floor(rows * (1.0 - validation_split)))
    rows = split_at if part == 'train' else rows - split_at
  return _ArrayBatches(rows, batch_size or DEFAULT_BATCH_SIZE)


def BatchProblem(name, num_micro_batches, sizes, what):
  """The error message if a batch of `sizes` ({size: why}) is below M."""
  small = sorted(size for size in sizes or {} if size < num_micro_batches)
  if not small:
    return None
  return (f'{name}: {what} would get a batch of {small[0]} example(s) '
          f'({sizes[small[0]]}), fewer than num_micro_batches='
          f'{num_micro_batches}: every micro-batch needs an example. Use a '
          'batch_size whose batches (the last one too) hold at least '
          f'{num_micro_batches}, drop the remainder (tf.data: batch(..., '
          'drop_remainder=True)), or pipeline with fewer micro-batches.')


def CallProblem(name, num_micro_batches, method, arguments):
  """BatchProblem of a call of keras.Model `method` ('fit', 'evaluate' or
  'predict') with `arguments` ({name: value}, defaults included).

  fit's validation batches count too: from validation_split (the last part
  of the arrays) or validation_data.
  """
  x, batch_size = arguments['x'], arguments['batch_size']
  if method != 'fit':
    return BatchProblem(name, num_micro_batches, BatchSizes(x, batch_size),
                        method)
  split = arguments['validation_split']
  val_batch_size = arguments['validation_batch_size'] or batch_size
  if split:
    validation = BatchSizes(x, val_batch_size, split, 'validation')
  else:
    val_x = arguments['validation_data']
    if isinstance(val_x, (tuple, list)):
      val_x = val_x[0]
    validation = None if val_x is None else BatchSizes(val_x, val_batch_size)
  return (BatchProblem(name, num_micro_batches,
                       BatchSizes(x, batch_size, split), 'fit') or
          BatchProblem(name, num_micro_batches, validation,
                       'fit\'s validation'))


@contextlib.contextmanager
def ShortRuntimeErrors(name):
  """Re-raises the engine's runtime batch check as a one-line ValueError."""
  try:
    yield
  except tf.errors.InvalidArgumentError as e:
    message = e.message or ''
    if _RUNTIME_MESSAGE not in message:
      raise
    start = message.index(_RUNTIME_MESSAGE)
    end = message.find(']', start)
    raise ValueError(
        f'{name}: {message[start:end if end > 0 else None]} (a batch whose '
        'size is known only as the data runs, e.g. the last one of a '
        'tf.data batch() without drop_remainder=True).') from None
