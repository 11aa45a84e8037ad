"""Every Keras layer with randomness or state: run exactly in a pipeline, or refused.

CLASSES lists each keras.layers class that draws random numbers or keeps
state, with how tfpipe runs it (the README's table says the same). A walk
over keras.layers fails when a Keras release adds such a class that is not
listed. Each listed class is then tested both wrapped in layers.KerasLayer
and through tfpipe.keras.pipeline, for the property its kind promises:

  per example      a recompute (a second forward in the same step) repeats
                   the values; another step draws others; and the values of
                   the whole batch equal those of its micro-batches, however
                   it is split (so they do not depend on M).
  per micro-batch  a recompute repeats the values; another step draws others.
  statistics       one merged update of the moving statistics per step
                   (keras_layer_test and cell_test check the values).
  read only        the step's output is the plain layer's, and nothing is
                   assigned.
  refused          a ValueError naming the layer and what to use instead.
"""
# bazel: data=//:README.md

import inspect
import os
import re
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfpipe
from tfpipe import base_layer
from tfpipe import layers
from tfpipe.layers import keras_exact

L = keras.layers
PER_EXAMPLE = 'exact, per example'
STATISTICS = 'exact, one merged update per step'
PER_MICRO_BATCH = 'exact, seeded per micro-batch'
READ_ONLY = 'exact, state only read'
REFUSED = 'refused'
NOT_APPLICABLE = 'not applicable'

IMAGE = (6, 8, 8, 3)
SEQUENCE = (6, 5, 3)
VECTOR = (6, 8)


class Case:
  """How to build and call one layer class.

  Attributes:
    kind: one of the kinds above.
    make: () -> (cls, args), fresh each call (args may hold layers).
    shape: the input's shape (batch first), or None for no runtime test.
    call: 'one' (layer(x)), 'list' (layer([x, x])) or 'pair' (layer(x, x));
      only 'one' can be wrapped in KerasLayer, which takes one input.
    dtype: the input's dtype ('float32', 'int64' or 'string').
    fix: words the refusal's message must contain.
  """

  def __init__(self, kind, make, shape=None, call='one', dtype='float32',
               fix=None):
    self.kind, self.make, self.shape = kind, make, shape
    self.call, self.dtype, self.fix = call, dtype, fix


def _Image(cls, **args):
  return Case(PER_MICRO_BATCH, lambda: (cls, args), IMAGE)


def _Rnn(cls, **args):
  return Case(PER_MICRO_BATCH, lambda: (cls, dict(
      units=3, dropout=0.5, recurrent_dropout=0.5, **args)), SEQUENCE)


def _Cell(cls):
  return Case(PER_MICRO_BATCH, lambda: (L.RNN, dict(cell=cls(
      3, dropout=0.5, recurrent_dropout=0.5))), SEQUENCE)


def _ConvLstm(cls, shape):
  return Case(PER_MICRO_BATCH, lambda: (cls, dict(
      filters=2, kernel_size=3, padding='same', dropout=0.5,
      recurrent_dropout=0.5)), shape)


def _Quantizable(cls, **args):
  # Plain: no state. Quantized: int8 is read only, float8 refused (tested
  # separately below).
  return Case(READ_ONLY, lambda: (cls, args), None)


