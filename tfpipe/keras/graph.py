"""Reads a Keras model's layer graph as one ordered list of steps, and cuts it.

A pipeline runs contiguous blocks of work, so a functional graph has to become
a sequence first. Keras already orders a functional model's nodes by depth
(every node is deeper than all of its consumers), which is a topological
order; walking it from the deepest node gives the steps. Nested functional
and Sequential models are expanded in place, so their layers can be cut and
their batch norms handled like any other.

Every tensor gets a string key. Cutting the steps into K contiguous cells
then decides what crosses each boundary: cell k receives exactly the keys
produced before it and still consumed at or after it, so a skip connection
from cell 0 to cell 3 is carried through cells 1 and 2 and dropped after
its last consumer; nothing has to be marked by the user.
"""

import keras

from tfpipe.layers import keras_exact


class Step:
  """One call of one operation: a node of the Keras graph.

  Attributes:
    index: position in the topological order.
    operation: the Keras layer or op that is called.
    node: the Keras node (holds the call's arguments).
    input_keys: {id(KerasTensor): key} of the tensors the call reads.
    output_keys: keys of the call's flattened outputs.
    first_use: True for the first call of the operation (costs count its
      parameters once).
  """

  def __init__(self, index, operation, node, input_keys, output_keys,
               first_use):
    self.index = index
    self.operation = operation
    self.node = node
    self.input_keys = input_keys
    self.output_keys = output_keys
    self.first_use = first_use

  @property
  def name(self):
    return self.operation.name

  def Arguments(self, values):
    """The call's (args, kwargs) with tensors taken from `values` by key."""
    tensor_dict = {kid: values[key] for kid, key in self.input_keys.items()}
    return self.node.arguments.fill_in(tensor_dict)

  def __repr__(self):
    return f'Step({self.index}, {self.name})'


class ModelGraph:
  """A Keras model as ordered steps plus the keys of its inputs and outputs."""

  def __init__(self, model):
    self.model = model
    function = FunctionalOf(model)
    self.function = function
    self.input_keys = [f'input:{t.name}:{i}'
                       for i, t in enumerate(function.inputs)]
    self.steps = []
    # {id(operation): why} for nested models kept as one step.
    self.unexpanded = {}
    self._names = {}
    self._seen_ops = set()
    keys = {id(t): k for t, k in zip(function.inputs, self.input_keys)}
    self._Expand(function, keys)
    self.output_keys = [keys[id(t)] for t in function.outputs]
    self.outputs_struct = function._outputs_struct  # pylint: disable=protected-access

  def _NewKey(self, name):
    count = self._names.get(name, 0)
    self._names[name] = count + 1
    return name if count == 0 else f'{name}_{count}'

  def _Expand(self, function, keys):
    """Appends the steps of `function`, mapping its tensors into `keys`."""
    nodes_by_depth = function._nodes_by_depth  # pylint: disable=protected-access
    for depth in sorted(nodes_by_depth, reverse=True):
      for node in nodes_by_depth[depth]:
        if not node.operation or node.is_input:
          continue
        if any(id(t) not in keys for t in node.input_tensors):
          continue  # Not connected to this graph's inputs (Keras skips too).
        op = node.operation
        inner, why_not = _ExpandableModel(op, node)
        if why_not:
          self.unexpanded.setdefault(id(op), why_not)
        if inner is not None:
          inner_keys = dict(keys)
          for t_in, t_out in zip(inner.inputs, keras.tree.flatten(
              node.arguments.args[0])):
            inner_keys[id(t_in)] = keys[id(t_out)]
          self._Expand(inner, inner_keys)
          for t_in, t_out in zip(inner.outputs, node.outputs):
            keys[id(t_out)] = inner_keys[id(t_in)]
          continue
        input_keys = {id(t): keys[id(t)] for t in node.input_tensors}
        outputs = keras.tree.flatten(node.outputs)
        output_keys = []
        for i, t in enumerate(outputs):
          key = self._NewKey(op.name if len(outputs) == 1 else
                             f'{op.name}/{i}')
          keys[id(t)] = key
          output_keys.append(key)
        first_use = id(op) not in self._seen_ops
        self._seen_ops.add(id(op))
        self.steps.append(Step(len(self.steps), op, node, input_keys,
                               output_keys, first_use))

  def Liveness(self):
    """{key: (producer step or -1, last consumer step)}; outputs live on."""
    produced = {k: -1 for k in self.input_keys}
    last_use = {}
    for step in self.steps:
      for key in step.input_keys.values():
        last_use[key] = step.index
      for key in step.output_keys:
        produced[key] = step.index
    end = len(self.steps)
    for key in self.output_keys:
      last_use[key] = end
    return {k: (produced[k], last_use.get(k, produced[k])) for k in produced}


def FunctionalOf(model):
  """The functional graph of a Sequential or functional model.

  Raises:
    ValueError: for subclassed models and unbuilt Sequential models.
  """
  if isinstance(model, keras.Sequential):
    function = getattr(model, '_functional', None)
    if function is None:
      raise ValueError(
          f'Sequential model {model.name!r} has no known input shape, so its '
          'layer graph does not exist yet. Start it with '
          'keras.Input(shape=...) '
          'or call model.build(input_shape) before pipelining it.')
    return function
  if not hasattr(model, '_nodes_by_depth') or not getattr(
      model, '_is_graph_network', hasattr(model, '_outputs_struct')):
    raise ValueError(
        f'Model {model.name!r} ({type(model).__name__}) is a subclassed model: '
        'its computation is Python code, not a layer graph that can be cut. '
        'Build it with the functional API or keras.Sequential, or pipeline '
        'its layers with tfpipe.gpipe.PipeliningLayer directly.')
  return model


