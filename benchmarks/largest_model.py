r"""GPipe Table 1 on emulated accelerators: the largest model that trains.

Why: GPipe's headline is model *size*. Each of K accelerators has a fixed
memory; re-materialization and partitioning let them hold far more than one
plain model: AmoebaNet-D 82M parameters naive, 318M pipeline-1, 542M
pipeline-2, 1.05B pipeline-4, 1.8B pipeline-8 (22x); a Transformer 3
layers naive, 13 pipeline-1, 103 pipeline-8 (34x).

How: every device is a worker process whose allocator is capped at the
family's budget or --budget_mib (TF_CPU_BFC_MEM_LIMIT_IN_MB: an allocation
past it fails, as on an accelerator of that size; benchmarks.capped_workers),
with one intra-op thread. A trial trains one full step (forward, backward, the
optimizer's update; then a second one) of a model of one size:

  naive-1     plain Keras (GradientTape, then the trainer's update:
              clipping and Adam) in one capped process;
  pipeline-K  the trainer's step (tfpipe.trainer.task) on K capped
              workers, remat_policy='always', schedule='1f1b', M = N
              micro-batches of one example, executor='threads' (which
              traces each cell once), cut by the memory model so that the
              devices' predicted peaks are balanced.

A trial fits if both steps run; it then reports each worker's peak and
where its time went (`phase_seconds`: the workers' start, the build, each
step; the first step is mostly tracing). The memory model
(gpipe.memory_model, fed by one profiled step per distinct layer) predicts
the largest size of each configuration first, so the search needs few
trials, run two side by side (--parallel_trials; each trial's processes
have their own caps, so the verdicts do not depend on it): the prediction
scaled by the previous pipeline's measured over predicted, with the size
above it, which together confirm a right prediction in one round; then the
prediction calibrated by a trial, or the sizes below, or the gap split
(size_search.ConfigSearch). The families' searches run side by side, a
free slot taking the next trial of the family with the most work left
(size_search.RunFamilies).

Models: a Transformer LM (size: its number of blocks) and AmoebaNet-D(L, D)
with D fixed (size: L, a multiple of 3), at shapes small enough for a trial
to take minutes on 2 cores (a pipeline-8 trial of AmoebaNet at L=96 took
9). The Transformer keeps GPipe's proportions: FFN 4d and a vocabulary of
16 d (GPipe's 32k tokens at d=2048), so its untied embedding and softmax
hold as many parameters as 2.7 blocks, a fixed cost that naive-1 pays in
full and pipeline-K on its first and last devices only. The growth over
naive-1 is printed next to GPipe's, and for the largest pipeline each
device's predicted peak says where its memory goes.

    python -m benchmarks.largest_model --output_json=/tmp/bench/largest_model.json
"""

import json
import os
import subprocess
import sys
import time

