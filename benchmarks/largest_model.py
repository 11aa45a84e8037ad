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

On a GPU (--device=auto picks it when one is visible) this is GPipe Table 1
on logical GPUs: each trial splits the GPU into K logical GPUs of
--budget_mib each (tfpipe.devices), so every device has its own allocator
and a HARD limit, and a trial fits if two Adam steps run without running
out of memory (each device's peak is read with get_memory_info('GPU:k')).
The defaults there are the paper's Transformer: d=2048, FFN 8192, 16 heads,
batch 32 x 256 tokens, Adam, 8 GiB per device, K=8, executor 'auto' (graph
on GPUs); the naive model is expected to fit 2 layers. K x budget must fit
the GPU, which is checked before any trial:

    python -m benchmarks.largest_model --device=gpu \
        --output_json=/tmp/largest_gpu.json
"""

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

FLAGS = flags.FLAGS
# Defaults of None are per device: (CPU, GPU), from DEFAULTS.
flags.DEFINE_enum('device', 'auto', ['auto', 'cpu', 'gpu'],
                  'Where the trials run: logical CPU devices sharing one '
                  'BFC allocator, logical GPUs of --budget_mib each, or auto '
                  '(gpu when one is visible).')
flags.DEFINE_float('budget_mib', None, 'Memory budget per device, MiB '
                   '(CPU 48, GPU 8192: each logical GPU\'s hard limit).')
flags.DEFINE_integer('num_cells', None, 'K of the pipeline-K configuration '
                     '(CPU 4, GPU 8).', lower_bound=1)
flags.DEFINE_integer('num_micro_batches', None, 'M of the pipelined runs '
                     '(CPU 4, GPU 8).', lower_bound=1)
flags.DEFINE_integer('batch', None, 'Global batch size N (CPU 16, GPU 32).')
flags.DEFINE_integer('seq', None, 'Sequence length (CPU 64, GPU 256).')
flags.DEFINE_integer('dim', None, 'Model dim, FFN 4*dim (CPU 128, GPU 2048).')
flags.DEFINE_integer('heads', None, 'Attention heads (CPU 4, GPU 16).')
flags.DEFINE_enum('optimizer', None, ['sgd', 'adam'],
                  'Update of the trials (CPU sgd, GPU adam: two slots per '
                  'parameter, on its device).')
flags.DEFINE_integer('max_layers', None, 'Stop the search here (CPU 64, GPU '
                     '256).')
flags.DEFINE_integer('trial_timeout_s', None, 'Timeout of one trial, s (CPU '
                     '240, GPU 600).')
flags.DEFINE_enum('executor', None, ['threads', 'graph', 'auto'],
                  "Executor of the pipelined trials (CPU threads, GPU auto, "
                  "which is graph there). 'threads' traces each cell once; "
                  "'graph' traces every action of the schedule, which takes "
                  'minutes for deep models.')
flags.DEFINE_string('output_json', None, 'Where to write the results.')
# Internal: set when this file runs as one trial's subprocess.
flags.DEFINE_string('trial', None, 'Run one trial: naive or pipeline.')
flags.DEFINE_integer('layers', 1, 'Trial: number of layers.')
flags.DEFINE_integer('trial_cells', 1, 'Trial: K.')

_MIB = 1024.0 * 1024.0
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per-device defaults of the flags left at None: {flag: (CPU, GPU)}. The GPU
# column is GPipe Table 1's Transformer on 8 GiB devices.
DEFAULTS = {
    'budget_mib': (48.0, 8192.0), 'num_cells': (4, 8),
    'num_micro_batches': (4, 8), 'batch': (16, 32), 'seq': (64, 256),
    'dim': (128, 2048), 'heads': (4, 16), 'optimizer': ('sgd', 'adam'),
    'max_layers': (64, 256), 'trial_timeout_s': (240, 600),
    'executor': ('threads', 'auto'),
}


def ResolveDefaults(flag_values, device_type):
  """Sets every flag left at None to its default for 'CPU' or 'GPU'."""
  column = 0 if device_type == 'CPU' else 1
  for name, values in DEFAULTS.items():
    if flag_values[name].value is None:
      flag_values[name].value = values[column]


def CheckGpuPlan(num_gpus, gpu_memory_mb, num_cells, budget_mib,
                 memory_source=''):
  """The split of pipeline-K, or a ValueError naming --budget_mib/--num_cells.

  Pure (tfpipe.devices.PlanSplit), so the GPU mode's arguments are checked
  the same way with or without a GPU.
  """
  from tfpipe import devices  # pylint: disable=g-import-not-at-top
  try:
    return devices.PlanSplit('GPU', num_gpus, num_cells,
                             physical_memory_mb=gpu_memory_mb,
                             memory_limit_mb=int(budget_mib),
                             memory_source=memory_source,
                             memory_name='--budget_mib')
  except ValueError as e:
    raise ValueError(f'pipeline-{num_cells} (--num_cells): {e}') from None


def _RunTrial():
  """Child process: build, train two steps, print the peak as JSON."""
  os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  tf = bench_lib.tf
  k = FLAGS.trial_cells
  if FLAGS.device == 'gpu':
    device_type, devices = bench_lib.LocalDevices(
        max(k, 1), 'gpu', memory_limit_mb=int(FLAGS.budget_mib))
    memory_names = [f'GPU:{i}' for i in range(max(k, 1))]
  else:
    device_type, devices = 'CPU', bench_lib.SplitCpu(max(k, 1))
    memory_names = ['CPU:0']
  try:
    step, variables = _TrialStep(bench_lib, devices)
    for _ in range(2):
      float(step())
  except Exception as e:  # pylint: disable=broad-except
    if not IsOutOfMemory(e):
      raise
    # A logical GPU's hard limit was reached: this many layers do not fit.
    print('TRIAL ' + json.dumps({'oom': True, 'device': device_type}))
    return
  params = sum(int(tf.size(v)) for v in variables)
  peaks = [tf.config.experimental.get_memory_info(name)['peak']
           for name in memory_names]
  print('TRIAL ' + json.dumps({'peak': max(peaks), 'peaks': peaks,
                               'params': params, 'device': device_type}))


def IsOutOfMemory(error):
  """True if `error`, or an error it was raised from, is an allocation failure.

  The threads executor re-raises a device thread's error as its cause.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, tf.errors.ResourceExhaustedError) or (
        'RESOURCE_EXHAUSTED' in str(error) or 'OOM when allocating' in
        str(error)):
      return True
    error = error.__cause__ or error.__context__
  return False


