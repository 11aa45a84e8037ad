"""What one cell does for one micro-batch, on its device: the actions F, B and W.

A schedule says which action runs when (schedule.py); the interpreter walks
it (runtime.py); this module says what an action does, once, for every
entry point and dispatcher. There is one way to keep what a backward needs
and one way to run it:

    F(m, k)  runs the cell's forward and keeps, per micro-batch, a record:
               KeptResiduals  the forward tensors the backward reads and
                              nothing else (no re-materialization);
               KeptInput      only the cell's input (re-materialization: the
                              backward runs the forward again first).
    B(m, k)  runs the backward from that record and d loss / d output: the
             input gradient and the weight gradients in one call, or, in
             zero-bubble schedules, the input gradient only, keeping for W
             what it reads (KeptForWeights).
    W(m, k)  the weight gradients from KeptForWeights.

Each record's `tensors` are what the micro-batch holds on the cell's device
until its backward (or W): the figure a memory model multiplies by the
micro-batches in flight (schedule.MaxInFlight).

All of it comes from one trace per input signature (`_Program`): the cell's
forward with the loss on the last cell, and its whole backward. The whole
trace is the fused action F+B+W, used when B(m, K-1) directly follows
F(m, K-1) (nothing to keep: K=1 costs what a plain step costs) and, called
as one non-inlined call, as the re-materialized backward: a call starts
only when all its inputs, d loss / d output included, exist, so the
recomputed activations live only during the backward. The residual records
and the B/W split come from cutting that trace (split_backward.py); a cell
whose trace cannot be cut falls back to re-materialization, with B running
the whole backward and W nothing. A forward with no backward to follow
(inference) is its own small trace.

Traced programs are cached per input signature, with shapes relaxed as
`tf.function(reduce_retracing=True)` relaxes them (a second sequence length
retraces once, with that dimension unknown; later lengths reuse it), and the
cache is bounded, so changing shapes neither retrace every step nor grow
memory. A program depends on the cell's trainable variables at the time of
the call, so freezing a layer between steps is followed.

Variables' gradients are added, as they arrive, into one buffer per variable
on the cell's device (`GradientAccumulators`); a variable that no
micro-batch's loss reaches has no gradient (None), as in plain TensorFlow.
"""

import collections
import contextlib
import dataclasses
import threading
from typing import Any, List

from absl import logging
import tensorflow as tf
from tensorflow.python import pywrap_tfe  # pylint: disable=g-direct-tensorflow-import
from tensorflow.python.ops import resource_variable_ops  # pylint: disable=g-direct-tensorflow-import

from tfpipe import base_layer
from tfpipe.gpipe import loss as loss_lib
from tfpipe.gpipe import split_backward

# Errors a cell raises when its layers do not fit its input.
CELL_ERRORS = (ValueError, TypeError, tf.errors.InvalidArgumentError)

# Tracing runs Python layer code that keeps per-thread context (seeds,
# collectors), but Keras and tf.function also hold process-wide state while
# tracing; tracing one function at a time keeps that simple and costs nothing
# after the first step.
_TRACE_LOCK = threading.RLock()


@contextlib.contextmanager
def Tracing():
  """Where a cell's functions are traced: one at a time, with tapes on.

  The tape path stops recording on its thread while it runs actions (so the
  caller's tape keeps none of their tensors), which would also silence the
  GradientTape inside a trace.
  """
  with _TRACE_LOCK:
    stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
    if stopped:
      pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
      yield
    finally:
      if stopped:
        pywrap_tfe.TFE_Py_TapeSetStopOnThread()

# Programs kept per cell: each distinct input signature (after relaxation),
# loss_fn, `training` and trainable-variable set is one.
MAX_PROGRAMS = 8


def SplitFloat(structure):
  """Separates the floating leaves (differentiable) from the rest.

  Returns (float_leaves, rebuild) where rebuild(new_float_leaves) puts new
  floating leaves back into the original structure, keeping the others.
  """
  leaves = tf.nest.flatten(structure)
  float_index = [i for i, t in enumerate(leaves)
                 if t is not None and tf.as_dtype(t.dtype).is_floating]

  def Rebuild(new_floats):
    out = list(leaves)
    for i, t in zip(float_index, new_floats):
      out[i] = t
    return tf.nest.pack_sequence_as(structure, out)
  return [leaves[i] for i in float_index], Rebuild


