"""The pipeline runtime: one interpreter of the schedule for every entry point.

`PipelineRuntime` holds a `CellRuntime` per (replica, cell) and runs a
step's actions through a dispatcher (dispatch.py). What an action does is
written once, in `_Step`:

    F(m, k)  takes cell k's input (the micro-batch, or cell k-1's output),
             runs the forward and hands the output on, keeping for B(m, k)
             what cell_runtime.py says: only the input when re-materialized,
             else the residuals. On the last cell of a training step the
             loss is applied too, and when B(m, K-1) comes right after, F,
             B and W are one call.
    B(m, k)  takes the gradient of cell k's output (from B(m, k+1), or from
             the caller's tape), runs the backward, which adds the
             variables' gradients to the cell's buffers, and hands the
             input's gradient to B(m, k-1). In zero-bubble schedules it
             computes the input's gradient only and keeps what W reads.
    W(m, k)  the variables' gradients, from what B(m, k) kept.

The entry points are different sets of these actions:

    Forward          the F actions (inference).
    ForwardBackward  all actions, loss on the last cell: the train step.
    TapeForward /    the F actions now and the B and W actions each time the
    TapeBackward     caller's GradientTape asks for the gradient (`pipe(x)`
                     under a tape; tape_path.py). The F records are kept
                     until the tape is gone, so a persistent tape can ask
                     twice.

Whether F keeps anything is decided by whether a backward will run, not by
the layers' `training` mode. Random ops see a seed unique to (step,
micro-batch) and the index of the micro-batch's first example in the whole
batch, so a recompute draws the same values whichever dispatcher runs it.
Deferred statistics (batch norm) are gathered per (replica, micro-batch,
cell) and handed to the step's collector in that order, so the update does
not depend on timing.
"""

import dataclasses
from typing import Any

import tensorflow as tf

from tfpipe.gpipe import cell_runtime as cell_runtime_lib
from tfpipe.gpipe import dispatch as dispatch_lib
from tfpipe.gpipe import loss as loss_lib
from tfpipe.gpipe import schedule as schedule_lib

REMAT_POLICIES = ('always', 'except_last', 'never')


def OnDevice(structure, device):
  """Copies eager tensors to `device` before a call that runs there.

  Then each cell's function runs on one device only (its variables are there
  too): cheaper to dispatch, and runnable by TensorFlow's single-threaded
  executor, which hangs on functions that span devices. In a graph the
  runtime inserts the transfers itself.
  """
  if not tf.executing_eagerly():
    return structure
  canonical = tf.DeviceSpec.from_string(device)

  def Copy(t):
    if not isinstance(t, tf.Tensor):
      return t
    spec = tf.DeviceSpec.from_string(t.device)
    if spec.make_merged_spec(canonical) == spec:
      return t  # Already there.
    return tf.identity(t)
  with tf.device(device):
    return tf.nest.map_structure(Copy, structure)


@dataclasses.dataclass
class _Fused:
  """F, B and W of the last cell ran as one call; B hands on its result."""
  input_gradient: list


@dataclasses.dataclass
class MicroBatches:
  """One replica's share of a step: its micro-batches and their bookkeeping.

  Attributes:
    inputs: the first cell's input of each micro-batch.
    targets: the loss's targets of each micro-batch (or None).
    scales: n_m / N of each micro-batch (float32), N the whole batch.
    seeds: [2] int64 seed of each micro-batch.
    offsets: index in the whole batch of each micro-batch's first example.
    sizes: number of examples of each micro-batch (ints, or scalar tensors
      when the batch size is not static).
  """

  inputs: list
  targets: Any
  scales: list
  seeds: list
  offsets: list
  sizes: list

  def __len__(self):
    return len(self.inputs)


