"""Measured pipeline timelines: what each device really did during one step.

The simulator (`gpipe.schedule.Simulate`) says what a schedule *should* do on
ideal exclusive devices. This module records what the runtime *did*: one
training step is run with `record_times=True`, so every action F(m, k),
B(m, k) and (zero-bubble schedules) W(m, k) is bracketed by timestamps (in
a graph, `tf.timestamp()` ops), and the timestamps are turned into a
`Timeline`:

* per device, each action's start and end in seconds since the step started;
* the measured bubble fraction, 1 - busy / (D * makespan);
* the simulator's prediction for the same schedule, with each cell's forward,
  backward and weight-gradient cost estimated from the measured durations
  (median over micro-batches), so the two bubbles can be compared directly:
  the gap is
  time the runtime lost to something the schedule does not model (dispatch,
  transfers, devices that are not exclusive);
* a text rendering for terminals (`schedule.TextTimeline` with the measured
  times) and a PNG picture (matplotlib, an optional extra: `pip install -e
  .[timeline]`; imported only when a picture is drawn).

    tl = timeline.RecordStep(pipe, x, y, loss_fn)
    print(tl.Text())
    print(tl.Summary())
    tl.SavePng('timeline.png')
"""

import dataclasses
import json
from typing import Dict, List, Optional

import numpy as np

from tfpipe.gpipe import schedule as schedule_lib

_COLOURS = {schedule_lib.FORWARD: '#4c72b0', schedule_lib.BACKWARD: '#dd8452',
            schedule_lib.WEIGHT: '#55a868'}


def _ImportPyplotFree():
  """Returns (Figure, FigureCanvasAgg) or raises a clear ImportError."""
  try:
    # pylint: disable=g-import-not-at-top
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError as e:
    raise ImportError(
        'Drawing a timeline picture needs matplotlib, an optional extra of '
        'tfpipe. Install it with `pip install -e .[timeline]` (or `pip '
        'install matplotlib`); the text timeline (Timeline.Text) works '
        'without it.') from e
  return Figure, FigureCanvasAgg


# Timestamps on two devices of one action and its prerequisite wait for the
# same tensor, not for each other: a gap this small is the timer's jitter.
_TIMER_JITTER_S = 1e-4


