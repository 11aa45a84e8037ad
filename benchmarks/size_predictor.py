"""The largest model size the memory model predicts fits, per configuration.

Table 1's search (benchmarks/largest_model.py) starts each configuration
from this prediction: it profiles each distinct layer once (one profiled
step per layer signature, shared by every size of the family), walks the
memory model over a size's peak-balanced cut, and gallops then bisects
over sizes. What a size is (its trainer params) is the subclass's.
"""

import concurrent.futures
import time

from benchmarks import model_environment

MIB = 2.0**20


def NumCells(config):
  """K of a configuration name ('naive-1', 'pipeline-8')."""
  return int(config.split('-')[1])


class SizePredictor:
  """The memory model's largest size per configuration of one family, from
  layer profiles (one profiled step per distinct layer, shared by all
  sizes). A subclass says what a size is (`Params`)."""

  def __init__(self, family, log, step, smallest, budget_mib, batch,
               max_size, parallel):
    """Starts with no profiles.

    Args:
      family: the model family (its environment: model_environment).
      log: fn(line).
      step: sizes come in multiples of it.
      smallest: the family's smallest size.
      budget_mib: each device's memory.
      batch: the global batch (M = batch in the pipelines).
      max_size: the largest size considered.
      parallel: profiling subprocesses run side by side (Prefetch).
    """
    self.family = family
    self.log = log
    self.step, self.smallest = step, smallest
    self.budget_mib, self.batch = budget_mib, batch
    self.max_size, self.parallel = max_size, parallel
    self._profiles = {}  # layer signature -> CellProfile

  def Params(self, size):
    """The trainer's params of the family's model of this size."""
    raise NotImplementedError

  def _Signatures(self, p):
    """(layer cells, the memory profile's signature of each) of params p."""
    from tfpipe.gpipe import memory_profile  # pylint: disable=g-import-not-at-top
    from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
    cells = memory_report.LayerCells(p)
    model = p.task.model.Instantiate()
    shapes = memory_report.CellInputShapes(cells, model.InputShape())
    return cells, [memory_profile.CellSignature(c, s, k == len(cells) - 1,
                                                k == 0)
                   for k, (c, s) in enumerate(zip(cells, shapes))]

  def _Profile(self, p, cells, indices):
    """CellProfiles of the layers at `indices` of params p, in a subprocess."""
    from benchmarks import capped_workers  # pylint: disable=g-import-not-at-top
    from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
    # The devices are capped workers, whose builds hold no allocator slack
    # (their variables' initial values are made by the controller) and
    # whose actions are calls on the single-threaded executor.
    request = memory_report.ProfileRequest(
        p, cells=cells, micro_batch_sizes=[1, self.batch],
        intra_op_threads=capped_workers.INTRA_OP_THREADS,
        single_threaded_calls=capped_workers.SINGLE_THREADED_CALLS,
        allocator_slack=False, process_per_cell=False)
    request.Select(indices)  # Only the layers not profiled yet.
    return memory_report.Profile(request, in_subprocess=True)

  def Prefetch(self):
    """Profiles, before the search, every distinct layer it will meet, in
    `parallel` subprocesses side by side.

    A family's small sizes hold layers its larger ones do not (AmoebaNet's
    L=3, 6 and 9 each add some; from L=12 on the 13 are the same), and the
    search probes sizes in that order, so profiling on demand took three
    rounds of one subprocess each (3 minutes for AmoebaNet). The sizes
    walked here stop once two in a row add nothing; the largest size the
    search considers is looked at too. A profile measures memory (each
    subprocess its own allocator), so running them side by side changes
    their time, not what they measure.
    """
    step, smallest, max_size = self.step, self.smallest, self.max_size
    seen = set(self._profiles)
    items = []  # (size, params, cells, signatures, index): new signatures.

    def Walk(size):
      p = self.Params(size)
      cells, keys = self._Signatures(p)
      new = [k for k, key in enumerate(keys)
             if key not in seen and key not in keys[:k]]
      seen.update(keys)
      items.extend((size, p, cells, keys, k) for k in new)
      return new
    quiet, size = 0, smallest
    while size <= max_size and quiet < 2:
      quiet = 0 if Walk(size) else quiet + 1
      size += step
    if size <= max_size:
      Walk(max_size)
    if not items:
      return
    start = time.time()
    width = max(1, min(self.parallel, len(items)))
    share = -(-len(items) // width)
    groups = [items[i:i + share] for i in range(0, len(items), share)]

    def ProfileGroup(group):
      """One subprocess per size in the group, one after another."""
      profiled = {}
      for size in dict.fromkeys(item[0] for item in group):
        mine = [item for item in group if item[0] == size]
        _, p, cells, keys, _ = mine[0]
        indices = [item[4] for item in mine]
        for k, profile in zip(indices, self._Profile(p, cells, indices)):
          profiled[keys[k]] = profile
      return profiled
    with model_environment.Within(self.family), (
        concurrent.futures.ThreadPoolExecutor(len(groups))) as pool:
      for profiled in pool.map(ProfileGroup, groups):
        self._profiles.update(profiled)
    self.log(f'  profiled {len(items)} layer(s) of sizes '
             f'{sorted(set(item[0] for item in items))} in {len(groups)} '
             f'subprocess chain(s) side by side, {time.time() - start:.0f}s')

  def _LayerProfiles(self, p):
    """gpipe.planner.LayerProfiles of the model of params p."""
    from tfpipe.gpipe import planner  # pylint: disable=g-import-not-at-top
    cells, keys = self._Signatures(p)
    missing = [k for k, key in enumerate(keys) if key not in self._profiles]
    if missing:
      start = time.time()
      with model_environment.Within(self.family):
        profiles = self._Profile(p, cells, missing)
      for k, profile in zip(missing, profiles):
        self._profiles[keys[k]] = profile
      self.log(f'  profiled {len(missing)} new layer(s) in '
               f'{time.time() - start:.0f}s')
    profiles = [self._profiles[key] for key in keys]
    return planner.LayerProfiles(profiles, profiles[-1])

  def Peaks(self, config, size):
    """(predicted per-device peaks, layer counts) of one size."""
    from tfpipe.gpipe import memory_model  # pylint: disable=g-import-not-at-top
    from tfpipe.gpipe import planner  # pylint: disable=g-import-not-at-top
    p = self.Params(size)
    layers = self._LayerProfiles(p)
    if config == 'naive-1':
      step = memory_model.StepConfig('gpipe', 1, self.batch, 'never')
      cell = layers.Range(0, len(layers), self.batch)
      peak = memory_model.WalkDevice(memory_model.MakeSchedule(step, 1), 0,
                                     lambda k, n: cell, step)
      # With one micro-batch the walk counts no accumulators, as plain Keras.
      return [peak.peak_bytes], [len(layers)], [peak]
    step = memory_model.StepConfig('1f1b', self.batch, self.batch,
                                   'always')
    found = planner.MemoryBalancedCut(layers, NumCells(config), step)
    if found is None:
      return None, None, None
    counts, _, peaks = found
    return [p.peak_bytes for p in peaks], counts, peaks

  def Largest(self, config, start, scale=1.0):
    """The largest size predicted to fit (galloping, then bisecting).

    With `scale`, each predicted peak is multiplied by it first: the ratio
    of a trial's measured peak to the prediction calibrates the model for
    this configuration's next guess.
    """
    step, smallest = self.step, self.smallest
    budget = self.budget_mib * MIB / scale
    limit = self.max_size

    def Fits(size):
      peaks, _, _ = self.Peaks(config, size)
      return peaks is not None and max(peaks) <= budget
    # The smallest model with at least one layer per cell.
    while smallest <= limit and self.Peaks(config, smallest)[0] is None:
      smallest += step
    if smallest > limit or not Fits(smallest):
      return 0
    good, size = smallest, max(smallest, start)
    while size <= limit and Fits(size):
      good, size = size, size * 2 - (size * 2) % step
    bad = min(size, limit + step)
    while bad - good > step:
      mid = good + ((bad - good) // 2) // step * step
      if Fits(mid):
        good = mid
      else:
        bad = mid
    return good
