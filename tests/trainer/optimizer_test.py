"""Tests of learning-rate schedules, gradient clipping and optimizer building."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfpipe.trainer import optimizer


def _Schedule(lr=2.0, **kwargs):
  p = optimizer.LearningRateScheduleParams().Set(**kwargs)
  return optimizer.WarmupDecaySchedule(lr, p)


def _Values(schedule, steps):
  return np.array([float(schedule(s)) for s in steps])


def test_constant_with_linear_warmup():
  s = _Schedule(warmup_steps=4)
  np.testing.assert_allclose(_Values(s, [0, 1, 3, 4, 100]),
                             [0.5, 1.0, 2.0, 2.0, 2.0], rtol=1e-6)


def test_cosine_decay():
  s = _Schedule(warmup_steps=10, decay='cosine', decay_steps=100,
                min_ratio=0.1)
  steps = [9, 10, 35, 60, 110, 500]
  want = []
  for step in steps:
    frac = min(max(step - 10, 0) / 100, 1.0)
    want.append(2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))))
  np.testing.assert_allclose(_Values(s, steps), want, rtol=1e-5)


def test_exponential_decay():
  s = _Schedule(decay='exponential', decay_steps=10, decay_rate=0.5,
                min_ratio=0.2)
  np.testing.assert_allclose(_Values(s, [0, 10, 15, 20, 100]),
                             [2.0, 1.0, 2 * 0.5**1.5, 0.5, 0.4], rtol=1e-5)


def test_inverse_sqrt_decay():
  s = _Schedule(warmup_steps=4, decay='inverse_sqrt')
  np.testing.assert_allclose(_Values(s, [1, 3, 15, 63]),
                             [1.0, 2.0, 1.0, 0.5], rtol=1e-6)


def test_bad_schedule_names_the_param():
  with pytest.raises(ValueError, match=r'lr_schedule.decay=.linear'):
    _Schedule(decay='linear')


def test_clip_by_global_norm():
  grads = [tf.constant([3.0, 0.0]), tf.constant([[4.0]])]
  clipped, norm = optimizer.ClipGradients(grads, 1.0)
  assert float(norm) == pytest.approx(5.0)
  np.testing.assert_allclose(clipped[0], [0.6, 0.0], rtol=1e-6)
  np.testing.assert_allclose(clipped[1], [[0.8]], rtol=1e-6)
  unclipped, norm = optimizer.ClipGradients(grads, 0.0)
  assert float(norm) == pytest.approx(5.0)
  np.testing.assert_allclose(unclipped[0], [3.0, 0.0])
  small, _ = optimizer.ClipGradients(grads, 10.0)
  np.testing.assert_allclose(small[1], [[4.0]])


def test_build_optimizers():
  p = optimizer.OptimizerParams()
  assert isinstance(optimizer.BuildOptimizer(p, 0.1), keras.optimizers.Adam)
  sgd = optimizer.BuildOptimizer(p.Copy().Set(type='sgd', momentum=0.5), 0.1)
  assert isinstance(sgd, keras.optimizers.SGD)
  assert sgd.momentum == 0.5
  rms = optimizer.BuildOptimizer(p.Copy().Set(type='rmsprop'), 0.1)
  assert isinstance(rms, keras.optimizers.RMSprop)
  with pytest.raises(ValueError, match=r"optimizer.type='adagrad'"):
    optimizer.BuildOptimizer(p.Copy().Set(type='adagrad'), 0.1)


def test_sgd_step_uses_scheduled_rate():
  var = tf.Variable([1.0])
  opt = optimizer.BuildOptimizer(
      optimizer.OptimizerParams().Set(type='sgd', momentum=0.0),
      _Schedule(lr=1.0, warmup_steps=2))
  opt.apply_gradients([(tf.constant([1.0]), var)])
  np.testing.assert_allclose(var.numpy(), [0.5])  # lr = 1 * (0+1)/2.
  opt.apply_gradients([(tf.constant([1.0]), var)])
  np.testing.assert_allclose(var.numpy(), [-0.5])


def _Ancestors(op):
  seen, stack = set(), [op]
  while stack:
    node = stack.pop()
    for parent in [t.op for t in node.inputs] + list(node.control_inputs):
      if parent not in seen:
        seen.add(parent)
        stack.append(parent)
  return seen


def test_apply_gradients_updates_a_devices_variables_one_after_another():
  """Each device's variables are updated one after another (so its update
  peaks at one variable's working set, every step), other devices' at the
  same time, and the values are the optimizer's own."""
  devices = ['/device:CPU:0', '/device:CPU:1']
  shapes = [[3, 4], [4], [4, 2]]
  def Make():
    variables = []
    for i, shape in enumerate(shapes):
      with tf.device(devices[0]):
        variables.append(tf.Variable(tf.ones(shape) * (i + 1)))
    with tf.device(devices[1]):
      variables.append(tf.Variable(tf.ones([5])))
    return variables
  grads = [tf.fill(v.shape, 0.1 * (i + 1)) for i, v in enumerate(Make())]
  chained, plain = Make(), Make()
  opt_chained = keras.optimizers.Adam(learning_rate=0.1)
  opt_plain = keras.optimizers.Adam(learning_rate=0.1)

  @tf.function
  def Chained():
    optimizer.ApplyGradients(opt_chained, zip(grads, chained), clip_norm=0.5)

  @tf.function
  def Plain():
    clipped, _ = optimizer.ClipGradients(grads, 0.5)
    opt_plain.apply_gradients(zip(clipped, plain))
  for _ in range(2):
    Chained()
    Plain()
  for a, b in zip(chained, plain):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)
  assert 'update_step' not in vars(opt_chained)  # Restored.

  graph = Chained.get_concrete_function().graph
  writes = {}  # variable index -> its update's writes
  handles = {id(v.handle): i for i, v in enumerate(chained)}
  captured = {id(internal): handles[id(external)]
              for external, internal in graph.captures
              if id(external) in handles}
  for op in graph.get_operations():
    if op.type.startswith('Assign') and op.inputs:
      handle = op.inputs[0]
      index = captured.get(id(handle))
      if index is not None:
        writes.setdefault(index, []).append(op)
  assert sorted(writes) == [0, 1, 2, 3]
  for later in (1, 2):  # On device 0, after the variable before it.
    ancestors = set().union(*(_Ancestors(op) for op in writes[later]))
    assert set(writes[later - 1]) & ancestors, later
  ancestors = set().union(*(_Ancestors(op) for op in writes[3]))
  assert not any(set(writes[i]) & ancestors for i in range(3))  # Device 1.
