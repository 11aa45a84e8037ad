"""What one cell does for one micro-batch, on its device: the actions F, B and W.

A schedule says which action runs when (schedule.py); the interpreter walks
it (runtime.py); this module says what an action does, once, for every
entry point and dispatcher. There is one way to keep what a backward needs
and one way to run it:

    F(m, k)  runs the cell's forward and keeps, per micro-batch, a record:
               KeptResiduals  the forward tensors the backward reads and
                              nothing else (no re-materialization);
               KeptInput      only the cell's input (re-materialization: the
                              backward runs the forward again first; on the
                              last cell also d loss / d output).
    B(m, k)  runs the backward from that record and d loss / d output: the
             input gradient and the weight gradients in one call, or, in
             zero-bubble schedules, the input gradient only, keeping for W
             what it reads (KeptForWeights).
    W(m, k)  the weight gradients, from KeptForWeights.

Each record's `tensors` are what the micro-batch holds on the cell's device
from its F until its B (or W): what a memory model multiplies by the
micro-batches in flight (schedule.MaxInFlight). Under re-materialization
that is the cell's input; without, the residuals of split_backward.py
(exactly what the backward reads: no weights, no activation it does not).

The functions come from the cell's CellProgram for the input's signature
(cell_program.py): the residual forward and the B, W and B+W parts are cut
from the program's whole trace; the re-materialized backward is the whole
trace as one call that stays a call, so that it starts only once d loss /
d output exists and its recomputed activations live only while it runs
(and it returns none of the recomputed outputs, which would live until it
ends).
When B(m, K-1) directly follows F(m, K-1), F, B and W are that whole trace
as one call (nothing to keep). Backward calls are inlined into a caller's
graph only when the pipeline is one cell and the step one micro-batch, so
that K=1, M=1 costs what a plain step costs; otherwise each stays a call,
which keeps one backward from overlapping the next one's (and their peaks
from adding up). A cell whose trace cannot be cut is re-materialized, with
B running the whole backward and W nothing.

On a CPU of a worker process (a tf.distribute.Server task), every action
of a graph step is a call that stays a call and runs on TensorFlow's
single-threaded executor (OnWorkerCpu). A worker runs its part of the step
on its inter-op threads, and a call that finishes there queues what became
ready (the _Send handing its output to the next worker among them) at the
front of that thread's queue, behind which the device's next action then
queues its own ops: with one inter-op thread, a worker handed nothing on
until it had nothing left to do, and the stages ran one after the other
(benchmarks/RESULTS.md, issue 23). With two, the second thread hands
tensors on while the first computes, and the single-threaded executor
keeps each action's ops on one thread, one at a time, so a worker still
computes on one core. Each such action's ops are chained into one order
(op_order.py): that executor's own order differs between processes, and
with it each worker's peak. A call whose function holds what that executor
cannot run (a while loop, a cond, a nested call that stays a call:
single_threaded_executor.py) keeps the default executor, and a line in the
log names the cell and the op, once. A Python function cannot run on
another process at all: such a cell is refused when traced (cell_program.py).
"""

import contextlib
import dataclasses
from typing import Any

from absl import logging
import tensorflow as tf

from tfpipe import device_names
from tfpipe import placement
from tfpipe.gpipe import accumulators
from tfpipe.gpipe import cell_program
from tfpipe.gpipe import microbatch
from tfpipe.gpipe import op_order
from tfpipe.gpipe import single_threaded_executor
from tfpipe.gpipe import split_backward

# Errors a cell raises when its layers do not fit its input.
CELL_ERRORS = (ValueError, TypeError, tf.errors.InvalidArgumentError)

SINGLE_THREADED_EXECUTOR = 'SINGLE_THREADED_EXECUTOR'


def OnWorkerCpu(device):
  """Whether `device` is a CPU of another process's server (a worker)."""
  return ((tf.DeviceSpec.from_string(device).device_type or 'CPU') == 'CPU'
          and device_names.OnOtherProcess(device))


@dataclasses.dataclass
class _KeptValues:
  program: cell_program.CellProgram
  values: dict  # traced tensor name -> value

  @property
  def tensors(self):
    return list(self.values.values())