os.environ['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags  # pylint: disable=g-import-not-at-top

from benchmarks import model_environment  # pylint: disable=g-import-not-at-top
from benchmarks import size_predictor  # pylint: disable=g-import-not-at-top
from benchmarks import size_search  # pylint: disable=g-import-not-at-top
from benchmarks import trial_workers  # pylint: disable=g-import-not-at-top
from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
from tfpipe import network_namespace  # pylint: disable=g-import-not-at-top
from tfpipe import process_exit  # pylint: disable=g-import-not-at-top

FLAGS = flags.FLAGS
flags.DEFINE_float('budget_mib', None, 'Memory of each emulated accelerator; '
                   'by default the family\'s (FAMILIES).')
flags.DEFINE_list('families', ['transformer', 'amoebanet'],
                  'Model families (keys of FAMILIES).')
flags.DEFINE_list('configs', ['naive-1', 'pipeline-1', 'pipeline-2',
                              'pipeline-4', 'pipeline-8'],
                  'naive-1 and pipeline-K configurations.')
flags.DEFINE_integer('batch', 8, 'Global batch N (M = N in the pipelines).')
flags.DEFINE_integer('dim', 64, 'Transformer: model dim (FFN 4x, 4 heads).')
flags.DEFINE_integer('seq', 64, 'Transformer: sequence length.')
flags.DEFINE_integer('vocab', 0, 'Transformer: vocabulary size; 0 means 16 '
                     'x --dim, the ratio of GPipe\'s Table 1 Transformer '
                     '(32k tokens at d=2048), whose untied embedding and '
                     'softmax hold 2.6 blocks\' parameters.')
flags.register_validator(
    'vocab', lambda v: v == 0 or v >= 3,
    '--vocab must be 0 (16 x --dim) or at least 3 (the input generator '
    'reserves 2 ids: PAD and SEP).')
flags.DEFINE_bool('predict_only', False, 'Print the memory model\'s largest '
                  'size of each configuration and where its memory goes; '
                  'run no trial (minutes: one profiled step per layer).')
flags.DEFINE_integer('filters', 32, 'AmoebaNet: D.')
flags.DEFINE_integer('image', 16, 'AmoebaNet: image size.')
flags.DEFINE_integer('max_trials', 6, 'Trials per configuration at most.')
flags.DEFINE_integer('parallel_trials', 2, 'Trials run side by side, each '
                     'its own processes with their own caps (a size and '
                     'the next one, so that a right prediction is confirmed '
                     'in one round).', lower_bound=1)
flags.DEFINE_integer('max_size', 192, 'Largest size the search considers.')
flags.DEFINE_integer('first_size', 0, 'The first trial\'s size, in place of '
                     'the memory model\'s prediction (0): a lower one when '
                     'the predicted size takes longer than a trial may.')
flags.DEFINE_integer('trial_timeout_s', 600, 'Timeout of one trial; one '
                     'that times out stops its search (no memory verdict).')
flags.DEFINE_string('output_json', None, 'Where to write the results.')
# Internal: set when this file runs as one trial's subprocess.
flags.DEFINE_string('trial', None, 'Run one trial of this configuration.')
flags.DEFINE_string('family', None, 'Trial: the model family.')
flags.DEFINE_integer('size', None, 'Trial: the model size.')
flags.DEFINE_list('layer_counts', None, 'Trial: layers per cell.')

MIB = size_predictor.MIB
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# family: (size step, smallest size, GPipe's numbers by configuration,
# budget in MiB). Each budget is the smallest tried in which naive-1 trains
# GPipe's naive-1 model: 3 Transformer blocks (22 MiB, of 18, 20, 22 and 24,
# at the default shapes, whose vocabulary of 16 x d is GPipe's ratio), and
# AmoebaNet's L=3, whose activations per example are far larger than its
# weights (32 MiB, of 16, 24 and 32).
FAMILIES = {
    'transformer': (1, 1, {'naive-1': '3 layers', 'pipeline-1': '13 layers',
                           'pipeline-8': '103 layers (34x)'}, 22),
    'amoebanet': (3, 3, {'naive-1': '82M', 'pipeline-1': '318M (3.9x)',
                         'pipeline-2': '542M (6.6x)',
                         'pipeline-4': '1.05B (12.8x)',
                         'pipeline-8': '1.8B (22x)'}, 32),
}


def ExperimentParams(family, size):
  """The trainer's params of the family's model of this size."""
  from tfpipe import model_registry  # pylint: disable=g-import-not-at-top
  if family == 'transformer':
    p = model_registry.GetParams('lm.TinyTransformerLm', 'Train')
    p.task.model.Set(num_layers=size, model_dim=FLAGS.dim, num_heads=4,
                     hidden_dim=4 * FLAGS.dim, sequence_length=FLAGS.seq,
                     vocab_size=Vocab())
    p.input.Set(batch_size=FLAGS.batch, vocab_size=Vocab(),
                length=FLAGS.seq // 2)
  elif family == 'amoebanet':
    p = model_registry.GetParams('image.TinyAmoebaNetD', 'Train')
    p.task.model.Set(num_layers=size, num_filters=FLAGS.filters,
                     image_size=FLAGS.image)
    p.input.Set(batch_size=FLAGS.batch, image_size=FLAGS.image)
  else:
    raise app.UsageError(f'--families: unknown family {family!r}; expected '
                         f'one of {sorted(FAMILIES)}.')
  p.task.train.optimizer.type = 'adam'
  return p


def Vocab():
  return FLAGS.vocab or 16 * FLAGS.dim


def Budget(family):
  """MiB of each device: --budget_mib, else the family's."""
  return FLAGS.budget_mib or FAMILIES[family][3]


# ---- one trial, in its own process ---------------------------------------------


def _RunTrial():
  """Trains two steps of one size; prints TRIAL {json}."""
  if FLAGS.trial != 'naive-1':  # Its workers' servers serve on loopback.
    network_namespace.EnterLoopbackNamespace('benchmarks.largest_model',
                                             sys.argv)
  from tfpipe import quiet  # pylint: disable=g-import-not-at-top
  tf = quiet.ImportTensorFlow()
  tf.get_logger().setLevel('ERROR')
  from tfpipe import memory_limit  # pylint: disable=g-import-not-at-top
  from tfpipe import out_of_memory  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import memory_report  # pylint: disable=g-import-not-at-top
  # naive-1's one capped device, as its workers are: one region.
  memory_limit.OpenOneRegion()
  p = ExperimentParams(FLAGS.family, FLAGS.size)
  batch = tf.nest.map_structure(tf.convert_to_tensor,
                                memory_report.ExampleBatch(p))
  phases = {}  # Seconds of the trial's parts (where a trial's time goes).
  result = {'params': p.task.model.Instantiate().NumParams(),
            'phase_seconds': phases}
  workers = None
  try:
    if FLAGS.trial == 'naive-1':
      _NaiveSteps(p, batch)
      result['peaks'] = [tf.config.experimental.get_memory_info('CPU:0')[
          'peak']]
    else:
      from benchmarks import capped_workers  # pylint: disable=g-import-not-at-top
      k = size_predictor.NumCells(FLAGS.trial)
      started = time.time()
      workers = capped_workers.CappedWorkers(
          k, memory_mb=int(Budget(FLAGS.family)), owner='largest_model')
      workers.Connect()
      phases['workers'] = time.time() - started
      p.task.pipeline.Set(
          num_partitions=k, num_micro_batches=FLAGS.batch,
          remat_policy='always', schedule='1f1b', executor='threads',
          balance=[int(c) for c in FLAGS.layer_counts],
          devices=workers.devices)
      started = time.time()
      task = p.task.Instantiate()
      phases['build'] = time.time() - started

      def Steps():
        for step in range(2):
          started = time.time()
          float(task.TrainStep(batch)['loss'])
          phases[f'step{step}'] = time.time() - started
      trial_workers.StepsWatchingWorkers(Steps, workers)
      result['peaks'] = workers.Peaks()
    result['fits'] = True
  except Exception as e:  # pylint: disable=broad-except
    records = out_of_memory.FindInError(e)
    result.update(fits=False, out_of_memory=bool(
        records or out_of_memory.IsOutOfMemoryError(e) or
        isinstance(e, (trial_workers.WorkerDied,
                       trial_workers.WorkerOutOfMemory)) and e.refusals),
                  error=(records[0].device + ': ' + records[0].Describe()
                         if records else f'{type(e).__name__}: '
                         f'{str(e).splitlines()[0][:300]}'))
  result['phase_seconds'] = {k: round(v, 1) for k, v in phases.items()}
  print('TRIAL ' + json.dumps(result), flush=True)
  sys.stdout.flush()
  if workers:
    workers.Close()
  process_exit.ExitNow(0)


def _NaiveSteps(p, batch):
  """Two plain Keras steps: the model's layers, clipping and Adam."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import optimizer as optimizer_lib  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import task as task_lib  # pylint: disable=g-import-not-at-top
  model_builder = p.task.model.Instantiate()
  model = keras.Sequential([
      lp.Instantiate() for lp in task_lib.SeededLayerParams(
          model_builder, p.task.random_seed)])
  inputs, targets = batch
  model(tf.nest.map_structure(lambda t: t[:1], inputs))
  optimizer = optimizer_lib.BuildOptimizer(p.task.train.optimizer, 1e-4)
  optimizer.build(model.trainable_variables)

  @tf.function
  def Step():
    with tf.GradientTape() as tape:
      loss = model_builder.Loss(model(inputs, training=True), targets)
      loss = loss[0] if isinstance(loss, tuple) else loss
    grads = tape.gradient(loss, model.trainable_variables)
    # The trainer's update (clipping, then Adam's fused kernel, one
    # variable after another), so the two sides differ by pipelining alone.
    optimizer_lib.ApplyGradients(
        optimizer, zip(grads, model.trainable_variables),
        clip_norm=p.task.train.clip_gradient_norm,
        fused=p.task.train.optimizer.fused)
    return loss
  for _ in range(2):
    float(Step())


def Trial(config, family, size, layer_counts=None):
  """Runs one trial in a subprocess; its TRIAL dict (fits False on failure)."""
  cmd = [sys.executable, '-m', 'benchmarks.largest_model',
         f'--trial={config}', f'--family={family}', f'--size={size}',
         f'--budget_mib={Budget(family)}', f'--batch={FLAGS.batch}',
         f'--dim={FLAGS.dim}', f'--seq={FLAGS.seq}', f'--vocab={Vocab()}',
         f'--filters={FLAGS.filters}', f'--image={FLAGS.image}']
  if layer_counts:
    cmd.append('--layer_counts=' + ','.join(map(str, layer_counts)))
  env = memory_limit.CappedEnv(
      int(Budget(family)) if config == 'naive-1' else None,
      environ=model_environment.Environment(family))
  # naive-1's allocator logs its refusals as warnings: kept, so that a
  # trial that crashes after one (some kernels do) is said to be out of
  # memory (trial_workers.DiedResult). Pipelined trials' workers keep
  # reports of their own.
  env['TF_CPP_MIN_LOG_LEVEL'] = '1' if config == 'naive-1' else '2'
  start = time.time()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          cwd=_REPO_ROOT, timeout=FLAGS.trial_timeout_s,
                          check=False)
  except subprocess.TimeoutExpired:
    return {'fits': False, 'error': 'timed out', 'timed_out': True,
            'seconds': FLAGS.trial_timeout_s}
  for line in proc.stdout.splitlines():
    if line.startswith('TRIAL '):
      result = json.loads(line[len('TRIAL '):])
      result['seconds'] = round(time.time() - start, 1)
      return result
  return trial_workers.DiedResult(proc.returncode, proc.stderr,
                                  time.time() - start)


# ---- the memory model's seed ----------------------------------------------------


class Predictor(size_predictor.SizePredictor):
  """The family's SizePredictor under this benchmark's flags."""

  def __init__(self, family, log):
    step, smallest, _, _ = FAMILIES[family]
    super().__init__(family, log, step=step, smallest=smallest,
                     budget_mib=Budget(family), batch=FLAGS.batch,
                     max_size=FLAGS.max_size,
                     parallel=FLAGS.parallel_trials)

  def Params(self, size):
    return ExperimentParams(self.family, size)


# ---- the search (benchmarks/size_search.py) ------------------------------------


def SearchSettings():
  """The search's settings under this benchmark's flags. Trials are looked
  up at call time, so a test may replace `Trial`."""
  return size_search.Settings(
      families={family: FAMILIES[family][:2] for family in FLAGS.families},
      configs=list(FLAGS.configs),
      trial=lambda *args: Trial(*args), parallel=FLAGS.parallel_trials,
      max_trials=FLAGS.max_trials, max_size=FLAGS.max_size,
      first_size=FLAGS.first_size)


def Search(family, config, predictor, start, log, scale=1.0):
  """One configuration's search (size_search.Search)."""
  settings = SearchSettings()
  settings.families[family] = FAMILIES[family][:2]
  return size_search.Search(family, config, predictor, start, log, settings,
                            scale)


def RunFamilies(predictors, log):
  """Every family's search, side by side (size_search.RunFamilies)."""
  return size_search.RunFamilies(predictors, log, SearchSettings())


def main(argv):
  del argv
  if FLAGS.trial:
    _RunTrial()
    return
  network_namespace.EnterLoopbackNamespace('benchmarks.largest_model',
                                           sys.argv)
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.WARNING)
  from benchmarks import bench_lib  # pylint: disable=g-import-not-at-top
  bench_lib.tf.get_logger().setLevel('ERROR')
  start = time.time()

  def Log(line):
    print(line, flush=True)
  predictors = {}
  for family in FLAGS.families:
    predictor = predictors[family] = Predictor(family, Log)
    predictor.Prefetch()
    if FLAGS.predict_only:
      _Predict(family, predictor, FAMILIES[family][1], Log)
  if not FLAGS.predict_only:
    _Report(RunFamilies(predictors, Log), bench_lib, time.time() - start)
  process_exit.ExitNow(0)


def _Predict(family, predictor, smallest, log):
  """--predict_only: each configuration's predicted largest size, its
  growth over naive-1's, and where the largest pipeline's memory goes."""
  base = None
  for config in FLAGS.configs:
    size = predictor.Largest(config, smallest)
    smallest = max(smallest, size)
    base = base or size
    params = (ExperimentParams(family, size).task.model.Instantiate()
              .NumParams() if size else 0)
    log(f'{family} {config}: predicted {size} ({params / 1e6:.2f}M '
        f'parameters), {size / base if base else 0:.1f}x '
        f'{FLAGS.configs[0]}; GPipe: '
        f'{FAMILIES[family][2].get(config, "-")}')
    if config == FLAGS.configs[-1] and size:
      for d, peak in enumerate(predictor.Peaks(config, size)[2]):
        log(f'  device {d}: {peak.Describe()}')


def _Report(results, bench_lib, seconds):
  budgets = ', '.join(f'{family} {Budget(family):.0f} MiB'
                      for family in FLAGS.families)
  print(f'\nLargest model that trains one step, every device capped ('
        f'{budgets}; worker processes with their own allocator), batch '
        f'{FLAGS.batch}, Adam; {seconds / 60:.1f} min')
  rows = []
  for family in FLAGS.families:
    mine = [r for r in results if r['family'] == family]
    base = next((r for r in mine if r['config'] == 'naive-1'), mine[0])
    for r in mine:
      growth = r['params'] / base['params'] if base['params'] else 0.0
      size_growth = r['size'] / base['size'] if base['size'] else 0.0
      # No larger size was seen to fail: the answer is a lower bound.
      bound = not any(not t['fits'] and not t.get('timed_out') and
                      int(size) > r['size']
                      for size, t in r['trials'].items())
      rows.append([family, r['config'],
                   f'>={r["size"]}' if bound else r['size'],
                   r['predicted_size'],
                   f'{r["params"] / 1e6:.2f}M', f'{growth:.1f}x',
                   f'{size_growth:.1f}x',
                   ' '.join(f'{v:.1f}' for v in r['measured_peaks_mib']),
                   FAMILIES[family][2].get(r['config'], '-')])
  print(bench_lib.FormatTable(
      ['model', 'config', 'size', 'predicted', 'params', 'params x naive',
       'size x naive', 'measured peak MiB per device', 'GPipe Table 1'],
      rows))
  for r in results:
    if r['config'] == FLAGS.configs[-1] and r['where']:
      print(f'{r["family"]} {r["config"]} at size {r["size"]}: where the '
            'memory goes (memory model, per device):')
      for d, line in enumerate(r['where']):
        print(f'  device {d}: {line}')
  bench_lib.WriteJson(FLAGS.output_json, {
      'benchmark': 'largest_model', 'results': results,
      'flags': {name: FLAGS[name].value for name in (
          'budget_mib', 'families', 'configs', 'batch', 'dim', 'seq',
          'vocab', 'filters', 'image')},
      'vocab_size': Vocab(),
      'budgets_mib': {family: Budget(family) for family in FLAGS.families}})


if __name__ == '__main__':
  app.run(main)
