"""Each device's peak memory in a training step, predicted before it runs.

A device holds, for the whole step, its cells' variables, one gradient
accumulator per variable and the optimizer's slots (`resident`). On top of
that, the schedule decides what is in flight: each forward F(m, k) keeps
what its backward B(m, k) will read (under re-materialization the cell's
input only; without it the activations the engine keeps, and the input
only if the backward reads it), and each action needs a working set while
it runs (a re-materialized B recomputes the cell's activations, takes the
gradient and holds the weight gradients until they are accumulated). So
the peak is found by walking each device's action list, as the runtime
issues it:

    live = resident
    F(m, k): peak candidate  live + input + forward working set
             then            live += kept input + kept(m)
    B(m, k): peak candidate  live + received output gradient + backward
                             working set (the input gradient it hands back
                             included: memory_profile measures it there)
             then            live -= kept input + kept(m)
    the update: peak candidate  resident + the optimizer's working set
                (clipping included)

and at every action, the inputs already received for forwards still to
come on this device: in one graph (the executor for GPUs and worker
processes) a receive has no inputs of its own, so it pulls each activation
as soon as the neighbour has made it. An input counts from the first
action that the schedule does not order before its producer's forward:
what the devices' speeds allow, not what they did (with executor='threads'
a device copies an input when its forward starts, and this is a bound).
Measured on AmoebaNet-D K=4's capped workers against each device's median
of three runs: 14 of 18 configurations within 15% with it, 12 without;
over every stored run of the grid, the H200's included, 399 of 486 rows
against 389; the whole grid measured after the rule was chosen, 151 of 162
(benchmarks/RESULTS.md). Received gradients do not arrive that way: the
runtime sends one on only once the taker's action before the one before
its backward has ended (dispatch.HandOver), so it counts during the action
before its backward, and on its sender, which holds it until then, through
every later action the schedule does not order after the taker's. Before,
a device whose backwards were the slower could hold every gradient its
neighbour had made, as many as the devices' speeds allowed (counting them
all, or timing them by the profile, over-predicted the others): AmoebaNet-D
on 4 workers, GPipe M=8 with remat, device 0 measured 9.0-11.2 MiB against
7.7-9.4 predicted in two runs; 7.7-9.1 with the hand-over, within 15%.

The last cell's F and B run as one call when B comes right after F (the
runtime's fused call: no recompute, nothing kept). Inputs and targets of the
whole batch sit on the first and last devices for the step. With one
micro-batch there are no accumulators: each B's weight gradients are its
own, live from the B to the update.

The per-cell numbers (`CellMemory`) are measured, not derived from the
engine's code: `memory_profile` runs each distinct cell through the engine's
own training step once and reads the allocator around every action, so the
model follows whatever the engine keeps. What a cell holds scales with the
micro-batch size n, except its weight gradients; `CellProfile` interpolates
between profiled sizes (affine in n). This module is pure Python (no
TensorFlow), so the planner can evaluate thousands of configurations.
"""

import dataclasses
import statistics
from typing import Dict, List, Optional, Sequence

from tfpipe.gpipe import schedule as schedule_lib

REMAT = 'always'
NO_REMAT = 'never'
# Schedules whose actions the walk understands: F and B (no split W).
SCHEDULES = ('gpipe', '1f1b', 'interleaved_1f1b')

# Fields of CellMemory that do not depend on the micro-batch size.
_RESIDENT_FIELDS = ('variable_bytes', 'other_variable_bytes',
                    'optimizer_bytes', 'allocator_slack_bytes', 'update_peak',
                    'update_s')
# Fields of CellMemory that say how it was profiled.
_FLAGS = ('is_last', 'includes_input_gradient')


