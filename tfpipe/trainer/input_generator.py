"""Input generators: deterministic streams of (inputs, targets) batches.

Exact resumption needs the input to be a pure function of (seed, step): batch
k must be the same whether the run started at step 0 or was restored at step
k. `GetDataset(start_step)` guarantees that. Synthetic generators build
example i from the stateless seed (seed, i), so starting at step k costs
nothing; file readers shuffle with a fixed seed and skip k batches.

Synthetic tasks ship with the project so every model trains out of the box:
  * `SequenceTaskInput`: copy / reverse / sort token sequences for the LM.
  * `SyntheticImageInput`: images whose class sets a grating's orientation and
    frequency, for the conv classifier.
  * `SyntheticClassificationInput`: Gaussian vectors labelled by a fixed random
    linear teacher, for the MLP.
Users' own data: `TFRecordInput` (tf.train.Example records, see
`WriteTFRecordExamples`) and `TextLineInput` (token ids, one example a line).

Targets use -1 for positions that carry no loss (the LM's prompt positions).
"""

import math

import numpy as np
import tensorflow as tf

from tfpipe import hyperparams

# Reserved token ids of the synthetic sequence tasks.
PAD_ID = 0
SEP_ID = 1


class BaseInputGenerator:
  """Base class: `GetDataset(start_step)` yields (inputs, targets) batches."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', 'input', 'Name of this input, used in messages.')
    p.Define('batch_size', 32, 'Number of examples in each batch.')
    p.Define('seed', 0, 'Seed that fixes the examples and their order.')
    return p

  def __init__(self, params):
    self._params = params.Copy().Freeze()
    if self.p.batch_size <= 0:
      raise ValueError(f'{self.p.name}.batch_size must be > 0; received '
                       f'{self.p.batch_size}.')

  @property
  def p(self):
    return self._params

  def GetDataset(self, start_step=0):
    """The endless dataset of batches, starting at batch `start_step`."""
    raise NotImplementedError(
        f'{type(self).__name__} must implement GetDataset.')


class SyntheticInput(BaseInputGenerator):
  """Example i is `_Example(seed=[p.seed, i])`: a pure function of the seed."""

  def _Example(self, seed):
    """Returns (inputs, targets) of one example from a [2] int64 seed."""
    raise NotImplementedError(f'{type(self).__name__} must implement _Example.')

  def GetDataset(self, start_step=0):
    bs = self.p.batch_size
    seed = tf.constant(self.p.seed, tf.int64)
    ds = tf.data.Dataset.counter(start=start_step * bs, dtype=tf.int64)
    ds = ds.map(lambda i: self._Example(tf.stack([seed, i])),
                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.batch(bs, drop_remainder=True).prefetch(2)


class SequenceTaskInput(SyntheticInput):
  """Sequence transduction as next-token prediction, for a causal LM.

  An example is `x_1..x_n SEP y_1..y_n` with x uniform over the symbols
  [2, vocab_size) and y = copy / reverse / sort of x. Inputs are the first 2n
  tokens, targets the next token at each position, -1 (no loss) where the
  target is still part of x or SEP: only y is scored.
  """

  TASKS = ('copy', 'reverse', 'sort')

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 16, 'Number of token ids, including PAD=0 and SEP=1.')
    p.Define('length', 8, 'Number of tokens n of the source sequence x.')
    p.Define('task', 'reverse', 'Transduction y = f(x): copy, reverse or sort.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    if p.task not in self.TASKS:
      raise ValueError(f'{p.name}.task={p.task!r}; use one of {self.TASKS}.')
    if p.vocab_size < 3 or p.length < 1:
      raise ValueError(f'{p.name}: vocab_size must be >= 3 and length >= 1.')

  @property
  def sequence_length(self):
    """Length of the model's input (and target) sequences: 2n."""
    return 2 * self.p.length

  def _Example(self, seed):
    p = self.p
    x = tf.random.stateless_uniform([p.length], seed, minval=2,
                                    maxval=p.vocab_size, dtype=tf.int32)
    if p.task == 'copy':
      y = x
    elif p.task == 'reverse':
      y = tf.reverse(x, [0])
    else:
      y = tf.sort(x)
    full = tf.concat([x, [SEP_ID], y], axis=0)
    inputs = full[:-1]
    targets = tf.concat([tf.fill([p.length], -1), y], axis=0)
    return inputs, targets