class KeptResiduals(_KeptValues):
  """F kept the forward tensors its backward reads (no re-materialization)."""


class KeptForWeights(_KeptValues):
  """B kept what W reads (zero-bubble schedules)."""


@dataclasses.dataclass
class KeptInput:
  """F kept only the cell's input; the backward runs the forward again.

  On the last cell of a training step F also kept d loss / d output
  (`output_gradients`), so the backward recomputes the cell but not the loss.
  """
  program: cell_program.CellProgram
  inputs: list  # the forward's flat inputs (input, seed, offset)
  output_gradients: list = None

  @property
  def tensors(self):
    return list(self.inputs) + list(self.output_gradients or [])


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

  def Structure(self):
    return (self.x, self.seed, self.offset, self.loss)

  def Present(self):
    """The non-None leaves, as tensors."""
    return [t if isinstance(t, tf.Tensor) else tf.convert_to_tensor(t)
            for t in microbatch.Leaves(self.Structure())]


def _List(outputs):
  if isinstance(outputs, (list, tuple)):
    return list(outputs)
  return [] if outputs is None else [outputs]


class CellRuntime:
  """Cell k's actions, on its device (see the module docstring)."""

  def __init__(self, cell, index, device, describe_error,
               inline_backward=False):
    """Creates the runtime; its accumulators live on `device`.

    Args:
      cell: the cell layer, built on its device.
      index: k.
      device: where this cell runs (a replica's device, for replicas).
      describe_error: fn(k, x, error) -> ValueError naming the cell.
      inline_backward: inline the backward calls into a caller's graph. Only
        for a pipeline of one cell: inlined, a call's input gradient is ready
        before its weight gradients, and the cell before would start its
        backward alongside them, raising the peak.
    """
    self.cell = cell
    self.index = index
    self.device = device
    self._inline_backward = inline_backward
    self._on_worker_cpu = None  # OnWorkerCpu(device), once connected.
    # None: graph actions are single-threaded calls on a worker's CPU
    # (_SingleThreadedCalls). True: every action is, eagerly too, wherever
    # the cell runs: the memory profile (gpipe/memory_profile.py) runs a
    # worker's actions so in its own process, since how many of an
    # action's ops run at once decides its peak.
    self.single_threaded_calls = None
    self._logged_unsupported_op = False
    self.accumulators = accumulators.GradientAccumulators(device)
    self.programs = cell_program.ProgramCache()
    self._describe_error = describe_error

  def Variables(self):
    """The cell's trainable variables now (tf.Variables)."""
    return [placement.TfVariable(v) for v in self.cell.trainable_variables]

  def PassGradients(self, variables, num_accumulations, need_dx):
    """A backward pass's gradients of `variables`.

    Buffers of variables no longer trained are freed, and with them the
    programs that wrote to them.
    """
    dropped = self.accumulators.Keep(variables)
    if dropped:
      self.programs.Drop(lambda program: any(
          v.ref() in dropped for v in program.variables))
    return accumulators.PassGradients(self.accumulators, variables,
                                      num_accumulations, need_dx)

  def _Program(self, inputs, variables, training, loss_fn):
    structure = inputs.Structure()
    specs = [tf.TensorSpec(t.shape, t.dtype) for t in inputs.Present()]
    x_key = 'tensor' if isinstance(inputs.x, tf.Tensor) else repr(
        tf.nest.map_structure(lambda t: t is None, inputs.x))
    key = (x_key, tuple(t is None for t in tf.nest.flatten(structure)),
           tuple(s.dtype for s in specs), training, loss_fn,
           tuple(id(v) for v in variables))
    return self._Run(inputs.x, lambda: self.programs.Get(
        key, specs, lambda relaxed: cell_program.CellProgram(
            self.cell, self.index, self.device, structure, relaxed,
            variables, training, loss_fn)))

  def _Run(self, x, call):
    """Runs `call`; a cell's error is described with its input's shapes."""
    try:
      return call()
    except CELL_ERRORS as e:
      if (getattr(e, 'loss_fn_error', False) or
          isinstance(e, cell_program.CellPlacementError)):
        raise
      raise self._describe_error(self.index, x, e) from e

  def _SingleThreadedCalls(self):
    """Whether graph actions are single-threaded calls (module docstring),
    those whose functions that executor can run (_SingleThreadedCall).

    Only for a cell whose variables are all on its device: the
    single-threaded executor cannot run a function that spans devices, as
    a replica's cell reading replica 0's variables does. Set
    `single_threaded_calls` decides instead.
    """
    if self.single_threaded_calls is not None:
      return self.single_threaded_calls
    if tf.executing_eagerly():
      return False
    if self._on_worker_cpu is None:
      self._on_worker_cpu = OnWorkerCpu(self.device) and all(
          device_names.SameDevice(v.device, self.device)
          for v in self.Variables())
    return self._on_worker_cpu

  def _SingleThreadedCall(self, function):
    """Whether calls of `function` run on the single-threaded executor: on
    a worker's CPU, unless it holds an op that executor cannot run (logged
    once per cell). A Python function is no call: its ops join the
    caller's graph."""
    if not self._SingleThreadedCalls() or not hasattr(function, 'graph'):
      return False
    op_type = single_threaded_executor.UnsupportedOp(function)
    if op_type and not self._logged_unsupported_op:
      self._logged_unsupported_op = True
      logging.warning(
          'tfpipe: cell %d (%s): TensorFlow\'s single-threaded executor '
          'cannot run its %s; the calls holding it run on the default '
          'executor.', self.index, self.cell.name, op_type)
    return not op_type

  def _Action(self, program, function, body=None):
    """`function` as this device's actions call it: a call that stays one
    on the single-threaded executor on a worker's CPU, else as it is.
    `body`: the ops `function` calls, if it only calls them."""
    if self._SingleThreadedCall(function):
      return _NoInline(program, function, single_threaded=True, body=body)
    return function

  def _Call(self, function, args):
    with tf.device(self.device), _SingleThreaded(
        self._SingleThreadedCall(function)):
      return _List(function(*args))

  def _Accumulating(self, program, function, num_weights, connected, modes,
                    pack, noinline, body, discard=0):
    """`function`'s call, and the accumulation of its last `num_weights`
    outputs, the gradients of the variables `connected` (indices): (*args)
    -> the other outputs but the first `discard`, the gradients of mode
    ONLY, and a token that exists once the buffers are updated.

    In a graph these are ops of the caller's graph, unless `noinline`: then
    one call that stays a call (see the module docstring). Eagerly they are
    one traced call, so that an action costs one call, not one per
    variable. Either way `function`'s ops are imported, not called
    (split_backward.ImportCall), so each gradient is added as soon as it is
    made: a call inside a call that stays one returns all of its outputs at
    once, and the cell's weight gradients were all alive before the first
    was added. On every executor: on a worker's single-threaded one too,
    where the one-cell MLP's backward (five 1024 x 1024 weights) held all
    five gradients, 20 MiB, and peaked 105-108 MiB against 90-100 imported.
    There its one fixed order could still make them all before adding one
    (102-106 MiB by worker process), so each is also made only once the one
    before is added (accumulators.AddedOneAtATime): 86-90 MiB in every run.
    """
    variables = [program.variables[i] for i in connected]

    single_threaded = self._SingleThreadedCall(function)

    def Run(*args):
      # Imported ops, no calls: the executor is the caller's (_Call).
      with tf.device(self.device), op_order.OneOrder(single_threaded):
        outputs = _List(split_backward.ImportCall(function, args, 'backward',
                                                  body))
        split = len(outputs) - num_weights
        updates, kept = self.accumulators.Add(
            variables, pack(outputs[split:]), modes,
            one_at_a_time=single_threaded)
        with tf.control_dependencies(updates):
          done = tf.constant(True)
        return outputs[discard:split] + kept + [done]
    if not tf.executing_eagerly() and not noinline:
      return Run
    key = (id(function), modes, noinline, single_threaded, discard)
    if key not in program.actions:
      attributes = {'_noinline': True} if noinline else None
      with cell_program.Tracing():
        program.actions[key] = (function, tf.function(
            Run, autograph=False,
            experimental_attributes=attributes).get_concrete_function(
                *function.structured_input_signature[0]))
    return program.actions[key][1]

  def _CallAccumulating(self, program, function, num_weights, gradients,
                        args, pack=list, noinline=None, body=None, discard=0):
    """Runs `function` on `args` and accumulates its weight gradients;
    `body`: the ops `function` calls, if it only calls them
    (split_backward.Part.body); `discard`: how many leading outputs the
    caller does not want (see Backward).

    Returns (the other outputs, done token).
    """
    connected = program.Whole(gradients.need_dx)[1].connected
    modes = gradients.Modes(connected)
    if noinline is None:
      # Inlined, TensorFlow overlaps one micro-batch's call with the next
      # ones' (measured on the one-cell 1F1B step, where every action is a
      # fused F+B+W), and their activations and weight gradients pile up:
      # only a step's single accumulation (M=1) is inlined.
      noinline = (not self._inline_backward or
                  self._SingleThreadedCall(function) or
                  any(mode != accumulators.ONLY for mode in modes))
    run = self._Accumulating(program, function, num_weights, connected,
                             modes, pack, noinline, body, discard)
    outputs = self._Call(run, args)
    split = len(outputs) - 1 - modes.count(accumulators.ONLY)
    gradients.Done(connected, modes, outputs[split:-1])
    return outputs[:split], outputs[-1]

  # ---- the actions ---------------------------------------------------------

  def Forward(self, inputs, training, variables=None, keep=None,
              loss_fn=None, need_dx=True):
    """F: the forward; keeps for the backward what `keep` says.

    Args:
      inputs: ActionInputs.
      training: the layers' mode.
      variables: the variables a backward will differentiate.
      keep: None (no backward follows), 'input' (re-materialized) or
        'residuals'.
      loss_fn: applied on the last cell of a training step.
      need_dx: whether the backward returns the input's gradient.

    Returns:
      (outputs, stats, record): outputs is y, or LossParts with a loss;
      stats [(layer, (count, stats))]; record KeptInput, KeptResiduals or
      None.
    """
    present = inputs.Present()
    program = self._Program(inputs, variables or [], training, loss_fn)
    cut = None
    if keep == 'residuals':
      cut = self._Run(inputs.x, lambda: program.Cut(need_dx))
    record = None
    if cut is not None:
      part = cut.Part(split_backward.FORWARD)
      traced = program.Whole(need_dx)[1].traced
      values = dict(zip([t.name for t in traced.inputs], present))
      results = self._Run(inputs.x, lambda: self._Call(
          self._Action(program, part.function, part.body),
          [values[n] for n in part.feeds]))
      values.update(zip(part.fetches, results))
      record = KeptResiduals(program, {t.name: values[t.name]
                                       for t in cut.residuals})
    elif keep == 'input' and loss_fn is not None:
      results = self._Run(inputs.x, lambda: self._Call(
          self._Action(program, program.LossGradient()), present))
      cell_inputs = ActionInputs(inputs.x, inputs.seed, inputs.offset)
      record = KeptInput(
          self._Program(cell_inputs, variables, training, None),
          cell_inputs.Present(), results[program.num_forward:])
    else:
      results = self._Run(inputs.x, lambda: self._Call(
          self._Action(program, program.Forward()), present))
      if keep:
        record = KeptInput(program, present)
    forward, stats = program.Outputs(results[:program.num_forward])
    return forward, stats, record

  def ForwardBackward(self, inputs, training, loss_fn, gradients):
    """F, B and W in one call (B directly after F on the last cell).

    Returns (LossParts, stats, dx, done).
    """
    program = self._Program(inputs, gradients.variables, training, loss_fn)
    function, backward = self._Run(
        inputs.x, lambda: program.Whole(gradients.need_dx))
    outputs, done = self._Run(inputs.x, lambda: self._CallAccumulating(
        program, function, len(backward.connected), gradients,
        inputs.Present()))
    forward, stats = program.Outputs(outputs[:program.num_forward])
    return forward, stats, outputs[program.num_forward:], done

  def Backward(self, record, dy, gradients, split=False):
    """B: from F's record and d loss / d output (None on the last cell).

    With `split` (zero-bubble schedules), only the input gradient: W's share
    is left in the returned KeptForWeights.

    Returns (dx, KeptForWeights or None, done tokens).
    """
    program, need_dx = record.program, gradients.need_dx
    if isinstance(record, KeptInput) and record.output_gradients is not None:
      dy = record.output_gradients
    dy = [] if dy is None else list(dy)
    function, backward = program.Whole(need_dx)
    traced = backward.traced
    cut = program.Cut(need_dx) if (
        split or isinstance(record, KeptResiduals)) else None
    if cut is None:  # Re-materialized, B and W in one call.
      # The recomputed forward outputs are not returned: a call's outputs
      # live until it returns, and the cell's output (or the last cell's
      # loss) would be held through the whole backward for nothing.
      outputs, done = self._CallAccumulating(
          program, function, len(backward.connected), gradients,
          record.inputs + dy, noinline=True, discard=program.num_forward)
      return outputs, None, [done]
    values = (dict(record.values) if isinstance(record, KeptResiduals) else
              dict(zip([t.name for t in traced.inputs], record.inputs)))
    values.update(zip([t.name for t in traced.output_gradients], dy))
    if not split:
      part = cut.Part(split_backward.BACKWARD)
      dx, done = self._CallAccumulating(
          program, part.function, part.num_weight_gradients, gradients,
          [values[n] for n in part.feeds], cut.WeightGradients,
          body=part.body)
      return dx, None, [done]
    if isinstance(record, KeptInput):
      part = cut.Part(split_backward.RECOMPUTE_INPUT_GRADIENT)
      function = _NoInline(program, part.function,
                           self._SingleThreadedCall(part.function),
                           part.body)
    else:
      part = cut.Part(split_backward.INPUT_GRADIENT)
      single_threaded = self._SingleThreadedCall(part.function)
      function = (part.function if self._inline_backward and
                  not single_threaded else
                  _NoInline(program, part.function, single_threaded,
                            part.body))
    results = self._Call(function, [values[n] for n in part.feeds])
    values.update(zip(part.fetches, results))
    weight_feeds = cut.Part(split_backward.WEIGHT_GRADIENT).feeds
    kept = KeptForWeights(program, {n: values[n] for n in weight_feeds})
    num_dx = len(traced.input_gradients)
    return results[:num_dx], kept, results[:1]

  def WeightGradient(self, record, gradients):
    """W: accumulates the weight gradients; returns a done token."""
    cut = record.program.Cut(gradients.need_dx)
    part = cut.Part(split_backward.WEIGHT_GRADIENT)
    _, done = self._CallAccumulating(
        record.program, part.function, part.num_weight_gradients, gradients,
        [record.values[n] for n in part.feeds], cut.WeightGradients,
        body=part.body)
    return done


