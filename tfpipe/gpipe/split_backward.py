"""A cell's backward split into B (input gradient) and W (weight gradient).

Zero-bubble schedules run B(m, k), the gradient of the cell's input, as
soon as the next cell hands the output gradient back, because the previous
cell waits for it; and W(m, k), the gradient of the cell's weights, later,
in what would otherwise be a bubble. Nothing is gained if W redoes B's work
or the forward, so each of F, B and W must compute only its own part, and
hand the rest on.

TensorFlow cannot split a recorded backward: a GradientTape over a traced
function call computes every input's gradient, weights included; and eager
per-layer tapes, which can split, made ZB-H1's step 1.35x 1F1B's on the
benchmark model (benchmarks/RESULTS.md). So the split is made on the
graph. The cell's forward and its whole backward are traced once into one
graph, and the graph is cut by what each gradient needs:

    B   the backward ops the input gradient needs (for a dense layer: the
        activation's gradient dz and dx = dz W^T);
    W   the other backward ops the weight gradients need (dW = x^T dz, the
        bias's sum of dz), which read dz from B instead of recomputing it;
    F   the forward ops, which also return the activations B and W read.

Each part becomes a traced function of exactly the tensors it reads
(`SplitProgram`): F's residuals are what a GradientTape would have kept,
so a micro-batch holds about the memory of a backward without
re-materialization until its W, plus the B results W reads (for a dense
layer, dz: one activation per layer). The cut is by ops, so it splits any
cell, Transformer blocks and Keras stages included. A gradient computed
inside a nested function call cannot be cut: if the call is on the input
gradient's path, all of it runs in B, and W reads its weight gradients.
"""

import collections

import tensorflow as tf

# Function options of the three parts: traced without autograph, kept as
# calls (not inlined) inside a caller's graph, as stage.py's functions are.
_FUNCTION_OPTIONS = dict(autograph=False,
                         experimental_attributes={'_noinline': True})

Traced = collections.namedtuple('Traced', ['forward', 'output_gradients',
                                           'input_gradients',
                                           'weight_gradients'])
Traced.__doc__ = """What a cell's trace returns (lists of graph tensors).

  forward: the forward's outputs the caller wants (outputs, loss, stats).
  output_gradients: placeholders for d loss / d outputs ([] with a loss).
  input_gradients: d loss / d input's float leaves.
  weight_gradients: d loss / d each variable (IndexedSlices allowed).
"""


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
      if (t.op.name not in ops and t.name not in captured and
          t.name not in seen):
        seen.add(t.name)
        result.append(t)
  return result


