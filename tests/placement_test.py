"""placement: unplaced ops follow their tensors, and the audit sees the rest.

Logical CPU devices share one allocator, so these tests cannot measure where
memory lands; they check the graph instead: which device each op asks for.
"""

import keras
import numpy as np
import tensorflow as tf

from tfpipe import layers
from tfpipe import placement


def _Variables():
  with tf.device('/CPU:1'):
    small = tf.Variable(tf.ones([4, 4]), name='small')
  with tf.device('/CPU:2'):
    large = tf.Variable(tf.ones([64, 64]), name='large')
  return small, large


def _Devices(concrete, op_type):
  return [op.device for op in concrete.graph.get_operations()
          if op.type == op_type]


def test_unplaced_ops_follow_the_variable_they_work_on():
  small, large = _Variables()

  @tf.function
  def Update(g_small, g_large):
    with placement.FollowInputDevices():
      small.assign(small * 0.9 + g_small)
      large.assign(large * 0.9 + g_large)
  concrete = Update.get_concrete_function(tf.ones([4, 4]), tf.ones([64, 64]))
  muls = _Devices(concrete, 'Mul')
  assert [d.split(':')[-1] for d in muls] == ['1', '2'], muls
  assert not placement.Audit(Update, tf.ones([4, 4]), tf.ones([64, 64]))


def test_ops_follow_variables_captured_while_the_trace_runs():
  # Each read captures its variable after earlier ops asked for devices:
  # what placement keeps about captures and ops must stay current.
  variables = []
  for k in range(24):
    with tf.device(f'/CPU:{1 + k % 3}'):
      variables.append(tf.Variable(tf.ones([8, 8]) * k))

  @tf.function
  def Fn():
    with placement.FollowInputDevices():
      return [tf.reduce_sum(v * 2.0 + 1.0) for v in variables]
  concrete = Fn.get_concrete_function()
  expected = [str(1 + k % 3) for k in range(24)]
  for op_type in ('Mul', 'AddV2', 'Sum'):
    devices = _Devices(concrete, op_type)
    assert [d.split(':')[-1] for d in devices] == expected, (op_type, devices)


def test_explicit_device_scopes_inside_still_win():
  small, _ = _Variables()

  @tf.function
  def Fn():
    with placement.FollowInputDevices():
      with tf.device('/CPU:5'):
        return small * 2.0
  assert _Devices(Fn.get_concrete_function(), 'Mul')[0].endswith('CPU:5')


def test_scalars_do_not_pull_tensors_to_their_device():
  _, large = _Variables()
  with tf.device('/CPU:0'):
    scale = tf.Variable(0.5)

  @tf.function
  def Fn():
    with placement.FollowInputDevices():
      return scale * large  # The scalar is the first input.
  assert _Devices(Fn.get_concrete_function(), 'Mul')[0].endswith('CPU:2')


def test_audit_names_an_unplaced_update_and_ignores_scalars():
  _, large = _Variables()

  def Update(g):
    large.assign(large * 0.9 + g)   # No device: the default device would run it.
    return tf.reduce_sum(g) * 2.0   # A scalar result costs nothing there.
  findings = placement.Audit(Update, tf.TensorSpec([64, 64]))
  types = {f.op_type for f in findings}
  assert {'Mul', 'AddV2'} <= types, findings
  assert 'Sum' in types  # Reads the 64x64 input off its device.
  assert all('64' in f.tensor for f in findings)
  assert 'has no device' in str(findings[0])


def test_audit_looks_inside_called_functions_with_the_callers_device():
  _, large = _Variables()
  inner = tf.function(lambda x: x * 3.0)

  def Placed(x):
    with tf.device('/CPU:2'):
      return tf.reduce_sum(inner(x) + large)

  def Unplaced(x):
    return tf.reduce_sum(inner(x) + large)
  spec = tf.TensorSpec([64, 64])
  assert not placement.Audit(Placed, spec)
  found = placement.Audit(Unplaced, spec)
  assert any(f.op_type == 'Mul' and f.function != 'Unplaced' for f in found), (
      found)


