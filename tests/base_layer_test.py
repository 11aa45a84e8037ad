"""Tests of BaseLayer: the contract every tfpipe layer and user layer relies on.

Protected properties: params extend the parent's and are validated; children
are built from params with predictable names; variables are seeded
deterministically and placed on the device active at instantiation; `call`
forwards `training` only to an FProp that takes it; the default cost model
and `compute_output_shape` agree with the real computation; the per-step
context (seeds, deferred statistics, recomputation) is scoped and restored;
the nested-shape helpers; and a BaseLayer is an ordinary Keras layer that
trains with `keras.Model.fit` and round-trips through `tf.train.Checkpoint`.
"""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe import base_layer
from tfpipe import layers


class _Affine(base_layer.BaseLayer):
  """x @ w + b with eager variables and no `training` argument."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dims', 3, 'Input width.')
    p.Define('output_dims', 2, 'Output width.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.p
    self.w = self.CreateVariable('w', [p.input_dims, p.output_dims])
    self.b = self.CreateVariable('b', [p.output_dims], initializer='zeros')

  def FProp(self, inputs):
    return tf.matmul(inputs, self.w) + self.b


class _TrainingProbe(base_layer.BaseLayer):
  """Records the `training` value its FProp receives."""

  def __init__(self, params):
    super().__init__(params)
    self.seen = []

  def FProp(self, inputs, training=None):
    self.seen.append(training)
    return inputs


class _NoFProp(base_layer.BaseLayer):
  pass


class _Parent(base_layer.BaseLayer):
  """Two children from params: one single, one list."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('child', _Affine.Params(), 'A single child.')
    p.Define('stack', [_Affine.Params().Set(input_dims=2),
                       _Affine.Params().Set(name='named', input_dims=2)],
             'A list of children.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('child', self.p.child)
    self.CreateChildren('stack', self.p.stack)

  def FProp(self, inputs):
    out = self.child(inputs)
    for layer in self.stack:
      out = layer(out)
    return out


class _Recorder(base_layer.BaseLayer):
  """Counts ApplyDeferredStats calls and the records each received."""

  def __init__(self, params):
    super().__init__(params)
    self.applied = []

  def FProp(self, inputs):
    return inputs

  def ApplyDeferredStats(self, records):
    self.applied.append(list(records))
    return f'update-{self.name}'


def _Affine2x3(name='affine', seed=None):
  return _Affine.Params().Set(name=name, input_dims=3, output_dims=2,
                              random_seed=seed)


# ---- params -----------------------------------------------------------------


def test_params_extend_the_parents_and_target_the_class():
  base = base_layer.BaseLayer.Params()
  p = _Affine.Params()
  assert {'name', 'dtype', 'random_seed'} <= {k for k, _ in base.IterParams()}
  for name, _ in base.IterParams():
    assert name in p, name
  assert 'input_dims' in p and 'input_dims' not in base
  assert p.target_cls is _Affine
  assert isinstance(p.Set(name='x').Instantiate(), _Affine)


def test_layer_keeps_a_frozen_copy_of_its_params():
  p = _Affine2x3()
  layer = p.Instantiate()
  p.output_dims = 7
  assert layer.p.output_dims == 2 and layer.params is layer.p
  with pytest.raises(Exception):
    layer.p.output_dims = 5
  assert layer.name == 'affine'


def test_init_rejects_non_params():
  with pytest.raises(TypeError, match=r'_Affine is built from params.*dict'):
    _Affine({'name': 'x'})


def test_init_rejects_missing_name():
  with pytest.raises(ValueError, match=r'_Affine: params.name must be set'):
    _Affine.Params().Instantiate()


# ---- children ---------------------------------------------------------------


def test_children_are_named_after_their_attribute_unless_named():
  parent = _Parent.Params().Set(name='parent').Instantiate()
  assert parent.child.name == 'child'
  assert [c.name for c in parent.stack] == ['stack_0', 'named']
  assert set(parent.children) == {'child', 'stack'}
  assert parent.children['stack'] == parent.stack
  # The parent owns its children's variables (optimizers and checkpoints
  # see them through the parent).
  assert len(parent.trainable_variables) == 6
  out = parent(tf.ones([4, 3]))
  assert out.shape == (4, 2)


def test_duplicate_child_names_are_rejected():
  parent = _Parent.Params().Set(name='parent').Instantiate()
  with pytest.raises(ValueError, match="parent: child 'child' already exists"):
    parent.CreateChild('child', _Affine.Params())
  with pytest.raises(ValueError, match="children 'stack' already exist"):
    parent.CreateChildren('stack', [_Affine.Params()])


# ---- variables --------------------------------------------------------------


def test_random_seed_makes_initialization_deterministic():
  a = _Affine2x3('a', seed=11).Instantiate()
  b = _Affine2x3('b', seed=11).Instantiate()
  c = _Affine2x3('c', seed=12).Instantiate()
  np.testing.assert_array_equal(a.w.numpy(), b.w.numpy())
  assert not np.allclose(a.w.numpy(), c.w.numpy())
  np.testing.assert_array_equal(a.b.numpy(), np.zeros(2))


def test_variables_with_different_names_get_different_initial_values():

  class TwoWeights(base_layer.BaseLayer):

    def __init__(self, params):
      super().__init__(params)
      self.u = self.CreateVariable('u', [4, 4])
      self.v = self.CreateVariable('v', [4, 4])

    def FProp(self, inputs):
      return inputs

  layer = TwoWeights.Params().Set(name='two', random_seed=3).Instantiate()
  assert not np.allclose(layer.u.numpy(), layer.v.numpy())
  again = TwoWeights.Params().Set(name='two', random_seed=3).Instantiate()
  np.testing.assert_array_equal(layer.v.numpy(), again.v.numpy())


def test_variables_live_on_the_device_active_at_instantiation():
  with tf.device('/CPU:3'):
    layer = _Affine2x3().Instantiate()
  assert layer.weights
  for v in layer.weights:
    assert v.value.device.endswith('CPU:3'), (v.name, v.value.device)
  # Calling elsewhere does not move them.
  with tf.device('/CPU:0'):
    layer(tf.ones([1, 3]))
  assert layer.w.value.device.endswith('CPU:3')


def test_create_variable_dtype_and_trainable():
  layer = _Affine2x3().Instantiate()
  extra = layer.CreateVariable('count', [], initializer='zeros',
                               trainable=False, dtype='int32')
  assert extra.dtype == 'int32'
  assert all(v is not extra for v in layer.trainable_variables)
  assert any(v is extra for v in layer.non_trainable_variables)
  assert layer.w.dtype == 'float32'


# ---- computation ------------------------------------------------------------


def test_fprop_not_overridden_raises_type_error_naming_the_class():
  layer = _NoFProp.Params().Set(name='bare').Instantiate()
  with pytest.raises(TypeError, match='_NoFProp must override FProp'):
    layer(tf.ones([1, 2]))


def test_call_passes_training_only_when_fprop_accepts_it():
  probe = _TrainingProbe.Params().Set(name='probe').Instantiate()
  probe(tf.ones([1, 2]), training=True)
  probe(tf.ones([1, 2]), training=False)
  assert probe.seen[-2:] == [True, False]
  # _Affine.FProp has no `training`; calling with it must not fail.
  affine = _Affine2x3().Instantiate()
  np.testing.assert_allclose(
      affine(tf.ones([1, 3]), training=True).numpy(),
      affine(tf.ones([1, 3])).numpy())


def test_default_fprop_meta_instantiates_and_traces():
  p = _Affine.Params().Set(name='affine', input_dims=3, output_dims=5)
  meta = _Affine.FPropMeta(p, (None, 3))
  assert meta.output_shape == (None, 5)
  assert meta.num_params == 3 * 5 + 5
  meta = _Affine.FPropMeta(p, (4, 3))
  assert meta.output_shape == (4, 5)
  assert meta.activation_bytes == 4.0 * 4 * 5
  assert meta.flops > 0


def test_compute_output_shape_uses_fprop_meta():

  class Declared(_Affine):

    @classmethod
    def FPropMeta(cls, p, input_shape):
      return base_layer.CostMeta(output_shape=(input_shape[0], 42))

  layer = Declared.Params().Set(name='declared').Instantiate()
  assert layer.compute_output_shape((7, 3)) == (7, 42)
  plain = _Affine2x3().Instantiate()
  assert tuple(plain.compute_output_shape((7, 3))) == (7, 2)


# ---- step context -----------------------------------------------------------


def _Seed(layer, salt=''):
  """The [2] seed a layer's draw named `salt` gets in the current step."""
  return base_layer.SaltedStepSeed(layer.SeedSalt(salt))


def test_salted_step_seed_only_inside_a_step_and_per_layer():
  a = _Affine2x3('a').Instantiate()
  b = _Affine2x3('b').Instantiate()
  assert _Seed(a) is None
  step = tf.constant([5, 9], tf.int32)
  with base_layer.StepSeed(step):
    assert base_layer.CurrentStepSeed() is step
    sa1 = _Seed(a).numpy()
    sa2 = _Seed(a).numpy()
    sb = _Seed(b).numpy()
    salted = _Seed(a, 'mask').numpy()
  assert base_layer.CurrentStepSeed() is None
  assert _Seed(a) is None
  np.testing.assert_array_equal(sa1, sa2)
  assert sa1.shape == (2,)
  assert not np.array_equal(sa1, sb)
  assert not np.array_equal(sa1, salted)
  with base_layer.StepSeed(tf.constant([6, 9], tf.int32)):
    assert not np.array_equal(_Seed(a).numpy(), sa1)
  # A fresh layer of the same name reproduces the seed (what a recomputed
  # forward relies on).
  with base_layer.StepSeed(step):
    np.testing.assert_array_equal(_Seed(_Affine2x3('a').Instantiate()).numpy(),
                                  sa1)


def test_seed_path_leaves_out_the_cells_and_sequential_containers():
  """What makes random draws independent of the number of partitions."""
  block = _Parent.Params().Set(name='block_0')
  one_cell = layers.SequentialLayer.Params().Set(name='cell0', sub=[block])
  nested = layers.SequentialLayer.Params().Set(name='cell3', sub=[
      layers.SequentialLayer.Params().Set(name='encoder', sub=[block])])
  for container in (one_cell, nested):
    layer = container.Instantiate()
    while isinstance(layer, layers.SequentialLayer):
      layer = layer.sub[0]
    assert layer.SeedPath() == 'block_0'
    assert layer.child.SeedPath() == 'block_0/child'
    assert [c.SeedPath() for c in layer.stack] == ['block_0/stack_0',
                                                   'block_0/named']
  assert _Parent.Params().Set(name='p').Instantiate().SeedPath() == 'p'
  with base_layer.StepSeed(tf.constant([4, 1], tf.int64)):
    seeds = [_Seed(c.Instantiate().sub[0].child).numpy()
             for c in (one_cell, one_cell.Copy().Set(name='cell1'))]
  np.testing.assert_array_equal(seeds[0], seeds[1])


def test_variable_paths_name_the_parents_but_not_the_containers():
  """Unique, readable names: `block_0/child/w`, not `w` once per block."""
  block = _Parent.Params().Set(name='block_0')
  want = ['block_0/child/w', 'block_0/child/b', 'block_0/stack_0/w',
          'block_0/stack_0/b', 'block_0/named/w', 'block_0/named/b']
  for container in (
      block,
      layers.SequentialLayer.Params().Set(name='cell0', sub=[block]),
      layers.SequentialLayer.Params().Set(name='cell3', sub=[
          layers.SequentialLayer.Params().Set(name='encoder', sub=[block])])):
    assert [v.path for v in container.Instantiate().variables] == want
  # Two levels of parents, and equally named children of two blocks.
  top = _Parent.Params().Set(name='top', child=_Parent.Params())
  paths = [v.path for v in top.Instantiate().variables]
  assert paths[:2] == ['top/child/child/w', 'top/child/child/b']
  assert len(set(paths)) == len(paths) == 10


def _Bits(shape, salt=7, step=(5, 0), offset=0, **kwargs):
  with base_layer.StepSeed(tf.constant(step, tf.int64), offset):
    return base_layer.StepRandomBits(shape, salt, **kwargs).numpy()


def test_step_random_bits_are_per_example_and_independent_of_the_split():
  assert base_layer.StepRandomBits([2, 3], 7) is None  # Outside a step.
  whole = _Bits([6, 2, 3])
  assert whole.dtype == np.uint32 and whole.shape == (6, 2, 3)
  np.testing.assert_array_equal(_Bits([6, 2, 3]), whole)
  # A micro-batch's bits depend on its offset, not on seed[1].
  np.testing.assert_array_equal(
      np.concatenate([_Bits([2, 2, 3], step=(5, 0), offset=0),
                      _Bits([4, 2, 3], step=(5, 1), offset=2)]), whole)
  for other in (_Bits([6, 2, 3], salt=8), _Bits([6, 2, 3], step=(6, 0)),
                _Bits([6, 2, 3], step=(5 + 2**32, 0))):
    assert (other != whole).mean() > 0.99
  # Without the offset (or per_example=False) they follow seed[1].
  assert not np.array_equal(_Bits([6, 2, 3], offset=None),
                            _Bits([6, 2, 3], step=(5, 1), offset=None))
  np.testing.assert_array_equal(
      _Bits([6, 2, 3], offset=0, per_example=False),
      _Bits([6, 2, 3], offset=None))
  shared = _Bits([1, 4], offset=3, shared_across_batch=True)
  np.testing.assert_array_equal(
      shared, _Bits([1, 4], offset=0, shared_across_batch=True))


def test_step_random_values_have_the_right_distribution():
  with base_layer.StepSeed(tf.constant([9, 0], tf.int64), 0):
    bits = base_layer.StepRandomBits([200, 500], 3).numpy()
    uniform = base_layer.StepUniform([200, 500], 3).numpy()
    normal = base_layer.StepNormal([200, 500], 3).numpy()
    keep = base_layer.StepKeepMask([200, 500], 0.3, 3).numpy()
    assert base_layer.StepKeepMask([2, 2], 1.0, 3).numpy().all()
  # Every bit is a fair coin, uniform covers (0, 1), normal is standard.
  per_bit = [((bits >> b) & 1).mean() for b in range(32)]
  np.testing.assert_allclose(per_bit, 0.5, atol=0.01)
  assert 0.0 < uniform.min() and uniform.max() < 1.0
  np.testing.assert_allclose(uniform.mean(), 0.5, atol=0.005)
  np.testing.assert_allclose([normal.mean(), normal.std()], [0.0, 1.0],
                             atol=0.01)
  np.testing.assert_allclose(keep.mean(), 0.3, atol=0.005)
  # Neighbouring examples and elements are uncorrelated.
  np.testing.assert_allclose(
      np.corrcoef(uniform[:-1].ravel(), uniform[1:].ravel())[0, 1], 0.0,
      atol=0.01)
  np.testing.assert_allclose(
      np.corrcoef(uniform[:, :-1].ravel(), uniform[:, 1:].ravel())[0, 1],
      0.0, atol=0.01)


def test_step_context_is_restored_after_errors_and_is_per_thread():
  with pytest.raises(RuntimeError):
    with base_layer.StepSeed(tf.constant([1, 2])):
      raise RuntimeError('boom')
  assert base_layer.CurrentStepSeed() is None
  seen = []
  with base_layer.StepSeed(tf.constant([1, 2])):
    thread = threading.Thread(
        target=lambda: seen.append(base_layer.CurrentStepSeed()))
    thread.start()
    thread.join()
  assert seen == [None]


def test_deferred_stats_are_routed_and_applied_once_per_layer():
  a = _Recorder.Params().Set(name='a').Instantiate()
  b = _Recorder.Params().Set(name='b').Instantiate()
  collector = base_layer.DeferredStatsCollector()
  assert base_layer.CurrentStatsCollector() is None
  with base_layer.CollectDeferredStats(collector):
    assert base_layer.CurrentStatsCollector() is collector
    for mb in range(3):
      base_layer.CurrentStatsCollector().Add(a, ('a', mb), 2.0)
    base_layer.CurrentStatsCollector().Add(b, ('b', 0), 4.0)
  assert base_layer.CurrentStatsCollector() is None
  assert len(collector) == 2
  updates = collector.Apply()
  assert sorted(updates) == ['update-a', 'update-b']
  assert a.applied == [[(2.0, ('a', 0)), (2.0, ('a', 1)), (2.0, ('a', 2))]]
  assert b.applied == [[(4.0, ('b', 0))]]
  # Records are consumed: a second Apply applies nothing.
  assert not collector.Apply() and len(collector) == 0
  assert len(a.applied) == 1


# ---- Keras integration ------------------------------------------------------


def test_trains_inside_keras_model_fit():
  keras.utils.set_random_seed(0)
  rng = np.random.default_rng(0)
  x = rng.normal(size=(64, 3)).astype(np.float32)
  y = x @ np.array([[1.0, -2.0], [0.5, 0.0], [0.0, 3.0]], np.float32)
  layer = _Affine2x3(seed=1).Instantiate()
  model = keras.Sequential([keras.Input((3,)), layer])
  model.compile(optimizer=keras.optimizers.SGD(0.1), loss='mse')
  history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False,
                      verbose=0)
  losses = history.history['loss']
  assert losses[-1] < 0.5 * losses[0], losses
  assert [v.path for v in model.trainable_variables] == [
      v.path for v in layer.trainable_variables]


def test_checkpoint_round_trip_restores_outputs(tmp_path):
  x = tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3))
  saved = _Parent.Params().Set(name='parent', random_seed=1).Instantiate()
  other = _Parent.Params().Set(name='parent', random_seed=2).Instantiate()
  want = saved(x).numpy()
  assert not np.allclose(other(x).numpy(), want)
  path = tf.train.Checkpoint(model=saved).write(str(tmp_path / 'ckpt'))
  tf.train.Checkpoint(model=other).read(path).assert_consumed()
  np.testing.assert_array_equal(other(x).numpy(), want)