def _NoInline(program, function, single_threaded=False, body=None):
  """`function` as a call that stays a call inside a caller's graph.

  A re-materialized backward must start only when all its inputs exist
  (d loss / d output included), so the recomputed activations live only
  during it; inlined, its forward ops would run as soon as the cell's
  input exists, and Grappler could merge them with the first forward.
  With `single_threaded`, the calls inside it run on the single-threaded
  executor too (see _SingleThreaded), and `function`'s ops (`body`'s, if
  it only calls those) are imported and chained into one order, the same
  in every process (op_order.py).
  """
  key = ('noinline', id(function), single_threaded)
  if key not in program.actions:
    def Call(*args):
      if not single_threaded:
        return function(*args)
      with _SingleThreaded(True), op_order.OneOrder():
        return split_backward.ImportCall(function, args, 'action', body)
    with cell_program.Tracing():
      program.actions[key] = (function, tf.function(
          Call, autograph=False,
          experimental_attributes={'_noinline': True}).get_concrete_function(
              *function.structured_input_signature[0]))
  return program.actions[key][1]


def _SingleThreaded(enabled):
  """Calls made in it run on the single-threaded executor, if `enabled`.

  A call run by the single-threaded executor holds its inter-op thread
  until it returns; a call inside it on the default executor would queue
  its ops for the other threads, and a worker whose threads all hold such
  calls (two devices, two threads) would wait forever.
  """
  if not enabled:
    return contextlib.nullcontext()
  return tf.experimental.function_executor_type(SINGLE_THREADED_EXECUTOR)
