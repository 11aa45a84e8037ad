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
  * `TranslationTaskInput`: a generated translation-like task (a lexicon,
    local reordering, one-to-two word alignments, variable lengths with
    padding) for the encoder-decoder Transformer.
Real text that ships with Python: `PythonSourceTextInput` reads the standard
library's .py files as bytes, split into train and eval files by a hash of
each path, for the character-level LM.
Users' own data: `TFRecordInput` (tf.train.Example records, see
`WriteTFRecordExamples`) and `TextLineInput` (token ids, one example a line).

Targets use -1 for positions that carry no loss (the LM's prompt positions).
"""

import hashlib
import math
import os
import sysconfig

import numpy as np
import tensorflow as tf

from tfpipe import hyperparams

# Reserved token ids of the synthetic sequence tasks.
PAD_ID = 0
SEP_ID = 1
EOS_ID = 2


class BaseInputGenerator:
  """Base class: `GetDataset(start_step)` yields (inputs, targets) batches."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', 'input', 'Name of this input, used in messages.')
    p.Define('batch_size', 32, 'Number of examples in each batch.')
    p.Define('seed', 0, 'Seed that fixes the examples and their order.')
    return p

  @classmethod
  def CheckParams(cls, p, prefix=None):
    """Raises ValueError naming the bad param, before anything is read.

    Args:
      p: this class's params.
      prefix: how the params are named in messages, e.g. 'eval_input' (the
        trainer's override key); default p.name.
    """
    prefix = prefix or p.name
    if p.batch_size <= 0:
      raise ValueError(f'{prefix}.batch_size must be > 0; received '
                       f'{p.batch_size}.')

  def __init__(self, params):
    self._params = params.Copy().Freeze()
    type(self).CheckParams(self.p)

  @property
  def p(self):
    return self._params

  def CheckData(self, prefix=None):
    """Raises ValueError if the data is not there, naming the param to fix.

    The trainer calls it for the training and the eval input before the
    first step, so a wrong path stops the run at once, not after training.
    """
    del prefix  # Generated data is always there.

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

  @classmethod
  def CheckParams(cls, p, prefix=None):
    super().CheckParams(p, prefix)
    prefix = prefix or p.name
    if p.task not in cls.TASKS:
      raise ValueError(f'{prefix}.task={p.task!r}; use one of {cls.TASKS}.')
    if p.vocab_size < 3 or p.length < 1:
      raise ValueError(f'{prefix}: vocab_size must be >= 3 and length >= 1; '
                       f'received vocab_size={p.vocab_size}, '
                       f'length={p.length}.')

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


class TranslationTaskInput(SyntheticInput):
  """A generated translation-like task for encoder-decoder models.

  A source sentence is n words (n uniform in [min_length, max_length]) of a
  source language; its translation reorders them (each adjacent pair is
  swapped, as adjective-noun order differs between languages), maps each
  word through a fixed random lexicon into the target language, and writes
  a `two_token_fraction` of the words as two tokens (the word and a suffix
  token), so lengths differ and the alignment is not monotonic. Learning it
  needs attention over the source, not just a per-position mapping.

  Ids: PAD=0, SEP=1 (start of the decoder input), EOS=2, source words
  [3, 3+W), target words [3+W, 3+2W), the suffix 3+2W; so vocab_size is
  2W+4. Inputs are the source's max_length ids padded with PAD, followed by
  the decoder input, SEP and the translation padded with PAD (one tensor,
  as models.transformer_nmt reads it); targets are the translation and EOS,
  padded with -1 (no loss). Both target sequences have length
  2*max_length+1, enough for any sentence.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('num_words', 16, 'W: words of each language.')
    p.Define('min_length', 3, 'Fewest words in a source sentence.')
    p.Define('max_length', 8, 'Most words in a source sentence.')
    p.Define('two_token_fraction', 0.25,
             'Fraction of the source words translated as two tokens.')
    p.Define('lexicon_seed', 7, 'Seed of the lexicon (fixes the task).')
    return p

  @classmethod
  def CheckParams(cls, p, prefix=None):
    super().CheckParams(p, prefix)
    prefix = prefix or p.name
    if p.num_words < 2 or not 1 <= p.min_length <= p.max_length:
      raise ValueError(f'{prefix}: need num_words >= 2 and 1 <= min_length <= '
                       f'max_length; received num_words={p.num_words}, '
                       f'min_length={p.min_length}, max_length={p.max_length}.')
    if not 0.0 <= p.two_token_fraction <= 1.0:
      raise ValueError(f'{prefix}.two_token_fraction must be in [0, 1]; '
                       f'received {p.two_token_fraction}.')

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    # Numpy, not tensors: configs instantiate this to read vocab_size before
    # TensorFlow's devices are configured.
    rng = np.random.RandomState(p.lexicon_seed)
    self.lexicon = (3 + p.num_words +
                    rng.permutation(p.num_words)).astype(np.int32)
    self.two_token = np.zeros(p.num_words, np.int32)
    self.two_token[rng.permutation(p.num_words)[
        :int(round(p.two_token_fraction * p.num_words))]] = 1

  @property
  def vocab_size(self):
    """Number of ids the task uses: 2W+4."""
    return 2 * self.p.num_words + 4

  @property
  def suffix_id(self):
    return 3 + 2 * self.p.num_words

  @property
  def source_length(self):
    return self.p.max_length

  @property
  def target_length(self):
    return 2 * self.p.max_length + 1

  def _Example(self, seed):
    p = self.p
    n = tf.random.stateless_uniform([], seed, minval=p.min_length,
                                    maxval=p.max_length + 1, dtype=tf.int32)
    words = tf.random.stateless_uniform(
        [p.max_length], seed + [0, 1], maxval=p.num_words,
        dtype=tf.int32)[:n]
    index = tf.range(n)
    partner = index + 1 - 2 * (index % 2)  # 0<->1, 2<->3, ...
    reordered = tf.gather(words, tf.where(partner < n, partner, index))
    counts = 1 + tf.gather(tf.constant(self.two_token), reordered)
    owner = tf.repeat(index, counts)
    first = tf.gather(tf.cumsum(counts, exclusive=True), owner)
    translation = tf.where(tf.range(tf.size(owner)) == first,
                           tf.gather(tf.constant(self.lexicon),
                                     tf.gather(reordered, owner)),
                           self.suffix_id)

    def Pad(x, length, value):
      x = tf.pad(x, [[0, length - tf.size(x)]], constant_values=value)
      return tf.ensure_shape(x, [length])
    source = Pad(3 + words, self.source_length, PAD_ID)
    decoder_input = Pad(tf.concat([[SEP_ID], translation], 0),
                        self.target_length, PAD_ID)
    targets = Pad(tf.concat([translation, [EOS_ID]], 0), self.target_length,
                  -1)
    return tf.concat([source, decoder_input], 0), targets


_CORPUS_CACHE = {}


class PythonSourceTextInput(BaseInputGenerator):
  """Character-level LM windows of the .py sources of Python's standard library.

  Real text that every Python installation ships, so a language model can
  train on it with no download. The files under `root` (default: this
  interpreter's stdlib, `sysconfig.get_paths()['stdlib']`, without
  site-packages) are split into train and eval by a hash of each file's path
  relative to `root`, so the split is the same on every run and for every
  seed: about `eval_percent`% of the files are eval. A split's files are
  read as bytes (ids 0..255; the stdlib is more than 99.9% ASCII) and
  concatenated in path order.

  Example i is the window at an offset drawn from the stateless seed
  (seed, i): inputs are `sequence_length` bytes, targets the next byte at
  each position. So a batch is a pure function of (seed, step), and an eval
  input with a fixed seed sees the same windows at every evaluation.
  """

  VOCAB_SIZE = 256
  EXCLUDED_DIRS = ('site-packages', 'dist-packages', '__pycache__')

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('root', '', 'Directory whose .py files are the corpus; empty '
             'means the standard library of the running Python.')
    p.Define('split', 'train', 'train or eval: which files to read.')
    p.Define('eval_percent', 5, 'Percent of the files (by path hash) that '
             'form the eval split.')
    p.Define('sequence_length', 128, 'Bytes of each example\'s inputs.')
    return p

  @classmethod
  def CheckParams(cls, p, prefix=None):
    super().CheckParams(p, prefix)
    prefix = prefix or p.name
    if p.split not in ('train', 'eval'):
      raise ValueError(f'{prefix}.split={p.split!r}; use train or eval.')
    if not 0 < p.eval_percent < 100:
      raise ValueError(f'{prefix}.eval_percent must be in (0, 100); received '
                       f'{p.eval_percent}.')
    if p.sequence_length < 1:
      raise ValueError(f'{prefix}.sequence_length must be >= 1; received '
                       f'{p.sequence_length}.')

  @property
  def root(self):
    return self.p.root or sysconfig.get_paths()['stdlib']

  def CheckData(self, prefix=None):
    self.Corpus(prefix)

  def Files(self, prefix=None):
    """The split's files, relative to `root`, in the order they are read."""
    root = self.root
    if not os.path.isdir(root):
      raise ValueError(f'{prefix or self.p.name}.root={root!r} is not a '
                       'directory; set it to a directory of .py files.')
    files = []
    for directory, subdirs, names in os.walk(root):
      subdirs[:] = sorted(d for d in subdirs if d not in self.EXCLUDED_DIRS)
      for name in sorted(names):
        if name.endswith('.py'):
          path = os.path.relpath(os.path.join(directory, name), root)
          if IsEvalFile(path, self.p.eval_percent) == (self.p.split == 'eval'):
            files.append(path)
    return files

  def Corpus(self, prefix=None):
    """The split's bytes as a uint8 numpy array (read once per process)."""
    p = self.p
    key = (self.root, p.split, p.eval_percent)
    if key not in _CORPUS_CACHE:
      chunks = []
      for path in self.Files(prefix):
        with open(os.path.join(self.root, path), 'rb') as f:
          chunks.append(f.read())
      _CORPUS_CACHE[key] = np.frombuffer(b''.join(chunks), np.uint8)
    data = _CORPUS_CACHE[key]
    if data.size <= p.sequence_length + 1:
      raise ValueError(
          f'{prefix or p.name}: the {p.split} split of {self.root!r} has '
          f'{data.size} bytes, fewer than one example needs '
          f'({p.sequence_length + 1}); point root at more source code or '
          'lower sequence_length.')
    return data

  def GetDataset(self, start_step=0):
    p = self.p
    corpus = tf.constant(self.Corpus())
    num_offsets = tf.cast(tf.size(corpus) - p.sequence_length, tf.int64)
    seed = tf.constant(p.seed, tf.int64)

    def Example(i):
      offset = tf.random.stateless_uniform(
          [], tf.stack([seed, i]), maxval=num_offsets, dtype=tf.int64)
      window = tf.cast(corpus[offset:offset + p.sequence_length + 1],
                       tf.int32)
      return window[:-1], window[1:]

    ds = tf.data.Dataset.counter(start=start_step * p.batch_size,
                                 dtype=tf.int64)
    ds = ds.map(Example, num_parallel_calls=tf.data.AUTOTUNE,
                deterministic=True)
    return ds.batch(p.batch_size, drop_remainder=True).prefetch(2)


def IsEvalFile(relative_path, eval_percent):
  """Whether a file belongs to the eval split: a stable hash of its path."""
  digest = hashlib.sha256(relative_path.replace(os.sep, '/').encode('utf-8'))
  return int.from_bytes(digest.digest()[:8], 'big') % 100 < eval_percent

class _FileInput(BaseInputGenerator):
  """Shared logic of file readers: glob, repeat, seeded shuffle, batch, skip."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('file_pattern', '', 'Glob of the data files, e.g. /data/train-*.')
    p.Define('shuffle_buffer_size', 1024,
             'Examples in the shuffle buffer; 0 keeps the file order.')
    return p

  def _Files(self, prefix=None):
    files = sorted(tf.io.gfile.glob(self.p.file_pattern)) if (
        self.p.file_pattern) else []
    if not files:
      raise ValueError(f'{prefix or self.p.name}.file_pattern='
                       f'{self.p.file_pattern!r} matches no files; set it to a '
                       'glob of your data.')
    return files

  def CheckData(self, prefix=None):
    self._Files(prefix)

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
