"""Placement: every op that works on a cell's tensors runs on that cell's device.

A pipeline exists to spread a model over several accelerators' separate
memories. An op left without a device (an optimizer update, a gradient
clip, an accumulation) runs on the default device, GPU:0, and pulls every
tensor it reads there: an unplaced Adam update puts all of a model's
weights, gradients and slots on GPU:0, which runs out of memory while the
other devices hold little (benchmarks/device_memory.py; benchmarks/RESULTS.md
has the measurements). Logical CPU devices share one allocator, so a CPU
test cannot see this by measuring memory. This module gives two tools:

  FollowInputDevices()  a scope for code tfpipe does not write (a Keras
      optimizer's update, gradient clipping, a user's loss): inside a traced
      function, every op created without a device goes to the device of its
      largest input (a variable counts as the largest), so per-variable
      work stays next to its variable. Small shared results (a global norm,
      the learning rate) cross devices as scalars.
  Audit(fn, *args)  traces `fn` and lists the ops that would run on the
      default device while reading or producing a floating-point tensor of
      more than one element: the ones that cost memory where they run.
      Nested functions (cell functions, cond branches) are audited with
      their caller's device as the default, which is how TensorFlow places
      them.
"""

import contextlib
import dataclasses
import itertools
from typing import List

import tensorflow as tf

from tfpipe import device_names


def _Captures(graph):
  """{id(internal placeholder): external tensor} of a FuncGraph's captures.

  Kept up to date by appending what was captured since the last call:
  `graph.captures` rebuilds its whole list after every new capture, and an
  optimizer update captures three resources per variable, so asking it once
  per op made tracing a 1000-variable update quadratic (seconds per
  hundred variables).
  """
  function_captures = getattr(graph, '_function_captures', None)
  internal = getattr(function_captures, 'by_val_internal', None)
  external = getattr(function_captures, 'by_val_external', None)
  cached = getattr(graph, '_tfpipe_captures', None)
  if not isinstance(internal, dict) or not isinstance(external, dict):
    captures = list(getattr(graph, 'captures', []) or [])
    if cached is None or cached[0] != len(captures):
      cached = [len(captures), {id(i): e for e, i in captures}]
      graph._tfpipe_captures = cached  # pylint: disable=protected-access
    return cached[1]
  if cached is None or cached[0] > len(internal):  # New, or some removed.
    cached = [0, {}]
    graph._tfpipe_captures = cached  # pylint: disable=protected-access
  if cached[0] < len(internal):  # The newest captures are the last keys.
    for key in itertools.islice(reversed(internal),
                                len(internal) - cached[0]):
      if key in external:
        cached[1][id(internal[key])] = external[key]
    cached[0] = len(internal)
  return cached[1]


def TensorDevice(t, depth=0):
  """The device a graph tensor lives on, if the graph says so; else None.

  Follows an op's own device, its colocation group, the variable behind a
  resource input (resource ops always run with their resource), and the
  external tensor behind a captured placeholder.
  """
  if depth > 8:
    return None
  if isinstance(t, tf.Tensor) and not hasattr(t, 'op'):
    return t.device or None  # An eager tensor.
  op = t.op
  if op.device:
    return op.device
  graph = op.graph
  if op.type == 'Placeholder':
    external = _Captures(graph).get(id(t))
    if external is None:
      return None
    if not hasattr(external, 'op'):
      return external.device or None
    return TensorDevice(external, depth + 1)
  # An unplaced op's answer depends only on ops made before it, so it is
  # kept: without that, tracing walked the same inputs again for every op
  # that read them (an update's ops with hundreds of inputs, its variables'
  # reads).
  known = getattr(graph, '_tfpipe_op_devices', None)
  if known is None:
    known = graph._tfpipe_op_devices = {}  # pylint: disable=protected-access
  if id(op) in known:
    return known[id(op)]
  device, searched = _UnplacedOpDevice(op, graph, depth)
  if device or not searched:
    known[id(op)] = device
  return device