class SyntheticImageInput(SyntheticInput):
  """Images of class-dependent gratings plus noise: needs spatial filters.

  Class c has a fixed orientation and spatial frequency; each example draws
  a random phase and Gaussian noise, so the class is not readable from any
  single pixel.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('image_size', 16, 'Height and width of the square images.')
    p.Define('channels', 3, 'Number of channels of the images.')
    p.Define('num_classes', 10, 'Number of classes.')
    p.Define('noise_stddev', 0.5, 'Stddev of the Gaussian pixel noise.')
    return p

  def _Example(self, seed):
    p = self.p
    label = tf.random.stateless_uniform([], seed, maxval=p.num_classes,
                                        dtype=tf.int32)
    c = tf.cast(label, tf.float32)
    angle = math.pi * c / p.num_classes
    freq = 1.5 + tf.math.floormod(c, 3.0)
    phase = tf.random.stateless_uniform([], seed + [0, 1],
                                        maxval=2 * math.pi)
    grid = tf.range(p.image_size, dtype=tf.float32) / p.image_size
    yy, xx = tf.meshgrid(grid, grid, indexing='ij')
    wave = tf.sin(2 * math.pi * freq *
                  (tf.cos(angle) * xx + tf.sin(angle) * yy) + phase)
    channel_gain = tf.linspace(1.0, 0.5, p.channels)
    image = wave[:, :, None] * channel_gain
    image += p.noise_stddev * tf.random.stateless_normal(
        [p.image_size, p.image_size, p.channels], seed + [0, 2])
    return image, label


class SyntheticClassificationInput(SyntheticInput):
  """Gaussian vectors labelled by argmax of a fixed random linear teacher."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 16, 'Dimension of the input vectors.')
    p.Define('num_classes', 4, 'Number of classes.')
    p.Define('teacher_seed', 7, 'Seed of the teacher weights (fixes the task).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    rng = np.random.RandomState(p.teacher_seed)
    self._teacher = tf.constant(
        rng.normal(size=(p.input_dim, p.num_classes)).astype(np.float32))

  def _Example(self, seed):
    x = tf.random.stateless_normal([self.p.input_dim], seed)
    label = tf.argmax(tf.linalg.matvec(self._teacher, x, transpose_a=True),
                      output_type=tf.int32)
    return x, label


class _FileInput(BaseInputGenerator):
  """Shared logic of file readers: glob, repeat, seeded shuffle, batch, skip."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('file_pattern', '', 'Glob of the data files, e.g. /data/train-*.')
    p.Define('shuffle_buffer_size', 1024,
             'Examples in the shuffle buffer; 0 keeps the file order.')
    return p

  def _Files(self):
    files = sorted(tf.io.gfile.glob(self.p.file_pattern)) if (
        self.p.file_pattern) else []
    if not files:
      raise ValueError(f'{self.p.name}.file_pattern={self.p.file_pattern!r} '
                       'matches no files; set it to a glob of your data.')
    return files

  def _Examples(self, files):
    raise NotImplementedError(f'{type(self).__name__} must implement _Examples.')

  def GetDataset(self, start_step=0):
    ds = self._Examples(self._Files()).repeat()
    if self.p.shuffle_buffer_size > 0:
      ds = ds.shuffle(self.p.shuffle_buffer_size, seed=self.p.seed,
                      reshuffle_each_iteration=True)
    ds = ds.batch(self.p.batch_size, drop_remainder=True)
    return ds.skip(start_step).prefetch(2)


class TFRecordInput(_FileInput):
  """tf.train.Example records with fixed-shape 'inputs' and 'targets' features.

  Integer features are stored as int64_list, float ones as float_list (see
  `WriteTFRecordExamples`); they are cast to `inputs_dtype`/`targets_dtype`.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('inputs_shape', [], 'Shape of one example\'s inputs, e.g. [16].')
    p.Define('inputs_dtype', 'int32', 'Dtype of the inputs tensor.')
    p.Define('targets_shape', [], 'Shape of one example\'s targets.')
    p.Define('targets_dtype', 'int32', 'Dtype of the targets tensor.')
    return p

  def _Examples(self, files):
    p = self.p

    def Feature(shape, dtype):
      stored = tf.float32 if tf.as_dtype(dtype).is_floating else tf.int64
      return tf.io.FixedLenFeature(list(shape), stored)

    spec = {'inputs': Feature(p.inputs_shape, p.inputs_dtype),
            'targets': Feature(p.targets_shape, p.targets_dtype)}

    def Parse(record):
      ex = tf.io.parse_single_example(record, spec)
      return (tf.cast(ex['inputs'], p.inputs_dtype),
              tf.cast(ex['targets'], p.targets_dtype))

    return tf.data.TFRecordDataset(files).map(Parse)


class TextLineInput(_FileInput):
  """Text files with one example a line: whitespace-separated token ids.

  A line `1 2 3<TAB>4 5 6` is inputs [1 2 3], targets [4 5 6]. A line without
  a TAB is a language-model sequence: inputs are its tokens but the last,
  targets its tokens but the first. Every line must give `sequence_length`
  inputs and targets.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('sequence_length', 16, 'Number of input (and target) tokens a line.')
    return p

  def _Examples(self, files):
    n = self.p.sequence_length

    def Ids(text):
      return tf.strings.to_number(tf.strings.split(text), tf.int32)

    def Parse(line):
      parts = tf.strings.split(line, '\t')
      if_pair = tf.size(parts) > 1
      inputs = tf.cond(if_pair, lambda: Ids(parts[0]),
                       lambda: Ids(parts[0])[:-1])
      targets = tf.cond(if_pair, lambda: Ids(parts[-1]),
                        lambda: Ids(parts[0])[1:])
      return tf.ensure_shape(inputs, [n]), tf.ensure_shape(targets, [n])

    ds = tf.data.TextLineDataset(files)
    ds = ds.filter(lambda line: tf.strings.length(tf.strings.strip(line)) > 0)
    return ds.map(Parse)


def WriteTFRecordExamples(filename, examples):
  """Writes (inputs, targets) numpy pairs as records `TFRecordInput` reads."""

  def Feature(value):
    value = np.asarray(value)
    if np.issubdtype(value.dtype, np.floating):
      return tf.train.Feature(
          float_list=tf.train.FloatList(value=value.ravel().tolist()))
    return tf.train.Feature(
        int64_list=tf.train.Int64List(value=value.ravel().tolist()))

  with tf.io.TFRecordWriter(filename) as writer:
    for inputs, targets in examples:
      ex = tf.train.Example(features=tf.train.Features(feature={
          'inputs': Feature(inputs), 'targets': Feature(targets)}))
      writer.write(ex.SerializeToString())
