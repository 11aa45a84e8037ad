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
    function is not in that process. They cannot run on a worker on any
    executor, so a cell holding one on another process's device is
    refused when its functions are traced (cell_program.py,
    PythonFunctionOp);
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

# Python functions: their ops call back into the Python of the process that
# traced them.
PYTHON_FUNCTION_OPS = frozenset(['PyFunc', 'PyFuncStateless', 'EagerPyFunc'])

# Functional control flow (lowered to the low-level ops before execution),
# the low-level control-flow ops themselves, and Python functions. (The
# executor also refuses reference-typed outputs, which a TF 2 function
# cannot hold.)
_REFUSED_OPS = frozenset([
    'If', 'StatelessIf', '_If', 'Case', 'StatelessCase', 'While',
    'StatelessWhile', '_While', 'Switch', '_SwitchN', 'Merge', 'Enter',
    'Exit', 'NextIteration', 'LoopCond']) | PYTHON_FUNCTION_OPS

_CALL_OPS = frozenset(['PartitionedCall', 'StatefulPartitionedCall'])
_SINGLE_THREADED = b'SINGLE_THREADED_EXECUTOR'

# concrete function -> (unsupported op or '', Python function op or '')
_verdicts = weakref.WeakKeyDictionary()


def UnsupportedOp(function):
  """What in `function` the executor cannot run, or None.

  Args:
    function: a concrete function; the functions it calls (its graph's
      library) are searched too.

  Returns:
    The op's type, e.g. 'While', or for a call on the default executor
    that stays a call, e.g. "StatefulPartitionedCall of 'f' (_noinline)".
  """
  return _Verdicts(function)[0] or None


def PythonFunctionOp(function):
  """The type of a tf.py_function's or tf.numpy_function's op in `function`
  or a function it calls, e.g. 'EagerPyFunc', or None.

  Such an op runs only in the process that traced it (cell_program.py
  refuses it on another process's device), found by the same walk.
  """
  return _Verdicts(function)[1] or None


def _Verdicts(function):
  """Both verdicts of `function`, from one walk of its graph, cached."""
  if function not in _verdicts:
    graph_def = function.graph.as_graph_def()
    nodes = _Nodes(graph_def)
    python_ops = [n.op for n in nodes if n.op in PYTHON_FUNCTION_OPS]
    _verdicts[function] = (_Find(graph_def, nodes) or '',
                           python_ops[0] if python_ops else '')
  return _verdicts[function]


def _Nodes(graph_def):
  """The graph's nodes and those of every function in its library."""
  nodes = list(graph_def.node)
  for called in graph_def.library.function:
    nodes.extend(called.node_def)
  return nodes


def _Find(graph_def, nodes):
  noinline = {called.signature.name for called in graph_def.library.function
              if called.attr['_noinline'].b}
  for node in nodes:
    if node.op in _REFUSED_OPS:
      return node.op
    if (node.op in _CALL_OPS and node.attr['f'].func.name in noinline and
        node.attr['executor_type'].s != _SINGLE_THREADED):
      return f"{node.op} of {node.attr['f'].func.name!r} (_noinline)"
  return None