def _UnplacedOpDevice(op, graph, depth):
  """(device of an unplaced op from its colocation group or its resource
  inputs, or None; whether that needed a search that may have been cut
  short by the depth limit)."""
  searched = False
  for group in op.colocation_groups():
    name = group.decode()[len('loc:@'):] if isinstance(group, bytes) else (
        group[len('loc:@'):])
    if name == op.name:
      continue
    try:
      other = graph.get_operation_by_name(name)
    except (KeyError, ValueError):
      continue
    if other.outputs:
      searched = True
      device = TensorDevice(other.outputs[0], depth + 1)
      if device:
        return device, searched
  for inp in op.inputs:
    if inp.dtype == tf.resource:
      searched = True
      device = TensorDevice(inp, depth + 1)
      if device:
        return device, searched
  return None, searched


def _NumElements(t):
  if t.dtype == tf.resource:
    return float('inf')
  shape = t.shape
  if shape.rank is None or not shape.is_fully_defined():
    return float('inf') if shape.rank else 1
  return shape.num_elements()


def _LargestInputDevice(op):
  best, best_size = None, -1.0
  for t in op.inputs:
    device = TensorDevice(t)
    if device is None:
      continue
    size = _NumElements(t)
    if size > best_size:
      best, best_size = device, size
  return best


@contextlib.contextmanager
def FollowInputDevices():
  """Inside a traced function, unplaced ops run where their largest input is.

  Explicit `tf.device` scopes inside still win. Eagerly this does nothing:
  eager ops already run where TensorFlow places their inputs' kernels, and
  tfpipe traces the code it wraps in this scope.
  """
  if tf.executing_eagerly():
    yield
    return
  graph = tf.compat.v1.get_default_graph()
  with graph.device(_FollowInputs):
    yield


def FollowInputDevicesToTheEnd():
  """Inside a traced function: FollowInputDevices for the rest of the trace.

  Why not a `with` scope: tf.function wraps every returned tensor in an
  Identity created after the Python function returns, outside any scope
  the function opened; unplaced, those run on the default device, so
  returning the gradients of a K-device pipeline would copy all of them to
  GPU:0. The device function pushed here stays on the function's graph
  (which is discarded after tracing) and so also places those identities
  with their inputs. Eagerly this does nothing.
  """
  if tf.executing_eagerly():
    return
  graph = tf.compat.v1.get_default_graph()
  graph._add_device_to_stack(_FollowInputs)  # pylint: disable=protected-access


def _FollowInputs(op):
  if op.device:
    return op.device
  return _LargestInputDevice(op) or ''


@contextlib.contextmanager
def NoSingleReplicaAllReduce(optimizer):
  """Keras' optimizer update without its one-replica all-reduce.

  Keras' TensorFlow optimizer passes the gradients through the replica
  context's all-reduce even without a tf.distribute strategy, where it is
  an identity, written as one IdentityN over every gradient: an op that one
  device has to run, so every gradient of the pipeline is copied there
  (benchmarks/device_memory.py measures it, benchmarks/RESULTS.md). Outside a
  strategy nothing is reduced, so the step skips it; under a strategy it
  runs as Keras wrote it.
  """
  targets = [optimizer]
  inner = getattr(optimizer, 'inner_optimizer', None)
  if inner is not None:
    targets.append(inner)
  targets = [o for o in targets if hasattr(o, '_all_reduce_sum_gradients')]
  if tf.distribute.has_strategy() or not targets:
    yield
    return
  for o in targets:
    o._all_reduce_sum_gradients = _Unreduced  # pylint: disable=protected-access
  try:
    yield
  finally:
    for o in targets:
      del o._all_reduce_sum_gradients  # pylint: disable=protected-access


def _Unreduced(grads_and_vars):
  return list(grads_and_vars)


def TfVariable(v):
  """The tf.Variable behind a Keras variable (tapes watch, and devices hold,
  that one); a tf.Variable itself."""
  value = getattr(v, 'value', None)
  return value if isinstance(value, tf.Variable) else v


def OnVariableDevices(tensors, variables):
  """Pins each tensor to its variable's device (None stays None).

  For a traced function's arguments (e.g. gradients handed to an update
  step): the trace cannot know where an argument lives, so ops computed
  from it could not follow it; an Identity on the variable's device, where
  the gradient already is, costs nothing and gives them the device.
  """
  result = []
  for t, v in zip(tensors, variables):
    if t is None:
      result.append(None)
      continue
    with tf.device(TfVariable(v).device):
      result.append(tf.identity(t))
  return result


