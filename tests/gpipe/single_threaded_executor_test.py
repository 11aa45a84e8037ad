"""The ops the single-threaded executor cannot run are found at trace time.

The layers here hold the constructs users' cells bring (control flow,
recurrent Keras layers, Python functions, integer and string side inputs,
nested tf.functions); remote_runtime_test.py trains cells of them on worker
processes.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.gpipe import pipelining_layer_test as plt_test
from tfpipe import layers
from tfpipe.gpipe import cell_runtime
from tfpipe.gpipe import single_threaded_executor

DIM = plt_test.DIM
TIME_STEPS = 3


class _Dense(keras.layers.Layer):
  """A DIM x DIM weight, seeded, that the subclasses apply their way."""

  def __init__(self, seed=0, **kwargs):
    super().__init__(**kwargs)
    self.seed = seed

  def build(self, input_shape):
    self.w = self.add_weight(
        shape=(DIM, DIM),
        initializer=keras.initializers.GlorotUniform(seed=self.seed))

  def Apply(self, x):
    return tf.tanh(tf.matmul(x, self.w))


class CondLayer(_Dense):
  """tf.cond on a tensor (the weights', so that micro-batches agree)."""

  def call(self, x):
    return tf.cond(tf.reduce_sum(self.w) > 0, lambda: self.Apply(x),
                   lambda: tf.sin(tf.matmul(x, self.w)))


class SwitchCaseLayer(_Dense):

  def call(self, x):
    branch = tf.cast(tf.reduce_sum(self.w) > 0, tf.int32)
    return tf.switch_case(branch, [lambda: tf.sin(tf.matmul(x, self.w)),
                                   lambda: self.Apply(x)])


class WhileLoopLayer(_Dense):
  """Applies the weight a tensor-valued number of times (3)."""

  def call(self, x):
    n = tf.size(tf.ones([3]))
    return tf.while_loop(lambda i, y: i < n,
                         lambda i, y: (i + 1, self.Apply(y)), (0, x))[1]


class MapFnLayer(_Dense):

  def call(self, x):
    return tf.map_fn(lambda row: self.Apply(row[tf.newaxis])[0], x)


class PyFunctionLayer(_Dense):

  def call(self, x):
    y = self.Apply(x)
    return tf.reshape(tf.py_function(lambda t: 2.0 * t, [y], tf.float32),
                      tf.shape(y))


class StringIndexLayer(_Dense):
  """Permutes the features by indices hashed from strings (int64 side
  input of a gather)."""

  def call(self, x):
    buckets = tf.strings.to_hash_bucket_fast(
        tf.constant(['a', 'b', 'c', 'd'][:DIM]), DIM)
    return tf.gather(self.Apply(x), tf.argsort(buckets), axis=1)


class InlinedFunctionLayer(_Dense):
  """Calls a tf.function (inlined before it runs)."""

  def call(self, x):
    return tf.function(self.Apply, autograph=False)(x)


class NoInlineFunctionLayer(_Dense):
  """Calls a tf.function that stays a call."""

  def call(self, x):
    return tf.function(self.Apply, autograph=False,
                       experimental_attributes={'_noinline': True})(x)


def Params(cls, name, seed):
  """KerasLayer params of one of the layers above."""
  return layers.KerasLayer.Params().Set(name=name, cls=cls,
                                        args={'seed': seed})


def RecurrentParams(cls, name, seed, return_sequences):
  """KerasLayer params of a seeded keras.layers.LSTM or GRU of DIM units."""
  return layers.KerasLayer.Params().Set(name=name, cls=cls, args=dict(
      units=DIM, return_sequences=return_sequences,
      kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
      recurrent_initializer=keras.initializers.Orthogonal(seed=seed + 1)))


def _LayerFunction(name):
  """(a Keras layer holding construct `name`, its input)."""
  if name in ('lstm', 'gru'):
    cls = keras.layers.LSTM if name == 'lstm' else keras.layers.GRU
    return cls(DIM), tf.random.stateless_normal(
        [plt_test.BATCH, TIME_STEPS, DIM], seed=[5, 6])
  return _LAYERS[name](seed=1), plt_test._Data()[0]  # pylint: disable=protected-access


_LAYERS = {'cond': CondLayer, 'switch_case': SwitchCaseLayer,
           'while_loop': WhileLoopLayer, 'map_fn': MapFnLayer,
           'py_function': PyFunctionLayer, 'string_index': StringIndexLayer,
           'inlined_function': InlinedFunctionLayer,
           'noinline_function': NoInlineFunctionLayer}
# Stateful ops (If, While, Case): the branches and bodies read a variable.
_REFUSED = {'cond': 'If', 'switch_case': 'Case', 'while_loop': 'While',
            'map_fn': 'While', 'lstm': 'While', 'gru': 'While',
            'py_function': 'EagerPyFunc', 'string_index': None,
            'inlined_function': None,
            'noinline_function': 'StatefulPartitionedCall of '}
# On a worker these hung (a Python function is now refused there:
# cell_program.py); in one process they run.
_HUNG = ('py_function', 'noinline_function')


def _Traced(name):
  """(the concrete function of a layer holding `name`, its input, the layer).

  A concrete function holds its variables weakly: the caller keeps the
  layer, or the next garbage collection deletes them.
  """
  layer, x = _LayerFunction(name)
  layer(x)  # Builds it.
  function = tf.function(layer, autograph=False).get_concrete_function(
      tf.TensorSpec(x.shape, x.dtype))
  return function, x, layer


@pytest.mark.parametrize('name', sorted(_REFUSED))
def test_unsupported_op_names_what_the_executor_refuses(name):
  function, _, _ = _Traced(name)
  found = single_threaded_executor.UnsupportedOp(function)
  if _REFUSED[name] is None:
    assert found is None
  else:
    assert found.startswith(_REFUSED[name]), found


def test_ops_of_called_functions_are_found():
  """A cond inside a tf.function the traced one calls, and a
  tf.numpy_function (a PyFunc op), directly and inside a called one."""
  inner = tf.function(lambda x: tf.cond(tf.reduce_sum(x) > 0, lambda: x,
                                        lambda: -x), autograph=False)
  outer = tf.function(lambda x: inner(x) + 1.0, autograph=False)
  spec = tf.TensorSpec([DIM], tf.float32)
  assert single_threaded_executor.UnsupportedOp(
      outer.get_concrete_function(spec)) == 'StatelessIf'
  numpy_function = tf.function(
      lambda x: tf.numpy_function(np.sin, [x], tf.float32), autograph=False)
  assert single_threaded_executor.UnsupportedOp(
      numpy_function.get_concrete_function(spec)) == 'PyFunc'
  # The Python functions alone (refused on another process), found in a
  # called function too; control flow is none.
  calls_numpy = tf.function(lambda x: numpy_function(x) + 1.0,
                            autograph=False)
  assert single_threaded_executor.PythonFunctionOp(
      calls_numpy.get_concrete_function(spec)) == 'PyFunc'
  assert single_threaded_executor.PythonFunctionOp(
      outer.get_concrete_function(spec)) is None


@pytest.mark.parametrize('name', sorted(
    n for n in _REFUSED if n not in _HUNG))
def test_the_executor_runs_what_is_accepted_and_refuses_the_rest(name):
  """What UnsupportedOp accepts gives the default executor's result on the
  single-threaded one; the control flow it refuses fails there. (A Python
  function and a nested call that stays one run there in one process; on
  a worker the call hung, and the Python function cannot run at all.)"""
  function, x, layer = _Traced(name)
  expected = function(x)
  with tf.experimental.function_executor_type(
      cell_runtime.SINGLE_THREADED_EXECUTOR):
    call = tf.function(lambda t: function(t), autograph=False)  # pylint: disable=unnecessary-lambda
    if _REFUSED[name]:
      with pytest.raises(tf.errors.FailedPreconditionError,
                         match='Single-threaded executor'):
        call(x)
    else:
      np.testing.assert_allclose(call(x), expected, rtol=1e-6)
  del layer  # Alive until here (see _Traced).