@dataclasses.dataclass
class Timeline:
  """One recorded step: per-action times and the simulator's prediction.

  Attributes:
    schedule: the `gpipe.schedule.Schedule` that ran.
    start_times: {Action: seconds since the step's first action started}.
    end_times: {Action: seconds since the step's first action started}.
    forward_costs: estimated forward seconds of each cell (median measured).
    backward_costs: estimated backward (B) seconds of each cell.
    predicted: `SimulationResult` of the schedule with those costs.
    weight_costs: estimated weight-gradient (W) seconds of each cell; empty
      for schedules without W actions.
  """
  schedule: schedule_lib.Schedule
  start_times: Dict[schedule_lib.Action, float]
  end_times: Dict[schedule_lib.Action, float]
  forward_costs: List[float]
  backward_costs: List[float]
  predicted: schedule_lib.SimulationResult
  weight_costs: List[float] = dataclasses.field(default_factory=list)

  @property
  def num_devices(self):
    return self.schedule.num_devices

  @property
  def makespan(self):
    """Seconds from the first action's start to the last action's end."""
    return max(self.end_times.values()) - min(self.start_times.values())

  def DeviceBusy(self):
    """Seconds each device spent inside its actions."""
    busy = [0.0] * self.num_devices
    for d, acts in enumerate(self.schedule.device_actions):
      busy[d] = sum(self.end_times[a] - self.start_times[a] for a in acts)
    return busy

  @property
  def bubble_fraction(self):
    """Measured idle share of device time, 1 - busy / (D * makespan)."""
    span = self.makespan
    if span <= 0:
      return 0.0
    return 1.0 - sum(self.DeviceBusy()) / (self.num_devices * span)

  @property
  def ideal_bubble_fraction(self):
    """GPipe's (K-1)/(M+K-1), for equal cells, one per device."""
    return schedule_lib.IdealBubbleFraction(self.schedule.num_cells,
                                            self.schedule.num_micro_batches)

  def OrderViolations(self, tolerance=0.0):
    """Actions that started before a dependency or a device predecessor ended.

    Returns a list of (action, prerequisite, seconds early). A start and the
    end of an action on another device it depends on both wait only for the
    same tensor, so tiny negative gaps across devices are timer order, not
    reordering; `tolerance` allows for them.
    """
    found = []
    s = self.schedule
    for acts in s.device_actions:
      for prev, a in zip(acts, acts[1:]):
        gap = self.start_times[a] - self.end_times[prev]
        if gap < -tolerance:
          found.append((a, prev, -gap))
      for a in acts:
        for dep in schedule_lib.Dependencies(a, s.num_cells):
          gap = self.start_times[a] - self.end_times[dep]
          if gap < -tolerance:
            found.append((a, dep, -gap))
    return found

  def Text(self, width=None):
    """The measured timeline as text, one row per device."""
    return schedule_lib.TextTimeline(
        self.schedule, start_times=self.start_times,
        end_times=self.end_times, width=width)

  def PredictedText(self, width=None):
    """The simulator's timeline for the same schedule and estimated costs."""
    return schedule_lib.TextTimeline(
        self.schedule, start_times=self.predicted.start_times,
        end_times=self.predicted.end_times, width=width)

  def AsDict(self):
    """Plain numbers, for JSON."""
    return {
        'schedule': self.schedule.name,
        'num_cells': self.schedule.num_cells,
        'num_micro_batches': self.schedule.num_micro_batches,
        'num_devices': self.num_devices,
        'makespan_s': self.makespan,
        'measured_bubble_fraction': self.bubble_fraction,
        'predicted_bubble_fraction': self.predicted.bubble_fraction,
        'predicted_makespan_s': self.predicted.makespan,
        'ideal_bubble_fraction': self.ideal_bubble_fraction,
        'device_busy_s': self.DeviceBusy(),
        'forward_costs_s': list(self.forward_costs),
        'backward_costs_s': list(self.backward_costs),
        'weight_costs_s': list(self.weight_costs),
        'actions': [
            {'device': d, 'kind': a.kind, 'micro_batch': a.micro_batch,
             'cell': a.cell, 'start_s': self.start_times[a],
             'end_s': self.end_times[a]}
            for d, acts in enumerate(self.schedule.device_actions)
            for a in acts],
    }

  def ToJson(self, indent=2):
    return json.dumps(self.AsDict(), indent=indent)

  def Summary(self):
    """Measured vs predicted makespan and bubble, as a few text lines."""
    s = self.schedule
    lines = [
        f'schedule {s.name}: K={s.num_cells} cells on {self.num_devices} '
        f'device(s), M={s.num_micro_batches} micro-batches',
        f'  makespan   measured {self.makespan * 1e3:9.2f} ms   predicted '
        f'{self.predicted.makespan * 1e3:9.2f} ms   ratio '
        f'{self.makespan / max(self.predicted.makespan, 1e-12):.2f}x',
        f'  bubble     measured {self.bubble_fraction:9.3f}      predicted '
        f'{self.predicted.bubble_fraction:9.3f}      ideal (K-1)/(M+K-1) '
        f'{self.ideal_bubble_fraction:.3f}',
        '  per-cell F ms: ' + ' '.join(
            f'{c * 1e3:.2f}' for c in self.forward_costs),
        '  per-cell B ms: ' + ' '.join(
            f'{c * 1e3:.2f}' for c in self.backward_costs),
    ]
    if self.weight_costs:
      lines.append('  per-cell W ms: ' + ' '.join(
          f'{c * 1e3:.2f}' for c in self.weight_costs))
    early = self.OrderViolations(tolerance=_TIMER_JITTER_S)
    lines.append('  order      ' + (
        f'{len(early)} action(s) started before a prerequisite ended, by up '
        f'to {max(e for _, _, e in early) * 1e3:.2f} ms (across devices, '
        'timer order)' if early else
        'every action started after its prerequisites ended'))
    return '\n'.join(lines)

  def SavePng(self, path, title=None, show_prediction=True, dpi=110):
    """Draws per-device rows of F, B and W boxes labelled with micro-batches.

    With `show_prediction`, a second panel draws the simulator's timeline on
    the same time axis. Needs matplotlib (see module docstring).
    """
    figure_cls, canvas_cls = _ImportPyplotFree()
    panels = [('measured', self.start_times, self.end_times,
               self.bubble_fraction)]
    if show_prediction:
      panels.append(('predicted (simulator, measured per-cell costs)',
                     self.predicted.start_times, self.predicted.end_times,
                     self.predicted.bubble_fraction))
    rows = self.num_devices
    fig = figure_cls(figsize=(12, 0.55 * rows * len(panels) + 1.6))
    canvas_cls(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    span = max(self.makespan, self.predicted.makespan) * 1e3
    label_cells = self.num_devices != self.schedule.num_cells
    for ax, (name, starts, ends, bubble) in zip(axes, panels):
      t0 = min(starts.values())
      for d, acts in enumerate(self.schedule.device_actions):
        for a in acts:
          s = (starts[a] - t0) * 1e3
          w = (ends[a] - starts[a]) * 1e3
          ax.broken_barh([(s, w)], (d - 0.4, 0.8), facecolors=_COLOURS[a.kind],
                         edgecolors='black', linewidth=0.4)
          label = f'{a.micro_batch}' + (f'.{a.cell}' if label_cells else '')
          if w > span / 150:
            ax.text(s + w / 2, d, label, ha='center', va='center',
                    fontsize=7, color='white')
      ax.set_yticks(range(rows))
      ax.set_yticklabels([f'dev{d}' for d in range(rows)])
      ax.invert_yaxis()
      ax.set_xlim(0, span * 1.01)
      ax.set_title(f'{name}: bubble {bubble:.1%}', fontsize=9)
    axes[-1].set_xlabel('ms since step start  (blue: forward F, orange: '
                        'backward B, green: weight gradient W; numbers: '
                        'micro-batch)')
    s = self.schedule
    fig.suptitle(title or f'{s.name} K={s.num_cells} M={s.num_micro_batches}',
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    return path


def EstimateCellCosts(schedule, start_times, end_times):
  """Median measured F, B and W seconds of each cell: (fwd, bwd, weight).

  `weight` is empty for a schedule without W actions.
  """
  fwd, bwd, weight = [], [], []
  kinds = [(schedule_lib.FORWARD, fwd), (schedule_lib.BACKWARD, bwd)]
  if schedule.splits_backward:
    kinds.append((schedule_lib.WEIGHT, weight))
  for k in range(schedule.num_cells):
    for kind, out in kinds:
      durations = [end_times[a] - start_times[a] for a in start_times
                   if a.cell == k and a.kind == kind]
      out.append(float(np.median(durations)) if durations else 0.0)
  return fwd, bwd, weight


def FromActionTimes(schedule, action_times, replica=None):
  """Builds a Timeline from `LossAndGradients.action_times`.

  Args:
    schedule: the schedule that ran (`pipe.Schedule(M)`).
    action_times: {Action: (start, end)} timestamps (tensors or floats), or
      {(replica, Action): ...} for a pipeline with several replicas.
    replica: which replica to keep when keys are (replica, Action) pairs
      (default 0).

  Raises:
    ValueError: if an action of the schedule has no recorded time.
  """
  times = {}
  for key, (start, end) in action_times.items():
    if isinstance(key, tuple) and len(key) == 2 and isinstance(
        key[1], schedule_lib.Action):
      if key[0] != (replica or 0):
        continue
      key = key[1]
    times[schedule_lib.Action(*key)] = (float(np.asarray(start)),
                                        float(np.asarray(end)))
  missing = [str(a) for acts in schedule.device_actions for a in acts
             if a not in times]
  if missing:
    raise ValueError(f'No recorded time for actions {missing}; record the '
                     'step with record_times=True on the same schedule.')
  t0 = min(s for s, _ in times.values())
  start_times = {a: s - t0 for a, (s, _) in times.items()}
  end_times = {a: e - t0 for a, (_, e) in times.items()}
  fwd, bwd, weight = EstimateCellCosts(schedule, start_times, end_times)
  predicted = schedule_lib.Simulate(schedule, fwd, bwd,
                                    weight_costs=weight or None)
  return Timeline(schedule, start_times, end_times, fwd, bwd, predicted,
                  weight)


def RecordStep(pipe, inputs, targets, loss_fn, warmup_steps=1, step=None,
               replica=0, training=True):
  """Runs `warmup_steps` + 1 steps of `pipe` and times the last one.

  Gradients are computed but not applied, so recording does not change the
  model. Warm-up steps absorb tracing and first-run allocation.

  Args:
    pipe: a `gpipe.PipeliningLayer`.
    inputs, targets, loss_fn: as for `pipe.ComputeLossAndGradients`.
    warmup_steps: untimed steps run first.
    step: seed for random ops (default: the layer's counter).
    replica: which replica's timeline to return.
    training: run layers in training mode.

  Returns:
    A Timeline.
  """
  out = None
  for _ in range(warmup_steps + 1):
    out = pipe.ComputeLossAndGradients(inputs, targets, loss_fn,
                                       training=training, step=step,
                                       record_times=True)
  actions = [k[1] if len(k) == 2 else k for k in out.action_times]
  num_micro_batches = 1 + max(a.micro_batch for a in actions)
  sched = pipe.Schedule(num_micro_batches, replica)
  return FromActionTimes(sched, out.action_times,
                         replica if pipe.num_replicas > 1 else None)