def _TrialStep(bench_lib, devices):
  """(step(), variables) of the trial's model on `devices`."""
  tf = bench_lib.tf
  k = FLAGS.trial_cells
  layer_params, x = bench_lib.MakeModel('transformer', FLAGS.layers,
                                        FLAGS.batch, seq=FLAGS.seq,
                                        dim=FLAGS.dim, heads=FLAGS.heads)
  if FLAGS.trial == 'naive':
    with tf.device(devices[0]):
      model = tf.keras.Sequential([p.Instantiate() for p in layer_params])
      model(x[:1])
    variables = model.trainable_variables
    update = _Update(bench_lib, variables)

    @tf.function
    def Step():
      with tf.GradientTape() as tape:
        loss = bench_lib.Loss(model(x, training=True))
      update(variables, tape.gradient(loss, variables))
      return loss
    return Step, variables
  pipe = bench_lib.MakePipe(layer_params, k, FLAGS.num_micro_batches,
                            devices, 'always',
                            input_shape=(None,) + tuple(x.shape[1:]),
                            executor=FLAGS.executor)
  variables = pipe.trainable_variables
  update = _Update(bench_lib, variables)
  if pipe.ResolvedExecutor(x) == 'threads':
    return bench_lib.PipeTrainStep(pipe, x, update), variables
  step = bench_lib.PipeTrainStep(pipe, update=update)
  return (lambda: step(x)), variables


def _Update(bench_lib, variables):
  """update(variables, gradients) for --optimizer."""
  if FLAGS.optimizer == 'adam':
    optimizer = bench_lib.Adam(variables)
    return lambda unused_variables, gradients: optimizer.Apply(gradients)
  return bench_lib.Sgd


