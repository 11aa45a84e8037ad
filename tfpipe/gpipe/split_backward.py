"""A cell's traced forward and backward, cut into parts that keep only what they read.

Two things need a cell's backward apart from its forward:

* Without re-materialization, F(m, k) must keep what B(m, k) will read, and
  nothing else. A GradientTape over a traced function call keeps every
  tensor the call's backward graph refers to, before any pruning: GELU
  internals, attention scores (benchmarks/RESULTS.md, memory.py). Cutting
  the graph keeps only the tensors the backward ops really read.
* Zero-bubble schedules run B(m, k), the gradient of the cell's input, as
  soon as the next cell hands the output gradient back, because the
  previous cell waits for it, and W(m, k), the gradient of the weights,
  later, in what would otherwise be a bubble. Nothing is gained if W redoes
  B's work or the forward.

TensorFlow cannot split a recorded backward: a tape's gradient of a traced
call computes every input's gradient, weights included. So the cut is made
on the graph. The cell's forward and its whole backward are traced once
into one graph (cell_runtime.py), and each part is that graph pruned to
what its results need, fed with what it reads:

    forward       the forward ops; also returns the residuals, the forward
                  tensors the backward reads (what a tape would keep, no
                  more);
    backward      from the residuals and d loss / d output: the input
                  gradient and the weight gradients in one call;
    input_gradient (B)  the backward ops on the input gradient's path (for a
                  dense layer: the activation's gradient dz and dx = dz W^T),
                  returning also the results W reads;
    weight_gradient (W) the other backward ops (dW = x^T dz, the bias's sum
                  of dz), reading dz from B instead of recomputing it;
    recompute_input_gradient  re-materialized B: the forward again from the
                  cell's input, then B, returning what W reads.

So nothing is computed twice: on 4 x FC(256), B and W together cost one
backward (benchmarks/RESULTS.md, schedules.py). The cut is by ops, so it
splits any cell, Transformer blocks and Keras cells included. A gradient
computed inside a nested function call cannot be cut: if the call is on the
input gradient's path, all of it runs in B, and W reads its weight gradients.
"""

import dataclasses
from typing import List

import tensorflow as tf

FORWARD = 'forward'
BACKWARD = 'backward'
INPUT_GRADIENT = 'input_gradient'
WEIGHT_GRADIENT = 'weight_gradient'
RECOMPUTE_INPUT_GRADIENT = 'recompute_input_gradient'


@dataclasses.dataclass
class Traced:
  """A cell's forward and backward in one graph (lists of its tensors).

  Attributes:
    inputs: the forward's input placeholders, flat.
    forward: the forward's outputs (outputs or loss, then statistics).
    output_gradients: placeholders of d loss / d outputs ([] with a loss).
    input_gradients: d loss / d the input's float leaves wanted.
    weight_gradients: d loss / d each variable that has one (IndexedSlices
      allowed).
    forward_end: how many of the graph's ops the forward created.
  """
  inputs: List[tf.Tensor]
  forward: List[tf.Tensor]
  output_gradients: List[tf.Tensor]
  input_gradients: List[tf.Tensor]
  weight_gradients: list
  forward_end: int


@dataclasses.dataclass
class Part:
  """One part: `function(*values of feeds)` returns the values of fetches.

  Feeds and fetches are names of the traced graph's tensors; weight
  gradients are the last `num_weight_gradients` fetches, flattened.
  `body`: the FuncGraph of the part's own ops, which `function` calls (to
  import them instead: ImportCall).
  """
  function: object
  feeds: List[str]
  fetches: List[str]
  num_weight_gradients: int = 0
  body: object = None


# Graph elements are compared by name: Python wrappers of graph tensors are
# not guaranteed to be the same object twice.


def _Ancestors(graph, roots, within):
  """Names of the ops in `within` (names) that `roots` (tensors, ops) need."""
  seen = set()
  stack = [(r.op if isinstance(r, tf.Tensor) else r).name for r in roots]
  while stack:
    name = stack.pop()
    if name in seen or name not in within:
      continue
    seen.add(name)
    op = graph.get_operation_by_name(name)
    stack.extend(t.op.name for t in op.inputs)
    stack.extend(c.name for c in op.control_inputs)
  return seen


