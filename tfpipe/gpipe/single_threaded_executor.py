"""What TensorFlow's single-threaded executor cannot run, found at trace time.

A worker process's cell runs each action as a call on the single-threaded
executor (cell_runtime.py, issue 23). That executor runs a function's ops
one after another in one topological order, with no frames and no dead
tensors, so it refuses some graphs, and when it does the step fails only
on worker processes, long after tracing, often as a bare CancelledError
that names nothing of the user's model:

  * control flow: tf.cond, tf.switch_case, tf.while_loop and tf.map_fn,
    and so Keras' LSTM and GRU (a while loop in the TensorFlow backend),
    trace to functional If/Case/While ops, which the function
    runtime lowers to Switch/Merge/Enter/Exit/NextIteration before the
    executor sees them (or tf.compat.v1 control flow made them); the
    executor rejects those;
  * Python functions (tf.py_function, tf.numpy_function): on a worker the
    step hung instead of failing with TensorFlow's error that the Python
    function is not in that process;
  * a call that stays a call (a tf.function with the `_noinline`
    attribute) on the default executor: inside a single-threaded call it
    needs a free thread of the worker's inter-op pool, which the worker's
    other single-threaded calls may all hold, and the step hung. (Calls
    of other tf.functions are inlined before they run.)

A call whose function (or a function it calls: branches, loop bodies,
nested tf.functions) holds such an op keeps the default executor. What the
executor accepts was checked on worker processes for those constructs and
for integer and string side inputs (tf.strings hashing, tf.gather) and
nested tf.function calls, inlined or not
(tests/gpipe/remote_runtime_test.py).
"""

import weakref

# Functional control flow (lowered to the low-level ops before execution),
# the low-level control-flow ops themselves, and Python functions. (The
# executor also refuses reference-typed outputs, which a TF 2 function
# cannot hold.)
_REFUSED_OPS = frozenset([
    'If', 'StatelessIf', '_If', 'Case', 'StatelessCase', 'While',
    'StatelessWhile', '_While', 'Switch', '_SwitchN', 'Merge', 'Enter',
    'Exit', 'NextIteration', 'LoopCond',
    'PyFunc', 'PyFuncStateless', 'EagerPyFunc'])

_CALL_OPS = frozenset(['PartitionedCall', 'StatefulPartitionedCall'])
_SINGLE_THREADED = b'SINGLE_THREADED_EXECUTOR'

_verdicts = weakref.WeakKeyDictionary()  # concrete function -> op type or ''


def UnsupportedOp(function):
  """What in `function` the executor cannot run, or None.

  Args:
    function: a concrete function; the functions it calls (its graph's
      library) are searched too.

  Returns:
    The op's type, e.g. 'While', or for a call on the default executor
    that stays a call, e.g. "StatefulPartitionedCall of 'f' (_noinline)".
  """
  if function not in _verdicts:
    _verdicts[function] = _Find(function.graph.as_graph_def()) or ''
  return _verdicts[function] or None


def _Find(graph_def):
  nodes = list(graph_def.node)
  noinline = set()
  for called in graph_def.library.function:
    nodes.extend(called.node_def)
    if called.attr['_noinline'].b:
      noinline.add(called.signature.name)
  for node in nodes:
    if node.op in _REFUSED_OPS:
      return node.op
    if (node.op in _CALL_OPS and node.attr['f'].func.name in noinline and
        node.attr['executor_type'].s != _SINGLE_THREADED):
      return f"{node.op} of {node.attr['f'].func.name!r} (_noinline)"
  return None