class _Step:
  """What F(m, k), B(m, k) and W(m, k) do in one step (items: (replica,
  Action)).

  Per-micro-batch state, keyed (replica, micro-batch, cell):
    kept       F's record for B (cell_runtime.KeptInput or KeptResiduals),
               or _Fused when F, B and W ran as one call;
    for_weights  B's record for W (KeptForWeights), zero-bubble schedules.
  """

  def __init__(self, runtime, shards, training, backward, batch_size=None,
               loss_fn=None, need_input_gradient=False):
    self.runtime = runtime
    self.shards = shards
    self.training = training
    self.backward = backward  # Whether B actions will follow.
    self.batch_size = batch_size
    self.loss_fn = loss_fn
    self.need_input_gradient = need_input_gradient
    # Taken now: gradients follow the trainable set at the time of the call.
    self.variables = {(r, k): cell.Variables() if backward else None
                      for r, cells in enumerate(runtime.cells)
                      for k, cell in enumerate(cells)}
    self.gradients = {}       # (r, k) -> PassGradients of this backward pass
    self.kept = {}
    self.for_weights = {}
    self.release_kept = True  # False: the tape may ask for B again.
    self.stats = {}           # (r, m, k) -> [(layer, (count, stats))]
    self.losses = {}          # (r, m) -> LossParts
    self.outputs = {}         # (r, m) -> the last cell's output
    self.output_gradients = {}  # (r, m) -> caller's d loss / d output
    self.input_gradients = {}   # (r, m) -> d loss / d pipeline input
    self._last = runtime.num_cells - 1
    self._split = {}          # r -> whether B and W are separate actions
    self._fused = set()       # (r, m): B(m, K-1) right after F(m, K-1)
    for r in range(len(shards)):
      sched = runtime.Schedule(len(shards[r]), r)
      self._split[r] = sched.splits_backward
      for acts in sched.device_actions:
        for a, following in zip(acts, acts[1:] + [None]):
          if (a.kind == schedule_lib.FORWARD and a.cell == self._last and
              loss_fn is not None and following == schedule_lib.Action(
                  schedule_lib.BACKWARD, a.micro_batch, a.cell)):
            self._fused.add((r, a.micro_batch))

  def StartBackward(self):
    """Fresh gradients for a backward pass (each of a tape's gradients)."""
    self.gradients = {
        (r, k): cell.PassGradients(self.variables[(r, k)],
                                   len(self.shards[r]), self._NeedDx(k))
        for r, cells in enumerate(self.runtime.cells)
        for k, cell in enumerate(cells)}

  def _Cell(self, r, k):
    return self.runtime.cells[r][k]

  def Gather(self, item, store):
    r, (kind, m, k) = item
    device = self._Cell(r, k).device
    if kind == schedule_lib.FORWARD:
      x = self.shards[r].inputs[m] if k == 0 else store.Take(('y', r, m, k - 1))
      return OnDevice(x, device)
    if kind == schedule_lib.WEIGHT:
      return None  # W needs only what B kept on this device.
    if k < self._last:
      made_on = self._Cell(r, k + 1).device
      key = ('dy', r, m, k + 1)
      dy = (store.Take(key) if made_on == device else
            store.TakeWhenDue(key, made_on))
      return OnDevice(dy, device)
    if self.loss_fn is None:
      return OnDevice(self.output_gradients[(r, m)], device)
    return None  # The backward starts from the loss.

  def Execute(self, item, args, store):
    r, (kind, m, k) = item
    if kind == schedule_lib.FORWARD:
      return self._Forward(r, m, k, args, store)
    if kind == schedule_lib.BACKWARD:
      return self._Backward(r, m, k, args, store)
    return self._Weight(r, m, k)

  def _Inputs(self, r, m, k, x):
    cell = self._Cell(r, k)
    shard = self.shards[r]
    loss = None
    if k == self._last and self.loss_fn is not None:
      loss = (None if shard.targets is None else shard.targets[m],
              shard.scales[m], self.batch_size)
    seed, offset, loss = OnDevice((shard.seeds[m], shard.offsets[m], loss),
                                  cell.device)
    return cell_runtime_lib.ActionInputs(x, seed, offset, loss)

  def _NeedDx(self, k):
    return k > 0 or self.need_input_gradient

  def _Forward(self, r, m, k, x, store):
    cell = self._Cell(r, k)
    inputs = self._Inputs(r, m, k, x)
    if (r, m) in self._fused and k == self._last:
      outputs, stats, dx, done = cell.ForwardBackward(
          inputs, self.training, self.loss_fn, self.gradients[(r, k)])
      self.kept[(r, m, k)] = _Fused(dx)
      tokens = [done]
    else:
      keep = None
      if self.backward:
        keep = ('input' if self.runtime.UsesRemat(m, len(self.shards[r]))
                else 'residuals')
      outputs, stats, record = cell.Forward(
          inputs, self.training, self.variables[(r, k)], keep,
          self.loss_fn if inputs.loss is not None else None, self._NeedDx(k))
      if record is not None:
        self.kept[(r, m, k)] = record
      tokens = []
    if inputs.loss is not None:
      self.losses[(r, m)] = outputs
      tokens.append(outputs.numerator)
    elif k == self._last:
      self.outputs[(r, m)] = outputs
    else:
      store.Put(('y', r, m, k), outputs)
    if stats:
      self.stats[(r, m, k)] = stats
    return tokens + [t for t in tf.nest.flatten((outputs, stats))
                     if isinstance(t, tf.Tensor)]

  def _Backward(self, r, m, k, dy, store):
    cell = self._Cell(r, k)
    record = (self.kept.pop((r, m, k)) if self.release_kept else
              self.kept[(r, m, k)])
    if isinstance(record, _Fused):
      dx, done = record.input_gradient, []
    else:
      dx, for_weights, done = cell.Backward(
          record, dy, self.gradients[(r, k)], split=self._split[r])
      if for_weights is not None:
        self.for_weights[(r, m, k)] = for_weights
    if k > 0:
      store.Put(('dy', r, m, k), dx)
    elif self.need_input_gradient:
      self.input_gradients[(r, m)] = dx
    return list(dx) + list(done)

  def _Weight(self, r, m, k):
    record = self.for_weights.pop((r, m, k), None)
    if record is None:
      return []  # B ran the whole backward (a cell that cannot be cut).
    return [self._Cell(r, k).WeightGradient(record, self.gradients[(r, k)])]

  def ApplyStats(self, collector):
    if collector is None:
      return
    for key in sorted(self.stats):
      r, _, k = key
      for layer, (count, stats) in self.stats[key]:
        collector.Add(layer, stats, count, device=self._Cell(r, k).device)

  def Gradients(self, scale=None):
    """The pass's gradients, summed over replicas, aligned with the
    variables taken at the step's start; None where none has one.

    Each replica's buffers live on its own devices; the sum is taken on the
    variable's device, which is replica 0's cell device.
    """
    gradients = []
    for k in range(self.runtime.num_cells):
      per_replica = [self.gradients[(r, k)].Read(scale)
                     for r in range(len(self.shards))]
      for i, v in enumerate(self.variables[(0, k)]):
        values = [grads[i] for grads in per_replica if grads[i] is not None]
        if len(values) <= 1:
          gradients.append(values[0] if values else None)
          continue
        with tf.device(v.device):
          gradients.append(tf.add_n(values))
    return gradients