def _Reads(graph, ops, captured, fetches=()):
  """Tensors the ops named `ops` read from outside themselves, in graph
  order, and the `fetches` they do not compute (a passed-through input);
  captures (variables) excluded."""
  result = [t for t in _Unique(fetches)
            if t.op.name not in ops and t.name not in captured]
  seen = {t.name for t in result}
  for op in graph.get_operations():
    if op.name not in ops:
      continue
    for t in op.inputs:
      # Constants and variables' values are not handed on: a part that
      # reads one makes (or reads) it again.
      if (t.op.name not in ops and t.name not in captured and
          t.name not in seen and not _Remade(t, captured)):
        seen.add(t.name)
        result.append(t)
  return result


def _Remade(t, captured):
  return t.op.type == 'Const' or (
      t.op.type == 'ReadVariableOp' and t.op.inputs[0].name in captured)


def _Unique(tensors):
  seen, result = set(), []
  for t in tensors:
    if t.name not in seen:
      seen.add(t.name)
      result.append(t)
  return result


def _Stateful(op):
  """Forward ops that change state; pruning would drop them, so they are
  run explicitly by the forward part (never by a recompute)."""
  return op.op_def.is_stateful and op.type not in (
      'Placeholder', 'ReadVariableOp', 'VarHandleOp', 'Const', 'NoOp')


def _Extract(graph, graph_def, feeds, fetches, targets, name, device):
  """(A concrete function computing `fetches` (and running `targets` ops) of
  `graph` from `feeds` only, the FuncGraph of the ops it calls).

  The whole graph is imported with the feeds rewired to the function's
  inputs, and what the fetches do not need is pruned, so nothing upstream
  of a feed runs again. Only the captures (variables) the part reads
  become its captures.
  """
  feed_names = {t.name for t in feeds}
  needed = set()
  stack = [t.op for t in fetches] + list(targets)
  while stack:
    op = stack.pop()
    if op.name in needed:
      continue
    needed.add(op.name)
    stack.extend(t.op for t in op.inputs if t.name not in feed_names)
    stack.extend(op.control_inputs)
  read = {t.name for name in needed
          for t in graph.get_operation_by_name(name).inputs}
  captures = [(external, internal) for external, internal in graph.captures
              if internal.name in read]

  def Body(*args):
    input_map = {t.name: a for t, a in zip(feeds, args)}
    current = tf.compat.v1.get_default_graph()
    for external, internal in captures:
      input_map[internal.name] = current.capture(external)
    with tf.device(device):
      return tf.graph_util.import_graph_def(
          graph_def, input_map=input_map,
          return_elements=[t.name for t in fetches], name=name)

  specs = [tf.TensorSpec(t.shape, t.dtype) for t in feeds]
  wrapped = tf.compat.v1.wrap_function(Body, specs)
  pruned = wrapped.prune(wrapped.inputs, wrapped.outputs + [
      wrapped.graph.get_operation_by_name(f'{name}/{op.name}')
      for op in targets])

  # Called as a concrete tf.function: a WrappedFunction's own call, or a
  # tf.function's argument matching, costs Python time per call that
  # matters for small cells.
  def Call(*args):
    return pruned(*args)
  return tf.function(Call, input_signature=specs,
                     autograph=False).get_concrete_function(), pruned.graph


def ImportCall(function, args, name, body=None):
  """`function(*args)` (a ConcreteFunction) as its ops, imported (Import):
  its outputs in their structure (IndexedSlices rebuilt, None kept).
  `body`: the FuncGraph whose ops `function` calls, if it only calls them
  (a Part's)."""
  flat = iter(Import(body or function.graph, args, name))
  structure = tf.nest.flatten(function.structured_outputs,
                              expand_composites=True)
  return tf.nest.pack_sequence_as(
      function.structured_outputs,
      [None if t is None else next(flat) for t in structure],
      expand_composites=True)


def Import(graph, args, name):
  """The outputs of FuncGraph `graph`, its ops imported into the graph being
  built, on `args` (and on its captures, captured again here).

  Where a call of `graph`'s function would stay a call (inside a call that
  stays one), every output exists only once the whole call returns: an
  accumulating backward then held all of its cell's weight gradients at
  once before adding the first. Imported, each output is an op's, and what
  consumes it runs as soon as it exists.
  """
  current = tf.compat.v1.get_default_graph()
  num_args = len(graph.inputs) - len(graph.captures)
  input_map = {t.name: a for t, a in zip(graph.inputs[:num_args], args)}
  for external, internal in graph.captures:
    input_map[internal.name] = current.capture(external)
  return tf.graph_util.import_graph_def(
      graph.as_graph_def(), input_map=input_map,
      return_elements=[t.name for t in graph.outputs], name=name)


