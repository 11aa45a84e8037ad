"""Ordering a Keras graph, carrying skips between cells, and refusing what
the pipeline cannot run exactly."""

import keras
import numpy as np
import pytest

import tfpipe
from tfpipe.keras import graph as graph_lib
from tests.keras import model_test

DEVICES = model_test.DEVICES


def test_steps_are_topologically_ordered():
  graph = graph_lib.ModelGraph(model_test._Functional())
  produced = set(graph.input_keys)
  for step in graph.steps:
    assert set(step.input_keys.values()) <= produced, step
    produced.update(step.output_keys)
  assert set(graph.output_keys) <= produced


def test_skip_is_carried_to_its_consumer_and_no_further():
  keras.utils.set_random_seed(0)
  i = keras.Input((4,), name='x')
  h = [keras.layers.Dense(4, name='d0')(i)]
  for n in range(1, 5):
    h.append(keras.layers.Dense(4, name=f'd{n}')(h[-1]))
  skip = keras.layers.Add(name='skip')([h[0], h[-1]])
  out = keras.layers.Dense(2, name='out')(keras.layers.Dense(
      4, name='after')(skip))
  graph = graph_lib.ModelGraph(keras.Model(i, out))
  plans = graph_lib.PlanCells(graph, [1, 2, 2, 3])
  assert [p.input_keys for p in plans] == [
      ['input:x:0'], ['d0'], ['d0', 'd2'], ['d0', 'd4']]
  assert [p.output_keys for p in plans] == [
      ['d0'], ['d0', 'd2'], ['d0', 'd4'], ['out']]
  assert [s.name for s in plans[3].steps] == ['skip', 'after', 'out']


def test_nested_models_are_expanded():
  keras.utils.set_random_seed(0)
  inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name='a'),
                            keras.layers.Dense(4, name='b')], name='inner')
  i = keras.Input((4,))
  model = keras.Model(i, keras.layers.Dense(2, name='c')(inner(i)))
  graph = graph_lib.ModelGraph(model)
  assert [s.name for s in graph.steps] == ['a', 'b', 'c']
  pm = tfpipe.keras.pipeline(model, num_partitions=3, devices=DEVICES[:3],
                             num_micro_batches=2, balance='params')
  x = np.random.RandomState(0).randn(4, 4).astype(np.float32)
  np.testing.assert_allclose(pm(x), model(x), rtol=1e-6)


def _Build(*layers, shape=(4,), **input_kwargs):
  i = keras.Input(shape, **input_kwargs)
  h = i
  for layer in layers:
    h = layer(h)
  return keras.Model(i, keras.layers.Dense(2)(h))


class _Subclassed(keras.Model):

  def __init__(self):
    super().__init__()
    self.dense = keras.layers.Dense(2)

  def call(self, x):
    return self.dense(x)


class _AddsLoss(keras.layers.Layer):

  def call(self, x):
    self.add_loss(keras.ops.sum(x))
    return x


@pytest.mark.parametrize('make,match', [
    (lambda: keras.Sequential([keras.layers.Dense(2)]), 'no known input'),
    (_Subclassed, 'subclassed model'),
    (lambda: _Build(keras.layers.LSTM(3, stateful=True), shape=(5, 4),
                    batch_size=2), "'lstm.*stateful"),
    (lambda: _Build(keras.layers.Dense(3, activity_regularizer='l2',
                                       name='reg')), "'reg'.*activity"),
    (lambda: _Build(keras.layers.Embedding(10, 3, mask_zero=True, name='emb'),
                    shape=(5,)), "'emb'.*mask"),
    (lambda: _Build(keras.layers.BatchNormalization(renorm=True, name='bn')),
     "'bn'.*renorm"),
    (lambda: _Build(keras.layers.SpectralNormalization(
        keras.layers.Dense(3), name='sn')), "'sn'.*kernel_constraint"),
    (lambda: _Build(_WithStatefulRnn(name='block'), shape=(5, 4),
                    batch_size=2), "'gru'.*inside layer 'block'.*stateful"),
])
def test_unsupported_models_are_refused_by_name(make, match):
  with pytest.raises(ValueError, match=match):
    tfpipe.keras.pipeline(make(), num_partitions=2, devices=DEVICES[:2],
                          balance='params')


class _WithStatefulRnn(keras.layers.Layer):

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.rnn = keras.layers.GRU(3, stateful=True, name='gru')

  def build(self, input_shape):
    self.rnn.build(input_shape)

  def call(self, x):
    return self.rnn(x)


@pytest.mark.parametrize('remat_policy', ['always', 'except_last', 'never'])
def test_random_layers_and_nested_batch_norm_are_accepted_under_remat(
    remat_policy):
  """They run exactly in every policy (cell_test checks the values)."""
  inner = keras.Sequential([keras.layers.Dense(3, name='inner_dense'),
                            keras.layers.BatchNormalization(name='inner_bn'),
                            keras.layers.Dropout(0.5, name='inner_drop')],
                           name='block')
  model = _Build(keras.layers.Dense(3), keras.layers.GaussianNoise(0.1),
                 keras.layers.Lambda(inner))
  tfpipe.keras.pipeline(model, num_partitions=2, devices=DEVICES[:2],
                        balance='params', remat_policy=remat_policy)


