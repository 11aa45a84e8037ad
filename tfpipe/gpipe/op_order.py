"""One order for an action's ops, the same in every worker process.

TensorFlow's single-threaded executor, which runs a worker's actions
(cell_runtime.py), orders a function's ops by a reverse post-order walk of
its graph with no tie-break: the walk takes a node's consumers in the order
of its edge set, which holds more than a few edges in a hash set keyed by
their addresses. So the same graph runs in a different order in each
process, and with the order move which tensors are alive together and how
the allocator packs them: the re-materialized backward of AmoebaNet-D's
first cell of two peaked at 59.6-72.7 MiB over eight processes, and a
memory model that profiles one process missed another by 27%
(benchmarks/RESULTS.md, "Why each process packs its own way").

Chained by control edges into one order, an action's ops leave the executor
a single topological order to follow. The order is TensorFlow's own walk
made deterministic, each op's consumers taken in creation order: depth
first, so a tensor's consumers run soon after it is made. That backward
then peaked at 58.2-61.3 MiB over six processes (creation order, as
steady, peaked 25% higher), and a backward without re-materialization at
about half its peak before, its gradients consumed as soon as made.
Grappler may drop an edge that a data path already implies; the order
stays.
"""

import contextlib

import tensorflow as tf
from tensorflow.python.framework import auto_control_deps  # pylint: disable=g-direct-tensorflow-import


@contextlib.contextmanager
def OneOrder(enabled=True):
  """Chains the ops created inside it, in the graph being built, into one
  order (if `enabled`, and only while building a graph)."""
  if not enabled or tf.executing_eagerly():
    yield
    return
  graph = tf.compat.v1.get_default_graph()
  start = len(graph.get_operations())
  yield
  Chain(graph.get_operations()[start:])


def Chain(ops):
  """Adds the control edges that leave `ops` (in creation order) one order
  to run in: Order's. A pair already joined by an edge gets none."""
  for before, op in _Unjoined(ops):
    op._add_control_input(before)  # pylint: disable=protected-access


def Order(ops):
  """`ops` but the function's arguments and the ops that float
  (_Floating), in a topological order: a reverse post-order of a
  depth-first walk from the ops without inputs, each op's consumers (and
  the roots) taken in creation order.

  The order also keeps the edges that tf.function's automatic control
  dependencies add once the traced function returns (_StateEdges): another
  order would close a cycle with them.
  """
  candidates = [op for op in ops if op.type != 'Placeholder']
  state_edges = _StateEdges(candidates)
  ordered_state = {op for edge in state_edges for op in edge}
  members = [op for op in candidates
             if op in ordered_state or not _Floating(op)]
  index = {op: i for i, op in enumerate(members)}
  consumers = {op: set() for op in members}
  for op in members:
    for before in _Inputs(op):
      if before in index:
        consumers[before].add(op)
  for before, op in state_edges:
    consumers[before].add(op)
  has_input = set().union(*consumers.values())
  children = {op: sorted(found, key=index.get)
              for op, found in consumers.items()}
  seen, post_order = set(), []
  for root in members:
    if root in has_input or root in seen:
      continue
    seen.add(root)
    stack = [(root, iter(children[root]))]
    while stack:
      op, pending = stack[-1]
      unseen = next((c for c in pending if c not in seen), None)
      if unseen is None:
        post_order.append(op)
        stack.pop()
      else:
        seen.add(unseen)
        stack.append((unseen, iter(children[unseen])))
  return post_order[::-1]


def IsOneOrder(ops):
  """Whether `ops` (but the arguments and the ops that float) have
  exactly one topological order: one path through all of them, each op an
  input of the next."""
  return not _Unjoined(ops)


def _Unjoined(ops):
  """The pairs of Order(ops) that follow each other with no edge between."""
  ordered = Order(ops)
  return [(before, op) for before, op in zip(ordered, ordered[1:])
          if before not in _Inputs(op)]


def _Inputs(op):
  """The ops `op` reads or waits for."""
  return {t.op for t in op.inputs} | set(op.control_inputs)


# Ops that allocate nothing when they run: a constant's tensor is made with
# its kernel, and a variable's read returns the variable's buffer.
_ALLOCATING_NOTHING = frozenset(['Const', 'ReadVariableOp'])


def _Floating(op):
  """Whether `op` is left out of the chain: it allocates nothing, reads
  only the function's arguments and waits for nothing, so where it runs
  changes no peak and it can close no cycle. Chained, such an op breaks up
  the patterns Grappler fuses: a MatMul, the read of its bias and the bias
  add in one order put a control edge on the MatMul, and it stayed unfused
  (_FusedMatMul) in the MLP's forward."""
  return (op.type in _ALLOCATING_NOTHING and not op.control_inputs and
          all(t.op.type == 'Placeholder' for t in op.inputs))


def _StateEdges(ops):
  """(before, after) pairs of `ops` (in creation order) that tf.function's
  automatic control dependencies order: a resource's writes after its
  earlier reads and writes, its reads after its last write, and stateful
  ops that take no resource one after another. Found by its own rules
  (auto_control_deps), so that the two never disagree; they order only ops
  that share state, never two variables' updates, which other edges (as
  accumulators.AddedOneAtATime's) may order against creation."""
  edges = []
  last_write, reads_since = {}, {}
  last_stateful = None
  for op in ops:
    if (op.type in auto_control_deps.MUST_RUN_ORDER_INSENSITIVE_STATEFUL_OPS
        or not (op.op_def.is_stateful or any(
            t.dtype == tf.resource for t in op.inputs))):
      continue
    # pylint: disable=protected-access
    touched = list(auto_control_deps._get_resource_inputs(op))
    for tensor, kind in touched:
      key = tensor.ref()
      if key in last_write:
        edges.append((last_write[key], op))
      if kind == auto_control_deps.ResourceType.READ_ONLY:
        reads_since.setdefault(key, []).append(op)
      else:
        edges.extend((read, op) for read in reads_since.pop(key, []))
        last_write[key] = op
    if not touched and auto_control_deps.op_is_stateful(op):
      if last_stateful is not None:
        edges.append((last_stateful, op))
      last_stateful = op
  return [(before, after) for before, after in edges if before is not after]