def _ExpandableModel(op, node):
  """(the functional graph of a nested model, None) or (None, why it is not).

  A nested model is expanded when its call gives each of its inputs a
  tensor and no keyword argument holds anything but None (keras_hub task
  models call their backbone with `mask={'token_ids': None, ...}`) or
  `training`. `why` is '' for an operation that is not a model.
  """
  if not isinstance(op, keras.Model):
    return None, ''
  try:
    inner = FunctionalOf(op)
  except ValueError:
    return None, (f'it is a {type(op).__name__} whose call is Python code '
                  '(a subclassed model), not a layer graph')
  for name, value in node.arguments.kwargs.items():
    if name != 'training' and any(
        v is not None for v in keras.tree.flatten(value)):
      return None, (f'it is called with the keyword argument {name!r} '
                    'holding tensors')
  if len(node.arguments.args) != 1 or len(keras.tree.flatten(
      node.arguments.args[0])) != len(inner.inputs):
    return None, ('its call does not give each of its inputs one tensor of '
                  'the first argument')
  return inner, ''


def TooFewStepsError(graph, num_partitions):
  """A ValueError for a model with fewer steps than num_partitions.

  It names the nested models that stayed one step, and why, when there are
  any: then the limit is tfpipe's, not the model's.
  """
  n = len(graph.steps)
  text = (f'tfpipe.keras.pipeline: model {graph.model.name!r} has {n} layer '
          f'calls, too few to cut into num_partitions={num_partitions} '
          'non-empty cells')
  whole = [(s.operation, graph.unexpanded[id(s.operation)])
           for s in graph.steps if id(s.operation) in graph.unexpanded]
  if not whole:
    return ValueError(f'{text}. Use num_partitions <= {n}.')
  reasons = '; '.join(f'layer {op.name!r} ({type(op).__name__}) is one call '
                      f'because {why}' for op, why in whole)
  return ValueError(
      f'{text}: nested models are cut like the rest of the graph, but '
      f'{reasons}. Use num_partitions <= {n}, or build the model so that '
      'its nested models are functional and called on their inputs alone.')


def CheckSupported(graph, remat_policy):
  """Raises ValueError naming the first layer the pipeline cannot run.

  Layers whose state a re-materialized, micro-batched forward cannot
  reproduce are refused here, before anything runs, with the reason and the
  fix (see keras_exact.Refusal); random layers and batch norms, nested ones
  included, run exactly through keras_exact.ExactCalls whatever the
  remat_policy.
  """
  del remat_policy  # Every policy is exact.
  for step in graph.steps:
    op = step.operation
    for layer in _SelfAndSublayers(op):
      _CheckLayer(layer, op, nested=layer is not op)


def _SelfAndSublayers(op):
  if isinstance(op, keras.layers.Layer):
    return list(op._flatten_layers(include_self=True))  # pylint: disable=protected-access
  return [op]


def _CheckLayer(layer, op, nested):
  where = (f'layer {layer.name!r} ({type(layer).__name__}) inside layer '
           f'{op.name!r}' if nested else
           f'layer {layer.name!r} ({type(layer).__name__})')
  reason = keras_exact.Refusal(layer)
  if reason:
    raise ValueError(f'tfpipe.keras: {where} {reason}')
  if getattr(layer, 'activity_regularizer', None) is not None:
    raise ValueError(
        f'tfpipe.keras: {where} has an activity_regularizer, which adds a '
        'loss with add_loss inside the cell; the pipeline only '
        'differentiates the compiled loss. Remove it and add the penalty to '
        'the loss instead.')
  if getattr(layer, 'mask_zero', False) or isinstance(
      layer, keras.layers.Masking):
    raise ValueError(
        f'tfpipe.keras: {where} produces a Keras mask, which does not cross '
        'pipeline cells. Pass the mask explicitly as a model input or '
        'tensor instead (e.g. mask_zero=False).')


class CellPlan:
  """Steps of one cell and the keys it receives and sends on."""

  def __init__(self, index, steps, input_keys, output_keys):
    self.index = index
    self.steps = steps
    self.input_keys = input_keys
    self.output_keys = output_keys


def PlanCells(graph, counts):
  """Cuts graph.steps into cells of `counts` steps each.

  Returns a list of CellPlan; the last cell's output_keys are the model's
  outputs in order, the others' the sorted keys still needed later. A layer
  called in two cells (a shared layer) and a variable read in two are
  allowed: the pipeline gives later cells a copy (gpipe/tied_variables.py).
  """
  liveness = graph.Liveness()
  plans = []
  start = 0
  for k, count in enumerate(counts):
    end = start + count
    steps = graph.steps[start:end]
    input_keys = sorted(key for key, (p, last) in liveness.items()
                        if p < start <= last)
    if k == len(counts) - 1:
      output_keys = list(graph.output_keys)
    else:
      output_keys = sorted(key for key, (p, last) in liveness.items()
                           if p < end <= last)
    plans.append(CellPlan(k, steps, input_keys, output_keys))
    start = end
  return plans
