"""A cell's traced work for one input signature, and the cache that holds it.

Everything a cell does for a micro-batch comes from two traces per input
signature (`CellProgram`):

    Forward()       the forward alone (with the loss on the last cell of a
                    training step): inference, and a re-materialized F;
    Whole(need_dx)  the forward and its whole backward: the input's and the
                    variables' gradients. It is the fused action F+B+W, the
                    re-materialized backward, and the graph that
                    split_backward.py cuts into parts (`Cut`).

and, on the last cell under re-materialization, `LossGradient()`: the
forward, the loss and d loss / d output, so that the backward recomputes
the cell but never calls loss_fn twice (it may update metrics).

User code runs here, traced with autograph (base_layer.Autograph). A variable
the backward does not reach has no gradient; `connected` says which do,
decided when the program is traced.

Programs are cached per cell (`ProgramCache`) by everything that changes the
traced graph: the input's structure and dtypes, `training`, the loss_fn and
the trainable variables. Shapes are relaxed as `tf.function(
reduce_retracing=True)` relaxes them: a second sequence length retraces once
with that dimension unknown, and later lengths reuse it. The cache keeps at
most MAX_PROGRAMS, least recently used first out, so changing shapes or a
new loss_fn closure per step neither retrace forever nor grow memory.
"""

import collections
import contextlib
import dataclasses
import threading
from typing import List

from absl import logging
import tensorflow as tf
from tensorflow.python import pywrap_tfe  # pylint: disable=g-direct-tensorflow-import

from tfpipe import base_layer
from tfpipe import deferred_stats
from tfpipe import device_names
from tfpipe.gpipe import accumulators
from tfpipe.gpipe import loss as loss_lib
from tfpipe.gpipe import single_threaded_executor
from tfpipe.gpipe import split_backward

# Programs kept per cell: each distinct input signature (after relaxation),
# loss_fn, `training` and trainable-variable set is one.
MAX_PROGRAMS = 8

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


class CellPlacementError(ValueError):
  """A cell cannot run where it is placed; the message names the cell, so
  it is raised as it is (not described again with the input's shapes)."""


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


class _RecordingCollector(base_layer.DeferredStatsCollector):
  """Keeps a traced cell's deferred statistics so the function returns them."""

  def __init__(self):
    super().__init__()
    self.entries = []

  def Add(self, layer, stats, count, device=None):
    del device
    self.entries.append((layer, count, stats))


@dataclasses.dataclass
class Backward:
  """What the whole trace says about the backward.

  Attributes:
    traced: its tensors, as split_backward.Traced.
    connected: indices (into the program's variables) of the variables
      with a gradient; their gradients are the whole function's last
      outputs, in this order.
  """
  traced: split_backward.Traced
  connected: List[int]


def _Pad(structure, flat):
  """`flat` with None put back where `structure` has None leaves."""
  flat = iter(list(flat))
  return [None if t is None else next(flat)
          for t in tf.nest.flatten(structure)]


