"""Pipeline schedules as data: an ordered list of actions per device.

A schedule says, for each device, in which order it runs the forward (F) and
backward (B) passes of each (micro-batch m, cell k). Everything else follows
from that list: the executor emits the actions in that order (adding control
dependencies so the runtime cannot reorder them), the simulator predicts the
makespan and bubble, `TextTimeline` prints it, and `Validate` proves that it
cannot deadlock before anything runs.

Dependencies between actions are fixed by the model, not the schedule::

    F(m, k) needs F(m, k-1)                  the cell's input
    B(m, k) needs F(m, k) and B(m, k+1)      its activations and output gradient

GPipe (fill-drain), K=3 cells on 3 devices, M=4 micro-batches, F and B of
equal length (B is drawn as b)::

    dev0  F0 F1 F2 F3 .  .  .  .  .  b3 b2 b1 b0
    dev1  .  F0 F1 F2 F3 .  .  .  b3 b2 b1 b0 .
    dev2  .  .  F0 F1 F2 F3 .  b3 b2 b1 b0 .  .

1F1B (PipeDream-flush) starts a micro-batch's backward as soon as it can, so
at most K micro-batches are in flight on the first device instead of M.
"""

import collections
import dataclasses
from typing import List, Optional, Sequence

FORWARD = 'F'
BACKWARD = 'B'

Action = collections.namedtuple('Action', ['kind', 'micro_batch', 'cell'])
Action.__doc__ = 'Forward (F) or backward (B) of micro-batch `micro_batch` on cell `cell`.'
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
  if len(device_of_cell) != num_cells:
    raise ValueError(f'device_of_cell has {len(device_of_cell)} entries for '
                     f'{num_cells} cells.')
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


SCHEDULES = {'gpipe': GPipeSchedule, '1f1b': OneFOneBSchedule}


def MakeSchedule(name, num_cells, num_micro_batches, device_of_cell=None):
  """Builds the schedule registered under `name` ('gpipe' or '1f1b')."""
  if name not in SCHEDULES:
    raise ValueError(f'Unknown schedule {name!r}; expected one of '
                     f'{sorted(SCHEDULES)}. Received: schedule={name!r}')
  return SCHEDULES[name](num_cells, num_micro_batches, device_of_cell)


def Validate(schedule, forward_only=False):
  """Checks completeness and that the per-device orders cannot deadlock.

  Returns one global order of all actions that respects both the
  dependencies and every device's order: the order in which the executor
  emits them.
  """
  expected = set()
  kinds = [FORWARD] if forward_only else [FORWARD, BACKWARD]
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


@dataclasses.dataclass
class SimulationResult:
  """Predicted timing of a schedule.

  Attributes:
    makespan: time from the first action's start to the last action's end.
    bubble_fraction: idle share of total device time, 1 - busy / (D * makespan).
    start_times: {Action: start time}.
    end_times: {Action: end time}.
  """
  makespan: float
  bubble_fraction: float
  start_times: dict
  end_times: dict


def Simulate(schedule, forward_costs: Optional[Sequence[float]] = None,
             backward_costs: Optional[Sequence[float]] = None,
             transfer_cost: float = 0.0):
  """Runs the schedule on ideal exclusive devices and times it.

  Args:
    schedule: a Schedule.
    forward_costs: forward time of each cell (default 1 for all).
    backward_costs: backward time of each cell (default 2x forward, the usual
      ratio of a backward pass that computes input and weight gradients).
    transfer_cost: delay when a dependency crosses devices.
  """
  k_cells = schedule.num_cells
  fwd = list(forward_costs) if forward_costs is not None else [1.0] * k_cells
  bwd = (list(backward_costs) if backward_costs is not None else
         [2.0 * c for c in fwd])
  if len(fwd) != k_cells or len(bwd) != k_cells:
    raise ValueError(f'Need one cost per cell ({k_cells}); received '
                     f'{len(fwd)} forward and {len(bwd)} backward costs.')
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
    end[a] = ready + (fwd[a.cell] if a.kind == FORWARD else bwd[a.cell])
    device_free[d] = end[a]
  makespan = max(end.values()) - min(start.values())
  busy = sum(end[a] - start[a] for a in order)
  bubble = 1.0 - busy / (schedule.num_devices * makespan) if makespan else 0.0
  return SimulationResult(makespan, bubble, start, end)


def IdealBubbleFraction(num_cells, num_micro_batches):
  """GPipe's (K-1)/(M+K-1) for equal cells, one per device."""
  return (num_cells - 1) / (num_micro_batches + num_cells - 1)


def MaxInFlight(schedule):
  """Most micro-batches whose forward ran but whose backward has not, per device."""
  result = []
  for acts in schedule.device_actions:
    live, peak = set(), 0
    for a in acts:
      if a.kind == FORWARD:
        live.add((a.micro_batch, a.cell))
      else:
        live.discard((a.micro_batch, a.cell))
      peak = max(peak, len(live))
    result.append(peak)
  return result


def TextTimeline(schedule, forward_costs=None, backward_costs=None,
                 start_times=None, end_times=None, width=None):
  """A terminal picture of when each device runs what.

  Without times it simulates unit forward and 2x backward costs. Forward
  actions print as `F<m>`, backward as `B<m>`; dots are idle slots. Measured
  times (from a recorded step) can be passed in instead.
  """
  if start_times is None:
    sim = Simulate(schedule, forward_costs, backward_costs)
    start_times, end_times = sim.start_times, sim.end_times
  t0 = min(start_times.values())
  span = max(end_times.values()) - t0
  shortest = min(end_times[a] - start_times[a] for a in start_times)
  label_w = max(2 + len(str(schedule.num_micro_batches - 1)), 3)
  cols = width or min(200, int(round(span / max(shortest, 1e-12))) * label_w)
  scale = cols / span if span else 1.0
  lines = []
  for d, acts in enumerate(schedule.device_actions):
    row = ['.'] * (cols + label_w)
    for a in acts:
      if a not in start_times:
        continue
      s = int(round((start_times[a] - t0) * scale))
      e = max(s + 1, int(round((end_times[a] - t0) * scale)))
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