@dataclasses.dataclass
class CellMemory:
  """What one cell's actions hold, in bytes, at one micro-batch size.

  `kept`, `forward_peak` and `backward_peak` are keyed by REMAT and NO_REMAT.
  A peak is measured above what was live before the action started.

  Attributes:
    micro_batch_size: n, the examples of the micro-batch measured.
    variable_bytes: the cell's trainable variables (also the size of its
      gradient accumulators).
    other_variable_bytes: its other variables (batch-norm statistics).
    optimizer_bytes: the optimizer's slots for its variables.
    allocator_slack_bytes: what a fresh one-region allocator (a GPU's, a
      capped worker's) holds after building the cell's variables and slots,
      beyond their bytes: BFC gives a request a whole free chunk when the
      chunk is under twice its size, so a slot that lands in the hole left
      by an initializer's temporaries can take nearly twice its bytes for
      the whole run (allocator_slack.BuildSlack).
    input_bytes: one micro-batch's input to the cell (what a device receives
      and, re-materialized, keeps).
    input_gradient_bytes: the float part of it (the gradient B hands back).
    kept_input: of the input, what F keeps until its B (its buffers that
      F's record holds), keyed like `kept`: all of it re-materialized;
      without, only what the backward reads. A received input that is not
      kept is freed when F ends. Profiles without it keep the whole input.
    output_bytes: one micro-batch's output (what F hands on).
    output_gradient_bytes: the float part of it (the gradient B receives).
    kept: what F keeps until its B, beyond the input.
    forward_peak: F's working set.
    backward_peak: B's working set (the recompute included, under remat).
    fused_peak: F, loss and B of the last cell in one call.
    update_peak: the optimizer update's working set (clipping included).
    is_last: profiled as the last cell, with the model's loss.
    includes_input_gradient: the actions were profiled computing the input
      gradient, as a cell that is not first does, so B's and the fused
      call's peaks hold it where it is made. Without (a first cell's
      profile, or an older one), the walk adds its bytes to a later cell's
      B.
    forward_s, backward_s, fused_s, update_s: seconds, as measured once
      while profiling (keyed like the peaks where they are dicts; the
      forward and the fused call in the re-materialized mode where it was
      profiled, else in the one that was).
  """
  micro_batch_size: int
  variable_bytes: int = 0
  other_variable_bytes: int = 0
  optimizer_bytes: int = 0
  allocator_slack_bytes: int = 0
  input_bytes: int = 0
  input_gradient_bytes: int = 0
  kept_input: Dict[str, float] = dataclasses.field(default_factory=dict)
  output_bytes: int = 0
  output_gradient_bytes: int = 0
  kept: Dict[str, float] = dataclasses.field(default_factory=dict)
  forward_peak: Dict[str, float] = dataclasses.field(default_factory=dict)
  backward_peak: Dict[str, float] = dataclasses.field(default_factory=dict)
  fused_peak: float = 0.0
  update_peak: float = 0.0
  is_last: bool = False
  includes_input_gradient: bool = False
  forward_s: float = 0.0
  backward_s: Dict[str, float] = dataclasses.field(default_factory=dict)
  fused_s: float = 0.0
  update_s: float = 0.0

  @property
  def resident_bytes(self):
    """Variables, gradient accumulators, optimizer slots, other variables
    and the allocator's slack around them."""
    return (2 * self.variable_bytes + self.optimizer_bytes +
            self.other_variable_bytes + self.allocator_slack_bytes)

  def ToDict(self):
    return dataclasses.asdict(self)

  @classmethod
  def FromDict(cls, values):
    return cls(**values)


def _Blend(a, b, weight):
  """a + weight * (b - a), recursively over dicts; never below 0."""
  if isinstance(a, dict):
    return {key: _Blend(a[key], b[key], weight) for key in a}
  if isinstance(a, bool):
    return a
  return max(0.0, a + weight * (b - a))