CLASSES = {
    'Dropout': Case(PER_EXAMPLE, lambda: (L.Dropout, dict(rate=0.5)),
                    VECTOR),
    'SpatialDropout1D': Case(PER_EXAMPLE, lambda: (
        L.SpatialDropout1D, dict(rate=0.5)), SEQUENCE),
    'SpatialDropout2D': Case(PER_EXAMPLE, lambda: (
        L.SpatialDropout2D, dict(rate=0.5)), IMAGE),
    'SpatialDropout3D': Case(PER_EXAMPLE, lambda: (
        L.SpatialDropout3D, dict(rate=0.5)), (6, 3, 3, 3, 2)),
    'GaussianNoise': Case(PER_EXAMPLE, lambda: (
        L.GaussianNoise, dict(stddev=0.5)), VECTOR),
    'GaussianDropout': Case(PER_EXAMPLE, lambda: (
        L.GaussianDropout, dict(rate=0.5)), VECTOR),
    'AlphaDropout': Case(PER_EXAMPLE, lambda: (
        L.AlphaDropout, dict(rate=0.5)), VECTOR),
    'MultiHeadAttention': Case(PER_EXAMPLE, lambda: (
        L.MultiHeadAttention, dict(num_heads=2, key_dim=3, dropout=0.5)),
                               SEQUENCE, call='pair'),
    'GroupQueryAttention': Case(PER_EXAMPLE, lambda: (
        L.GroupQueryAttention, dict(head_dim=3, num_query_heads=2,
                                    num_key_value_heads=1, dropout=0.5)),
                                SEQUENCE, call='pair'),
    'BatchNormalization': Case(STATISTICS, lambda: (
        L.BatchNormalization, dict(momentum=0.5)), VECTOR),
    'Attention': Case(PER_MICRO_BATCH, lambda: (
        L.Attention, dict(dropout=0.5)), SEQUENCE, call='list'),
    'AdditiveAttention': Case(PER_MICRO_BATCH, lambda: (
        L.AdditiveAttention, dict(dropout=0.5)), SEQUENCE, call='list'),
    'LSTM': _Rnn(L.LSTM),
    'GRU': _Rnn(L.GRU),
    'SimpleRNN': _Rnn(L.SimpleRNN),
    'LSTMCell': _Cell(L.LSTMCell),
    'GRUCell': _Cell(L.GRUCell),
    'SimpleRNNCell': _Cell(L.SimpleRNNCell),
    'RNN': _Cell(L.LSTMCell),
    'StackedRNNCells': Case(PER_MICRO_BATCH, lambda: (L.RNN, dict(
        cell=L.StackedRNNCells([L.LSTMCell(3, dropout=0.5),
                                L.GRUCell(3, recurrent_dropout=0.5)]))),
                            SEQUENCE),
    'Bidirectional': Case(PER_MICRO_BATCH, lambda: (L.Bidirectional, dict(
        layer=L.LSTM(3, dropout=0.5))), SEQUENCE),
    'ConvLSTM1D': _ConvLstm(L.ConvLSTM1D, (6, 3, 5, 2)),
    'ConvLSTM2D': _ConvLstm(L.ConvLSTM2D, (6, 2, 4, 4, 2)),
    'ConvLSTM3D': _ConvLstm(L.ConvLSTM3D, (6, 2, 3, 3, 3, 2)),
    'CutMix': _Image(L.CutMix),
    'MixUp': _Image(L.MixUp),
    'RandAugment': _Image(L.RandAugment),
    'RandomBrightness': _Image(L.RandomBrightness, factor=0.5),
    'RandomColorDegeneration': _Image(L.RandomColorDegeneration, factor=0.5),
    'RandomColorJitter': _Image(L.RandomColorJitter, brightness_factor=0.5,
                                contrast_factor=0.5),
    'RandomContrast': _Image(L.RandomContrast, factor=0.5),
    'RandomCrop': _Image(L.RandomCrop, height=5, width=5),
    'RandomElasticTransform': _Image(L.RandomElasticTransform),
    'RandomErasing': _Image(L.RandomErasing),
    'RandomFlip': _Image(L.RandomFlip),
    'RandomGaussianBlur': _Image(L.RandomGaussianBlur),
    'RandomGrayscale': _Image(L.RandomGrayscale, factor=0.5),
    'RandomHue': _Image(L.RandomHue, factor=0.5),
    'RandomInvert': _Image(L.RandomInvert),
    'RandomPerspective': _Image(L.RandomPerspective),
    'RandomPosterization': _Image(L.RandomPosterization, factor=(1, 4)),
    'RandomRotation': _Image(L.RandomRotation, factor=0.5),
    'RandomSaturation': _Image(L.RandomSaturation, factor=0.5),
    'RandomSharpness': _Image(L.RandomSharpness, factor=0.5),
    'RandomShear': _Image(L.RandomShear, x_factor=0.5, y_factor=0.5),
    'RandomTranslation': _Image(L.RandomTranslation, height_factor=0.3,
                                width_factor=0.3),
    'RandomZoom': _Image(L.RandomZoom, height_factor=0.5),
    'Solarization': _Image(L.Solarization, addition_factor=0.5,
                           threshold_factor=0.5),
    'Normalization': Case(READ_ONLY, lambda: (L.Normalization, {}), VECTOR),
    'IntegerLookup': Case(READ_ONLY, lambda: (L.IntegerLookup, dict(
        vocabulary=[1, 2, 3])), (6, 1), dtype='int64'),
    'StringLookup': Case(READ_ONLY, lambda: (L.StringLookup, dict(
        vocabulary=['1', '2', '3'])), (6, 1), dtype='string'),
    'TextVectorization': Case(READ_ONLY, lambda: (L.TextVectorization, dict(
        vocabulary=['1', '2', '3'])), (6,), dtype='string'),
    'STFTSpectrogram': Case(READ_ONLY, lambda: (L.STFTSpectrogram, dict(
        frame_length=8, frame_step=4, fft_length=8)), (6, 32, 1)),
    'Dense': _Quantizable(L.Dense, units=3),
    'EinsumDense': _Quantizable(L.EinsumDense, equation='ab,bc->ac',
                                output_shape=3),
    'Embedding': _Quantizable(L.Embedding, input_dim=5, output_dim=3),
    'ReversibleEmbedding': _Quantizable(L.ReversibleEmbedding, input_dim=5,
                                        output_dim=3),
    'Conv1D': _Quantizable(L.Conv1D, filters=2, kernel_size=3),
    'Conv2D': _Quantizable(L.Conv2D, filters=2, kernel_size=3),
    'Conv3D': _Quantizable(L.Conv3D, filters=2, kernel_size=3),
    'Convolution1D': _Quantizable(L.Convolution1D, filters=2, kernel_size=3),
    'Convolution2D': _Quantizable(L.Convolution2D, filters=2, kernel_size=3),
    'Convolution3D': _Quantizable(L.Convolution3D, filters=2, kernel_size=3),
    'AugMix': Case(REFUSED, lambda: (L.AugMix, {}), IMAGE,
                   fix='RandAugment'),
    'SpectralNormalization': Case(REFUSED, lambda: (
        L.SpectralNormalization, dict(layer=L.Dense(3))), VECTOR,
                                  fix='kernel_constraint'),
    'TFSMLayer': Case(REFUSED, None, fix='call_training_endpoint'),
    'JaxLayer': Case(NOT_APPLICABLE, None),
    'FlaxLayer': Case(NOT_APPLICABLE, None),
}