def TfVariable(v):
  """The tf.Variable behind a Keras variable (tapes watch those)."""
  value = getattr(v, 'value', None)
  return value if isinstance(value, tf.Variable) else v


def _Dense(g):
  return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


# ---- per micro-batch records ----------------------------------------------


@dataclasses.dataclass
class KeptResiduals:
  """F kept the forward tensors its backward reads (no re-materialization)."""
  program: Any
  values: dict  # traced tensor name -> value

  @property
  def tensors(self):
    return list(self.values.values())


@dataclasses.dataclass
class KeptInput:
  """F kept only the cell's input; the backward runs the forward again.

  On the last cell F also kept d loss / d output (`output_gradients`), so
  the backward recomputes the cell without calling loss_fn again.
  """
  program: Any
  inputs: list  # the forward's flat inputs (input, seed, offset)
  output_gradients: list = None

  @property
  def tensors(self):
    return list(self.inputs) + list(self.output_gradients or [])


@dataclasses.dataclass
class KeptForWeights:
  """B kept what W reads (zero-bubble schedules)."""
  program: Any
  values: dict  # traced tensor name -> value

  @property
  def tensors(self):
    return list(self.values.values())


@dataclasses.dataclass
class ActionInputs:
  """What a forward reads: the cell's input and its micro-batch's context.

  `loss` is (targets, scale, batch_size) on the last cell of a training
  step, else None.
  """
  x: Any
  seed: Any
  offset: Any
  loss: Any = None

  def Flat(self):
    structure = (self.x, self.seed, self.offset, self.loss)
    return [t if t is None or isinstance(t, tf.Tensor) else
            tf.convert_to_tensor(t) for t in tf.nest.flatten(structure)]


# ---- gradients --------------------------------------------------------------


class GradientAccumulators:
  """One buffer per variable on a cell's device, summed with assign_add.

  Why buffers and not `acc = acc + g`: Grappler's arithmetic optimizer turns a
  chain of adds into one AddN, which waits for, and so keeps alive, every
  micro-batch's gradient at once: M copies of the parameters, which erases
  1F1B's memory advantage (and makes the tape path's memory grow with M).
  Stateful assign_adds run as each gradient arrives and free it. Buffers are
  made on first use, for variables that have a gradient; they belong to the
  runtime and are never checkpointed.
  """

  def __init__(self, device):
    self.device = device
    self._buffers = {}

  def Buffer(self, variable):
    key = variable.ref()
    if key not in self._buffers:
      # A buffer may first be needed in a later trace of a caller's
      # tf.function (a layer unfrozen between steps), where tf.Variable is
      # refused; a ResourceVariable made directly, out of the trace, is not.
      with tf.init_scope(), tf.device(self.device):
        self._buffers[key] = resource_variable_ops.ResourceVariable(
            tf.zeros(variable.shape, variable.dtype), trainable=False,
            name='grad_accumulator')
    return self._buffers[key]

  def Add(self, variables, gradients, modes):
    """Ops adding each gradient to its variable's buffer ('first': assigning
    it); a gradient of mode 'only' is returned as it is. Returns (updates,
    [gradients of mode 'only'])."""
    updates, kept = [], []
    for v, g, mode in zip(variables, gradients, modes):
      g = _Dense(g)
      if mode == 'only':
        kept.append(g)
      elif mode == 'first':
        updates.append(self.Buffer(v).assign(g, read_value=False))
      else:
        updates.append(self.Buffer(v).assign_add(g, read_value=False))
    return [u for u in updates if u is not None], kept

  def Keep(self, variables):
    """Frees the buffers of variables no longer trained; returns their refs."""
    keep = {v.ref() for v in variables}
    dropped = {k for k in self._buffers if k not in keep}
    for key in dropped:
      del self._buffers[key]
    return dropped


