"""Pipeline schedules as data: an ordered list of actions per device.

A schedule says, for each device, in which order it runs the forward (F),
backward (B) and, for zero-bubble schedules, weight-gradient (W) passes of
each (micro-batch m, cell k). Everything else follows from that list: the
runtime issues the actions in that order (each waiting for its device's
previous action, so the runtime cannot reorder them), the simulator predicts the makespan and
bubble, `TextTimeline` prints it, and `Validate` proves that it cannot
deadlock before anything runs.

Dependencies between actions are fixed by the model, not the schedule::

    F(m, k) needs F(m, k-1)                  the cell's input
    B(m, k) needs F(m, k) and B(m, k+1)      its activations and output gradient
    W(m, k) needs B(m, k)                    the output gradients B kept

In a schedule without W actions, B computes both the input gradient and the
weight gradient. With W actions, B computes only the input gradient (what
the previous cell waits for) and W the weight gradient, which nobody waits
for, so it can fill the bubbles.

GPipe (fill-drain), K=3 cells on 3 devices, M=4 micro-batches, F and B of
equal length (B is drawn as b)::

    dev0  F0 F1 F2 F3 .  .  .  .  .  b3 b2 b1 b0
    dev1  .  F0 F1 F2 F3 .  .  .  b3 b2 b1 b0 .
    dev2  .  .  F0 F1 F2 F3 .  b3 b2 b1 b0 .  .

1F1B (PipeDream-flush) starts a micro-batch's backward as soon as it can, so
at most K micro-batches are in flight on the first device instead of M.
Interleaved 1F1B (Megatron-LM) runs v cells per device, placed round-robin,
which divides the fill and drain by v. ZB-H1 (Zero Bubble, Qi et al.) is
1F1B with each B split from its W, and the W of device d delayed by d
micro-batches, which leaves about a third of 1F1B's bubble at 1F1B's memory.
"""

import collections
import dataclasses
from typing import List, Optional, Sequence

FORWARD = 'F'
BACKWARD = 'B'
WEIGHT = 'W'

Action = collections.namedtuple('Action', ['kind', 'micro_batch', 'cell'])
Action.__doc__ = ('Forward (F), backward (B) or weight gradient (W) of '
                  'micro-batch `micro_batch` on cell `cell`.')
Action.__str__ = lambda a: f'{a.kind}{a.micro_batch}.{a.cell}'


class ScheduleError(ValueError):
  """A schedule that is incomplete, duplicated or would deadlock."""


@dataclasses.dataclass
class Schedule:
  """Per-device ordered actions.

  Attributes:
    name: generator name, e.g. 'gpipe' or '1f1b'.
    num_cells: K.
    num_micro_batches: M.
    device_of_cell: device index of each cell (cells on one device share it).
    device_actions: for each device, the actions it runs, in order.
  """
  name: str
  num_cells: int
  num_micro_batches: int
  device_of_cell: List[int]
  device_actions: List[List[Action]]

  @property
  def num_devices(self):
    return len(self.device_actions)

  @property
  def splits_backward(self):
    """Whether each backward is split into B (input) and W (weights)."""
    return any(a.kind == WEIGHT for acts in self.device_actions for a in acts)

  def ForwardOnly(self):
    """The same schedule with the backward actions removed (inference)."""
    return dataclasses.replace(
        self, device_actions=[[a for a in acts if a.kind == FORWARD]
                              for acts in self.device_actions])

  def __str__(self):
    return TextTimeline(self)


def Dependencies(action, num_cells, forward_only=False):
  """The actions `action` must wait for."""
  kind, m, k = action
  if kind == FORWARD:
    return [Action(FORWARD, m, k - 1)] if k > 0 else []
  if kind == WEIGHT:
    return [Action(BACKWARD, m, k)]
  deps = [Action(FORWARD, m, k)]
  if k < num_cells - 1 and not forward_only:
    deps.append(Action(BACKWARD, m, k + 1))
  return deps


def _CheckCounts(num_cells, num_micro_batches):
  if num_cells < 1:
    raise ValueError(f'num_cells must be >= 1. Received: num_cells={num_cells}')
  if num_micro_batches < 1:
    raise ValueError('num_micro_batches must be >= 1. Received: '
                     f'num_micro_batches={num_micro_batches}')


def _PerCellGPipe(num_cells, num_micro_batches):
  return [[Action(FORWARD, m, k) for m in range(num_micro_batches)] +
          [Action(BACKWARD, m, k) for m in reversed(range(num_micro_batches))]
          for k in range(num_cells)]