# Refused configurations of otherwise supported classes.
REFUSED_CONFIGS = {
    'stateful LSTM': (lambda: (L.LSTM, dict(units=3, stateful=True)),
                      'stateful=False'),
    'stateful GRU in Bidirectional': (lambda: (L.Bidirectional, dict(
        layer=L.GRU(3, stateful=True))), 'stateful=False'),
    'BatchNormalization(renorm=True)': (lambda: (
        L.BatchNormalization, dict(renorm=True)), 'renorm=False'),
}


# ---- the list is complete -----------------------------------------------------

# Modules whose source every layer shares (the base classes): not evidence.
_SHARED_MODULES = (
    'keras.src.layers.layer', 'keras.src.ops.', 'keras.src.backend',
    'keras.src.saving', 'keras.src.utils.', 'keras.src.layers.preprocessing.'
    'data_layer', 'keras.src.layers.preprocessing.image_preprocessing.'
    'base_image_preprocessing_layer')
_RANDOM = re.compile(r'SeedGenerator\(|seed_generator|^import random|'
                     r'\bDropout\(', re.M)
_STATE = re.compile(r'trainable=False|\.assign(_add|_sub)?\(|'
                    r'self\.stateful\b')


def _KerasLayerClasses():
  for name in sorted(dir(L)):
    cls = getattr(L, name)
    if isinstance(cls, type) and issubclass(cls, L.Layer) and cls is not L.Layer:
      yield name, cls


