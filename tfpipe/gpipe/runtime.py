"""The pipeline runtime: one interpreter of the schedule for every entry point.

`PipelineRuntime` holds a `Stage` per (replica, cell) and runs a step's
actions through a dispatcher (dispatch.py). What an action does is written
once, in `_Step`:

    F(m, k)  takes cell k's input (the micro-batch, or cell k-1's output),
             runs the stage's forward and hands the output on. With
             re-materialization only the input is kept; without, the forward
             is recorded under a tape kept until B(m, k). On the last cell of
             a training step the loss is applied too, and when B(m, K-1)
             comes right after, both are one call.
    B(m, k)  takes the gradient of cell k's output (from B(m, k+1), from the
             loss, or from the caller's tape), runs the stage's backward,
             which adds the variables' gradients to the stage's buffers, and
             hands the input's gradient to B(m, k-1).
    W(m, k)  (zero-bubble schedules) computes the variables' gradients from
             what F(m, k) and B(m, k) kept and adds them to the buffers;
             B(m, k) then computed only the input's gradient (see
             split_backward.py).

The three entry points are different sets of these actions:

    Forward          the F actions (inference, or a training forward without
                     a tape).
    ForwardBackward  all actions, loss on the last cell: the train step.
    TapeForward /    the F actions now and the B (and W) actions when the
    TapeBackward     caller's GradientTape asks for the gradient (`pipe(x)`
                     under a tape; see pipelining_layer.py), so the tape path
                     accumulates weight gradients in the same buffers and its
                     memory does not grow with M.

Random ops see a seed unique to (step, micro-batch) and the index of the
micro-batch's first example in the whole batch, so a recompute draws the
same values whichever dispatcher runs it. Deferred statistics (batch norm)
are gathered per (replica, micro-batch, cell) and handed to the step's
collector in that order, so the update does not depend on timing.
"""

import dataclasses
from typing import Any

import tensorflow as tf

from tfpipe.gpipe import dispatch as dispatch_lib
from tfpipe.gpipe import schedule as schedule_lib
from tfpipe.gpipe import stage as stage_lib

REMAT_POLICIES = ('always', 'except_last', 'never')


def CheckRematPolicy(remat_policy, name='remat_policy'):
  if remat_policy not in REMAT_POLICIES:
    raise ValueError(f'Unknown remat_policy {remat_policy!r}; expected one of '
                     f'{list(REMAT_POLICIES)}. Received: '
                     f'{name}={remat_policy!r}')