def _PerCell1F1B(num_cells, num_micro_batches):
  per_cell = []
  for k in range(num_cells):
    warmup = min(num_cells - k - 1, num_micro_batches)
    acts = [Action(FORWARD, m, k) for m in range(warmup)]
    f, b = warmup, 0
    while f < num_micro_batches:
      acts.append(Action(FORWARD, f, k))
      f += 1
      acts.append(Action(BACKWARD, b, k))
      b += 1
    acts.extend(Action(BACKWARD, m, k) for m in range(b, num_micro_batches))
    per_cell.append(acts)
  return per_cell


def _PerCellZeroBubbleH1(num_cells, num_micro_batches):
  """1F1B's F and B order; cell k runs W(m) right after B(m + k).

  Why this is enough: B no longer waits for W, so the first backward comes
  back through the pipeline in (K-1) B's instead of (K-1) B+W's, and cell k
  uses the k micro-batches of delay to fill the drain, where 1F1B idles.
  Cell k then holds at most (K-k-1) + 1 + k = K micro-batches between F and
  W: the first device's 1F1B bound, on every device. The W's still pending
  after the last B come last. With equal F, B and W costs the idle time per
  device is (K-1) slots against 1F1B's 3(K-1) (Qi et al.'s ZB-H1).
  """
  per_cell = []
  for k, one_f_one_b in enumerate(_PerCell1F1B(num_cells,
                                               num_micro_batches)):
    acts = []
    for a in one_f_one_b:
      acts.append(a)
      if a.kind == BACKWARD and a.micro_batch >= k:
        acts.append(Action(WEIGHT, a.micro_batch - k, k))
    acts.extend(Action(WEIGHT, m, k) for m in range(
        max(num_micro_batches - k, 0), num_micro_batches))
    per_cell.append(acts)
  return per_cell


def _Assemble(name, per_cell, num_micro_batches, device_of_cell):
  """Merges per-cell orders onto devices, ordered by unit-cost start time.

  With one cell per device this is the per-cell order itself. Where several
  cells share a device (round-robin placement), ordering their actions by the
  start times of the one-cell-per-device schedule keeps every dependency
  before its dependent, so the merged order cannot deadlock.
  """
  num_cells = len(per_cell)
  if device_of_cell is None:
    device_of_cell = list(range(num_cells))
  _CheckPlacement(num_cells, device_of_cell)
  num_devices = max(device_of_cell) + 1
  virtual = Schedule(name, num_cells, num_micro_batches,
                     list(range(num_cells)), per_cell)
  if num_devices == num_cells and device_of_cell == list(range(num_cells)):
    return virtual
  start = Simulate(virtual).start_times
  device_actions = [[] for _ in range(num_devices)]
  for k, acts in enumerate(per_cell):
    device_actions[device_of_cell[k]].extend(acts)
  for acts in device_actions:
    acts.sort(key=lambda a: (start[a], a.cell, a.kind, a.micro_batch))
  return Schedule(name, num_cells, num_micro_batches, list(device_of_cell),
                  device_actions)


def _CheckPlacement(num_cells, device_of_cell):
  if len(device_of_cell) != num_cells:
    raise ValueError(f'device_of_cell has {len(device_of_cell)} entries for '
                     f'{num_cells} cells.')
  used = sorted(set(device_of_cell))
  if used != list(range(len(used))):
    raise ValueError('device_of_cell must number the devices 0..D-1. '
                     f'Received: device_of_cell={list(device_of_cell)}')


def RoundRobin(num_cells, num_devices):
  """Cell k on device k % num_devices: the placement interleaving needs."""
  return [k % num_devices for k in range(num_cells)]


def GPipeSchedule(num_cells, num_micro_batches, device_of_cell=None):
  """Fill-drain: all forwards, then all backwards in reverse micro-batch order."""
  _CheckCounts(num_cells, num_micro_batches)
  return _Assemble('gpipe', _PerCellGPipe(num_cells, num_micro_batches),
                   num_micro_batches, device_of_cell)


def OneFOneBSchedule(num_cells, num_micro_batches, device_of_cell=None):
  """PipeDream-flush: warm up, then alternate one forward and one backward."""
  _CheckCounts(num_cells, num_micro_batches)
  return _Assemble('1f1b', _PerCell1F1B(num_cells, num_micro_batches),
                   num_micro_batches, device_of_cell)


def ZeroBubbleH1Schedule(num_cells, num_micro_batches, device_of_cell=None):
  """ZB-H1: 1F1B with B and W split and device k's W delayed k micro-batches."""
  _CheckCounts(num_cells, num_micro_batches)
  return _Assemble('zb_h1', _PerCellZeroBubbleH1(num_cells,
                                                 num_micro_batches),
                   num_micro_batches, device_of_cell)