class StepGradients:
  """One backward pass's gradients of one cell's variables.

  A backward pass of M micro-batches accumulates M times per cell. Each
  variable's first gradient is assigned to its buffer and later ones are
  added; with M = 1 the gradient is kept as it is, with no buffer (so K=1,
  M=1 costs what a plain step costs). A variable that no accumulation
  reached reads as None. The actions of one cell run in order, from one
  thread, so this needs no lock.
  """

  def __init__(self, accumulators, variables, num_accumulations):
    self.variables = list(variables)
    self._accumulators = accumulators
    self._remaining = num_accumulations
    self._values = {}  # variable index -> buffer, or the only gradient

  def Modes(self, connected):
    """How each connected variable's gradient is taken this time."""
    if self._remaining == 1 and not self._values:
      return tuple('only' for _ in connected)
    return tuple('add' if i in self._values else 'first' for i in connected)

  def Done(self, connected, modes, kept):
    """Records that an accumulation of `connected` ran."""
    self._remaining -= 1
    kept = iter(kept)
    for i, mode in zip(connected, modes):
      if mode == 'only':
        self._values[i] = next(kept)
      elif mode == 'first':
        self._values[i] = self._accumulators.Buffer(self.variables[i])

  def Read(self, scale=None):
    """Each variable's gradient (times `scale`), or None if it has none."""
    result = []
    for i in range(len(self.variables)):
      value = self._values.get(i)
      if value is not None:
        with tf.device(self._accumulators.device):
          if isinstance(value, tf.Variable):
            value = value.read_value()
          if scale is not None:
            value = value * tf.cast(scale, value.dtype)
      result.append(value)
    return result


# ---- one cell's traced work ------------------------------------------------


class _RecordingCollector(base_layer.DeferredStatsCollector):
  """Keeps a traced cell's deferred statistics so the function returns them."""

  def __init__(self):
    super().__init__()
    self.entries = []

  def Add(self, layer, stats, count, device=None):
    del device
    self.entries.append((layer, count, stats))