def OnDevice(structure, device):
  """Copies eager tensors to `device` before a call that runs there.

  Then each stage function runs on one device only (its variables are there
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


def _Tokens(structure):
  return [t for t in tf.nest.flatten(structure) if t is not None]


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
  """What F(m, k), B(m, k) and W(m, k) do in one step.

  The items are (replica, Action). When the schedule has W actions, the
  backward is split (split_backward.py): F also returns what B and W read
  (or, re-materialized, keeps only the input, and B runs F again first), B
  computes the input gradient and W the weight gradient, which it
  accumulates.
  """

  def __init__(self, runtime, shards, training, batch_size=None, loss_fn=None,
               backward=True, need_input_gradient=False):
    self.runtime = runtime
    self.shards = shards
    self.training = training
    # Whether B actions will follow (what F must keep for them).
    self.backward = backward
    self.batch_size = batch_size
    self.loss_fn = loss_fn
    self.need_input_gradient = need_input_gradient
    self.saved = {}           # (r, m, k) -> what B(m, k) needs
    self.pending = {}         # (r, m, k) -> what W(m, k) needs
    self.stats = {}           # (r, m, k) -> [(layer, (count, stats))]
    self.losses = {}          # (r, m) -> LossParts
    self.outputs = {}         # (r, m) -> the last cell's output
    self.output_gradients = {}  # (r, m) -> caller's d loss / d output
    self.input_gradients = {}   # (r, m) -> d loss / d pipeline input
    self._last = runtime.num_cells - 1
    self._split = {}          # r -> whether B and W are separate actions
    self._first_accumulation = {}  # (r, k) -> micro-batch accumulated first
    self._adjacent = set()    # (r, m): B(m, K-1) right after F(m, K-1)
    for r in range(len(shards)):
      sched = runtime.Schedule(len(shards[r]), r)
      self._split[r] = sched.splits_backward
      accumulates = (schedule_lib.WEIGHT if sched.splits_backward else
                     schedule_lib.BACKWARD)
      for acts in sched.device_actions:
        for a, following in zip(acts, acts[1:] + [None]):
          if a.kind == accumulates:
            self._first_accumulation.setdefault((r, a.cell), a.micro_batch)
          if (a.kind == schedule_lib.FORWARD and a.cell == self._last and
              loss_fn is not None and following == schedule_lib.Action(
                  schedule_lib.BACKWARD, a.micro_batch, a.cell)):
            self._adjacent.add((r, a.micro_batch))

  def _Stage(self, r, k):
    return self.runtime.stages[r][k]

  def Gather(self, item, store):
    r, (kind, m, k) = item
    device = self._Stage(r, k).device
    if kind == schedule_lib.FORWARD:
      x = self.shards[r].inputs[m] if k == 0 else store.Take(('y', r, m, k - 1))
      return OnDevice(x, device)
    if kind == schedule_lib.WEIGHT:
      return None  # W needs only what B kept on this device.
    if k < self._last:
      return OnDevice(store.Take(('dy', r, m, k + 1)), device)
    if self.loss_fn is None:
      return OnDevice(self.output_gradients[(r, m)], device)
    return None  # The loss's gradient was computed at F(m, K-1).

  def Execute(self, item, args, store):
    r, (kind, m, k) = item
    if kind == schedule_lib.FORWARD:
      return self._Forward(r, m, k, args, store)
    if kind == schedule_lib.BACKWARD:
      return self._Backward(r, m, k, args, store)
    return self._Weight(r, m, k)

  def _Forward(self, r, m, k, x, store):
    stage = self._Stage(r, k)
    shard = self.shards[r]
    seed = OnDevice(shard.seeds[m], stage.device)
    offset = OnDevice(shard.offsets[m], stage.device)
    remat = self.backward and self.runtime.UsesRemat(m, len(shard),
                                                      self.training)
    split = self._split[r]
    need_dx = k > 0 or self.need_input_gradient
    if k == self._last and self.loss_fn is not None:
      targets, scale, batch_size = OnDevice(
          (None if shard.targets is None else shard.targets[m],
           shard.scales[m], self.batch_size), stage.device)
      # Recomputing is pointless when B comes right after F.
      keep = (r, m) in self._adjacent or not remat
      if split and keep:
        parts, stats, recorded = stage.SplitForward(
            x, seed, offset, self.training, need_dx,
            loss=(targets, scale, batch_size, self.loss_fn))
        self.saved[(r, m, k)] = ('recorded', recorded)
        tokens = [parts.numerator]
      elif not keep:  # Re-materialized: keep the input only.
        parts, stats, dy = stage.ForwardLoss(
            x, targets, seed, offset, scale, batch_size, self.training,
            self.loss_fn)
        self.saved[(r, m, k)] = ('remat', x, dy)
        tokens = [parts.numerator] + list(dy)
      elif (r, m) in self._adjacent:
        # B right after F: both in one call, whatever the remat policy: a
        # separate B would either recompute F or keep a tape for nothing.
        parts, stats, dx, done = stage.ForwardLossBackward(
            x, targets, seed, offset, scale, batch_size, self.training,
            self.loss_fn, self._First(r, m, k), need_dx)
        self.saved[(r, m, k)] = ('done', dx)
        tokens = [parts.numerator, done] + list(dx)
      else:
        parts, stats, taped = stage.TapedForward(
            x, seed, offset, self.training, need_dx,
            loss=(targets, scale, batch_size, self.loss_fn))
        self.saved[(r, m, k)] = ('taped', taped)
        tokens = [parts.numerator]
      self.losses[(r, m)] = parts
    else:
      if remat or not self.backward:
        y, stats = stage.Forward(x, seed, offset, self.training)
        if self.backward:
          self.saved[(r, m, k)] = ('remat', x, None)
      elif split:
        y, stats, recorded = stage.SplitForward(x, seed, offset,
                                                self.training, need_dx)
        self.saved[(r, m, k)] = ('recorded', recorded)
      else:
        y, stats, taped = stage.TapedForward(x, seed, offset, self.training,
                                             need_dx)
        self.saved[(r, m, k)] = ('taped', taped)
      if k == self._last:
        self.outputs[(r, m)] = y
      else:
        store.Put(('y', r, m, k), y)
      tokens = _Tokens(y)
    if stats:
      self.stats[(r, m, k)] = stats
    return tokens

  def _First(self, r, m, k):
    return self._first_accumulation[(r, k)] == m

  def _Backward(self, r, m, k, dy, store):
    stage = self._Stage(r, k)
    shard = self.shards[r]
    # Popped: what F kept is freed as soon as its backward has run.
    saved = self.saved.pop((r, m, k))
    need_dx = k > 0 or self.need_input_gradient
    seed = OnDevice(shard.seeds[m], stage.device)
    offset = OnDevice(shard.offsets[m], stage.device)
    if self._split[r]:
      if saved[0] == 'remat':
        _, x, loss_dy = saved
        _, _, recorded = stage.SplitForward(x, seed, offset, self.training,
                                            need_dx, recomputing=True)
        if loss_dy is not None:
          dy = loss_dy
      else:
        recorded = saved[1]
      dx, state, done = stage.InputGradient(recorded, dy)
      self.pending[(r, m, k)] = (recorded.program, state)
      done = done[:1]
    elif saved[0] == 'done':
      dx, done = saved[1], []
    elif saved[0] == 'remat':
      _, x, loss_dy = saved
      if loss_dy is not None:
        dy = loss_dy
      dx, done = stage.Backward(x, dy, seed, offset, self.training,
                                self._First(r, m, k), need_dx)
      done = [done]
    else:
      dx, done = stage.TapedBackward(saved[1], dy, self._First(r, m, k))
    if k > 0:
      store.Put(('dy', r, m, k), dx)
    elif need_dx:
      self.input_gradients[(r, m)] = dx
    return list(dx) + list(done)

  def _Weight(self, r, m, k):
    program, state = self.pending.pop((r, m, k))
    return [self._Stage(r, k).WeightGradient(state, program,
                                             self._First(r, m, k))]

  def ApplyStats(self, collector):
    if collector is None:
      return
    for key in sorted(self.stats):
      r, _, k = key
      for layer, (count, stats) in self.stats[key]:
        collector.Add(layer, stats, count, device=self._Stage(r, k).device)


class PipelineRuntime:
  """Runs a pipeline's steps along its schedules, through a dispatcher."""

  def __init__(self, cells, replica_devices, schedule_name, remat_policy,
               name, describe_error):
    """Creates a stage per (replica, cell).

    Args:
      cells: the K cells, built on replica 0's devices.
      replica_devices: [replica][cell] device names.
      schedule_name: a key of schedule.SCHEDULES.
      remat_policy: one of REMAT_POLICIES.
      name: the pipeline's name, for messages.
      describe_error: fn(k, x, error) -> ValueError naming cell k.
    """
    CheckRematPolicy(remat_policy)
    self.num_cells = len(cells)
    self._cells = cells
    self._replica_devices = replica_devices
    self._schedule_name = schedule_name
    self._remat_policy = remat_policy
    self._schedules = {}
    self.stages = [
        [stage_lib.Stage(cell, k, self.num_cells, devices[k], name,
                         describe_error)
         for k, cell in enumerate(cells)]
        for devices in replica_devices]

  def Schedule(self, num_micro_batches, replica=0):
    """Replica `replica`'s validated schedule for M micro-batches, cached."""
    key = (num_micro_batches, replica)
    if key not in self._schedules:
      devices = self._replica_devices[replica]
      unique = list(dict.fromkeys(devices))
      sched = schedule_lib.MakeSchedule(
          self._schedule_name, self.num_cells, num_micro_batches,
          [unique.index(d) for d in devices])
      self._schedules[key] = (sched, schedule_lib.Validate(sched))
    return self._schedules[key][0]

  def UsesRemat(self, micro_batch, num_micro_batches, training):
    if not training or self._remat_policy == 'never':
      return False
    if self._remat_policy == 'except_last':
      return micro_batch != num_micro_batches - 1
    return True

  def _Program(self, shards, kinds):
    """The actions of `kinds` (some of F, B, W) of every replica."""
    program = dispatch_lib.Program()
    for r, shard in enumerate(shards):
      sched = self.Schedule(len(shard), r)
      order = self._schedules[(len(shard), r)][1]
      devices = self._replica_devices[r]
      device_of = {d: devices[sched.device_of_cell.index(d)]
                   for d in range(sched.num_devices)}
      for action in order:
        if action.kind in kinds:
          d = sched.device_of_cell[action.cell]
          program.Add((r, d), device_of[d], (r, action))
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
    step = _Step(self, shards, training, batch_size=batch_size,
                 loss_fn=loss_fn)
    times = dispatcher.Run(
        self._Program(shards, (schedule_lib.FORWARD, schedule_lib.BACKWARD,
                               schedule_lib.WEIGHT)),
        step, record_times)
    step.ApplyStats(collector)
    parts = [step.losses[(r, m)] for r, shard in enumerate(shards)
             for m in range(len(shard))]
    with tf.device(self.stages[0][-1].device), dispatch_lib.OrderAfter(
        dispatcher.last_tokens):
      loss = tf.add_n([p.numerator for p in parts])
      metrics = {name: tf.add_n([p.metrics[name] for p in parts])
                 for name in parts[0].metrics}
      scale = None
      if parts[0].is_sum:
        scale = 1.0 / tf.add_n([p.weight for p in parts])
        loss *= scale
        metrics = {name: value * scale for name, value in metrics.items()}
    with dispatch_lib.OrderAfter(
        dispatcher.last_tokens):
      gradients = self.Gradients(scale)
    if times is not None and len(shards) == 1:
      times = {action: t for (_, action), t in times.items()}
    return stage_lib.LossAndGradients(loss, gradients, metrics, times)

  def Gradients(self, scale=None):
    """The step's accumulated gradients, summed over replicas.

    Each replica's buffers live on its own devices; the sum is taken on the
    variable's device, which is replica 0's stage device.
    """
    gradients = []
    for k in range(self.num_cells):
      per_replica = [self.stages[r][k].accumulators.Read(scale)
                     for r in range(len(self.stages))]
      if len(per_replica) == 1:
        gradients.extend(per_replica[0])
        continue
      for i, v in enumerate(self.stages[0][k].variables):
        with tf.device(v.device):
          gradients.append(tf.add_n([grads[i] for grads in per_replica]))
    return gradients

  def TapeForward(self, shards, training, collector, dispatcher,
                  need_input_gradient):
    """The F actions of a step whose backward the caller's tape will ask for.

    Returns (outputs, step): each replica's last-cell outputs, and the state
    that TapeBackward needs.
    """
    step = _Step(self, shards, training,
                 need_input_gradient=need_input_gradient)
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
      variables' gradients.
    """
    step.output_gradients = {(r, m): g for r, per_micro in
                             enumerate(output_gradients)
                             for m, g in enumerate(per_micro)}
    dispatcher.Run(self._Program(step.shards, (schedule_lib.BACKWARD,
                                                schedule_lib.WEIGHT)), step)
    with dispatch_lib.OrderAfter(
        dispatcher.last_tokens):
      gradients = self.Gradients()
    input_gradients = None
    if step.need_input_gradient:
      input_gradients = [[step.input_gradients[(r, m)]
                          for m in range(len(shard))]
                         for r, shard in enumerate(step.shards)]
    return input_gradients, gradients