class CellProfile:
  """One cell's CellMemory at several micro-batch sizes; any size by
  interpolation.

  What a cell holds per micro-batch is affine in n (activations grow with
  the examples; the weight gradients do not), so two measured sizes give
  every other one; sizes beyond them are extrapolated from the nearest two.
  """

  def __init__(self, measurements: Sequence[CellMemory]):
    if not measurements:
      raise ValueError('A CellProfile needs at least one measurement.')
    self.by_size = {m.micro_batch_size: m for m in measurements}

  @property
  def sizes(self):
    return sorted(self.by_size)

  def At(self, n):
    """The CellMemory at micro-batch size n."""
    if n in self.by_size:
      return self.by_size[n]
    sizes = self.sizes
    if len(sizes) == 1:
      only = self.by_size[sizes[0]]
      return dataclasses.replace(
          _Scaled(only, n / sizes[0]), micro_batch_size=n)
    below = [s for s in sizes if s < n]
    above = [s for s in sizes if s > n]
    if below and above:
      lo, hi = below[-1], above[0]
    elif below:
      lo, hi = below[-2:] if len(below) > 1 else (below[-1], below[-1])
    else:
      lo, hi = above[:2]
    a, b = self.by_size[lo], self.by_size[hi]
    weight = (n - lo) / (hi - lo)
    values = {}
    for field in dataclasses.fields(CellMemory):
      name = field.name
      if name == 'micro_batch_size':
        values[name] = n
      elif name in _RESIDENT_FIELDS or name in _FLAGS:
        values[name] = getattr(a, name)
      else:
        values[name] = _Blend(getattr(a, name), getattr(b, name), weight)
    return CellMemory(**values)

  def ToDict(self):
    return {'measurements': [m.ToDict() for m in self.by_size.values()]}

  @classmethod
  def FromDict(cls, values):
    return cls([CellMemory.FromDict(m) for m in values['measurements']])


def MedianProfile(profiles):
  """Each measured quantity's median over profiles of one cell, each made
  in a process of its own: one process's allocator settles on one packing
  of a step's chunks (AmoebaNet-D's first cell of two, re-materialized:
  a backward of 55-60 MiB over six steps of one process, 65-72 in another),
  and so does a worker's; the median of three draws the common one."""
  profiles = list(profiles)
  if len(profiles) == 1:
    return profiles[0]
  measurements = []
  for n in profiles[0].sizes:
    runs = [p.by_size[n] for p in profiles]
    values = {}
    for field in dataclasses.fields(CellMemory):
      name = field.name
      first = getattr(runs[0], name)
      if name == 'micro_batch_size' or name in _FLAGS:
        values[name] = first
      elif isinstance(first, dict):
        values[name] = {key: statistics.median(
            getattr(r, name)[key] for r in runs) for key in first}
      else:
        values[name] = statistics.median(getattr(r, name) for r in runs)
    measurements.append(CellMemory(**values))
  return CellProfile(measurements)


def _Scaled(memory, factor):
  """A single measurement scaled to another size: activations only."""
  values = {}
  for field in dataclasses.fields(CellMemory):
    name = field.name
    value = getattr(memory, name)
    if name in _RESIDENT_FIELDS or name in ('micro_batch_size',) + _FLAGS:
      values[name] = value
    elif isinstance(value, dict):
      values[name] = {key: v * factor for key, v in value.items()}
    else:
      values[name] = value * factor
  return CellMemory(**values)


@dataclasses.dataclass
class DevicePeak:
  """A device's predicted peak and what it is made of at that moment.

  Attributes:
    device: the device's index in the schedule.
    cells: the cells it runs.
    peak_bytes: the prediction.
    variable_bytes, accumulator_bytes, optimizer_bytes, other_bytes,
      slack_bytes: the resident part (slack: CellMemory.allocator_slack_bytes).
    batch_bytes: the whole batch's inputs (first device) and targets (last).
    gradient_bytes: with one micro-batch, the weight gradients its backward
      actions made so far, kept until the update (there are no
      accumulators: accumulators.ONLY).
    in_flight: micro-batches whose forward state the device holds then.
    kept_bytes: that state: the inputs they keep and what their F kept.
    ahead_bytes: inputs and gradients received then for actions still to
      come.
    sending_bytes: input gradients its backwards made, held until the
      device before is due to use them (dispatch.HandOver).
    transient_bytes: the working set of the action running at the peak,
      with the gradient it received.
    action: that action ('F3.1', 'B0.2', or 'update').
  """
  device: int
  cells: List[int]
  peak_bytes: float
  variable_bytes: float = 0.0
  accumulator_bytes: float = 0.0
  optimizer_bytes: float = 0.0
  other_bytes: float = 0.0
  slack_bytes: float = 0.0
  batch_bytes: float = 0.0
  gradient_bytes: float = 0.0
  in_flight: int = 0
  kept_bytes: float = 0.0
  ahead_bytes: float = 0.0
  sending_bytes: float = 0.0
  transient_bytes: float = 0.0
  action: str = ''

  def Describe(self):
    """'12.3 MiB at B0.1 = variables 2.0 + accumulators 2.0 + ...'."""
    mib = 2.0**20
    parts = [('variables', self.variable_bytes),
             ('accumulators', self.accumulator_bytes),
             ('optimizer slots', self.optimizer_bytes),
             ('other variables', self.other_bytes),
             ('allocator slack', self.slack_bytes),
             ('batch', self.batch_bytes),
             ('gradients', self.gradient_bytes),
             (f'{self.in_flight} micro-batch(es) in flight', self.kept_bytes),
             ('received ahead', self.ahead_bytes),
             ('gradients to send', self.sending_bytes),
             (f'{self.action} working set', self.transient_bytes)]
    return (f'{self.peak_bytes / mib:.1f} MiB at {self.action} = ' + ' + '.join(
        f'{name} {value / mib:.1f}' for name, value in parts
        if value >= 0.05 * mib))