def _Extract(graph, graph_def, feeds, fetches, targets, name, device):
  """A tf.function computing `fetches` (and running `targets` ops) of
  `graph` from `feeds` only.

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
  # tf.function's argument matching, costs up to a millisecond of Python
  # per call, as much as a small cell's kernels.
  def Call(*args):
    return pruned(*args)
  function = tf.function(Call, input_signature=specs,
                         **_FUNCTION_OPTIONS).get_concrete_function()
  op_types = sorted(op.type for op in pruned.graph.get_operations()
                    if op.type not in ('Placeholder', 'Identity', 'NoOp'))
  return function, op_types


def _Stateful(op):
  """Forward ops that change state (e.g. a Keras batch norm's moving mean).

  Pruning keeps only what the fetches need, so these are run explicitly.
  """
  return op.op_def.is_stateful and op.type not in (
      'Placeholder', 'ReadVariableOp', 'VarHandleOp', 'Const', 'NoOp')


class SplitProgram:
  """F, B and W of one cell for one input signature, and what flows between.

  Values are handed on in a `state` dict (graph tensor name -> value):
  what F returns for B and W, and what B returns for W. Each part takes
  its inputs from the state and drops what no later part reads, so a
  micro-batch's state holds only its residuals.
  """

  def __init__(self, trace, input_specs, device, need_input_gradients=True,
               name='cell'):
    """Traces `trace` and cuts it into F, B and W.

    Args:
      trace: fn(inputs, end_forward) -> Traced, building the cell's forward
        and backward from placeholders `inputs` (one per input_specs), and
        calling end_forward() between the two.
      input_specs: TensorSpecs of the forward's inputs (flat).
      device: where the parts run.
      need_input_gradients: whether B returns the input gradients (not for
        the first cell, unless the caller wants the pipeline input's).
      name: for the functions' names.
    """
    marks = {}

    def Whole(*inputs):
      graph = tf.compat.v1.get_default_graph()
      with tf.device(device):
        traced = trace(list(inputs), lambda: marks.setdefault(
            'forward', len(graph.get_operations())))
      marks.update(inputs=list(inputs), traced=traced)
      return []

    # A tf.function trace (never run), so that a loss_fn may create its
    # variables (Keras metrics) as it would in any traced step.
    graph = tf.function(Whole, autograph=False).get_concrete_function(
        *input_specs).graph
    inputs, traced = marks['inputs'], marks['traced']
    # Placeholders (the inputs, output gradients and captures) are read,
    # never computed.
    ops = graph.get_operations()
    forward_ops = {op.name for op in ops[:marks['forward']]
                   if op.type != 'Placeholder'}
    backward_ops = {op.name for op in ops[marks['forward']:]
                    if op.type != 'Placeholder'}
    captured = {t.name for t in graph.internal_captures}
    self._weight_structure = traced.weight_gradients
    weight_fetches = tf.nest.flatten(traced.weight_gradients,
                                     expand_composites=True)
    # B: the ops on the input gradient's path, whether or not the input
    # gradient itself is wanted (the first cell's is not): they are what
    # the previous cell waits for, or what W reads.
    on_input_path = _Ancestors(graph, traced.input_gradients, backward_ops)
    weight_ops = _Ancestors(graph, weight_fetches, backward_ops) - on_input_path
    weight_reads = _Reads(graph, weight_ops, captured, weight_fetches)
    from_input_path = [t for t in weight_reads if t.op.name in on_input_path]
    wanted = list(traced.input_gradients) if need_input_gradients else []
    self._input_fetch_count = len(wanted)
    input_fetches = wanted + from_input_path
    input_ops = _Ancestors(graph, input_fetches, on_input_path)
    input_reads = _Reads(graph, input_ops, captured, input_fetches)
    residuals = [t for t in _Unique(input_reads + weight_reads)
                 if t.op.name in forward_ops]
    forward_fetches = list(traced.forward) + residuals
    stateful = [op for op in ops if op.name in forward_ops and _Stateful(op)]
    forward_reads = _Reads(graph, _Ancestors(
        graph, forward_fetches + stateful, forward_ops), captured,
                           forward_fetches)

    graph_def = graph.as_graph_def()
    self._op_types = {}
    self._forward, self._op_types['F'] = _Extract(
        graph, graph_def, forward_reads, forward_fetches, stateful,
        f'{name}_F', device)
    self._forward_feeds = [t.name for t in forward_reads]
    self._inputs = [t.name for t in inputs]
    self._forward_count = len(traced.forward)
    self._residuals = [t.name for t in residuals]
    self._output_gradients = [t.name for t in traced.output_gradients]
    self._input_feeds = [t.name for t in input_reads]
    self._input_returns = [t.name for t in from_input_path]
    self._input = self._weight = None
    self._op_types['B'] = self._op_types['W'] = []
    if input_fetches:
      self._input, self._op_types['B'] = _Extract(
          graph, graph_def, input_reads, input_fetches, [], f'{name}_B',
          device)
    self._weight_feeds = [t.name for t in weight_reads]
    if weight_fetches:
      self._weight, self._op_types['W'] = _Extract(
          graph, graph_def, weight_reads, weight_fetches, [], f'{name}_W',
          device)
    later = set(self._input_feeds) | set(self._weight_feeds)
    self._keep_after_forward = [n for n in self._inputs + self._residuals
                                if n in later]
    self._keep_after_input = [n for n in self._keep_after_forward
                              if n in self._weight_feeds]

  def OpTypes(self):
    """{'F', 'B', 'W'}: the sorted op types each part runs (for tests and
    for seeing where the backward's kernels went)."""
    return dict(self._op_types)

  def Forward(self, inputs):
    """F: returns (the trace's forward outputs, state for B and W)."""
    values = dict(zip(self._inputs, inputs))
    outputs = self._forward(*[values[n] for n in self._forward_feeds])
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [
        outputs]
    values.update(zip(self._residuals, outputs[self._forward_count:]))
    state = {n: values[n] for n in self._keep_after_forward}
    return outputs[:self._forward_count], state

  def InputGradient(self, state, output_gradients):
    """B: returns (d loss / d input float leaves, state for W, results).

    `results` are all the tensors B computed (to order after B in a graph).
    """
    values = dict(state)
    values.update(zip(self._output_gradients, output_gradients or []))
    dx, results = [], []
    if self._input is not None:
      results = self._input(*[values[n] for n in self._input_feeds])
      results = list(results) if isinstance(results, (list, tuple)) else [
          results]
      dx = results[:self._input_fetch_count]
      values.update(zip(self._input_returns,
                        results[self._input_fetch_count:]))
    kept = {n: values[n] for n in self._keep_after_input}
    kept.update({n: values[n] for n in self._input_returns})
    kept.update({n: values[n] for n in self._output_gradients
                 if n in self._weight_feeds})
    return dx, kept, results

  def WeightInputs(self, state):
    """The values W reads, in the order WeightGradientOf takes them."""
    return [state[n] for n in self._weight_feeds]

  def WeightGradientOf(self, *inputs):
    """W from WeightInputs(state): d loss / d each variable."""
    results = self._weight(*inputs) if self._weight is not None else []
    results = list(results) if isinstance(results, (list, tuple)) else [
        results]
    return tf.nest.pack_sequence_as(self._weight_structure, results,
                                    expand_composites=True)

  def WeightGradient(self, state):
    """W: returns d loss / d each variable."""
    return self.WeightGradientOf(*self.WeightInputs(state))


def _Unique(tensors):
  seen, result = set(), []
  for t in tensors:
    if t.name not in seen:
      seen.add(t.name)
      result.append(t)
  return result
