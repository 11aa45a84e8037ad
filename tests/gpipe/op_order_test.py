"""One order for an action's ops: a single topological order, the same
values, and state touched in the order the program wrote."""

import numpy as np
import tensorflow as tf

from tfpipe.gpipe import op_order


def _Traced(chained):
  """A function whose input feeds 12 consumers (more than an edge set keeps
  in creation order); its ops, and the function."""
  recorded = {}

  @tf.function(autograph=False)
  def F(x):
    graph = tf.compat.v1.get_default_graph()
    start = len(graph.get_operations())
    with op_order.OneOrder(chained):
      h = tf.nn.relu(x)
      branches = [tf.matmul(h, h * float(i)) for i in range(12)]
      y = tf.add_n(branches)
    recorded['ops'] = graph.get_operations()[start:]
    return y

  x = tf.constant(np.random.RandomState(0).normal(size=(4, 4)), tf.float32)
  return F.get_concrete_function(x), recorded['ops'], x


def test_a_chained_function_has_one_order_and_the_same_values():
  function, ops, x = _Traced(chained=True)
  plain, plain_ops, _ = _Traced(chained=False)
  assert op_order.IsOneOrder(ops)
  assert not op_order.IsOneOrder(plain_ops)
  np.testing.assert_allclose(function(x), plain(x), rtol=1e-6)


def test_the_order_is_depth_first_from_the_ops_without_inputs():
  """Each op's consumers are walked in creation order; in the reverse post
  order the walk's first branch runs last, as TensorFlow's own walk."""
  with tf.Graph().as_default() as graph:
    x = tf.random.stateless_uniform([], seed=[1, 2], name='x')
    first = tf.multiply(x, 2.0, name='first')
    second = tf.add(x, 1.0, name='second')
    after_first = tf.multiply(first, 3.0, name='after_first')
    tf.add(after_first, second, name='out')
  names = [op.name for op in op_order.Order(graph.get_operations())]
  compute = [n for n in names if n in
             ('x', 'first', 'second', 'after_first', 'out')]
  assert compute == ['x', 'second', 'first', 'after_first', 'out']
  assert names.index('first') + 1 == names.index('after_first')


def test_constants_and_variable_reads_float_so_fusions_stay_whole():
  """A dense layer's matmul, bias add and relu keep no control edge, which
  would keep Grappler from fusing them: the reads of its weights and the
  constants, which allocate nothing, are left out of the chain."""
  w = tf.Variable(tf.ones([4, 4]))
  b = tf.Variable(tf.zeros([4]))

  recorded = {}

  @tf.function(autograph=False)
  def F(x):
    with op_order.OneOrder():
      h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w), b))
      y = tf.nn.relu(tf.nn.bias_add(tf.matmul(h, w), b)) * 2.0
    recorded['ops'] = tf.compat.v1.get_default_graph().get_operations()
    return y

  F.get_concrete_function(tf.ones([2, 4]))
  layer_ops = [op for op in recorded['ops'] if op.type in (
      'MatMul', 'BiasAdd', 'Relu', 'ReadVariableOp')]
  assert len(layer_ops) == 10  # Each variable is read by each layer.
  assert not any(op.control_inputs for op in layer_ops)
  assert op_order.IsOneOrder(recorded['ops'])


def test_state_is_touched_in_the_order_the_program_wrote():
  """A read of a variable created after its assignment, with no data path
  between them: a depth-first order alone would read first, and
  tf.function's automatic control dependencies (assignment before read)
  would close a cycle with the chain."""
  v = tf.Variable(0.0)

  @tf.function(autograph=False)
  def F():
    with op_order.OneOrder():
      v.assign(tf.constant(2.0))
      return v.read_value() + tf.constant(3.0)

  assert float(F()) == 5.0
  assert float(v) == 2.0


def test_eagerly_nothing_is_chained():
  with op_order.OneOrder():
    y = tf.constant(1.0) + 1.0
  assert float(y) == 2.0