@dataclasses.dataclass
class StepConfig:
  """What the walk needs to know about the step besides the cells.

  Attributes:
    schedule: 'gpipe', '1f1b' or 'interleaved_1f1b'.
    num_micro_batches: M.
    batch_size: N, the examples of one replica's batch.
    remat_policy: 'always', 'except_last' or 'never'.
    device_of_cell: device index of each cell (default: cell k on device k).
    input_example_bytes: bytes of one example's input (the first device
      holds the whole batch's).
    target_example_bytes: bytes of one example's targets (last device).
  """
  schedule: str
  num_micro_batches: int
  batch_size: int
  remat_policy: str = 'always'
  device_of_cell: Optional[List[int]] = None
  input_example_bytes: float = 0.0
  target_example_bytes: float = 0.0


def MicroBatchSizes(batch_size, num_micro_batches):
  """Sizes of the M micro-batches of N examples (differing by at most one)."""
  base, extra = divmod(batch_size, num_micro_batches)
  return [base + (1 if m < extra else 0) for m in range(num_micro_batches)]


def UsesRemat(remat_policy, micro_batch, num_micro_batches):
  """Whether F(m) keeps only its input (the runtime's rule)."""
  if remat_policy == 'never':
    return False
  if remat_policy == 'except_last':
    return micro_batch != num_micro_batches - 1
  return True


def CheckStep(step):
  if step.schedule not in SCHEDULES:
    raise ValueError(
        f'The memory model walks the schedules {list(SCHEDULES)}; '
        f'schedule={step.schedule!r} splits the backward into B and W, whose '
        'memory it does not model yet.')
  if step.remat_policy not in ('always', 'except_last', 'never'):
    raise ValueError(f'Unknown remat_policy {step.remat_policy!r}. Received: '
                     f'remat_policy={step.remat_policy!r}')
  if step.batch_size < step.num_micro_batches:
    raise ValueError(f'batch_size={step.batch_size} is smaller than '
                     f'num_micro_batches={step.num_micro_batches}.')


def _FusedActions(sched):
  """Micro-batches whose last-cell B comes right after their F (one call)."""
  last = sched.num_cells - 1
  fused = set()
  for acts in sched.device_actions:
    for a, following in zip(acts, acts[1:] + [None]):
      if (a.kind == schedule_lib.FORWARD and a.cell == last and
          following == schedule_lib.Action(schedule_lib.BACKWARD,
                                           a.micro_batch, last)):
        fused.add(a.micro_batch)
  return fused