@dataclasses.dataclass
class Finding:
  """An op that would run where it should not, with what it touches.

  kind 'unplaced': no device, so the default device runs it; kind
  'gathers': one device receives big tensors from several others.
  """
  op_name: str
  op_type: str
  function: str
  tensor: str
  kind: str = 'unplaced'

  def __str__(self):
    if self.kind == 'gathers':
      return (f'{self.op_type} {self.op_name!r} in {self.function} takes '
              f'{self.tensor}')
    return (f'{self.op_type} {self.op_name!r} in {self.function} has no '
            f'device and touches {self.tensor}')


def _IsBigFloat(t):
  dtype = tf.as_dtype(t.dtype)
  if not (dtype.is_floating or dtype.is_complex):
    return False
  return _NumElements(t) > 1


def _FunctionGraph(graph, name):
  while graph is not None:
    functions = getattr(graph, '_functions', {})
    if name in functions and getattr(functions[name], 'graph', None):
      return functions[name].graph
    graph = getattr(graph, 'outer_graph', None)
  return None


def _CalledFunctions(op):
  names = []
  for key, value in op.node_def.attr.items():
    del key
    if value.HasField('func'):
      names.append(value.func.name)
    elif value.HasField('list'):
      names.extend(f.name for f in value.list.func)
  return names


_IGNORED_TYPES = ('Placeholder', 'NoOp', 'Const')
_CONTROL_FLOW_TYPES = ('If', 'StatelessIf', 'While', 'StatelessWhile', 'Case',
                       'StatelessCase')


def _AuditGraph(graph, default_device, where, findings, seen):
  for op in graph.get_operations():
    device = (op.device or
              (TensorDevice(op.outputs[0]) if op.outputs else None) or
              _ResourceDevice(op) or default_device)
    # A called function's unplaced ops run on the call's device. Control
    # flow (cond, while) is inlined into its graph instead, where an
    # unplaced op goes to the default device: its body must place itself.
    inherited = None if op.type in _CONTROL_FLOW_TYPES else device
    for name in _CalledFunctions(op):
      body = _FunctionGraph(graph, name)
      if body is not None and (name, inherited) not in seen:
        seen.add((name, inherited))
        _AuditGraph(body, inherited, name, findings, seen)
    if op.type in _IGNORED_TYPES or _CalledFunctions(op):
      continue
    if not device:
      for t in list(op.outputs) + list(op.inputs):
        if _IsBigFloat(t):
          findings.append(Finding(op.name, op.type, where,
                                  f'{t.name} {t.shape} {t.dtype.name}'))
          break
      continue
    # One op that gathers big tensors from two or more other devices (a
    # reduction or an IdentityN over every cell's gradients) holds them all.
    others = {TensorDevice(t) for t in op.inputs if _IsBigFloat(t)}
    others = ({device_names.CanonicalDevice(d) for d in others if d} -
              {device_names.CanonicalDevice(device)})
    if len(others) >= 2:
      findings.append(Finding(
          op.name, op.type, where,
          f'big inputs from {len(others)} other devices ({sorted(others)}) '
          f'on {device}', kind='gathers'))


def _ResourceDevice(op):
  for t in op.inputs:
    if t.dtype == tf.resource:
      device = TensorDevice(t)
      if device:
        return device
  return None


def Audit(fn, *args, **kwargs) -> List[Finding]:
  """Traces `fn(*args)` (a tf.function or a plain callable) and lists misplacements.

  Returns:
    Findings for every op, in `fn`'s graph and in the functions it calls,
    that has no device (explicit, by colocation, or inherited from its
    caller) and reads or produces a floating-point tensor of more than one
    element. An empty list means every such op knows its device.
  """
  if not hasattr(fn, 'get_concrete_function'):
    fn = tf.function(fn, autograph=False)
  concrete = fn.get_concrete_function(*args, **kwargs)
  findings = []
  _AuditGraph(concrete.graph, None, concrete.graph.name, findings, set())
  return findings
