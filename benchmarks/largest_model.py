r"""Largest Transformer that trains under a memory budget (GPipe Table 1 style).

Why: GPipe's headline is model *size*: re-materialization and partitioning
let a fixed per-accelerator memory hold far larger models (AmoebaNet 82M
naive -> 318M pipeline-1 -> 1.8B pipeline-8; Transformer 3 -> 13 -> 103
layers for pipeline-8). This searches the largest number of Transformer
layers whose training step stays under a budget:

  naive       plain Keras step, no pipeline, no remat, one device;
  pipeline-1  tfpipe, K=1, M micro-batches, remat;
  pipeline-K  tfpipe, K cells on K logical CPU devices, M, remat.

How: each trial is a fresh subprocess (so nothing of an earlier trial stays
allocated) with TensorFlow's BFC CPU allocator, building the model and
running two SGD train steps; its peak bytes are read from
`get_memory_info('CPU:0')`. Logical CPU devices share that allocator, so for
pipeline-K the total peak is compared with K x the per-device budget, which
assumes the K cells are balanced (partitioned by parameters; the layers are
identical). Search: double the layer count from the previous configuration's
answer until a trial exceeds the budget, then bisect.

    python -m benchmarks.largest_model --output_json=/tmp/largest.json
"""

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

FLAGS = flags.FLAGS
flags.DEFINE_float('budget_mib', 48.0, 'Memory budget per device, MiB.')
flags.DEFINE_integer('num_cells', 4, 'K of the pipeline-K configuration.')
flags.DEFINE_integer('num_micro_batches', 4, 'M of the pipelined runs.')
flags.DEFINE_integer('batch', 16, 'Global batch size N.')
flags.DEFINE_integer('seq', 64, 'Sequence length.')
flags.DEFINE_integer('dim', 128, 'Model dim (hidden 4*dim).')
flags.DEFINE_integer('max_layers', 64, 'Stop the search here.')
flags.DEFINE_integer('trial_timeout_s', 240, 'Timeout of one trial.')
flags.DEFINE_enum('executor', 'threads', ['threads', 'graph'],
                  "Executor of the pipelined trials. 'threads' traces each "
                  "cell once; 'graph' traces every action of the schedule, "
                  'which takes minutes for deep models.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')
# Internal: set when this file runs as one trial's subprocess.
flags.DEFINE_string('trial', None, 'Run one trial: naive or pipeline.')
flags.DEFINE_integer('layers', 1, 'Trial: number of layers.')
flags.DEFINE_integer('trial_cells', 1, 'Trial: K.')

_MIB = 1024.0 * 1024.0
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _RunTrial():
  """Child process: build, train two steps, print the peak as JSON."""
  os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  tf = bench_lib.tf
  k = FLAGS.trial_cells
  devices = bench_lib.SplitCpu(max(k, 1))
  layer_params, x = bench_lib.MakeModel('transformer', FLAGS.layers,
                                        FLAGS.batch, seq=FLAGS.seq,
                                        dim=FLAGS.dim)
  if FLAGS.trial == 'naive':
    model = tf.keras.Sequential([p.Instantiate() for p in layer_params])
    model(x[:1])
    variables = model.trainable_variables

    @tf.function
    def Step():
      with tf.GradientTape() as tape:
        loss = bench_lib.Loss(model(x, training=True))
      bench_lib.Sgd(variables, tape.gradient(loss, variables))
      return loss
  else:
    pipe = bench_lib.MakePipe(layer_params, k, FLAGS.num_micro_batches,
                              devices, 'always',
                              input_shape=(None,) + tuple(x.shape[1:]),
                              executor=FLAGS.executor)
    variables = pipe.trainable_variables
    if FLAGS.executor == 'threads':
      Step = bench_lib.PipeTrainStep(pipe, x)  # pylint: disable=invalid-name
    else:
      step = bench_lib.PipeTrainStep(pipe)
      Step = lambda: step(x)  # pylint: disable=invalid-name
  for _ in range(2):
    float(Step())
  info = tf.config.experimental.get_memory_info('CPU:0')
  params = sum(int(tf.size(v)) for v in variables)
  print('TRIAL ' + json.dumps({'peak': info['peak'], 'params': params}))


def _Trial(kind, layers, cells):
  cmd = [sys.executable, '-m', 'benchmarks.largest_model', f'--trial={kind}',
         f'--layers={layers}', f'--trial_cells={cells}',
         f'--num_micro_batches={FLAGS.num_micro_batches}',
         f'--batch={FLAGS.batch}', f'--seq={FLAGS.seq}', f'--dim={FLAGS.dim}',
         f'--executor={FLAGS.executor}']
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=_REPO_ROOT,
                          timeout=FLAGS.trial_timeout_s, check=False)
  except subprocess.TimeoutExpired:
    print(f'    {kind} K={cells} L={layers}: timed out (tracing, not memory)')
    return {'timed_out': True}
  for line in proc.stdout.splitlines():
    if line.startswith('TRIAL '):
      return json.loads(line[len('TRIAL '):])
  print(f'    {kind} K={cells} L={layers}: failed\n{proc.stderr[-2000:]}')
  return None