class _Program:
  """A cell's forward (and, traced on first need, backward) for one signature.

  Attributes:
    specs: TensorSpecs of the flat, non-None inputs.
    variables: the trainable variables it differentiates.
  """

  def __init__(self, cell_runtime, structure, specs, variables, training,
               loss_fn):
    self._cell = cell_runtime
    self._structure = structure
    self._present = [i for i, t in enumerate(tf.nest.flatten(structure))
                     if t is not None]
    self.specs = specs
    self.variables = variables
    self._training = training
    self._loss_fn = loss_fn
    self._forward = None
    self._loss_gradient = None
    self.num_forward = None
    self._whole = {}       # need_dx -> (concrete function, _Backward)
    self._cuts = {}        # need_dx -> SplitProgram or None
    self.actions = {}      # accumulating wrappers, see CellRuntime._Accumulating
    self.stat_layers = []
    self.output_structure = None
    self.is_sum = False

  def _Unflatten(self, inputs):
    full = [None] * len(tf.nest.flatten(self._structure))
    for i, t in zip(self._present, inputs):
      full[i] = t
    return tf.nest.pack_sequence_as(self._structure, full)

  def _Loss(self, y, loss):
    targets, scale, batch_size = loss
    parts = loss_lib.ParseLoss(
        loss_lib.CallLossFn(self._loss_fn, y, targets,
                            f'the output of cell {self._cell.index}'),
        scale, batch_size)
    self.is_sum = parts.is_sum
    return parts

  def _Trace(self, inputs, output_gradients, need_dx, mode, marks):
    """The cell's forward (and backward); returns flat outputs.

    Outputs: the forward's (y's leaves, or the loss's numerator, metrics and
    weight) and the statistics' leaves; then for mode 'loss_gradient' d
    numerator / d y's float leaves, for mode 'whole' the input's float
    leaves' gradients and the connected variables' gradients.
    """
    x, seed, offset, loss = self._Unflatten(inputs)
    x_float, rebuild = SplitFloat(x)
    watched = list(x_float) if need_dx else []
    collector = _RecordingCollector()
    tape = tf.GradientTape(watch_accessed_variables=False)
    extra = []
    with tape if mode == 'whole' else contextlib.nullcontext():
      if mode == 'whole':
        tape.watch(watched)
        tape.watch(self.variables)
      with base_layer.StepSeed(seed, offset), (
          base_layer.CollectDeferredStats(collector)):
        y = self._cell.cell(rebuild(watched) if watched else x,
                            training=self._training)
      if loss is None:
        forward = y
        target = SplitFloat(y)[0]
      elif mode == 'loss_gradient':
        y_float, rebuild_y = SplitFloat(y)
        with tf.GradientTape(watch_accessed_variables=False) as loss_tape:
          loss_tape.watch(y_float)
          parts = self._Loss(rebuild_y(y_float), loss)
        extra = loss_tape.gradient(
            parts.numerator, y_float,
            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      else:
        parts = self._Loss(y, loss)
      if loss is not None:
        forward = (parts.numerator, parts.metrics, parts.weight)
        target = [parts.numerator]
    self.stat_layers[:] = [layer for layer, _, _ in collector.entries]
    stats = [(count, stats) for _, count, stats in collector.entries]
    self.output_structure = (forward, stats)
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten((forward, stats))
            if t is not None]
    self.num_forward = len(flat)
    if mode != 'whole':
      return flat + [_Dense(g) for g in extra]
    marks.update(forward=flat, forward_end=len(
        tf.compat.v1.get_default_graph().get_operations()))
    grads = tape.gradient(target, watched + list(self.variables),
                          output_gradients=output_gradients or None)
    dx = [tf.zeros_like(t) if g is None else _Dense(g)
          for t, g in zip(watched, grads)]
    weights = grads[len(watched):]
    marks.update(dx=dx, connected=[i for i, g in enumerate(weights)
                                   if g is not None])
    marks['weights'] = [g for g in weights if g is not None]
    return flat + dx + marks['weights']

  def _Function(self, body, specs):
    def Traced(*args):
      with tf.device(self._cell.device):
        return body(*args)
    with Tracing():
      return tf.function(Traced, input_signature=specs,
                         autograph=False).get_concrete_function()

  def Forward(self):
    """The forward alone: flat inputs -> forward outputs and statistics."""
    if self._forward is None:
      self._forward = self._Function(
          lambda *inputs: self._Trace(inputs, [], False, 'forward', {}),
          self.specs)
    return self._forward

  def LossGradient(self):
    """The last cell's forward, loss and d numerator / d output: what a
    re-materialized last cell keeps, so that its backward recomputes the
    cell but never calls loss_fn again (it may update metrics)."""
    if self._loss_gradient is None:
      self._loss_gradient = self._Function(
          lambda *inputs: self._Trace(inputs, [], False, 'loss_gradient', {}),
          self.specs)
    return self._loss_gradient

  def Whole(self, need_dx):
    """(function, Backward): flat inputs and d loss / d outputs -> forward
    outputs, statistics, input gradients, connected variables' gradients."""
    if need_dx not in self._whole:
      if self._loss_fn is None:
        forward = self.Forward()
        y = tf.nest.pack_sequence_as(self.output_structure[0],
                                     _Pad(self.output_structure[0],
                                          forward.structured_outputs))
        dy_specs = [tf.TensorSpec(t.shape, t.dtype)
                    for t in SplitFloat(y)[0]]
      else:
        dy_specs = []
      marks = {}
      n = len(self.specs)
      function = self._Function(
          lambda *args: self._Trace(args[:n], list(args[n:]), need_dx,
                                    'whole', marks),
          list(self.specs) + dy_specs)
      graph = function.graph
      inputs = [t for t in graph.inputs[:n + len(dy_specs)]]
      traced = split_backward.Traced(
          inputs=inputs[:n], forward=marks['forward'],
          output_gradients=inputs[n:], input_gradients=marks['dx'],
          weight_gradients=marks['weights'],
          forward_end=marks['forward_end'])
      self._whole[need_dx] = (function, _Backward(traced, marks['connected']))
    return self._whole[need_dx]

  def Cut(self, need_dx):
    """The SplitProgram of the whole trace, or None if it cannot be cut."""
    if need_dx not in self._cuts:
      function, backward = self.Whole(need_dx)
      try:
        with Tracing():
          cut = split_backward.SplitProgram(
              function.graph, backward.traced, self._cell.device,
              name=f'{self._cell.cell.name}')
          cut.Part(split_backward.FORWARD)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning(
            'tfpipe: cell %d (%s): its backward cannot be cut (%s: %s); it '
            'is re-materialized instead.', self._cell.index,
            self._cell.cell.name, type(e).__name__, e)
        cut = None
      self._cuts[need_dx] = cut
    return self._cuts[need_dx]

  def Outputs(self, flat):
    """(forward outputs, [(layer, (count, stats))]) from flat values."""
    forward, stats = self.output_structure
    values = tf.nest.pack_sequence_as(
        (forward, stats), _Pad((forward, stats), flat))
    forward, stats = values
    if self._loss_fn is not None:
      forward = loss_lib.LossParts(*forward, self.is_sum)
    return forward, list(zip(self.stat_layers, stats))