def test_returned_tensors_stay_on_their_device_to_the_end_of_the_trace():
  _, large = _Variables()

  def Returns(place):
    if place:
      placement.FollowInputDevicesToTheEnd()
    with tf.device('/CPU:2'):
      return large * 2.0
  # tf.function's own output Identity would otherwise run on the default
  # device, copying the result there.
  assert [f.op_type for f in placement.Audit(lambda: Returns(False))] == [
      'Identity']
  assert not placement.Audit(lambda: Returns(True))


def test_keras_optimizer_update_is_placed_per_variable():
  small, large = _Variables()
  optimizer = keras.optimizers.Adam(1e-3)
  optimizer.build([small, large])
  for slot in optimizer.variables:
    if slot.shape == small.shape:
      assert slot.value.device.endswith('CPU:1'), slot.path
    elif slot.shape == large.shape:
      assert slot.value.device.endswith('CPU:2'), slot.path

  def Apply(g_small, g_large, place):
    if place:
      with placement.FollowInputDevices():
        # Arguments have no device in the trace; pin them to their variables'.
        g_small, g_large = placement.OnVariableDevices([g_small, g_large],
                                                       [small, large])
        optimizer.apply_gradients([(g_small, small), (g_large, large)])
    else:
      optimizer.apply_gradients([(g_small, small), (g_large, large)])
  specs = (tf.TensorSpec([4, 4]), tf.TensorSpec([64, 64]))
  assert not placement.Audit(lambda a, b: Apply(a, b, True), *specs)
  unplaced = placement.Audit(lambda a, b: Apply(a, b, False), *specs)
  assert len(unplaced) > 5, unplaced
  # And the placed update still computes Adam.
  before = large.numpy().copy()
  tf.function(lambda a, b: Apply(a, b, True))(tf.ones([4, 4]),
                                              tf.ones([64, 64]))
  np.testing.assert_allclose(large.numpy(), before - 1e-3, rtol=1e-4)


def test_audit_sees_one_op_gathering_every_device_s_gradients():
  """Keras' one-replica all-reduce is an IdentityN over every gradient."""
  variables = []
  for d in (1, 2, 3):
    with tf.device(f'/CPU:{d}'):
      variables.append(tf.Variable(tf.ones([32, 32]), name=f'v{d}'))
  optimizer = keras.optimizers.SGD(0.1)
  optimizer.build(variables)

  def Apply(grads, skip_all_reduce):
    with placement.FollowInputDevices():
      grads = placement.OnVariableDevices(grads, variables)
      if skip_all_reduce:
        with placement.NoSingleReplicaAllReduce(optimizer):
          optimizer.apply_gradients(zip(grads, variables))
      else:
        optimizer.apply_gradients(zip(grads, variables))
  specs = [tf.TensorSpec([32, 32])] * 3
  gathered = placement.Audit(lambda g: Apply(g, False), specs)
  assert [f.op_type for f in gathered] == ['IdentityN'], (
      gathered)
  assert gathered[0].kind == 'gathers'
  assert 'from 2 other devices' in str(gathered[0])
  assert not placement.Audit(lambda g: Apply(g, True), specs)
  tf.function(lambda g: Apply(g, True))([tf.ones([32, 32])] * 3)
  np.testing.assert_allclose(variables[2].numpy(), 0.9 * np.ones([32, 32]))
  assert not hasattr(optimizer, '__dict__') or (
      '_all_reduce_sum_gradients' not in optimizer.__dict__)


def test_tf_variable_unwraps_keras_variables():
  layer = layers.FCLayer.Params().Set(name='fc', input_dims=2,
                                      output_dims=2).Instantiate()
  for v in layer.trainable_variables:
    assert isinstance(placement.TfVariable(v), tf.Variable)
  plain = tf.Variable(1.0)
  assert placement.TfVariable(plain) is plain
