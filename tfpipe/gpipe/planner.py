"""The planner: the fastest pipeline configuration that fits every device.

Given the devices (how many, each one's memory, optionally the bandwidth
between neighbours), the model (one memory profile per layer,
gpipe.memory_profile) and the global batch, it chooses

    K partitions and R = devices // K data-parallel replicas,
    the cut (which layers each cell holds),
    M micro-batches, the remat policy and the schedule,

to minimise the predicted step time with every device's predicted peak
(gpipe.memory_model) within its budget, less a headroom for the model's
error (`Devices.headroom`). This is PipeDream's optimizer with
GPipe's constraint: a dynamic program over (the first i layers, j cells)
minimises the slowest cell (its compute and what it sends to its
neighbours), and only cuts whose cell fits its device are allowed; what a cell holds on device j depends on the schedule (how many
micro-batches are in flight there) and on M and the remat policy, so the
program runs once per (K, M, remat, schedule).

Predicted step time, from the profiled seconds of each action:
  * devices that run at the same time (accelerators): the schedule's
    simulated makespan (schedule.Simulate: the bubble included), each
    action's cost being its compute (a re-materialized B includes its
    recompute), plus the transfer of what it hands on (a forward's
    activation, a backward's input gradient); then the slowest device's
    update;
  * devices that do not (logical CPU devices of one process, whose stages
    share one thread pool): the sum of every action, transfer and update.
    CPU worker processes do compute at the same time, with either executor
    (benchmarks/RESULTS.md, "Issue 23").
A profiled action's time includes its fixed cost (a function call); a cell
of several layers pays it once, so it is counted once per action. Worker
processes driven by a controller (RemoteWorkers) also pay the trainer's
per-step work, two function calls per step and each transfer's send/recv
latency, as measured by benchmarks/remote_action_costs.py and
benchmarks/planner_check.py. Worker processes on one host share its cores:
only `Devices.computing_at_once` of them compute at the same time, and the
step lasts at least their summed compute over that number.

A cell of several layers is estimated from its layers' profiles
(`CombineLayers`): what they keep adds up, a re-materialized backward holds
all their activations at once, other working sets are the largest layer's.
The chosen plan's cells are then profiled as cells (`Refine`), which is
exact, and a plan that no longer fits is dropped for the next best.

Nothing fits: `NoPlanError` says so before anything runs and names the
smallest per-device memory that would fit.
"""

import dataclasses
import math
from typing import List, Sequence

from tfpipe.gpipe import memory_model
from tfpipe.gpipe import plan_devices
from tfpipe.gpipe import schedule as schedule_lib

MIB = 2.0**20
REMAT_POLICIES = ('never', 'except_last', 'always')
SCHEDULES = ('1f1b', 'gpipe')


# The devices' description lives in plan_devices; these names stay here too.
Devices = plan_devices.Devices
HostComputingAtOnce = plan_devices.HostComputingAtOnce
RemoteWorkers = plan_devices.RemoteWorkers


@dataclasses.dataclass
class PipelinePlan:
  """A configuration, its predicted peaks and step time, and why."""
  num_partitions: int
  num_replicas: int
  layer_counts: List[int]
  num_micro_batches: int
  remat_policy: str
  schedule: str
  peaks: List[memory_model.DevicePeak]
  step_time_s: float
  time_parts: dict
  memory_bytes: float
  reasons: List[str] = dataclasses.field(default_factory=list)
  # How `memory_bytes` was used: Devices.BudgetText().
  budget_text: str = ''

  @property
  def max_peak_bytes(self):
    return max(p.peak_bytes for p in self.peaks)

  def Describe(self):
    """The plan and why, in a few lines."""
    k, r, m = self.num_partitions, self.num_replicas, self.num_micro_batches
    parts = ', '.join(f'{name} {value:.3g}s'
                      for name, value in self.time_parts.items() if value)
    peaks = ' / '.join(f'{p.peak_bytes / MIB:.1f}' for p in self.peaks)
    lines = [
        f'Plan: {k} partition(s) x {r} replica(s), layers per cell '
        f'{self.layer_counts}, {m} micro-batch(es), '
        f'remat_policy={self.remat_policy}, schedule={self.schedule}.',
        f'  predicted step time {self.step_time_s:.3g}s ({parts})',
        f'  predicted peak per device {peaks} MiB, each within '
        f'{self.budget_text or f"{self.memory_bytes / MIB:.0f} MiB"}; the '
        f'largest: {max(self.peaks, key=lambda p: p.peak_bytes).Describe()}']
    lines += [f'  why: {reason}' for reason in self.reasons]
    return '\n'.join(lines)


