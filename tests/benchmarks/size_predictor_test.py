"""benchmarks/size_predictor.py: profiling a family's layers up front."""

import threading

from benchmarks import size_predictor


class _AmoebaLike(size_predictor.SizePredictor):
  """Sizes 3, 6 and 9 each add a layer, later ones none; the largest size
  holds one more. A size's params are the size itself; profiles are
  strings; the first subprocess of each chain waits for the other's."""

  def __init__(self):
    super().__init__('amoebanet', lambda line: None, step=3, smallest=3,
                     budget_mib=16, batch=8, max_size=30, parallel=2)
    self.calls = []
    self._started = threading.Barrier(2, timeout=20)

  def Params(self, size):
    return size

  def _Signatures(self, p):
    keys = ['first', 'grow%d' % min(p, 9), 'last'] + (
        ['big'] if p >= 30 else [])
    return ['cell'] * len(keys), keys

  def _Profile(self, p, cells, indices):
    if not self.calls or self.calls[-1][0] != p and p in (3, 6):
      self._started.wait()  # Each chain's first runs beside the other's.
    self.calls.append((p, indices))
    return ['profile of %d:%d' % (p, k) for k in indices]


def test_prefetch_profiles_each_new_layer_once_in_side_by_side_chains():
  predictor = _AmoebaLike()
  predictor.Prefetch()
  predictor.Prefetch()  # Everything is known: nothing more to profile.
  # Sizes 3 to 15 walked (12 and 15 add nothing), then the largest, 30;
  # six new layers in two chains of three: one subprocess per size.
  assert sorted(predictor.calls) == [(3, [0, 1, 2]), (6, [1]), (9, [1]),
                                     (30, [3])]
  assert predictor._profiles == {  # pylint: disable=protected-access
      'first': 'profile of 3:0', 'grow3': 'profile of 3:1',
      'last': 'profile of 3:2', 'grow6': 'profile of 6:1',
      'grow9': 'profile of 9:1', 'big': 'profile of 30:3'}


def test_num_cells_reads_the_configuration_name():
  assert size_predictor.NumCells('naive-1') == 1
  assert size_predictor.NumCells('pipeline-8') == 8


class _Request:

  def __init__(self, *args, **kwargs):
    self.args, self.kwargs = args, kwargs
    self.selected = None

  def Select(self, indices):
    self.selected = indices


def test_layers_are_profiled_as_the_capped_workers_run_them(monkeypatch):
  """Single-threaded calls, one intra-op thread, no build slack: the
  trials' workers' CPUs (capped_workers), not this process's executor;
  the layers, a search's estimate, share one process."""
  from benchmarks import capped_workers  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  seen = []
  monkeypatch.setattr(memory_report, 'ProfileRequest', _Request)
  monkeypatch.setattr(memory_report, 'Profile',
                      lambda request, in_subprocess: seen.append(
                          (request, in_subprocess)) or ['profile'])
  predictor = size_predictor.SizePredictor(
      'amoebanet', lambda line: None, step=3, smallest=3, budget_mib=16,
      batch=8, max_size=30, parallel=1)
  assert predictor._Profile('params', ['cell'], [0]) == ['profile']  # pylint: disable=protected-access
  [(request, in_subprocess)] = seen
  assert in_subprocess and request.selected == [0]
  assert request.args == ('params',)
  assert request.kwargs == {
      'cells': ['cell'], 'micro_batch_sizes': [1, 8],
      'intra_op_threads': capped_workers.INTRA_OP_THREADS,
      'single_threaded_calls': capped_workers.SINGLE_THREADED_CALLS,
      'allocator_slack': False, 'process_per_cell': False}