class _ReadsTable(keras.layers.Layer):
  """Projects onto another layer's kernel, tracked as its own variable."""

  def __init__(self, table, **kwargs):
    super().__init__(**kwargs)
    self.table = table

  def call(self, x):
    return keras.ops.matmul(x, keras.ops.transpose(self.table))


def _SharedLayerModel():
  keras.utils.set_random_seed(0)
  shared = keras.layers.Dense(4, name='shared')
  i = keras.Input((4,))
  h = shared(i)
  h = keras.layers.Dense(4, activation='tanh', name='mid')(h)
  return keras.Model(i, keras.layers.Dense(2, name='out')(shared(h)))


def _SharedVariableModel():
  keras.utils.set_random_seed(0)
  i = keras.Input((4,))
  first = keras.layers.Dense(6, name='shared')
  h = keras.layers.Dense(6, activation='tanh', name='mid')(first(i))
  h = _ReadsTable(first.kernel, name='reads_table')(h)
  return keras.Model(i, keras.layers.Dense(2, name='out')(h))


@pytest.mark.parametrize('make', [_SharedLayerModel, _SharedVariableModel])
def test_layer_or_variable_shared_across_stages_trains_like_plain(make):
  """Cell 1 reads a copy; its gradient is added to the variable's
  (gpipe/tied_variables.py). The variable is listed once."""
  model = make()
  pm = tfpipe.keras.pipeline(model, num_partitions=2, devices=DEVICES[:2],
                             num_micro_batches=2, balance=[2, 2])
  assert pm.cell_plans[1].steps[0].name in ('shared', 'reads_table')
  assert [id(v) for v in pm.trainable_variables] == [
      id(v) for v in model.trainable_variables]
  assert 'tied: shared/kernel (cell 0) is read by cell 1' in (
      tfpipe.keras.describe(pm))
  pm.compile(loss='mse')
  x, y = model_test._Data(model)
  model_test._AssertGradientsEqual(pm, model, x, y, model_test._Mse, 1)


def _NestedClassifier(backbone_kwargs):
  keras.utils.set_random_seed(0)
  a = keras.Input((4,), name='a')
  b = keras.Input((4,), name='b')
  backbone = keras.Model(
      {'a': a, 'b': b},
      keras.layers.Dense(4, name='b2')(keras.layers.Dense(4, name='b1')(
          keras.layers.Add(name='sum')([a, b]))), name='backbone')
  x = {'a': keras.Input((4,), name='x_a'), 'b': keras.Input((4,), name='x_b')}
  out = keras.layers.Dense(2, name='head')(backbone(x, **backbone_kwargs))
  return keras.Model(x, out, name='classifier')


def test_nested_model_called_on_a_dict_with_none_masks_is_expanded():
  """As keras_hub task models call their backbones: mask={'a': None, ...}."""
  model = _NestedClassifier({'mask': {'a': None, 'b': None}})
  assert [s.name for s in graph_lib.ModelGraph(model).steps] == [
      'sum', 'b1', 'b2', 'head']
  pm = tfpipe.keras.pipeline(model, num_partitions=4, devices=DEVICES[:4],
                             num_micro_batches=2, balance='params')
  rng = np.random.RandomState(0)
  x = {'a': rng.randn(4, 4).astype(np.float32),
       'b': rng.randn(4, 4).astype(np.float32)}
  np.testing.assert_allclose(pm(x), model(x), rtol=1e-6)


def test_too_few_layer_calls_names_the_nested_model_kept_whole():
  model = _NestedClassifier({'mask': {'a': keras.ops.ones((1, 4)),
                                      'b': None}})
  with pytest.raises(ValueError, match=(
      r"has 2 layer calls, too few .*num_partitions=4.*layer 'backbone' "
      r"\(Functional\) is one call because it is called with the keyword "
      r"argument 'mask' holding tensors")):
    tfpipe.keras.pipeline(model, num_partitions=4, balance='params')
  with pytest.raises(ValueError, match=r'has 4 layer calls, too few to cut '
                     r'into num_partitions=5 non-empty cells. Use '
                     r'num_partitions <= 4.$'):
    tfpipe.keras.pipeline(model_test._Sequential(), num_partitions=5,
                          balance='params')


def test_add_loss_at_run_time_is_refused():
  """Seen when pipeline() traces the cells (to find what each reads)."""
  model = _Build(keras.layers.Dense(3), _AddsLoss(name='adds'))
  with pytest.raises(ValueError, match="'adds'.*add_loss"):
    tfpipe.keras.pipeline(model, num_partitions=2, devices=DEVICES[:2],
                          num_micro_batches=2, balance='params')