class NoPlanError(ValueError):
  """No configuration fits; `smallest_memory_bytes` would fit one."""

  def __init__(self, message, smallest_memory_bytes):
    super().__init__(message)
    self.smallest_memory_bytes = smallest_memory_bytes


# ---- a cell of several layers, from its layers' profiles --------------------


def CombineLayers(layers: Sequence[memory_model.CellMemory],
                  action_seconds=0.0):
  """The CellMemory of a cell holding these layers, at one micro-batch size.

  Args:
    layers: the layers' CellMemory at that size, in order; the last one was
      profiled as the last cell if the cell is.
    action_seconds: the fixed cost of one action, which each layer's
      profiled time includes and the cell pays once.
  """
  first, last = layers[0], layers[-1]
  no, re = memory_model.NO_REMAT, memory_model.REMAT
  # Activations passed between the cell's layers that its forward keeps:
  # those a layer's backward reads.
  inner = sum(layer.kept_input.get(no, layer.input_bytes)
              for layer in layers[1:])
  recorded = sum(layer.kept[no] for layer in layers) + inner
  before_last = recorded - last.kept[no]
  fixed = action_seconds * (len(layers) - 1)

  def Seconds(values):
    return max(0.0, sum(values) - fixed)
  return memory_model.CellMemory(
      micro_batch_size=first.micro_batch_size,
      variable_bytes=sum(layer.variable_bytes for layer in layers),
      other_variable_bytes=sum(layer.other_variable_bytes for layer in layers),
      optimizer_bytes=sum(layer.optimizer_bytes for layer in layers),
      # The holes a build leaves are reused by the next layer's build: one
      # layer's slack, not their sum (the planner's refinement measures the
      # cell itself).
      allocator_slack_bytes=max(layer.allocator_slack_bytes
                                for layer in layers),
      input_bytes=first.input_bytes,
      input_gradient_bytes=first.input_gradient_bytes,
      kept_input=dict(first.kept_input),
      includes_input_gradient=first.includes_input_gradient,
      output_bytes=last.output_bytes,
      output_gradient_bytes=last.output_gradient_bytes,
      kept={re: last.kept[re], no: recorded},
      forward_peak={
          re: max(layer.forward_peak[re] + (layer.input_bytes if i else 0)
                  for i, layer in enumerate(layers)),
          no: before_last + last.forward_peak[no]},
      backward_peak={
          re: recorded + max(layer.backward_peak[re] - layer.kept[no]
                             for layer in layers),
          no: max(layer.backward_peak[no] for layer in layers)},
      fused_peak=before_last + last.fused_peak,
      update_peak=max(layer.update_peak for layer in layers),
      is_last=last.is_last,
      forward_s=Seconds(layer.forward_s for layer in layers),
      backward_s={mode: Seconds(layer.backward_s[mode] for layer in layers)
                  for mode in (re, no)},
      fused_s=Seconds([layer.forward_s + layer.backward_s[no]
                       for layer in layers[:-1]] + [last.fused_s]),
      update_s=sum(layer.update_s for layer in layers))


class LayerProfiles:
  """Per-layer profiles, and any range of layers as one cell (cached)."""

  def __init__(self, layers: Sequence[memory_model.CellProfile],
               last_layer: memory_model.CellProfile, action_seconds=0.0):
    """Args:
      layers: each layer's profile as a cell that is not last.
      last_layer: the last layer's profile as the last cell (with the loss).
      action_seconds: the fixed cost of one action.
    """
    self.layers = list(layers)
    self.last_layer = last_layer
    self.action_seconds = action_seconds
    self._cache = {}

  def __len__(self):
    return len(self.layers)

  def Range(self, start, stop, n):
    """The CellMemory of layers [start, stop) as one cell, at size n."""
    key = (start, stop, n)
    if key not in self._cache:
      memories = [self.layers[i].At(n) for i in range(start, stop)]
      if stop == len(self.layers):
        memories[-1] = self.last_layer.At(n)
      self._cache[key] = CombineLayers(memories, self.action_seconds)
    return self._cache[key]


# ---- step time ---------------------------------------------------------------


def _Transfer(num_bytes, devices):
  if not devices.bandwidth_bytes_per_s:
    return devices.latency_s
  return devices.latency_s + num_bytes / devices.bandwidth_bytes_per_s