class _DeviceWalk:
  """One device's live bytes through its actions, and its largest moment."""

  def __init__(self, peak, base):
    self.peak = peak
    self.base = base
    self.kept = 0.0
    self.gradients = 0.0
    self.held = {}
    self.best = None
    self.Consider(0.0, 'start')

  def Consider(self, transient, action, ahead=0.0, sending=0.0):
    total = self.base + self.gradients + self.kept + ahead + sending + transient
    if self.best is None or total > self.best[0]:
      self.best = (total, self.gradients, len(self.held), self.kept, ahead,
                   sending, transient, action)

  def Keep(self, key, value):
    self.held[key] = value
    self.kept += value

  def Free(self, key):
    self.kept -= self.held.pop(key)

  def KeepGradients(self, value):
    self.gradients += value

  def Result(self):
    (self.peak.peak_bytes, self.peak.gradient_bytes, self.peak.in_flight,
     self.peak.kept_bytes, self.peak.ahead_bytes, self.peak.sending_bytes,
     self.peak.transient_bytes, self.peak.action) = self.best
    return self.peak


def MakeSchedule(step, num_cells):
  """The schedule the step runs (checked), as schedule.MakeSchedule builds it."""
  CheckStep(step)
  return schedule_lib.MakeSchedule(step.schedule, num_cells,
                                   step.num_micro_batches, step.device_of_cell)


def _ReceivedAhead(sched, device, cell_at, sizes):
  """Per action of the device, in its order: the bytes it may have received
  by then for its actions still to come (see the module docstring): inputs
  of its forwards, from the first action the schedule does not order before
  their producer; gradients of its backwards, during the action before."""
  acts = sched.device_actions[device]
  clocks = schedule_lib.LatestAncestors(sched)
  last = sched.num_cells - 1
  ahead = [0.0] * len(acts)
  for j, a in enumerate(acts):
    if (a.kind == schedule_lib.FORWARD and a.cell > 0 and
        sched.device_of_cell[a.cell - 1] != device):
      producer = schedule_lib.Action(schedule_lib.FORWARD, a.micro_batch,
                                     a.cell - 1)
      received = cell_at(a.cell, sizes[a.micro_batch]).input_bytes
      first = clocks[producer][device] + 1
    elif (a.kind == schedule_lib.BACKWARD and a.cell < last and
          sched.device_of_cell[a.cell + 1] != device):
      producer = schedule_lib.Action(schedule_lib.BACKWARD, a.micro_batch,
                                     a.cell + 1)
      received = cell_at(a.cell, sizes[a.micro_batch]).output_gradient_bytes
      first = max(clocks[producer][device] + 1, j - 1)
    else:
      continue
    for i in range(first, j):
      ahead[i] += received
  return ahead


def _HeldToSend(sched, device, cell_at, sizes):
  """Per action of the device, in its order: the input gradients its
  backwards have made and still hold for another device. The runtime sends
  one only once the taker's action before the one before its use has ended
  (dispatch.HandOver), so it is held through every later action of this
  device that the schedule does not order after that one."""
  acts = sched.device_actions[device]
  clocks = schedule_lib.LatestAncestors(sched)
  held = [0.0] * len(acts)
  for b, a in enumerate(acts):
    if a.kind != schedule_lib.BACKWARD or a.cell == 0:
      continue
    taker = sched.device_of_cell[a.cell - 1]
    if taker == device:
      continue
    use = schedule_lib.Action(schedule_lib.BACKWARD, a.micro_batch,
                              a.cell - 1)
    due = sched.device_actions[taker].index(use) - 2
    if due < 0:
      continue  # Sent at once: the taker has no action to wait for.
    size = cell_at(a.cell, sizes[a.micro_batch]).input_gradient_bytes
    for i in range(b + 1, len(acts)):
      if clocks[acts[i]][taker] >= due:
        break
      held[i] += size
  return held