def _HasRandomnessOrState(cls):
  """True if the class's own code (not Layer's) or a default instance shows either."""
  modules = {base.__module__ for base in cls.__mro__
             if base.__module__.startswith('keras.src.') and
             not base.__module__.startswith(_SHARED_MODULES)}
  source = '\n'.join(inspect.getsource(sys.modules[m]) for m in modules)
  if _RANDOM.search(source) or _STATE.search(source):
    return True
  try:
    layer = cls()
  except Exception:  # pylint: disable=broad-except
    return False  # Needs arguments; its source was checked above.
  return bool(layer.non_trainable_variables) or any(
      isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values())


def test_every_keras_layer_with_randomness_or_state_is_classified():
  missing = [name for name, cls in _KerasLayerClasses()
             if name not in CLASSES and _HasRandomnessOrState(cls)]
  assert not missing, (
      f'keras.layers classes with randomness or state that CLASSES (and '
      f'the README table) do not classify: {missing}. Decide how tfpipe '
      'runs each (keras_exact.py) and add it to both.')
  # And the walk does see them: the known ones are found.
  assert _HasRandomnessOrState(L.Dropout)
  assert _HasRandomnessOrState(L.BatchNormalization)
  assert not _HasRandomnessOrState(L.Flatten)


def test_readme_table_lists_every_class_with_its_kind():
  readme = os.path.join(os.path.dirname(__file__), '..', '..', 'README.md')
  with open(readme, encoding='utf-8') as f:
    text = f.read()
  rows = {}
  for line in text.splitlines():
    match = re.match(r'\|\s*(.+?)\s*\|\s*(exact, [^|]+?|refused|not '
                     r'applicable)\s*\|', line)
    if match:
      for name in re.findall(r'`(\w+)`', match.group(1)):
        # A class's first row is its kind; later rows are refused configs.
        rows.setdefault(name, match.group(2))
  for name, case in CLASSES.items():
    assert name in rows, f'README table of Keras layers lacks {name}'
    assert rows[name].startswith(case.kind), (name, rows[name], case.kind)


# ---- running them -------------------------------------------------------------


def _Input(case, seed=0):
  rng = np.random.RandomState(seed)
  if case.dtype == 'string':
    return tf.constant(rng.randint(1, 5, size=case.shape).astype(str))
  if case.dtype == 'int64':
    return tf.constant(rng.randint(1, 5, size=case.shape), tf.int64)
  scale = 255.0 if case.shape == IMAGE else 1.0
  return tf.constant(rng.rand(*case.shape).astype(np.float32) * scale)


def _Wrapped(case, name='wrapped'):
  cls, args = case.make()
  wrapper = layers.KerasLayer.Params().Set(
      name=name, cls=cls, args=args).Instantiate()
  if cls is L.Normalization:
    wrapper.layer.adapt(np.random.RandomState(1).rand(20, VECTOR[1]))
  wrapper.build(tuple(case.shape))
  return lambda x: wrapper(x, training=True)


def _Piped(case):
  """A K=1 pipeline of Input -> the layer; returns its cell's forward."""
  cls, args = case.make()
  layer = cls(**args)
  if cls is L.Normalization:
    layer.adapt(np.random.RandomState(1).rand(20, VECTOR[1]))
  dtype = {'string': 'string', 'int64': 'int64'}.get(case.dtype, 'float32')
  inputs = keras.Input(case.shape[1:], dtype=dtype)
  outputs = {'one': lambda: layer(inputs), 'list': lambda: layer(
      [inputs, inputs]), 'pair': lambda: layer(inputs, inputs)}[case.call]()
  pm = tfpipe.keras.pipeline(keras.Model(inputs, outputs), num_partitions=1,
                             devices=['/CPU:0'], balance='params')
  cell = pm.pipe.cells[0]
  return lambda x: cell(pm._Feed(x), training=True)  # pylint: disable=protected-access


def _Runners(case):
  runners = [('tfpipe.keras', _Piped)]
  if case.call == 'one':
    runners.append(('KerasLayer', _Wrapped))
  return runners


def _InStep(run, x, step=1, micro_batch=0, offset=None):
  with base_layer.StepSeed(tf.constant([step, micro_batch], tf.int64),
                           offset):
    return np.asarray(run(x))


def _Names(kind):
  return sorted(n for n, c in CLASSES.items()
                if c.kind == kind and c.shape is not None)