def StepTime(cells, step, devices, sched=None, num_replicas=1):
  """(seconds, parts) of one step of these CellMemory cells (at step's n).

  With R replicas, each runs the step on its share of the batch; on
  concurrent devices at the same time, followed by the sum of their
  gradients into replica 0's (one transfer of each cell's weights), else
  one after another.
  """
  num_cells = len(cells)
  sched = sched or memory_model.MakeSchedule(step, num_cells)
  fused = memory_model._FusedActions(sched)  # pylint: disable=protected-access
  last = num_cells - 1
  remat = step.remat_policy != 'never'
  mode = memory_model.REMAT if remat else memory_model.NO_REMAT
  # Each boundary carries an activation on (sent by cell k's F) and its
  # gradient back (sent by cell k+1's B, or its fused call).
  transfers = [_Transfer(c.output_bytes, devices) if k < last else 0.0
               for k, c in enumerate(cells)]
  sent_back = [0.0] + [_Transfer(c.output_gradient_bytes, devices)
                       for c in cells[:last]]
  forward = [c.forward_s + t for c, t in zip(cells, transfers)]
  backward = [c.backward_s[mode] + g for c, g in zip(cells, sent_back)]
  if fused:
    forward[last] = cells[last].fused_s + sent_back[last]
    backward[last] = 0.0
  m = step.num_micro_batches
  recompute = sum(max(0.0, c.backward_s[mode] -
                      c.backward_s[memory_model.NO_REMAT])
                  for c in cells[:last]) * m
  update = [c.update_s for c in cells]
  moved = (sum(transfers) + sum(sent_back)) * m
  compute = (sum(forward) + sum(backward)) * m - moved - recompute
  parts = {'compute': compute, 'recompute': recompute, 'transfers': moved}
  if not devices.concurrent:
    parts = {name: value * num_replicas for name, value in parts.items()}
    parts['update'] = sum(update)
    parts['per step'] = devices.StepCallSeconds(num_cells * num_replicas)
    return sum(parts.values()), parts
  sim = schedule_lib.Simulate(sched, forward_costs=forward,
                              backward_costs=[max(b, 1e-12)
                                              for b in backward])
  busy = (compute + parts['recompute']) * num_replicas
  parts = {name: value / num_cells for name, value in parts.items()}
  parts['bubble'] = sim.idle_time / num_cells
  parts['update'] = max(update)
  makespan = sim.makespan
  at_once = devices.computing_at_once
  if at_once and at_once < num_cells * num_replicas:
    # More devices than can compute at once: they take turns, so the step
    # lasts at least their summed compute (and updates) over `at_once`.
    makespan = max(makespan, busy / at_once)
    parts['taking turns'] = makespan - sim.makespan
    parts['update'] = max(parts['update'],
                          sum(update) * num_replicas / at_once)
  if num_replicas > 1:
    bandwidth = devices.bandwidth_bytes_per_s
    parts['gradient sum'] = max(
        devices.latency_s +
        (c.variable_bytes / bandwidth if bandwidth else 0.0)
        for c in cells) * math.ceil(math.log2(num_replicas))
  parts['per step'] = devices.StepCallSeconds(num_cells * num_replicas)
  return makespan + sum(v for k, v in parts.items()
                        if k in ('update', 'gradient sum', 'per step')
                        ), parts


# ---- the search ----------------------------------------------------------------


def _MicroBatchChoices(batch_size, limit=64):
  choices, m = [], 1
  while m <= min(batch_size, limit):
    choices.append(m)
    m *= 2
  return choices


def _Cut(profiles, num_cells, n, cost, peak_of, budget):
  """The cut minimising its largest cell's `cost`, every cell fitting.

  A dynamic program over (first i layers, j cells), as
  partition.BlockPartition, where range [s, i) may be cell j only if
  peak_of(s, i, j) <= budget.

  Returns (layer counts, each cell's CellMemory at size n), or None.
  """
  num_layers = len(profiles)
  inf = float('inf')
  best = [[inf] * (num_layers + 1) for _ in range(num_cells + 1)]
  cut = [[0] * (num_layers + 1) for _ in range(num_cells + 1)]
  best[0][0] = 0.0
  for j in range(1, num_cells + 1):
    for i in range(j, num_layers - (num_cells - j) + 1):
      if j == num_cells and i != num_layers:
        continue
      for s in range(j - 1, i):
        if best[j - 1][s] == inf:
          continue
        value = max(best[j - 1][s], cost(s, i, j - 1))
        if value < best[j][i] and peak_of(s, i, j - 1) <= budget:
          best[j][i] = value
          cut[j][i] = s
  if best[num_cells][num_layers] == inf:
    return None
  counts, i = [], num_layers
  for j in range(num_cells, 0, -1):
    counts.append(i - cut[j][i])
    i = cut[j][i]
  counts.reverse()
  cells, start = [], 0
  for count in counts:
    cells.append(profiles.Range(start, start + count, n))
    start += count
  return counts, cells