class SplitProgram:
  """The parts of one traced forward and backward, extracted on first use."""

  def __init__(self, graph, traced, device, name='cell'):
    """Works out what each part reads; extracts nothing yet.

    Args:
      graph: the graph holding `traced`.
      traced: Traced.
      device: where the parts run.
      name: for the functions' names.
    """
    self._graph, self._device, self._name = graph, device, name
    self._graph_def = None
    ops = graph.get_operations()
    forward_ops = {op.name for op in ops[:traced.forward_end]
                   if op.type != 'Placeholder'}
    backward_ops = {op.name for op in ops[traced.forward_end:]
                    if op.type != 'Placeholder'}
    captured = {t.name for t in graph.internal_captures}
    weight_fetches = tf.nest.flatten(traced.weight_gradients,
                                     expand_composites=True)
    self._weight_structure = traced.weight_gradients
    input_path = _Ancestors(graph, traced.input_gradients, backward_ops)
    weight_ops = _Ancestors(graph, weight_fetches, backward_ops) - input_path
    weight_reads = _Reads(graph, weight_ops, captured, weight_fetches)
    # B's results that W reads (dz), computed once, by B.
    from_input_path = [t for t in weight_reads if t.op.name in input_path]
    input_fetches = list(traced.input_gradients) + from_input_path
    input_reads = _Reads(graph, _Ancestors(graph, input_fetches, input_path),
                         captured, input_fetches)
    backward_fetches = list(traced.input_gradients) + weight_fetches
    backward_reads = _Reads(
        graph, _Ancestors(graph, backward_fetches, backward_ops), captured,
        backward_fetches)
    input_names = {t.name for t in traced.inputs}
    # What F keeps: the forward tensors and the inputs the backward reads.
    self.residuals = [t for t in backward_reads
                      if t.op.name in forward_ops or t.name in input_names]
    residual_ops = [t for t in self.residuals if t.op.name in forward_ops]
    stateful = [op for op in ops if op.name in forward_ops and _Stateful(op)]
    forward_fetches = list(traced.forward) + residual_ops
    forward_reads = _Reads(graph, _Ancestors(
        graph, forward_fetches + stateful, forward_ops), captured,
                           forward_fetches)
    from_forward = [t for t in weight_reads if t.op.name in forward_ops]
    dy = list(traced.output_gradients)
    recompute_ops = _Ancestors(
        graph, input_fetches + from_forward, forward_ops | input_path)
    # What each part reads must exist where it runs: the forward reads the
    # inputs; the backward parts read residuals, d loss / d outputs and B's
    # results. A forward op that reads a tensor the backward made (a while
    # loop's gradient accumulators) cannot be cut.
    have = {t.name for t in traced.inputs}
    kept = have | {t.name for t in self.residuals} | {t.name for t in dy}
    for reads, available in ((forward_reads, have),
                             (backward_reads, kept), (input_reads, kept),
                             (weight_reads, kept | {
                                 t.name for t in input_fetches})):
      missing = [t.name for t in reads if t.name not in available]
      if missing:
        raise ValueError(f'its parts would read {missing[:3]}, which no '
                         'earlier part makes')
    self._plans = {
        FORWARD: (forward_reads, forward_fetches, stateful, 0),
        BACKWARD: (backward_reads, backward_fetches, [], len(weight_fetches)),
        INPUT_GRADIENT: (input_reads, input_fetches, [], 0),
        WEIGHT_GRADIENT: (weight_reads, weight_fetches, [],
                          len(weight_fetches)),
        RECOMPUTE_INPUT_GRADIENT: (
            _Reads(graph, recompute_ops, captured,
                   input_fetches + from_forward + dy),
            input_fetches + from_forward, [], 0),
    }
    self._parts = {}

  def WeightGradients(self, flat):
    """The weight gradients (IndexedSlices rebuilt) from their flat values."""
    return tf.nest.pack_sequence_as(self._weight_structure, list(flat),
                                    expand_composites=True)

  def Part(self, kind):
    """The Part of `kind` (one of this module's part names), extracted once."""
    if kind not in self._parts:
      feeds, fetches, targets, num_weights = self._plans[kind]
      if self._graph_def is None:
        self._graph_def = self._graph.as_graph_def()
      function, body = _Extract(self._graph, self._graph_def, feeds,
                                fetches, targets, f'{self._name}_{kind}',
                                self._device)
      self._parts[kind] = Part(function, [t.name for t in feeds],
                               [t.name for t in fetches], num_weights, body)
    return self._parts[kind]