class CellProgram:
  """A cell's forward (and, traced on first need, backward) for a signature.

  Attributes:
    specs: TensorSpecs of the flat, non-None inputs (x, seed, offset, and on
      the last cell of a training step targets, scale, batch size).
    variables: the trainable variables it differentiates.
    num_forward: how many flat outputs the forward has (outputs or loss,
      then statistics); known once traced.
    actions: callables made from its functions (cell_runtime.py), dropped
      with it.
  """

  def __init__(self, cell, index, device, structure, specs, variables,
               training, loss_fn):
    self._cell, self._index, self._device = cell, index, device
    present = [t is not None for t in tf.nest.flatten(structure)]
    self._present = [i for i, p in enumerate(present) if p]
    # The structure without its tensors, which must not outlive the call.
    self._structure = tf.nest.pack_sequence_as(
        structure, [0 if p else None for p in present])
    self.specs = specs
    self.variables = variables
    self._training = training
    self._loss_fn = loss_fn
    self._forward = None
    self._loss_gradient = None
    self._whole = {}       # need_dx -> (concrete function, Backward)
    self._cuts = {}        # need_dx -> SplitProgram or None
    self._stat_layers = []
    self._output_structure = None
    self._is_sum = False
    self.num_forward = None
    self.actions = {}

  def _Unflatten(self, inputs):
    full = [None] * len(tf.nest.flatten(self._structure))
    for i, t in zip(self._present, inputs):
      full[i] = t
    return tf.nest.pack_sequence_as(self._structure, full)

  def _Loss(self, y, loss):
    targets, scale, batch_size = loss
    parts = loss_lib.ParseLoss(
        loss_lib.CallLossFn(self._loss_fn, y, targets,
                            f'the output of cell {self._index}'),
        scale, batch_size)
    self._is_sum = parts.is_sum
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
        y = self._cell(rebuild(watched) if watched else x,
                       training=self._training)
      if loss is None:
        forward, target = y, SplitFloat(y)[0]
      else:
        if mode == 'loss_gradient':
          y_float, rebuild_y = SplitFloat(y)
          with tf.GradientTape(watch_accessed_variables=False) as loss_tape:
            loss_tape.watch(y_float)
            parts = self._Loss(rebuild_y(y_float), loss)
          extra = loss_tape.gradient(
              parts.numerator, y_float,
              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        else:
          parts = self._Loss(y, loss)
        forward = (parts.numerator, parts.metrics, parts.weight)
        target = [parts.numerator]
    # Batch norms' moments as one record per cell (deferred_stats).
    entries = deferred_stats.PackMoments(collector.entries)
    self._stat_layers[:] = [layer for layer, _, _ in entries]
    stats = [(count, stats) for _, count, stats in entries]
    self._output_structure = (forward, stats)
    flat = [tf.convert_to_tensor(t) for t in tf.nest.flatten((forward, stats))
            if t is not None]
    self.num_forward = len(flat)
    if mode != 'whole':
      return flat + [accumulators.Dense(g) for g in extra]
    marks.update(forward=flat, forward_end=len(
        tf.compat.v1.get_default_graph().get_operations()))
    grads = tape.gradient(target, watched + list(self.variables),
                          output_gradients=output_gradients or None)
    dx = [tf.zeros_like(t) if g is None else accumulators.Dense(g)
          for t, g in zip(watched, grads)]
    weights = grads[len(watched):]
    marks.update(dx=dx, connected=[i for i, g in enumerate(weights)
                                   if g is not None],
                 weights=[g for g in weights if g is not None])
    return flat + dx + marks['weights']

  def _Function(self, body, specs):
    def Traced(*args):
      with tf.device(self._device):
        return body(*args)
    with Tracing():
      function = tf.function(Traced, input_signature=specs,
                             autograph=False).get_concrete_function()
    self._CheckRunsOnDevice(function)
    return function

  def _CheckRunsOnDevice(self, function):
    """Refuses a Python function on another process's device, at trace time.

    Its Python code lives only in this process: on a worker the step failed
    late ("Could not find callback"), often as a bare CancelledError of the
    step's other calls, or hung.
    """
    if not device_names.OnOtherProcess(self._device):
      return
    op_type = single_threaded_executor.PythonFunctionOp(function)
    if op_type:
      raise CellPlacementError(
          f'cell {self._index} ({self._cell.name}) holds a Python function '
          f'(a {op_type} op, from tf.py_function or tf.numpy_function) but '
          f'is placed on {self._device}, a device of another process, where '
          'its Python function does not exist. Compute it in the input pipeline '
          '(tf.data), or place this cell on a device of this process.')

  def Forward(self):
    """The forward alone: flat inputs -> forward outputs and statistics."""
    if self._forward is None:
      self._forward = self._Function(
          lambda *inputs: self._Trace(inputs, [], False, 'forward', {}),
          self.specs)
    return self._forward

  def LossGradient(self):
    """The last cell's forward and loss, then d numerator / d output."""
    if self._loss_gradient is None:
      self._loss_gradient = self._Function(
          lambda *inputs: self._Trace(inputs, [], False, 'loss_gradient', {}),
          self.specs)
    return self._loss_gradient

  def Whole(self, need_dx):
    """(function, Backward): flat inputs and d loss / d outputs -> forward
    outputs, statistics, input gradients, connected variables' gradients."""
    if need_dx not in self._whole:
      dy_specs = []
      if self._loss_fn is None:
        outputs = self.Forward().structured_outputs
        y = tf.nest.pack_sequence_as(
            self._output_structure[0],
            _Pad(self._output_structure[0], outputs))
        dy_specs = [tf.TensorSpec(t.shape, t.dtype)
                    for t in SplitFloat(y)[0]]
      marks = {}
      n = len(self.specs)
      function = self._Function(
          lambda *args: self._Trace(args[:n], list(args[n:]), need_dx,
                                    'whole', marks),
          list(self.specs) + dy_specs)
      inputs = function.graph.inputs[:n + len(dy_specs)]
      traced = split_backward.Traced(
          inputs=inputs[:n], forward=marks['forward'],
          output_gradients=inputs[n:], input_gradients=marks['dx'],
          weight_gradients=marks['weights'],
          forward_end=marks['forward_end'])
      self._whole[need_dx] = (function, Backward(traced, marks['connected']))
    return self._whole[need_dx]

  def Cut(self, need_dx):
    """The SplitProgram of the whole trace, or None if it cannot be cut."""
    if need_dx not in self._cuts:
      function, backward = self.Whole(need_dx)
      try:
        with Tracing():
          cut = split_backward.SplitProgram(
              function.graph, backward.traced, self._device,
              name=self._cell.name)
          cut.Part(split_backward.FORWARD)
      except Exception as e:  # pylint: disable=broad-except
        logging.warning(
            'tfpipe: cell %d (%s): its backward cannot be cut (%s: %s); it '
            'is re-materialized instead.', self._index, self._cell.name,
            type(e).__name__, e)
        cut = None
      self._cuts[need_dx] = cut
    return self._cuts[need_dx]

  def Outputs(self, flat):
    """(forward outputs, [(layer, (count, stats))]) from flat values: the
    cell's output, or LossParts on the last cell of a training step."""
    forward, stats = tf.nest.pack_sequence_as(
        self._output_structure, _Pad(self._output_structure, flat))
    if self._loss_fn is not None:
      forward = loss_lib.LossParts(*forward, self._is_sum)
    return forward, list(zip(self._stat_layers, stats))


def _ShapesKey(specs):
  """The specs' shapes, hashable; None where a rank is unknown (an input
  from a tf.py_function), which relaxation keeps as tf.TensorShape(None)."""
  return tuple(None if s.shape.rank is None else tuple(s.shape)
               for s in specs)


class ProgramCache:
  """CellPrograms by signature, shapes relaxed; the least recently used go."""

  def __init__(self, max_size=MAX_PROGRAMS):
    self._max_size = max_size
    self._entries = collections.OrderedDict()  # (key, shapes) -> program

  def Get(self, key, specs, build):
    """The program of `key` whose specs accept `specs`, else build(specs
    relaxed against the latest program of the same key)."""
    shapes = _ShapesKey(specs)
    exact = self._entries.get((key, shapes))
    if exact is not None:
      self._entries.move_to_end((key, shapes))
      return exact
    related = None
    for (k, s), program in reversed(self._entries.items()):
      if k != key:
        continue
      # The program's specs must accept every input these specs allow
      # (tf.function's rule): one traced for [4, 4] is no program for an
      # input of unknown rank, though their shapes are "compatible".
      if all(b.is_subtype_of(a) for a, b in zip(program.specs, specs)):
        self._entries.move_to_end((k, s))
        return program
      related = related or program
    if related is not None:
      specs = [a.most_specific_common_supertype([b])
               for a, b in zip(related.specs, specs)]
    program = build(specs)
    self._entries[(key, _ShapesKey(specs))] = program
    while len(self._entries) > self._max_size:
      self._entries.popitem(last=False)
    return program

  def Drop(self, predicate):
    for key in [k for k, p in self._entries.items() if predicate(p)]:
      del self._entries[key]

  def __len__(self):
    return len(self._entries)