@dataclasses.dataclass
class _Backward:
  """What the whole trace says about its backward."""
  traced: split_backward.Traced
  connected: List[int]     # indices of the variables with a gradient


def _Pad(structure, flat):
  """`flat` with None put back where `structure` has None leaves."""
  flat = iter(list(flat))
  return [None if t is None else next(flat)
          for t in tf.nest.flatten(structure)]


class _ProgramCache:
  """Programs by signature, shapes relaxed as reduce_retracing does; LRU."""

  def __init__(self, max_size=MAX_PROGRAMS):
    self._max_size = max_size
    self._entries = collections.OrderedDict()  # (key, shapes) -> program

  def Get(self, key, specs, build):
    shapes = tuple(tuple(s.shape) for s in specs)
    exact = self._entries.get((key, shapes))
    if exact is not None:
      self._entries.move_to_end((key, shapes))
      return exact
    related = None
    for (k, s), program in reversed(self._entries.items()):
      if k != key:
        continue
      if all(a.is_compatible_with(b) for a, b in zip(program.specs, specs)):
        self._entries.move_to_end((k, s))
        return program
      related = related or program
    if related is not None:
      specs = [a.most_specific_common_supertype([b])
               for a, b in zip(related.specs, specs)]
    program = build(specs)
    self._entries[(key, tuple(tuple(s.shape) for s in specs))] = program
    while len(self._entries) > self._max_size:
      self._entries.popitem(last=False)
    return program

  def Drop(self, predicate):
    for key in [k for k, p in self._entries.items() if predicate(p)]:
      del self._entries[key]

  def __len__(self):
    return len(self._entries)