def _SkipWithoutScipy(name):
  if name == 'STFTSpectrogram':
    pytest.importorskip('scipy', reason='STFTSpectrogram needs scipy')


@pytest.mark.parametrize('name', _Names(PER_EXAMPLE))
def test_per_example_layers_repeat_and_do_not_depend_on_the_split(name):
  case = CLASSES[name]
  x = _Input(case)
  for where, make in _Runners(case):
    run = make(case)
    whole = _InStep(run, x, offset=0)
    np.testing.assert_array_equal(_InStep(run, x, offset=0), whole,
                                  err_msg=f'{name} via {where}: recompute')
    assert not np.allclose(_InStep(run, x, step=2, offset=0), whole), (
        f'{name} via {where}: another step must draw other values')
    # Micro-batches [0, 2) and [2, 6), with their own seed[1].
    parts = [_InStep(run, x[:2], micro_batch=0, offset=0),
             _InStep(run, x[2:], micro_batch=1, offset=2)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-6,
                               atol=1e-6, err_msg=f'{name} via {where}: M')


@pytest.mark.parametrize('name', _Names(PER_MICRO_BATCH))
def test_seeded_layers_repeat_when_recomputed(name):
  case = CLASSES[name]
  x = _Input(case)
  for where, make in _Runners(case):
    run = make(case)
    first = _InStep(run, x)
    np.testing.assert_array_equal(_InStep(run, x), first,
                                  err_msg=f'{name} via {where}: recompute')
    assert not np.array_equal(_InStep(run, x, step=2), first), (
        f'{name} via {where}: another step must draw other values')


@pytest.mark.parametrize('name', _Names(READ_ONLY))
def test_read_only_layers_run_as_in_plain_keras(name):
  _SkipWithoutScipy(name)
  case = CLASSES[name]
  x = _Input(case)
  for where, make in _Runners(case):
    run = make(case)
    np.testing.assert_array_equal(_InStep(run, x), np.asarray(run(x)),
                                  err_msg=f'{name} via {where}')


@pytest.mark.parametrize('name', [n for n in _Names(REFUSED)])
def test_refused_layers_name_the_layer_and_the_alternative(name):
  case = CLASSES[name]
  cls, args = case.make()
  with pytest.raises(ValueError, match=f'{name}.*{case.fix}'):
    layers.KerasLayer.Params().Set(name='w', cls=cls, args=args).Instantiate()
  cls, args = case.make()
  inputs = keras.Input(case.shape[1:])
  model = keras.Model(inputs, L.Dense(2)(cls(**args)(inputs)))
  with pytest.raises(ValueError, match=f'tfpipe.keras: layer .*{name}.*'
                     f'{case.fix}'):
    tfpipe.keras.pipeline(model, num_partitions=1, devices=['/CPU:0'],
                          balance='params')


@pytest.mark.parametrize('config', sorted(REFUSED_CONFIGS))
def test_refused_configurations_name_the_layer_and_the_fix(config):
  make, fix = REFUSED_CONFIGS[config]
  cls, args = make()
  with pytest.raises(ValueError, match=f'KerasLayer.*{fix}'):
    layers.KerasLayer.Params().Set(name='w', cls=cls, args=args).Instantiate()
  cls, args = make()
  inputs = keras.Input((5, 3), batch_size=2)
  model = keras.Model(inputs, L.Dense(2)(cls(**args)(inputs)))
  with pytest.raises(ValueError, match=f'tfpipe.keras: layer .*{fix}'):
    tfpipe.keras.pipeline(model, num_partitions=1, devices=['/CPU:0'],
                          balance='params')


def test_saved_model_layer_is_refused_only_with_a_training_endpoint(
    tmp_path):
  inputs = keras.Input((3,))
  keras.Model(inputs, L.Dense(2)(inputs)).export(str(tmp_path / 'sm'),
                                                 verbose=False)
  serving = layers.KerasLayer.Params().Set(
      name='sm', cls=L.TFSMLayer, args=dict(
          filepath=str(tmp_path / 'sm'))).Instantiate()
  x = tf.ones((2, 3))
  np.testing.assert_allclose(_InStep(lambda v: serving(v, training=True), x),
                             serving(x), rtol=1e-6)
  with pytest.raises(ValueError, match="TFSMLayer.*call_training_endpoint"):
    layers.KerasLayer.Params().Set(
        name='sm', cls=L.TFSMLayer, args=dict(
            filepath=str(tmp_path / 'sm'),
            call_training_endpoint='serve')).Instantiate()


