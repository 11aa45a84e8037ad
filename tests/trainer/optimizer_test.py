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
    optimizer.ApplyGradients(opt_chained, zip(grads, chained), clip_norm=0.5,
                             fused=False)

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
    if op.type.startswith(('Assign', 'ResourceApply')) and op.inputs:
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


def _Variables(dtype):
  """Variables on two devices, with their gradients for three steps."""
  rng = np.random.default_rng(0)
  shapes = [[6, 4], [4], [3, 5]]
  devices = ['/device:CPU:0', '/device:CPU:0', '/device:CPU:1']
  def Make():
    variables = []
    for shape, device in zip(shapes, devices):
      with tf.device(device):
        variables.append(tf.Variable(
            np.random.default_rng(len(variables)).normal(size=shape),
            dtype=dtype))
    return variables
  steps = [[tf.constant(rng.normal(size=s), dtype) for s in shapes]
           for _ in range(3)]
  return Make, steps


def _Train(make_optimizer, dtype, fused, clip_norm=0.5):
  """The variables after three traced updates, and the update's op types."""
  make, steps = _Variables(dtype)
  variables = make()
  opt = make_optimizer()

  @tf.function
  def Step(gradients):
    optimizer.ApplyGradients(opt, zip(gradients, variables),
                             clip_norm=clip_norm, fused=fused)
  for gradients in steps:
    Step(gradients)
  graph = Step.get_concrete_function(steps[0]).graph
  return [v.numpy() for v in variables], graph


_KERAS_OPTIMIZERS = {
    'adam': lambda: keras.optimizers.Adam(0.1),
    'adam_schedule': lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.5)),
    'sgd_momentum': lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    'sgd_nesterov': lambda: keras.optimizers.SGD(0.1, momentum=0.9,
                                                 nesterov=True),
    'sgd': lambda: keras.optimizers.SGD(0.1),
}
_KERNELS = {'adam': 'ResourceApplyAdam', 'adam_schedule': 'ResourceApplyAdam',
            'sgd_momentum': 'ResourceApplyKerasMomentum',
            'sgd_nesterov': 'ResourceApplyKerasMomentum',
            'sgd': 'ResourceApplyGradientDescent'}


@pytest.mark.parametrize('name', sorted(_KERAS_OPTIMIZERS))
@pytest.mark.parametrize('dtype', ['float32', 'float64'])
def test_fused_kernels_update_as_keras_does(name, dtype):
  make = _KERAS_OPTIMIZERS[name]
  fused, graph = _Train(make, dtype, fused=True)
  keras_own, _ = _Train(make, dtype, fused=False)
  kernels = [op for op in graph.get_operations()
             if op.type == _KERNELS[name]]
  assert len(kernels) == 3  # One per variable,
  assert not [op for op in graph.get_operations()  # and no Keras update op.
              if op.type in ('AssignAddVariableOp', 'AssignSubVariableOp')]
  if dtype == 'float64' or name.startswith('sgd'):
    # The same formula, rounded the same way up to the kernel's own
    # evaluation order: a few units in the last place.
    rtol = 1e-12 if dtype == 'float64' else 1e-6
    for a, b in zip(fused, keras_own):
      np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol)
  else:
    # Float32 Adam: the kernel's 1 - beta_2 is 1.3e-5 below Keras' 0.001,
    # so a step's change differs by up to 1e-5 of itself (here ~0.1).
    for a, b in zip(fused, keras_own):
      np.testing.assert_allclose(a, b, rtol=0, atol=3 * 0.1 * 1e-5)


@pytest.mark.parametrize('make', [
    lambda: keras.optimizers.Adam(0.1, amsgrad=True),
    lambda: keras.optimizers.RMSprop(0.1),
    lambda: type('MyAdam', (keras.optimizers.Adam,), {})(0.1),
], ids=['amsgrad', 'rmsprop', 'subclass'])
def test_other_updates_keep_the_optimizers_own_ops(make):
  fused, graph = _Train(make, 'float32', fused=True)
  keras_own, _ = _Train(make, 'float32', fused=False)
  assert not [op for op in graph.get_operations()
              if op.type.startswith('ResourceApply')]
  for a, b in zip(fused, keras_own):
    np.testing.assert_array_equal(a, b)


def test_a_sparse_gradient_keeps_keras_update_and_others_fuse():
  with tf.device('/device:CPU:1'):
    table = tf.Variable(tf.ones([5, 2]))
    dense = tf.Variable(tf.ones([2]))
  opt = keras.optimizers.Adam(0.1)
  sparse = tf.IndexedSlices(tf.ones([1, 2]), tf.constant([3]),
                            tf.constant([5, 2]))

  @tf.function
  def Step():
    optimizer.ApplyGradients(opt, [(sparse, table), (tf.ones([2]), dense)])
  Step()
  types = [op.type for op in Step.get_concrete_function().graph
           .get_operations()]
  assert types.count('ResourceApplyAdam') == 1
  # Keras densifies the sparse gradient: row 3 moves by Adam's first step.
  np.testing.assert_allclose(table.numpy()[3], [0.9, 0.9], rtol=1e-5)
  np.testing.assert_allclose(dense.numpy(), [0.9, 0.9], rtol=1e-5)


def test_an_optimizer_built_in_the_trace_keeps_each_slot_with_its_variable():
  # Keras colocates a slot with its variable only when built eagerly;
  # built inside the trace, every slot went to the default device.
  with tf.device('/device:CPU:1'):
    variable = tf.Variable(tf.ones([3]))
  opt = keras.optimizers.Adam(0.1)

  @tf.function
  def Step():
    optimizer.ApplyGradients(opt, [(tf.ones([3]), variable)])
  Step()
  slots = [v for v in opt.variables if v.shape == variable.shape]
  assert len(slots) == 2
  for slot in slots:
    assert slot.value.device == variable.device


def test_a_kernel_is_used_only_where_tensorflow_has_it():
  # A device type without the kernel for a dtype keeps Keras' ops, which
  # every device runs.
  assert optimizer._HasKernel('ResourceApplyAdam', '/device:CPU:0',
                              tf.float32)
  assert not optimizer._HasKernel('ResourceApplyAdam', '/device:CPU:0',
                                  tf.int32)
  assert not optimizer._HasKernel('ResourceApplyAdam',
                                  '/job:worker/task:1/device:NOSUCH:0',
                                  tf.float32)