def _Candidates(num_layers, devices, batch_size, num_partitions,
                micro_batches, remat_policies, schedules):
  """(K, R, M, remat, schedule) to consider, without duplicates."""
  ks = num_partitions or range(1, min(devices.count, num_layers) + 1)
  for k in ks:
    if k > devices.count:
      continue
    replicas = max(1, devices.count // k)
    per_replica = batch_size // replicas
    for m in micro_batches or _MicroBatchChoices(per_replica):
      if m > per_replica:
        continue
      for remat in remat_policies:
        if remat == 'except_last' and m == 1:
          continue  # The same as 'never'.
        for schedule in schedules:
          if m == 1 and schedule != schedules[0]:
            continue  # One micro-batch: every schedule is the same.
          yield k, replicas, m, remat, schedule


class _Candidate:
  """One (K, R, M, remat, schedule): its step and its peaks of ranges."""

  def __init__(self, profiles, k, replicas, step, devices=None):
    self.k, self.replicas, self.m = k, replicas, step.num_micro_batches
    self.devices = devices
    self.remat, self.schedule = step.remat_policy, step.schedule
    self.profiles = profiles
    self.step = step
    self.n = min(memory_model.MicroBatchSizes(step.batch_size, self.m))
    self.sched = memory_model.MakeSchedule(self.step, k)
    self.mode = (memory_model.REMAT if self.remat != 'never' else
                 memory_model.NO_REMAT)
    self._peaks = {}

  def Peak(self, s, i, j):
    """The peak of device j holding layers [s, i) as its cell."""
    key = (s, i, j)
    if key not in self._peaks:
      memory = self.profiles.Range(s, i, self.n)
      self._peaks[key] = memory_model.WalkDevice(
          self.sched, j, lambda k, size: memory, self.step).peak_bytes
    return self._peaks[key]

  def Seconds(self, s, i, j):
    """Device j's time per micro-batch holding layers [s, i): its compute,
    and what it sends (its output on, its input's gradient back), so that
    on a slow link a cut falls where little crosses it, as PipeDream's."""
    memory = self.profiles.Range(s, i, self.n)
    seconds = memory.forward_s + memory.backward_s[self.mode]
    if self.devices is not None and j < self.k - 1:
      seconds += _Transfer(memory.output_bytes, self.devices)
    if self.devices is not None and j > 0:
      seconds += _Transfer(memory.input_gradient_bytes, self.devices)
    return seconds

  def Peaks(self, cells):
    return [memory_model.WalkDevice(self.sched, d,
                                    lambda k, size: cells[k], self.step)
            for d in range(self.k)]

  def Describe(self):
    return (f'{self.k} partition(s), M={self.m}, remat_policy={self.remat}, '
            f'schedule={self.schedule}')

  def Balanced(self):
    """(counts, cells, peaks) of the cut with the smallest largest peak."""
    found = _Cut(self.profiles, self.k, self.n, self.Peak, self.Peak,
                 float('inf'))
    if found is None:
      return None
    counts, cells = found
    return counts, cells, self.Peaks(cells)


def MemoryBalancedCut(profiles: LayerProfiles, num_cells, step):
  """The cut of the layers into num_cells cells whose largest predicted
  device peak is the smallest, for the step (a memory_model.StepConfig).

  Returns (layer counts, each cell's CellMemory, each device's DevicePeak),
  or None when there are fewer layers than cells.
  """
  if num_cells > len(profiles):
    return None
  return _Candidate(profiles, num_cells, 1, step).Balanced()


def CandidatePlans(profiles: LayerProfiles, devices: Devices, batch_size,
                   num_partitions=None, micro_batches=None,
                   remat_policies=REMAT_POLICIES, schedules=SCHEDULES,
                   input_example_bytes=0.0, target_example_bytes=0.0):
  """Every configuration predicted to fit, as PipelinePlans, fastest first.

  Args:
    profiles: the model's LayerProfiles.
    devices: what is available.
    batch_size: the global batch N.
    num_partitions: K values to consider (default 1..devices).
    micro_batches: M values (default powers of two up to N/R).
    remat_policies, schedules: what to consider.
    input_example_bytes, target_example_bytes: one example's input and
      targets (held by the first and last devices).

  Raises:
    NoPlanError: nothing fits; names the smallest memory that would.
  """
  plans, smallest = [], None
  for k, r, m, remat, schedule in _Candidates(
      len(profiles), devices, batch_size, num_partitions, micro_batches,
      remat_policies, schedules):
    step = memory_model.StepConfig(
        schedule=schedule, num_micro_batches=m, batch_size=batch_size // r,
        remat_policy=remat, input_example_bytes=input_example_bytes,
        target_example_bytes=target_example_bytes)
    candidate = _Candidate(profiles, k, r, step, devices)
    found = _Cut(profiles, k, candidate.n, candidate.Seconds,
                 candidate.Peak, devices.plannable_bytes)
    if found is None:
      # How much memory would it take? The cut that balances the peaks.
      balanced = candidate.Balanced()
      if balanced is not None:
        need = max(p.peak_bytes for p in balanced[2])
        if smallest is None or need < smallest[0]:
          smallest = (need, candidate.Describe())
      continue
    counts, cells = found
    seconds, parts = StepTime(cells, candidate.step, devices, candidate.sched,
                              r)
    plans.append(PipelinePlan(k, r, counts, m, remat, schedule,
                              candidate.Peaks(cells), seconds, parts,
                              devices.memory_bytes,
                              budget_text=devices.BudgetText()))
  if not plans:
    if smallest is None:
      raise NoPlanError(f'No configuration fits {devices.count} device(s): '
                        'the model has no layers to cut.', float('inf'))
    need = devices.MemoryNeeded(smallest[0])
    with_headroom = (
        f' (a predicted peak of {smallest[0] / MIB:.1f} MiB and the '
        f'{devices.headroom:.0%} headroom)' if devices.headroom else '')
    raise NoPlanError(
        f'Nothing fits {devices.count} device(s) of {devices.BudgetText()} '
        f'each: the smallest per-device memory that would fit is '
        f'{math.ceil(need / MIB)} MiB{with_headroom}, with {smallest[1]}.',
        need)
  plans.sort(key=lambda plan: plan.step_time_s)
  return plans


def PlanPipeline(profiles: LayerProfiles, devices: Devices, batch_size,
                 **options):
  """The fastest configuration predicted to fit, with its reasons.

  CandidatePlans' arguments; returns its best PipelinePlan, explained.

  Raises:
    NoPlanError: nothing fits; names the smallest memory that would.
  """
  return Explain(CandidatePlans(profiles, devices, batch_size, **options),
                 devices)


def Explain(plans, devices):
  """Fills plans[0].reasons: why it, against the others; returns it."""
  best = plans[0]
  fitting = sorted({p.num_partitions for p in plans})
  reasons = [f'{len(plans)} configuration(s) fit (partitions: {fitting}); '
             'this one has the shortest predicted step.']
  for k in fitting:
    if k == best.num_partitions:
      continue
    other = min((p for p in plans if p.num_partitions == k),
                key=lambda p: p.step_time_s)
    reasons.append(
        f'the fastest with {k} partition(s) (M={other.num_micro_batches}, '
        f'remat_policy={other.remat_policy}, {other.schedule}) is predicted '
        f'at {other.step_time_s:.3g}s.')
  missing = [k for k in range(1, best.num_partitions) if k not in fitting]
  if missing:
    reasons.append(f'{missing} partition(s) fit in no configuration.')
  if not devices.concurrent:
    reasons.append('these devices do not compute at the same time, so a '
                   'pipeline buys memory, not speed: fewer cells, '
                   'micro-batches and recomputes are faster.')
  best.reasons = reasons
  return best


def Refine(plan, cells: Sequence[memory_model.CellProfile], devices,
           batch_size, input_example_bytes=0.0, target_example_bytes=0.0):
  """The plan re-predicted from its cells profiled as cells (exact).

  Returns the updated PipelinePlan, or None if a device no longer fits.
  """
  step = memory_model.StepConfig(
      schedule=plan.schedule, num_micro_batches=plan.num_micro_batches,
      batch_size=batch_size // plan.num_replicas,
      remat_policy=plan.remat_policy, input_example_bytes=input_example_bytes,
      target_example_bytes=target_example_bytes)
  peaks = memory_model.PredictPeaks(cells, step)
  if any(p.peak_bytes > devices.plannable_bytes for p in peaks):
    return None
  n = min(memory_model.MicroBatchSizes(step.batch_size,
                                       plan.num_micro_batches))
  seconds, parts = StepTime([c.At(n) for c in cells], step, devices,
                            num_replicas=plan.num_replicas)
  return dataclasses.replace(plan, peaks=peaks, step_time_s=seconds,
                             time_parts=parts)