class CellRuntime:
  """Cell k's actions, on its device (see the module docstring)."""

  def __init__(self, cell, index, device, describe_error):
    """Creates the runtime; its accumulators live on `device`.

    Args:
      cell: the cell layer, built on its device.
      index: k.
      device: where this cell runs (a replica's device, for replicas).
      describe_error: fn(k, x, error) -> ValueError naming the cell.
    """
    self.cell = cell
    self.index = index
    self.device = device
    self.accumulators = GradientAccumulators(device)
    self.programs = _ProgramCache()
    self._describe_error = describe_error

  def Variables(self):
    """The cell's trainable variables now (tf.Variables)."""
    return [TfVariable(v) for v in self.cell.trainable_variables]

  def StepGradients(self, variables, num_accumulations):
    """A backward pass's StepGradients over `variables`.

    Buffers of variables no longer trained are freed, and with them the
    programs that wrote to them.
    """
    dropped = self.accumulators.Keep(variables)
    if dropped:
      self.programs.Drop(lambda program: any(
          v.ref() in dropped for v in program.variables))
    return StepGradients(self.accumulators, variables, num_accumulations)

  def _Program(self, inputs, flat, variables, training, loss_fn):
    present = [t for t in flat if t is not None]
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in present]
    mask = tuple(t is None for t in flat)
    x_key = 'tensor' if isinstance(inputs.x, tf.Tensor) else repr(
        tf.nest.map_structure(lambda _: 0, inputs.x))
    key = (x_key, mask, tuple(s.dtype for s in specs), training, loss_fn,
           tuple(id(v) for v in variables))
    structure = (inputs.x, inputs.seed, inputs.offset, inputs.loss)
    return self.programs.Get(key, specs, lambda relaxed: _Program(
        self, structure, relaxed, variables, training, loss_fn))

  def _Run(self, x, call):
    """Runs `call`; a cell's error is described with its input's shapes."""
    try:
      return call()
    except CELL_ERRORS as e:
      if getattr(e, 'loss_fn_error', False):
        raise
      raise self._describe_error(self.index, x, e) from e

  def _Accumulating(self, program, function, num_weights, connected, modes,
                    pack, noinline):
    """`function`'s call and the accumulation of its last `num_weights`
    outputs, the gradients of variables `connected`: (*flat) -> the other
    outputs, the gradients kept as they are (mode 'only'), and a token that
    exists once the buffers are updated.

    In a graph these are ops of the caller's graph, unless `noinline`: then
    they are one call that stays a call (see _NoInline), which adds each
    gradient as it is made. Eagerly they are one traced call, so that an
    action costs one call, not one per variable.
    """
    variables = [program.variables[i] for i in connected]

    def Run(*flat):
      with tf.device(self.device):
        outputs = _List(function(*flat))
        split = len(outputs) - num_weights
        updates, kept = self.accumulators.Add(
            variables, pack(outputs[split:]), modes)
        with tf.control_dependencies(updates):
          done = tf.constant(True)
        return outputs[:split] + kept + [done]
    if not tf.executing_eagerly() and not noinline:
      return Run
    key = (id(function), modes, noinline)
    if key not in program.actions:
      attributes = {'_noinline': True} if noinline else None
      with Tracing():
        program.actions[key] = (function, tf.function(
            Run, autograph=False,
            experimental_attributes=attributes).get_concrete_function(
                *function.structured_input_signature[0]))
    return program.actions[key][1]

  def _CallAccumulating(self, program, function, num_weights, connected,
                        gradients, args, pack=list, noinline=False):
    """Runs `function` on `args` and accumulates its weight gradients, its
    last `num_weights` outputs (made gradients by `pack`).

    Returns (other outputs, done token).
    """
    modes = gradients.Modes(connected)
    run = self._Accumulating(program, function, num_weights, connected,
                             modes, pack, noinline)
    with tf.device(self.device):
      outputs = _List(run(*args))
    num_kept = sum(m == 'only' for m in modes)
    split = len(outputs) - 1 - num_kept
    gradients.Done(connected, modes, outputs[split:-1])
    return outputs[:split], outputs[-1]

  # ---- the actions ---------------------------------------------------------

  def Forward(self, inputs, training, variables=None, keep=None,
              loss_fn=None, need_dx=True):
    """F: the forward; keeps for the backward what `keep` says.

    Args:
      inputs: ActionInputs.
      training: the layers' mode.
      variables: the variables a backward will differentiate (None: no
        backward follows).
      keep: None (no backward follows), 'input' (re-materialized) or
        'residuals'.
      loss_fn: applied on the last cell of a training step.
      need_dx: whether the backward returns the input's gradient.

    Returns:
      (outputs, stats, record): outputs is y, or LossParts with a loss;
      stats [(layer, (count, stats))]; record KeptInput, KeptResiduals or
      None.
    """
    flat = inputs.Flat()
    present = [t for t in flat if t is not None]
    program = self._Run(inputs.x, lambda: self._Program(
        inputs, flat, variables or [], training, loss_fn))
    cut = None
    if keep == 'residuals':
      cut = self._Run(inputs.x, lambda: program.Cut(need_dx))
    with tf.device(self.device):
      if cut is None and keep == 'input' and loss_fn is not None:
        results = _List(self._Run(
            inputs.x, lambda: program.LossGradient()(*present)))
        outputs = results[:program.num_forward]
        cell_inputs = ActionInputs(inputs.x, inputs.seed, inputs.offset)
        cell_flat = cell_inputs.Flat()
        record = KeptInput(
            self._Program(cell_inputs, cell_flat, variables, training, None),
            [t for t in cell_flat if t is not None],
            results[program.num_forward:])
      elif cut is None:
        outputs = _List(self._Run(
            inputs.x, lambda: program.Forward()(*present)))
        record = KeptInput(program, present) if keep else None
      else:
        part = cut.Part(split_backward.FORWARD)
        traced = program.Whole(need_dx)[1].traced
        values = dict(zip([t.name for t in traced.inputs], present))
        results = _List(part.function(*[values[n] for n in part.feeds]))
        values.update(zip(part.fetches, results))
        outputs = results[:len(traced.forward)]
        record = KeptResiduals(program, {t.name: values[t.name]
                                         for t in cut.residuals})
    forward, stats = program.Outputs(outputs)
    return forward, stats, record

  def ForwardBackward(self, inputs, training, loss_fn, gradients, need_dx):
    """F, B and W in one call (B directly after F on the last cell).

    Returns (LossParts, stats, dx, done).
    """
    flat = inputs.Flat()
    present = [t for t in flat if t is not None]
    program = self._Run(inputs.x, lambda: self._Program(
        inputs, flat, gradients.variables, training, loss_fn))
    function, backward = self._Run(inputs.x, lambda: program.Whole(need_dx))
    outputs, done = self._CallAccumulating(
        program, function, len(backward.connected), backward.connected,
        gradients, present)
    num_forward = len(backward.traced.forward)
    forward, stats = program.Outputs(outputs[:num_forward])
    return forward, stats, outputs[num_forward:], done

  def Backward(self, record, dy, gradients, need_dx, split=False):
    """B: from F's record and d loss / d output (None on the last cell).

    With `split`, only the input gradient: W's share is left in the
    returned KeptForWeights.

    Returns (dx, KeptForWeights or None, done tokens).
    """
    program = record.program
    if isinstance(record, KeptInput) and record.output_gradients is not None:
      dy = record.output_gradients
    dy = [] if dy is None else list(dy)
    function, backward = program.Whole(need_dx)
    traced = backward.traced
    cut = program.Cut(need_dx) if (
        split or isinstance(record, KeptResiduals)) else None
    if isinstance(record, KeptInput):
      values = dict(zip([t.name for t in traced.inputs], record.inputs))
    else:
      values = dict(record.values)
    values.update(zip([t.name for t in traced.output_gradients], dy))
    num_forward = len(traced.forward)
    if cut is None:  # Re-materialized, B and W in one call.
      outputs, done = self._CallAccumulating(
          program, function, len(backward.connected), backward.connected,
          gradients, record.inputs + dy, noinline=True)
      return outputs[num_forward:], None, [done]
    if not split:
      part = cut.Part(split_backward.BACKWARD)
      outputs, done = self._CallAccumulating(
          program, part.function, part.num_weight_gradients,
          backward.connected, gradients, [values[n] for n in part.feeds],
          cut.WeightGradients)
      return outputs, None, [done]
    kind = (split_backward.RECOMPUTE_INPUT_GRADIENT
            if isinstance(record, KeptInput) else
            split_backward.INPUT_GRADIENT)
    part = cut.Part(kind)
    function = part.function
    if kind == split_backward.RECOMPUTE_INPUT_GRADIENT:
      function = _NoInline(program, function)
    with tf.device(self.device):
      results = _List(function(*[values[n] for n in part.feeds]))
    values.update(zip(part.fetches, results))
    weight_feeds = cut.Part(split_backward.WEIGHT_GRADIENT).feeds
    kept = KeptForWeights(program, {n: values[n] for n in weight_feeds})
    num_dx = len(traced.input_gradients)
    return results[:num_dx], kept, results[:1]

  def WeightGradient(self, record, gradients, need_dx):
    """W: accumulates the weight gradients; returns a done token."""
    program = record.program
    _, backward = program.Whole(need_dx)
    cut = program.Cut(need_dx)
    part = cut.Part(split_backward.WEIGHT_GRADIENT)
    _, done = self._CallAccumulating(
        program, part.function, part.num_weight_gradients,
        backward.connected, gradients,
        [record.values[n] for n in part.feeds], cut.WeightGradients)
    return done


def _List(outputs):
  if isinstance(outputs, (list, tuple)):
    return list(outputs)
  return [] if outputs is None else [outputs]


def _NoInline(program, function):
  """`function` as a call that stays a call inside a caller's graph.

  A re-materialized backward must start only when all its inputs exist
  (d loss / d output included), so the recomputed activations live only
  during it; inlined, its forward ops would run as soon as the cell's
  input exists, and Grappler could merge them with the first forward.
  """
  key = ('noinline', id(function))
  if key not in program.actions:
    with Tracing():
      program.actions[key] = (function, tf.function(
          lambda *args: function(*args), autograph=False,
          experimental_attributes={'_noinline': True}).get_concrete_function(
              *function.structured_input_signature[0]))
  return program.actions[key][1]