def _Search(kind, cells, budget_bytes, start):
  """Largest L in [1, max_layers] whose peak fits.

  Returns (L, trial, log, lower_bound); lower_bound is True when a trial
  timed out, so L is only the largest size known to fit.
  """
  log = []

  def Fits(layers):
    res = _Trial(kind, layers, cells)
    if res is not None and res.get('timed_out'):
      raise _TimedOut(layers)
    ok = res is not None and res['peak'] <= budget_bytes
    log.append({'layers': layers, 'fits': ok, **(res or {})})
    peak = f'{res["peak"] / _MIB:.1f} MiB' if res else '-'
    print(f'    L={layers:4d}: peak {peak}  {"fits" if ok else "too big"}')
    return ok, res

  try:
    good, good_res = _Grow(Fits, max(start, cells))
  except _TimedOut as e:
    fitting = [t for t in log if t['fits']]
    best = max(fitting, key=lambda t: t['layers']) if fitting else None
    good = best['layers'] if best else 0
    print(f'    stopped: L={e.layers} timed out; {good} is a lower bound')
    return good, best, log, True
  return good, good_res, log, False


class _TimedOut(Exception):

  def __init__(self, layers):
    super().__init__(f'trial with {layers} layers timed out')
    self.layers = layers


def _Grow(fits, start):
  """Doubles from `start` until a trial fails, then bisects."""
  good, good_res, bad = 0, None, None
  layers = max(1, start)
  while layers <= FLAGS.max_layers:
    ok, res = fits(layers)
    if not ok:
      bad = layers
      break
    good, good_res = layers, res
    layers *= 2
  if bad is None:
    bad = FLAGS.max_layers + 1
  while bad - good > 1:
    mid = (good + bad) // 2
    ok, res = fits(mid)
    if ok:
      good, good_res = mid, res
    else:
      bad = mid
  return good, good_res


def main(argv):
  del argv
  if FLAGS.trial:
    _RunTrial()
    return
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  k, m = FLAGS.num_cells, FLAGS.num_micro_batches
  budget = FLAGS.budget_mib * _MIB
  configs = [('naive', 'naive-1', 1, budget),
             ('pipeline', 'pipeline-1', 1, budget),
             ('pipeline', f'pipeline-{k}', k, k * budget)]
  paper = {'naive-1': '3 layers / 82M', 'pipeline-1': '13 layers / 318M',
           f'pipeline-{k}': ('103 layers (pipeline-8) / 1.05B (AmoebaNet '
                             'pipeline-4)')}
  results, start = [], 1
  for kind, name, cells, limit in configs:
    print(f'{name}: budget {limit / _MIB:.0f} MiB total')
    # K cells hold about K times the layers of one: start the search there.
    layers, res, log, lower_bound = _Search(kind, cells, limit, start * cells)
    start = max(1, layers)
    results.append({'config': name, 'layers': layers,
                    'lower_bound': lower_bound,
                    'params': res['params'] if res else 0,
                    'peak_bytes': res['peak'] if res else None,
                    'budget_bytes': limit, 'trials': log})
  base = results[0]
  rows = []
  for r in results:
    growth = r['params'] / base['params'] if base['params'] else float('nan')
    rows.append([r['config'],
                 f'>={r["layers"]}' if r['lower_bound'] else r['layers'],
                 f'{r["params"] / 1e6:.2f}M',
                 (r['peak_bytes'] or 0) / _MIB, growth, paper[r['config']]])
  print(f'\nTransformer dim={FLAGS.dim}, hidden={4 * FLAGS.dim}, '
        f'seq={FLAGS.seq}, batch={FLAGS.batch}, M={m}, executor='
        f'{FLAGS.executor}; budget '
        f'{FLAGS.budget_mib:.0f} MiB per device (BFC peak, total over '
        'logical devices compared with K x budget)')
  print(bench_lib.FormatTable(
      ['config', 'layers', 'params', 'peak MiB', 'params x naive',
       'GPipe Table 1'], rows))
  print('GPipe growth factors: AmoebaNet params 1 : 3.9 : 12.8 (1.05B, '
        'pipeline-4) : 22 (1.8B, pipeline-8); Transformer layers 3 : 13 : '
        '103 (pipeline-8).')
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'largest_model', 'flags': FLAGS.flag_values_dict(),
      'results': results})


if __name__ == '__main__':
  app.run(main)
