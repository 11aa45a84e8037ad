"""Table 1's search: the largest size of each configuration that trains.

A trial of one size takes minutes (benchmarks/largest_model.py runs it in
processes of its own), so the search asks the memory model first and runs as
few as it can: a configuration's search goes round by round (ConfigSearch),
and the families' searches share the trial slots (RunFamilies). What a trial
is and how a size is predicted come from the caller (Settings, the
predictor), so the search runs as well on fake trials (its tests).
"""

import concurrent.futures
import dataclasses
from typing import Callable, Dict, List, Tuple

from benchmarks import size_predictor

MIB = size_predictor.MIB


@dataclasses.dataclass
class Settings:
  """What the search may do.

  Attributes:
    families: {family: (size step, smallest size)}, searched in this order.
    configs: each family's configurations, in order ('naive-1',
      'pipeline-K').
    trial: fn(config, family, size, layer counts) -> the trial's dict
      ('fits', 'seconds', 'peaks', 'params', 'timed_out', 'error').
    parallel: trials run side by side.
    max_trials: trials per configuration at most.
    max_size: the largest size considered.
    first_size: the first trial's size in place of the prediction (0: none).
  """
  families: Dict[str, Tuple[int, int]]
  configs: List[str]
  trial: Callable[..., dict]
  parallel: int = 2
  max_trials: int = 6
  max_size: int = 192
  first_size: int = 0


class ConfigSearch:
  """The search for one configuration's largest size, round by round.

  Each round runs up to `parallel` trials at once, one process tree
  each with its own caps, so a verdict does not depend on its neighbour
  (only its time does; a trial's first step is mostly one Python thread
  tracing the cells). The first round tries the memory model's largest
  size, its peaks scaled by `scale` (measured over predicted, carried from
  the previous pipeline), and the sizes just above it: when the model is
  right, that one round finds the answer and shows the next size does not
  fit. Then: above the largest size that fitted, as far as the model
  calibrated by that trial says (it errs by a similar factor at nearby
  sizes of one configuration); below the smallest that did not; or
  splitting the gap between them; within `max_trials`. A trial that times
  out says nothing about memory: the search stops there, and the largest
  size that fitted is a lower bound.

  The caller runs the rounds (NextRound, then Record for each of its
  trials), so that several configurations' rounds can share the slots
  (RunFamilies).
  """

  def __init__(self, family, config, predictor, start, log, settings,
               scale=1.0):
    self.family, self.config = family, config
    self._predictor, self._log = predictor, log
    self._settings = settings
    self._step, self._smallest = settings.families[family]
    self.predicted = predictor.Largest(config, start)
    guess = predictor.Largest(config, start, scale) if scale != 1.0 else (
        self.predicted)
    log(f'{family} {config}: the memory model predicts {self.predicted} '
        'fits' + (f' ({guess} scaled by {scale:.3f})'
                  if guess != self.predicted else ''))
    self.trials = {}
    first = max(settings.first_size or guess, self._smallest)
    self._first = [s for s in (first + i * self._step
                               for i in range(settings.parallel))
                   if s <= max(settings.max_size, first)]
    self._started = False

  def NextRound(self):
    """The sizes to try side by side next; [] when the search is over."""
    if self._TimedOut():
      return []
    if self._started:
      if len(self.trials) >= self._settings.max_trials:
        return []
      sizes = self._NextSizes()
    else:
      self._started, sizes = True, self._first
    return sizes[:max(1, self._settings.max_trials - len(self.trials))]

  def Predict(self, size):
    """(predicted peaks, layer counts) of a size: a trial's cut. Here, not
    in the trial's thread: a new layer's profile is a subprocess."""
    return self._predictor.Peaks(self.config, size)[:2]

  def Record(self, size, result, prediction):
    """Takes a trial's result; logs it."""
    self.trials[size] = result
    peaks = prediction[0]
    if result.get('peaks') and peaks:
      result['measured_over_predicted'] = round(
          max(result['peaks']) / max(peaks), 3)
    measured = ' '.join(f'{v / MIB:.1f}' for v in result.get('peaks', []))
    self._log(f'  {self.family} {self.config} size {size}: '
              f'{"fits" if result["fits"] else "does not fit"} '
              f'({result["seconds"]:.0f}s) '
              f'{measured + " MiB" if measured else ""}'
              f'{"" if result["fits"] else " " + result.get("error", "")}')

  def Result(self):
    """(largest size that fitted, {size: trial}, the model's unscaled
    prediction)."""
    return self._Bounds()[0], self.trials, self.predicted

  def _TimedOut(self):
    return any(t.get('timed_out') for t in self.trials.values())

  def _Bounds(self):
    fitted = [s for s, t in self.trials.items() if t['fits']]
    failed = [s for s, t in self.trials.items() if not t['fits'] and
              not t.get('timed_out')]
    return max(fitted, default=0), min(failed, default=None)

  def _NextSizes(self):
    step, width = self._step, self._settings.parallel
    max_size = self._settings.max_size
    good, bad = self._Bounds()
    if bad is not None and bad - good <= step:
      return []
    if not good:  # Nothing fitted yet: the sizes just below.
      sizes = [bad - (i + 1) * step for i in range(width)]
    elif bad is None:  # Up, as far as the calibrated model says.
      calibrated = self.trials[good].get('measured_over_predicted', 1.0)
      first = min(max(good + step, self._predictor.Largest(
          self.config, good, calibrated)), max_size)
      sizes = [first + i * step for i in range(width)]
    else:  # The gap split evenly (every size in it, if it is that small).
      inside = (bad - good) // step - 1
      sizes = [good + (i + 1) * step for i in range(inside)] if (
          inside <= width) else [
              good + (bad - good) * (i + 1) // (width + 1) // step * step
              for i in range(width)]
    return [s for s in dict.fromkeys(sizes)
            if self._smallest <= s <= max_size and
            s not in self.trials and (bad is None or s < bad) and s > good]


