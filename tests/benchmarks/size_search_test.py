"""benchmarks/size_search.py: Table 1's search, on fake trials.

Protected properties: a right prediction is confirmed in one round of a
size and the next; a wrong one is calibrated by the trial that fits, or
searched below, or its gap split; a timed-out trial ends the search; the
families' searches share the slots and try what each would alone. Each
check runs the search in a subprocess (the benchmark's flags are parsed
there), through largest_model's flags and wrappers, with `Trial` replaced.
"""

import json

from tests.benchmarks import script_runner


_SEARCH = r'''
import json, sys
from absl import flags
from benchmarks import largest_model

flags.FLAGS(['largest_model', '--budget_mib=16', '--max_trials=%d',
             '--parallel_trials=%d'])
MIB = largest_model.MIB
TRUE_MIB, PREDICTED_MIB = %r, %r  # per size unit: the truth and the model
TIMEOUT_AT, SCALE, OVERSHOOT = %r, %r, %r


class Predictor:
  def Peaks(self, config, size):
    return [size * PREDICTED_MIB * MIB], [size], None

  def Largest(self, config, start, scale=1.0):
    # OVERSHOOT: a calibrated guess that is that much too large.
    return int(16 / (PREDICTED_MIB * scale)) + (OVERSHOOT if scale != 1.0
                                                 else 0)


def Trial(config, family, size, counts):
  if TIMEOUT_AT is not None and size >= TIMEOUT_AT:
    return {'fits': False, 'timed_out': True, 'seconds': 1}
  peak = size * TRUE_MIB * MIB
  return {'fits': peak <= 16 * MIB, 'peaks': [peak], 'seconds': 1}


largest_model.Trial = Trial
size, trials, predicted = largest_model.Search(
    'transformer', 'pipeline-8', Predictor(), 1, lambda line: None, SCALE)
print(json.dumps([size, sorted(trials), predicted]))
'''


def _Search(true_mib, predicted_mib, max_trials=6, timeout_at=None,
            parallel=2, scale=1.0, overshoot=0):
  """(largest size found, sizes tried, predicted) of a search whose trials
  fit while size x true_mib <= 16, its model predicting predicted_mib."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run(
      [sys.executable, '-c', _SEARCH % (max_trials, parallel, true_mib,
                                        predicted_mib, timeout_at, scale,
                                        overshoot)],
      cwd=script_runner.ROOT, capture_output=True, text=True, timeout=60,
      check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.splitlines()[-1])


def test_search_calibrates_the_memory_model_by_a_trial_and_bisects():
  # One trial at a time. The model over-predicts by 1.2x: it guesses 66
  # blocks; scaled by the first trial's measured/predicted it guesses 80,
  # the answer, and the trial after it (81) does not fit.
  assert _Search(0.2, 0.24, parallel=1) == [80, [66, 80, 81], 66]
  # Under-predicted: down from the guess, one size at a time.
  assert _Search(0.25, 0.24, parallel=1) == [64, [64, 65, 66], 66]
  # A timed-out trial ends the search: what fitted is a lower bound.
  assert _Search(0.2, 0.24, timeout_at=70, parallel=1) == [66, [66, 80], 66]


def test_search_runs_a_size_and_the_next_side_by_side():
  # A right prediction is confirmed in one round: 64 fits, 65 does not.
  assert _Search(0.25, 0.25) == [64, [64, 65], 64]
  # Over-predicted by 1.2x: 66 and 67 fit, then the calibrated 80 and 81.
  assert _Search(0.2, 0.24) == [80, [66, 67, 80, 81], 66]
  # Under-predicted: 66 and 67 fail, then the two sizes below them.
  assert _Search(0.25, 0.24) == [64, [64, 65, 66, 67], 66]
  # The previous pipeline's measured/predicted scales the first guess: a
  # model that over-predicts by 1.2x lands in one round.
  assert _Search(0.2, 0.24, scale=0.2 / 0.24) == [80, [80, 81], 66]
  # A timed-out trial ends the search.
  assert _Search(0.2, 0.24, timeout_at=70) == [67, [66, 67, 80, 81], 66]
  # A gap between a fit and a failure is split in three by each round
  # (67 and 90: 74 and 82; then 76 and 79; then 80 and 81).
  assert _Search(0.2, 0.24, overshoot=10, max_trials=10) == [
      80, [66, 67, 74, 76, 79, 80, 81, 82, 90, 91], 66]


_FAMILIES = r'''
import json, threading, time
from absl import flags
from benchmarks import largest_model

flags.FLAGS(['largest_model', '--budget_mib=16', '--parallel_trials=2',
             '--configs=naive-1,pipeline-2,pipeline-4'])
MIB = largest_model.MIB
# Per family: MiB per size unit, the truth and the model, on K devices.
TRUTH = {'transformer': (0.2, 0.24), 'amoebanet': (0.5, 0.45)}


class Predictor:
  def __init__(self, family):
    self.true_mib, self.predicted_mib = TRUTH[family]
    self.step = largest_model.FAMILIES[family][0]

  def Peaks(self, config, size):
    k = int(config.split('-')[1])
    return [size * self.predicted_mib / k * MIB], [size], None

  def Largest(self, config, start, scale=1.0):
    k = int(config.split('-')[1])
    return int(16 * k / (self.predicted_mib * scale)) // self.step * self.step


lock = threading.Lock()
running, log = set(), []


def Trial(config, family, size, counts):
  k = int(config.split('-')[1])
  with lock:
    running.add((family, config, size))
    log.append(sorted(running))
  # The amoebanet family's trials take longer, as they do.
  time.sleep((0.08 if family == 'amoebanet' else 0.02) * k)
  with lock:
    running.discard((family, config, size))
  peak = size * TRUTH[family][0] / k * MIB
  return {'fits': peak <= 16 * MIB, 'peaks': [peak], 'seconds': 0.1 * k,
          'params': size}


largest_model.Trial = Trial
predictors = {f: Predictor(f) for f in TRUTH}
results = largest_model.RunFamilies(predictors, lambda line: None)
# The same searches one after another, as Search runs them.
alone = []
for family in ('transformer', 'amoebanet'):
  previous, scale = largest_model.FAMILIES[family][1], 1.0
  for config in ('naive-1', 'pipeline-2', 'pipeline-4'):
    size, trials, predicted = largest_model.Search(
        family, config, predictors[family], previous, lambda line: None, scale)
    previous = max(previous, size)
    if config != 'naive-1':
      scale = trials[size].get('measured_over_predicted', scale)
    alone.append([family, config, size, sorted(trials)])
print(json.dumps({
    'together': [[r['family'], r['config'], r['size'], sorted(r['trials'])]
                 for r in results],
    'alone': alone, 'most_at_once': max(len(r) for r in log),
    'families_at_once': max(len({f for f, _, _ in r}) for r in log)}))
'''


def test_families_share_the_slots_and_search_as_they_would_alone():
  # Each configuration tries the sizes its search tries alone, with the
  # same answer; at most --parallel_trials trials run at once, and the
  # two families' trials run side by side.
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  proc = subprocess.run([sys.executable, '-c', _FAMILIES],
                        cwd=script_runner.ROOT, capture_output=True,
                        text=True, timeout=120, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.splitlines()[-1])
  assert result['together'] == result['alone'], result
  assert [r[:2] for r in result['together']] == [
      [f, c] for f in ('transformer', 'amoebanet')
      for c in ('naive-1', 'pipeline-2', 'pipeline-4')], result
  assert all(r[2] > 0 for r in result['together']), result
  assert result['most_at_once'] == 2, result
  assert result['families_at_once'] == 2, result