def _Trial(kind, layers, cells, device):
  cmd = [sys.executable, '-m', 'benchmarks.largest_model', f'--trial={kind}',
         f'--layers={layers}', f'--trial_cells={cells}',
         f'--device={device}', f'--budget_mib={FLAGS.budget_mib}',
         f'--num_micro_batches={FLAGS.num_micro_batches}',
         f'--batch={FLAGS.batch}', f'--seq={FLAGS.seq}', f'--dim={FLAGS.dim}',
         f'--heads={FLAGS.heads}', f'--optimizer={FLAGS.optimizer}',
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


def _Search(kind, cells, budget_bytes, start, device):
  """Largest L in [1, max_layers] whose peak fits.

  Returns (L, trial, log, lower_bound); lower_bound is True when a trial
  timed out, so L is only the largest size known to fit.
  """
  log = []

  def Fits(layers):
    res = _Trial(kind, layers, cells, device)
    if res is not None and res.get('timed_out'):
      raise _TimedOut(layers)
    ok = (res is not None and not res.get('oom') and
          res['peak'] <= budget_bytes)
    log.append({'layers': layers, 'fits': ok, **(res or {})})
    peak = (f'{res["peak"] / _MIB:.1f} MiB' if res and 'peak' in res else
            'out of memory' if res else '-')
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


def _ChooseDevice():
  """'cpu' or 'gpu' for --device, with the GPU mode's arguments checked.

  Call after bench_lib is imported (it imports TensorFlow quietly).
  """
  from tfpipe import devices  # pylint: disable=g-import-not-at-top
  try:
    device_type = devices.ChooseDeviceType(FLAGS.device, flag='--device')
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  ResolveDefaults(FLAGS, device_type)
  if device_type == 'GPU':
    gpus = devices.VisibleGpus()
    memory, source = devices.GpuMemoryMb(gpus)
    try:
      CheckGpuPlan(len(gpus), memory, FLAGS.num_cells, FLAGS.budget_mib,
                   source)
    except ValueError as e:
      raise app.UsageError(str(e)) from None
  return device_type.lower()


def main(argv):
  del argv
  if FLAGS.trial:
    _RunTrial()
    return
  # pylint: disable=g-import-not-at-top
  from benchmarks import bench_lib
  device = _ChooseDevice()
  k, m = FLAGS.num_cells, FLAGS.num_micro_batches
  budget = FLAGS.budget_mib * _MIB
  # On logical CPU devices the peak is a total over one shared allocator;
  # each logical GPU has its own, so its budget is per device.
  pipeline_k_limit = k * budget if device == 'cpu' else budget
  configs = [('naive', 'naive-1', 1, budget),
             ('pipeline', 'pipeline-1', 1, budget),
             ('pipeline', f'pipeline-{k}', k, pipeline_k_limit)]
  paper = {'naive-1': '3 layers / 82M', 'pipeline-1': '13 layers / 318M',
           f'pipeline-{k}': ('103 layers (pipeline-8) / 1.05B (AmoebaNet '
                             'pipeline-4)')}
  results, start = [], 1
  for kind, name, cells, limit in configs:
    print(f'{name}: budget {limit / _MIB:.0f} MiB '
          f'{"total" if device == "cpu" else "per device"}')
    # K cells hold about K times the layers of one: start the search there.
    layers, res, log, lower_bound = _Search(kind, cells, limit, start * cells,
                                            device)
    start = max(1, layers)
    results.append({'config': name, 'layers': layers,
                    'lower_bound': lower_bound,
                    'params': res['params'] if res else 0,
                    'peak_bytes': res.get('peak') if res else None,
                    'peak_bytes_per_device': res.get('peaks') if res else None,
                    'budget_bytes': limit, 'trials': log})
  base = results[0]
  rows = []
  for r in results:
    growth = r['params'] / base['params'] if base['params'] else float('nan')
    rows.append([r['config'],
                 f'>={r["layers"]}' if r['lower_bound'] else r['layers'],
                 f'{r["params"] / 1e6:.2f}M',
                 (r['peak_bytes'] or 0) / _MIB, growth, paper[r['config']]])
  how = ('BFC peak, total over logical devices compared with K x budget'
         if device == 'cpu' else
         'each logical GPU\'s hard limit; a trial fits if two steps run '
         'without running out of memory')
  print(f'\nTransformer dim={FLAGS.dim}, hidden={4 * FLAGS.dim}, heads='
        f'{FLAGS.heads}, seq={FLAGS.seq}, batch={FLAGS.batch}, M={m}, '
        f'{FLAGS.optimizer}, executor={FLAGS.executor}, on {device.upper()}; '
        f'budget {FLAGS.budget_mib:.0f} MiB per device ({how})')
  print(bench_lib.FormatTable(
      ['config', 'layers', 'params', 'peak MiB', 'params x naive',
       'GPipe Table 1'], rows))
  print('GPipe growth factors: AmoebaNet params 1 : 3.9 : 12.8 (1.05B, '
        'pipeline-4) : 22 (1.8B, pipeline-8); Transformer layers 3 : 13 : '
        '103 (pipeline-8).')
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'largest_model', 'device': device,
      'flags': FLAGS.flag_values_dict(), 'results': results})


if __name__ == '__main__':
  app.run(main)