class PipelineRuntime:
  """Runs a pipeline's steps along its schedules, through a dispatcher."""

  def __init__(self, cells, replica_devices, schedule_name, remat_policy,
               describe_error):
    """Creates a CellRuntime per (replica, cell).

    Args:
      cells: the K cells, built on replica 0's devices.
      replica_devices: [replica][cell] device names.
      schedule_name: a key of schedule.SCHEDULES.
      remat_policy: one of REMAT_POLICIES (checked by the pipeline's
        CheckParams).
      describe_error: fn(k, x, error) -> ValueError naming cell k.
    """
    self.num_cells = len(cells)
    self._replica_devices = replica_devices
    self._schedule_name = schedule_name
    self._remat_policy = remat_policy
    self._schedules = {}
    # Whether a training step's first cell also computes d loss / d its
    # input, as every other cell does: memory_profile's one-cell pipelines
    # stand for cells anywhere in a pipeline.
    self.first_cell_input_gradient = False
    self.cells = [
        [cell_runtime_lib.CellRuntime(cell, k, devices[k], describe_error,
                                      inline_backward=self.num_cells == 1)
         for k, cell in enumerate(cells)]
        for devices in replica_devices]

  def Schedule(self, num_micro_batches, replica=0, forward_only=False):
    """Replica `replica`'s validated schedule for M micro-batches, cached;
    with `forward_only`, its forward actions alone (inference, and the
    forward of the tape path)."""
    key = (num_micro_batches, replica, forward_only)
    if key not in self._schedules:
      if forward_only:
        sched = self.Schedule(num_micro_batches, replica).ForwardOnly()
      else:
        devices = self._replica_devices[replica]
        unique = list(dict.fromkeys(devices))
        sched = schedule_lib.MakeSchedule(
            self._schedule_name, self.num_cells, num_micro_batches,
            [unique.index(d) for d in devices])
      self._schedules[key] = (sched, schedule_lib.Validate(
          sched, forward_only=forward_only))
    return self._schedules[key][0]

  def UsesRemat(self, micro_batch, num_micro_batches):
    """Whether F(micro_batch, k) keeps only its input for the backward."""
    if self._remat_policy == 'never':
      return False
    if self._remat_policy == 'except_last':
      return micro_batch != num_micro_batches - 1
    return True

  def _Program(self, shards, kinds):
    """The actions of `kinds` (F; or F, B and W; or B and W) of every
    replica, in their validated order."""
    program = dispatch_lib.Program()
    forward_only = tuple(kinds) == (schedule_lib.FORWARD,)
    for r, shard in enumerate(shards):
      sched = self.Schedule(len(shard), r, forward_only)
      order = self._schedules[(len(shard), r, forward_only)][1]
      devices = self._replica_devices[r]
      for action in order:
        if action.kind in kinds:
          d = sched.device_of_cell[action.cell]
          program.Add((r, d), devices[action.cell], (r, action))
    return program

  # ---- entry points ------------------------------------------------------

  def Forward(self, shards, training, collector, dispatcher):
    """The F actions; returns each replica's list of last-cell outputs."""
    step = _Step(self, shards, training, backward=False)
    dispatcher.Run(self._Program(shards, (schedule_lib.FORWARD,)), step)
    step.ApplyStats(collector)
    return [[step.outputs[(r, m)] for m in range(len(shard))]
            for r, shard in enumerate(shards)]

  def ForwardBackward(self, shards, batch_size, loss_fn, training, collector,
                      dispatcher, record_times=False):
    """A training step: every action, the loss on the last cell.

    Returns:
      LossAndGradients. The loss is the exact batch mean (or, for a loss_fn
      returning (sum, weight), the total sum over the total weight), and so
      are the gradients, aligned with the cells' trainable variables.
    """
    step = _Step(self, shards, training, backward=True, batch_size=batch_size,
                 loss_fn=loss_fn,
                 need_input_gradient=self.first_cell_input_gradient)
    step.StartBackward()
    times = dispatcher.Run(
        self._Program(shards, (schedule_lib.FORWARD, schedule_lib.BACKWARD,
                               schedule_lib.WEIGHT)),
        step, record_times)
    step.ApplyStats(collector)
    parts = [step.losses[(r, m)] for r, shard in enumerate(shards)
             for m in range(len(shard))]
    with tf.device(self.cells[0][-1].device), dispatch_lib.OrderAfter(
        dispatcher.last_tokens):
      loss, metrics, scale = loss_lib.Normalize(parts)
    with dispatch_lib.OrderAfter(dispatcher.last_tokens):
      gradients = step.Gradients(scale)
    if times is not None and len(shards) == 1:
      times = {action: t for (_, action), t in times.items()}
    return loss_lib.LossAndGradients(loss, gradients, metrics, times)

  def TapeForward(self, shards, training, collector, dispatcher,
                  need_input_gradient):
    """The F actions of a step whose backward the caller's tape will ask for.

    Returns (outputs, step): each replica's last-cell outputs, and the state
    that TapeBackward needs (its `variables` are what the backward returns
    gradients for).
    """
    step = _Step(self, shards, training, backward=True,
                 need_input_gradient=need_input_gradient)
    step.release_kept = False
    dispatcher.Run(self._Program(shards, (schedule_lib.FORWARD,)), step)
    step.ApplyStats(collector)
    outputs = [[step.outputs[(r, m)] for m in range(len(shard))]
               for r, shard in enumerate(shards)]
    return outputs, step

  def TapeBackward(self, step, output_gradients, dispatcher):
    """The B and W actions, seeded with d loss / d output of each micro-batch.

    Args:
      step: what TapeForward returned.
      output_gradients: [replica][micro-batch] float leaves' gradients.
      dispatcher: how to issue the actions.

    Returns:
      (input_gradients, gradients): [replica][micro-batch] gradients of the
      pipeline input's float leaves (None if not needed), and the
      variables' gradients (None for a variable the output does not reach).
    """
    step.output_gradients = {(r, m): g for r, per_micro in
                             enumerate(output_gradients)
                             for m, g in enumerate(per_micro)}
    step.StartBackward()
    dispatcher.Run(self._Program(step.shards, (schedule_lib.BACKWARD,
                                                schedule_lib.WEIGHT)), step)
    with dispatch_lib.OrderAfter(dispatcher.last_tokens):
      gradients = step.Gradients()
    input_gradients = None
    if step.need_input_gradient:
      input_gradients = [[step.input_gradients[(r, m)]
                          for m in range(len(shard))]
                         for r, shard in enumerate(step.shards)]
    return input_gradients, gradients