def VirtualStages(num_cells, device_of_cell, name='interleaved_1f1b'):
  """(D, v): devices and cells per device of a round-robin placement.

  Raises:
    ValueError: the placement is not cell k on device k % D with the same
      number of cells on every device, naming how to get one.
  """
  if device_of_cell is None:
    return num_cells, 1
  _CheckPlacement(num_cells, device_of_cell)
  num_devices = max(device_of_cell) + 1
  if (num_cells % num_devices or
      list(device_of_cell) != RoundRobin(num_cells, num_devices)):
    raise ValueError(
        f'schedule={name!r} runs v cells per device, cell k on device k % D, '
        f'with K = v * D; the cells are placed on devices '
        f'{list(device_of_cell)} ({num_cells} cells, {num_devices} devices). '
        'Use a number of cells that is a multiple of the number of devices '
        'and round-robin placement (round_robin_placement=True, or list the '
        'devices in that order).')
  return num_devices, num_cells // num_devices


def _Rounds(num_micro_batches, num_devices):
  """Micro-batches in rounds of at least D, sizes differing by at most one.

  Megatron-LM's rounds are exactly D micro-batches and need M % D == 0; a
  short last round would leave devices waiting, so the remainder is spread
  over the rounds instead (torch.distributed.pipelining does the same).
  """
  rounds = max(1, num_micro_batches // num_devices)
  base, extra = divmod(num_micro_batches, rounds)
  result, first = [], 0
  for i in range(rounds):
    size = base + (1 if i < extra else 0)
    result.append(range(first, first + size))
    first += size
  return result


def InterleavedOneFOneBSchedule(num_cells, num_micro_batches,
                                device_of_cell=None):
  """Megatron-LM's interleaved 1F1B: v cells per device, placed round-robin.

  Device d holds cells d, d+D, ..., d+(v-1)D (its "virtual stages"). It runs
  the forwards of a round of micro-batches through its first cell, then
  through its second, and so on, so the next device starts after one cell's
  forward instead of v of them: fill and drain shrink by about v, at the cost
  of v times more transfers between devices. Backwards go through the cells
  in reverse. After a warm-up of (v-1) rounds plus 2(D-d-1) forwards, each
  device alternates one forward and one backward. With v=1 this is 1F1B.
  """
  _CheckCounts(num_cells, num_micro_batches)
  num_devices, v = VirtualStages(num_cells, device_of_cell)
  if v == 1:
    return _Assemble('interleaved_1f1b',
                     _PerCell1F1B(num_cells, num_micro_batches),
                     num_micro_batches, device_of_cell)
  rounds = _Rounds(num_micro_batches, num_devices)
  device_actions = []
  for d in range(num_devices):
    cells = [c * num_devices + d for c in range(v)]
    forwards = [Action(FORWARD, m, k) for r in rounds for k in cells
                for m in r]
    backwards = [Action(BACKWARD, m, k) for r in rounds
                 for k in reversed(cells) for m in r]
    warmup = min(len(forwards),
                 (v - 1) * len(rounds[0]) + 2 * (num_devices - d - 1))
    acts = forwards[:warmup]
    f, b = warmup, 0
    while f < len(forwards):
      acts.append(forwards[f])
      f += 1
      acts.append(backwards[b])
      b += 1
    acts.extend(backwards[b:])
    device_actions.append(acts)
  return Schedule('interleaved_1f1b', num_cells, num_micro_batches,
                  list(device_of_cell), device_actions)


SCHEDULES = {'gpipe': GPipeSchedule, '1f1b': OneFOneBSchedule,
             'interleaved_1f1b': InterleavedOneFOneBSchedule,
             'zb_h1': ZeroBubbleH1Schedule}


def MakeSchedule(name, num_cells, num_micro_batches, device_of_cell=None):
  """Builds the schedule registered under `name` (a key of SCHEDULES)."""
  if name not in SCHEDULES:
    raise ValueError(f'Unknown schedule {name!r}; expected one of '
                     f'{sorted(SCHEDULES)}. Received: schedule={name!r}')
  return SCHEDULES[name](num_cells, num_micro_batches, device_of_cell)


def Validate(schedule, forward_only=False):
  """Checks completeness and that the per-device orders cannot deadlock.

  A schedule with any W action must have one W per (micro-batch, cell).
  Returns one global order of all actions that respects both the
  dependencies and every device's order: the order in which the runtime
  issues them.
  """
  expected = set()
  if forward_only:
    kinds = [FORWARD]
  elif schedule.splits_backward:
    kinds = [FORWARD, BACKWARD, WEIGHT]
  else:
    kinds = [FORWARD, BACKWARD]
  for kind in kinds:
    for m in range(schedule.num_micro_batches):
      for k in range(schedule.num_cells):
        expected.add(Action(kind, m, k))
  seen = collections.Counter(a for acts in schedule.device_actions for a in acts)
  dupes = sorted(str(a) for a, n in seen.items() if n > 1)
  if dupes:
    raise ScheduleError(f'Schedule {schedule.name!r} repeats actions: {dupes}')
  missing = sorted(str(a) for a in expected - set(seen))
  extra = sorted(str(a) for a in set(seen) - expected)
  if missing or extra:
    raise ScheduleError(f'Schedule {schedule.name!r} is incomplete: missing '
                        f'{missing}, unexpected {extra}.')
  for d, acts in enumerate(schedule.device_actions):
    for a in acts:
      if schedule.device_of_cell[a.cell] != d:
        raise ScheduleError(
            f'Schedule {schedule.name!r} runs {a} on device {d}, but cell '
            f'{a.cell} is placed on device {schedule.device_of_cell[a.cell]}.')
  done = set()
  order = []
  cursor = [0] * schedule.num_devices
  progressed = True
  while progressed:
    progressed = False
    for d, acts in enumerate(schedule.device_actions):
      while cursor[d] < len(acts):
        a = acts[cursor[d]]
        if all(dep in done for dep in Dependencies(a, schedule.num_cells,
                                                    forward_only)):
          done.add(a)
          order.append(a)
          cursor[d] += 1
          progressed = True
        else:
          break
  if len(order) != len(expected):
    stuck = [str(acts[cursor[d]]) for d, acts in
             enumerate(schedule.device_actions) if cursor[d] < len(acts)]
    raise ScheduleError(f'Schedule {schedule.name!r} deadlocks: the next '
                        f'actions {stuck} wait on each other.')
  return order


def LatestAncestors(schedule):
  """{action: [per device, the index in that device's order of the last of
  its actions that must end before `action` starts, the action itself
  included; -1 for none]}: a vector clock per action.

  An action at index i of device d must precede `a` (whatever the devices'
  speeds) exactly when i <= LatestAncestors(schedule)[a][d]: device orders
  are chains, so the actions of d that precede `a` are a prefix. Computed
  once per schedule (the memory model asks for every device).
  """
  cached = getattr(schedule, '_latest_ancestors', None)
  if cached is not None:
    return cached
  index = {a: (d, i) for d, acts in enumerate(schedule.device_actions)
           for i, a in enumerate(acts)}
  clocks = {}
  for a in Validate(schedule):
    d, i = index[a]
    clock = [-1] * schedule.num_devices
    previous = [schedule.device_actions[d][i - 1]] if i else []
    for dep in Dependencies(a, schedule.num_cells) + previous:
      clock = [max(x, y) for x, y in zip(clock, clocks[dep])]
    clock[d] = i
    clocks[a] = clock
  schedule._latest_ancestors = clocks  # pylint: disable=protected-access
  return clocks


@dataclasses.dataclass
class SimulationResult:
  """Predicted timing of a schedule.

  Attributes:
    makespan: time from the first action's start to the last action's end.
    bubble_fraction: idle share of total device time, 1 - busy / (D * makespan).
    start_times: {Action: start time}.
    end_times: {Action: end time}.
    num_devices: D.
  """
  makespan: float
  bubble_fraction: float
  start_times: dict
  end_times: dict
  num_devices: int = 1

  @property
  def idle_time(self):
    """Device time spent waiting, summed over devices: D * makespan - busy."""
    busy = sum(self.end_times[a] - self.start_times[a] for a in self.end_times)
    return self.num_devices * self.makespan - busy


def _Costs(name, costs, default, k_cells):
  values = list(costs) if costs is not None else default
  if len(values) != k_cells:
    raise ValueError(f'Need one {name} cost per cell ({k_cells}); received '
                     f'{len(values)}.')
  return values


def Simulate(schedule, forward_costs: Optional[Sequence[float]] = None,
             backward_costs: Optional[Sequence[float]] = None,
             transfer_cost: float = 0.0,
             weight_costs: Optional[Sequence[float]] = None):
  """Runs the schedule on ideal exclusive devices and times it.

  Args:
    schedule: a Schedule.
    forward_costs: forward time of each cell (default 1 for all).
    backward_costs: time of each cell's B action. Default: 2x forward, the
      usual ratio of a backward that computes input and weight gradients;
      for a schedule with W actions, 1x forward (the input gradient only).
    transfer_cost: delay when a dependency crosses devices.
    weight_costs: time of each cell's W action (schedules with W actions);
      default 1x forward.
  """
  k_cells = schedule.num_cells
  split = schedule.splits_backward
  fwd = _Costs('forward', forward_costs, [1.0] * k_cells, k_cells)
  bwd = _Costs('backward', backward_costs,
               [(1.0 if split else 2.0) * c for c in fwd], k_cells)
  wgt = _Costs('weight', weight_costs, list(fwd), k_cells)
  cost = {FORWARD: fwd, BACKWARD: bwd, WEIGHT: wgt}
  forward_only = not any(a.kind == BACKWARD for acts in schedule.device_actions
                         for a in acts)
  order = Validate(schedule, forward_only=forward_only)
  device_free = [0.0] * schedule.num_devices
  start, end = {}, {}
  for a in order:
    d = schedule.device_of_cell[a.cell]
    ready = device_free[d]
    for dep in Dependencies(a, k_cells, forward_only):
      delay = (transfer_cost if schedule.device_of_cell[dep.cell] != d else 0.0)
      ready = max(ready, end[dep] + delay)
    start[a] = ready
    end[a] = ready + cost[a.kind][a.cell]
    device_free[d] = end[a]
  makespan = max(end.values()) - min(start.values())
  busy = sum(end[a] - start[a] for a in order)
  bubble = 1.0 - busy / (schedule.num_devices * makespan) if makespan else 0.0
  return SimulationResult(makespan, bubble, start, end, schedule.num_devices)


def IdealBubbleFraction(num_cells, num_micro_batches):
  """GPipe's (K-1)/(M+K-1) for equal cells, one per device."""
  return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def MaxInFlight(schedule):
  """Per device, the most (micro-batch, cell) pairs holding activations.

  A pair is in flight from its F until its last backward action: B, or W
  in a schedule with W actions, because B keeps what W needs (the cell's
  activations and each layer's output gradient). With v cells per device
  (interleaving) each pair holds one cell's activations, 1/v of the
  device's layers.
  """
  last = WEIGHT if schedule.splits_backward else BACKWARD
  result = []
  for acts in schedule.device_actions:
    live, peak = set(), 0
    for a in acts:
      if a.kind == FORWARD:
        live.add((a.micro_batch, a.cell))
      elif a.kind == last:
        live.discard((a.micro_batch, a.cell))
      peak = max(peak, len(live))
    result.append(peak)
  return result


def TextTimeline(schedule, forward_costs=None, backward_costs=None,
                 start_times=None, end_times=None, width=None,
                 weight_costs=None):
  """A terminal picture of when each device runs what.

  Without times it simulates the default costs (see `Simulate`). Forward
  actions print as `F<m>`, backward as `B<m>`, weight gradients as `W<m>`
  (with `.<cell>` when devices hold several cells); dots are idle slots.
  Measured times (from a recorded step) can be passed in instead. An action
  shorter than a column still shows its first letter: it is drawn one
  column after the previous action's start at the earliest.
  """
  if start_times is None:
    sim = Simulate(schedule, forward_costs, backward_costs,
                   weight_costs=weight_costs)
    start_times, end_times = sim.start_times, sim.end_times
  t0 = min(start_times.values())
  span = max(end_times.values()) - t0
  shortest = min(end_times[a] - start_times[a] for a in start_times)
  label_w = max(2 + len(str(schedule.num_micro_batches - 1)), 3)
  if schedule.num_devices != schedule.num_cells:
    label_w += 1 + len(str(schedule.num_cells - 1))
  cols = width or min(200, int(round(span / max(shortest, 1e-12))) * label_w)
  scale = cols / span if span else 1.0
  lines = []
  for d, acts in enumerate(schedule.device_actions):
    row = ['.'] * (cols + label_w)
    free = 0  # The first column the next action's label may start at.
    for a in acts:
      if a not in start_times:
        continue
      s = max(free, int(round((start_times[a] - t0) * scale)))
      e = max(s + 1, int(round((end_times[a] - t0) * scale)))
      free = s + 1
      text = f'{a.kind}{a.micro_batch}'
      if schedule.num_devices != schedule.num_cells:
        text += f'.{a.cell}'
      cell_text = (text + ' ' * (e - s))[:max(e - s, 1)]
      for i, ch in enumerate(cell_text):
        if s + i < len(row):
          row[s + i] = ch
      for i in range(len(cell_text), e - s):
        row[s + i] = '='
    lines.append(f'dev{d:<2} |' + ''.join(row).rstrip('.').ljust(cols) + '|')
  return '\n'.join(lines)