def Search(family, config, predictor, start, log, settings, scale=1.0):
  """One configuration's search, its rounds one after another
  (ConfigSearch); returns ConfigSearch.Result()."""
  search = ConfigSearch(family, config, predictor, start, log, settings,
                        scale)
  sizes = search.NextRound()
  while sizes:
    predictions = {size: search.Predict(size) for size in sizes}
    with concurrent.futures.ThreadPoolExecutor(len(sizes)) as pool:
      results = dict(zip(sizes, pool.map(
          lambda size: settings.trial(config, family, size,
                                      predictions[size][1]),
          sizes)))
    for size in sorted(sizes):
      search.Record(size, results[size], predictions[size])
    sizes = search.NextRound()
  return search.Result()


class _FamilyChain:
  """One family's configurations, searched in order: each starts from the
  previous one's answer, its first guess scaled by the previous
  pipeline's measured over predicted."""

  def __init__(self, family, predictor, log, settings):
    self.family, self.predictor, self.log = family, predictor, log
    self.settings = settings
    self.configs = list(settings.configs)
    self.previous = settings.families[family][1]
    self.scale = 1.0
    self.search = None
    self.queue = []       # [(size, prediction)] of the round not yet started
    self.in_flight = 0
    self.last_seconds = 0.0
    self.results = []

  def RemainingWork(self):
    """Seconds of trials this family may still need, roughly: its latest
    trial's time, scaled by the devices of its configurations left (a
    trial's time grows with the model, which grows with K)."""
    left = ([self.search.config] if self.search else []) + self.configs
    k = size_predictor.NumCells(left[0]) if left else 1
    return self.last_seconds * sum(size_predictor.NumCells(c)
                                   for c in left) / k

  def Advance(self):
    """Queues the next round; finishes configurations that are over and
    starts the next. Returns False when the family is done."""
    while True:
      if self.search is None:
        if not self.configs:
          return False
        self.search = ConfigSearch(self.family, self.configs.pop(0),
                                   self.predictor, self.previous, self.log,
                                   self.settings, self.scale)
      sizes = self.search.NextRound()
      if sizes:
        self.queue = [(size, self.search.Predict(size)) for size in sizes]
        return True
      self._Finish()

  def _Finish(self):
    search, self.search = self.search, None
    size, trials, predicted = search.Result()
    self.previous = max(self.previous, size)
    fitting = trials.get(size, {})
    if search.config != 'naive-1':  # The next pipeline errs by about as much.
      self.scale = fitting.get('measured_over_predicted', self.scale)
    _, counts, peaks = self.predictor.Peaks(search.config, size) if size else (
        None, None, None)
    self.results.append({
        'family': self.family, 'config': search.config, 'size': size,
        'predicted_size': predicted, 'params': fitting.get('params', 0),
        'measured_peaks_mib': [round(v / MIB, 2)
                               for v in fitting.get('peaks', [])],
        'predicted_peaks_mib': [round(p.peak_bytes / MIB, 2)
                                for p in peaks or []],
        'where': [p.Describe() for p in peaks or []],
        'layer_counts': counts, 'trials': trials})


def RunFamilies(predictors, log, settings):
  """Every family's search, side by side, their trials sharing
  `parallel` slots; returns the results, family by family.

  A family's configurations run in order (each round waits for the one
  before it), but another family's trials fill a slot that would wait: a
  round of two trials ends with its slower one, and a configuration's
  search waits for its round. A free slot takes a trial of the family with
  the most work left (RemainingWork), so the longer chain is not delayed.
  """
  chains = [_FamilyChain(family, predictors[family], log, settings)
            for family in settings.families]
  active = [chain for chain in chains if chain.Advance()]
  running = {}  # future -> (chain, search, size, prediction)
  with concurrent.futures.ThreadPoolExecutor(settings.parallel) as pool:
    while running or any(chain.queue for chain in active):
      while len(running) < settings.parallel:
        waiting = [chain for chain in active if chain.queue]
        if not waiting:
          break
        chain = max(waiting, key=lambda c: c.RemainingWork())
        size, prediction = chain.queue.pop(0)
        chain.in_flight += 1
        search = chain.search
        running[pool.submit(settings.trial, search.config, chain.family, size,
                            prediction[1])] = (chain, search, size, prediction)
      done, _ = concurrent.futures.wait(
          running, return_when=concurrent.futures.FIRST_COMPLETED)
      for future in done:
        chain, search, size, prediction = running.pop(future)
        result = future.result()
        search.Record(size, result, prediction)
        chain.in_flight -= 1
        chain.last_seconds = max(chain.last_seconds, result['seconds'])
        if not chain.in_flight and not chain.queue and not chain.Advance():
          active.remove(chain)
  return [r for chain in chains for r in chain.results]