def test_quantized_layers_int8_reads_its_state_float8_is_refused():
  x = tf.constant(np.random.RandomState(0).rand(4, 6).astype(np.float32))
  for mode, refused in (('int8', False), ('float8', True)):
    inputs = keras.Input((6,))
    dense = L.Dense(3, name='q')
    model = keras.Model(inputs, dense(inputs))
    dense.quantize(mode)
    if refused:
      with pytest.raises(ValueError, match="'q'.*float8.*int8"):
        tfpipe.keras.pipeline(model, num_partitions=1, devices=['/CPU:0'],
                              balance='params')
      continue
    pm = tfpipe.keras.pipeline(model, num_partitions=1, devices=['/CPU:0'],
                               balance='params')
    run = lambda v: pm.pipe.cells[0](pm._Feed(v), training=True)  # pylint: disable=protected-access,cell-var-from-loop
    np.testing.assert_array_equal(_InStep(run, x), np.asarray(model(x)))


class _CountsCalls(L.Layer):
  """Assigns to its own variable in call: an update tfpipe cannot defer."""

  def build(self, input_shape):
    self.calls = self.add_weight(name='calls', shape=(), initializer='zeros',
                                 trainable=False)

  def call(self, x):
    self.calls.assign_add(1.0)
    return x


def test_an_unknown_state_update_is_refused_when_the_layer_runs():
  wrapper = layers.KerasLayer.Params().Set(
      name='counter', cls=_CountsCalls).Instantiate()
  wrapper.build((None, 3))
  x = tf.ones((2, 3))
  wrapper(x)  # Outside a step it is plain Keras.
  assert float(wrapper.layer.calls) == 1.0
  with pytest.raises(ValueError, match="'counter'.*_CountsCalls.*assigns to "
                     "its variable.*once per micro-batch"):
    _InStep(lambda v: wrapper(v, training=True), x)
  assert float(wrapper.layer.calls) == 1.0
  wrapper(x)  # The guard is gone after the step.
  assert float(wrapper.layer.calls) == 2.0


def test_unseeded_keras_random_calls_are_repeated_too():
  class Unseeded(L.Layer):
    def call(self, x):
      return x + keras.random.normal(tf.shape(x))  # Keras' global generator.
  run = _Wrapped(Case(PER_MICRO_BATCH, lambda: (Unseeded, {}), VECTOR))
  x = _Input(CLASSES['Dropout'])
  np.testing.assert_array_equal(_InStep(run, x), _InStep(run, x))
  assert not np.array_equal(_InStep(run, x, step=2), _InStep(run, x))


def test_outside_a_step_keras_layers_draw_as_usual():
  run = _Wrapped(CLASSES['Dropout'])
  x = _Input(CLASSES['Dropout'])
  assert not np.array_equal(np.asarray(run(x)), np.asarray(run(x)))
  assert keras_exact.Refusal(L.Dropout(0.5)) is None


def test_deferred_statistics_do_not_keep_a_deleted_layer_alive():
  """The per-layer record of deferred statistics holds its layer weakly."""
  import gc  # pylint: disable=g-import-not-at-top
  import weakref  # pylint: disable=g-import-not-at-top
  from tfpipe import base_layer  # pylint: disable=g-import-not-at-top
  from tfpipe.layers import keras_exact  # pylint: disable=g-import-not-at-top
  bn = keras.layers.BatchNormalization()
  bn.build((2, 3))
  collector = base_layer.DeferredStatsCollector()
  with base_layer.CollectDeferredStats(collector), keras_exact.ExactCalls(
      bn, 'bn'):
    bn(tf.ones([2, 3]), training=True)
  collector.Apply()
  alive = weakref.ref(bn)
  del bn, collector
  gc.collect()
  assert alive() is None