def WalkDevice(sched, device, cell_at, step):
  """The DevicePeak of one device of a schedule.

  Args:
    sched: the schedule (MakeSchedule).
    device: the device's index.
    cell_at: cell_at(k, n) -> CellMemory of cell k at micro-batch size n,
      for the cells this device runs.
    step: the StepConfig.
  """
  sizes = MicroBatchSizes(step.batch_size, step.num_micro_batches)
  fused = _FusedActions(sched)
  last = sched.num_cells - 1
  acts = sched.device_actions[device]
  own = sorted({a.cell for a in acts})
  first = [cell_at(k, sizes[0]) for k in own]
  # With one micro-batch there are no accumulators: each B's weight
  # gradients are part of its working set, then live until the update.
  # Counting buffers as well over-predicted every M=1 peak at a B by the
  # cell's variables (MLP K=4: +15-17%).
  only = step.num_micro_batches == 1
  peak = DevicePeak(
      device=device, cells=own, peak_bytes=0.0,
      variable_bytes=sum(c.variable_bytes for c in first),
      accumulator_bytes=0.0 if only else sum(c.variable_bytes for c in first),
      optimizer_bytes=sum(c.optimizer_bytes for c in first),
      other_bytes=sum(c.other_variable_bytes for c in first),
      slack_bytes=sum(c.allocator_slack_bytes for c in first))
  if 0 in own:
    peak.batch_bytes += step.input_example_bytes * step.batch_size
  if last in own:
    peak.batch_bytes += step.target_example_bytes * step.batch_size
  walk = _DeviceWalk(peak, peak.variable_bytes + peak.accumulator_bytes +
                     peak.optimizer_bytes + peak.other_bytes +
                     peak.slack_bytes + peak.batch_bytes)
  ahead = _ReceivedAhead(sched, device, cell_at, sizes)
  sending = _HeldToSend(sched, device, cell_at, sizes)
  for a, early, held_to_send in zip(acts, ahead, sending):
    k, m = a.cell, a.micro_batch
    c = cell_at(k, sizes[m])
    # Cell 0's input is a slice of the batch, already counted.
    received = c.input_bytes if k > 0 else 0.0
    dx = (c.input_gradient_bytes
          if k > 0 and not c.includes_input_gradient else 0.0)
    mode = REMAT if UsesRemat(step.remat_policy, m,
                              step.num_micro_batches) else NO_REMAT
    if k == last and m in fused:
      if a.kind == schedule_lib.FORWARD:
        walk.Consider(received + c.fused_peak + dx, str(a), early,
                      held_to_send)
        if only:
          walk.KeepGradients(c.variable_bytes)
    elif a.kind == schedule_lib.FORWARD:
      walk.Consider(received + c.forward_peak[mode], str(a), early,
                    held_to_send)
      held = c.kept_input.get(mode, received) if k > 0 else 0.0
      walk.Keep((k, m), held + c.kept[mode])
    else:
      incoming = c.output_gradient_bytes if k < last else 0.0
      walk.Consider(incoming + c.backward_peak[mode] + dx, str(a), early,
                    held_to_send)
      walk.Free((k, m))
      if only:
        walk.KeepGradients(c.variable_bytes)
  # The update reads the step's gradients, which alias the accumulators
  # (measured: counting them again over-predicted multi-device MLPs by up
  # to 33%), and adds its own working set.
  walk.Consider(sum(c.update_peak for c in first), 'update')
  return walk.Result()


def PredictPeaks(cells: Sequence[CellProfile], step: StepConfig):
  """Each device's DevicePeak for one replica's training step.

  Args:
    cells: the profile of each cell, in order (the last one profiled with
      the loss).
    step: the schedule, M, N, remat policy and placement.

  Returns:
    A list of DevicePeak, one per device of the schedule.
  """
  sched = MakeSchedule(step, len(cells))
  cache = {}

  def CellAt(k, n):
    if (k, n) not in cache:
      cache[(k, n)] = cells[k].At(n)
    return cache[(k, n)]
  return [WalkDevice(sched, d, CellAt, step)
          for d in range(sched.num_devices)]


def PeakTable(peaks, budget_bytes=None):
  """Lines 'device k (cells ...): predicted X MiB of Y MiB: breakdown'."""
  mib = 2.0**20
  lines = []
  for p in peaks:
    cells = ', '.join(map(str, p.cells))
    limit = ''
    if budget_bytes:
      limit = (f' of {budget_bytes / mib:.0f} MiB'
               f'{" (does not fit)" if p.peak_bytes > budget_bytes else ""}')
    lines.append(f'device {p.device} (cell {cells}): predicted '
                 f'{p.peak_bytes / mib:.1f} MiB{limit}: {p.Describe()}')
  return lines
