"""tfpipe-train: trains, evaluates or inspects a registered experiment.

  python -m tfpipe.trainer --model=lm.TinyTransformerLm --logdir=/tmp/lm

The experiment's params come from the model registry, are overridden by
--model_params_override and then by the explicit flags, and are checked.
Every configuration error is reported with the flag or param to change before
TensorFlow starts any work. The run uses a GPU when one is visible
(--run_locally), and splits the CPU or the GPUs into as many logical devices
as the pipeline needs (--num_devices; see tfpipe.devices) before TensorFlow
initialises, which must happen first. TensorFlow's C++ start-up log is
hidden unless --verbosity=1 (see tfpipe.quiet).

A run that would lose or mix up data (a locked logdir, params that differ
from its params.txt, checkpoints that do not read back, a non-finite loss)
stops with one `ERROR:` line saying what to do, and exit status 1; see
train_loop for the guarantees.
"""

import os
import re
import sys

from absl import app
from absl import flags
from absl import logging

from tfpipe import command_line
from tfpipe import devices
from tfpipe import memory_limit
from tfpipe import multihost
from tfpipe import process_exit
from tfpipe import quiet
from tfpipe.trainer import logdir_lock
from tfpipe.trainer import memory_budget

MODES = ('train', 'eval', 'inspect_params', 'inspect_model', 'list_models')

flags.DEFINE_string('model', 'lm.TinyTransformerLm',
                    'The experiment: a registered name, e.g. '
                    'lm.TinyTransformerLm, or the import path of your own '
                    'class, e.g. my_project.experiments.MyLm '
                    '(--mode=list_models lists them).')
flags.DEFINE_string('logdir', None,
                    'Directory of checkpoints, summaries and params.txt.')
flags.DEFINE_enum('mode', 'train', MODES, 'What to do.')
flags.DEFINE_boolean('params_docs', False,
                     'With --mode=inspect_params, put each param\'s '
                     'one-sentence description above it as a # line.')
flags.DEFINE_integer('max_steps', None, 'Overrides task.train.max_steps.',
                     lower_bound=1)
flags.DEFINE_integer('seed', None,
                     'Overrides the model seed and the input seeds.')
flags.DEFINE_string('model_params_override', '',
                    'Params overrides, e.g. "task.train.learning_rate: 0.01; '
                    'input.batch_size: 64".')
flags.DEFINE_enum('run_locally', 'auto', ['auto', 'cpu', 'gpu'],
                  'Where to run: cpu, gpu, or auto (gpu when one is visible).')
flags.DEFINE_integer('num_devices', 0,
                     'Logical devices to make, on the CPU or the GPUs (0: '
                     'one per pipeline partition x replica). More than the '
                     'GPUs splits them into logical GPUs.', lower_bound=0)
flags.DEFINE_integer('logical_gpu_memory_mb', None,
                     'Memory of each logical GPU in MiB when the GPUs are '
                     'split (default: each GPU\'s memory, less a reserve, '
                     'shared evenly); given with whole GPUs, caps each.',
                     lower_bound=1)
flags.DEFINE_integer('num_partitions', None,
                     'Overrides task.pipeline.num_partitions.', lower_bound=1)
flags.DEFINE_integer('num_micro_batches', None,
                     'Overrides task.pipeline.num_micro_batches.',
                     lower_bound=1)
flags.DEFINE_string('schedule', None, 'Overrides task.pipeline.schedule.')
flags.DEFINE_string('remat_policy', None,
                    'Overrides task.pipeline.remat_policy.')
flags.DEFINE_string('balance', None,
                    'Overrides task.pipeline.balance: a method (params, flops, '
                    'memory, time) or layer counts per cell, e.g. 2,4.')
flags.DEFINE_string('executor', None, 'Overrides task.pipeline.executor: '
                    'auto, graph or threads.')
flags.DEFINE_integer('num_replicas', None, 'Overrides '
                     'task.pipeline.num_replicas: R data-parallel pipeline '
                     'replicas, so the pipeline uses R*K devices.',
                     lower_bound=1)
flags.DEFINE_integer('save_interval_steps', None,
                     'Overrides task.train.save_interval_steps.',
                     lower_bound=1)
flags.DEFINE_integer('log_interval_steps', None,
                     'Overrides task.train.log_interval_steps.', lower_bound=1)
flags.DEFINE_integer('eval_interval_steps', None,
                     'Overrides task.eval.interval_steps (0: only at the end).',
                     lower_bound=0)
flags.DEFINE_integer('timeline_step', None,
                     'Overrides task.train.timeline_step: record that step\'s '
                     'per-device timeline into the logdir.', lower_bound=0)
flags.DEFINE_boolean('deterministic', True,
                     'Use deterministic TensorFlow ops, so reruns and resumed '
                     'runs give identical losses.')

flags.DEFINE_enum('nan_policy', 'stop', ['stop', 'skip'],
                  'On a non-finite loss or gradient norm: stop the run (no '
                  'checkpoint is written from that step), or skip that '
                  'update (weights and optimizer untouched; the step counts).')
flags.DEFINE_integer('max_nan_skips', 10,
                     'With --nan_policy=skip, stop at the non-finite step '
                     'after this many skipped updates in one run.',
                     lower_bound=0)
flags.DEFINE_boolean('allow_params_change', False,
                     'Resume a logdir whose params.txt differs in the model or '
                     'training (not only in pipeline layout or run length).')

multihost.DefineFlags()
memory_budget.DefineFlags()

FLAGS = flags.FLAGS

# Seed offset of the evaluation input relative to the training input.
EVAL_SEED_OFFSET = 100003


def BuildParams():
  """The experiment params from the registry, overrides and flags; checked."""
  from tfpipe import model_registry  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import task as task_lib  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import train_loop  # pylint: disable=g-import-not-at-top
  try:
    p = model_registry.GetParams(FLAGS.model, 'Train')
  except model_registry.ModelNotFoundError as e:
    raise app.UsageError(f'--model: {e}') from None
  if FLAGS.model_params_override:
    try:
      p.FromText(FLAGS.model_params_override)
    except (AttributeError, ValueError, TypeError) as e:
      raise app.UsageError(f'--model_params_override: {_Message(e)}') from None
  overrides = {
      'task.train.max_steps': FLAGS.max_steps,
      'task.pipeline.num_partitions': FLAGS.num_partitions,
      'task.pipeline.num_micro_batches': FLAGS.num_micro_batches,
      'task.pipeline.schedule': FLAGS.schedule,
      'task.pipeline.remat_policy': FLAGS.remat_policy,
      'task.pipeline.balance': (None if FLAGS.balance is None else
                                ParseBalance(FLAGS.balance)),
      'task.pipeline.executor': FLAGS.executor,
      'task.pipeline.num_replicas': FLAGS.num_replicas,
      'task.train.save_interval_steps': FLAGS.save_interval_steps,
      'task.train.log_interval_steps': FLAGS.log_interval_steps,
      'task.eval.interval_steps': FLAGS.eval_interval_steps,
      'task.train.timeline_step': FLAGS.timeline_step,
  }
  if FLAGS.seed is not None:
    overrides.update({'task.random_seed': FLAGS.seed, 'input.seed': FLAGS.seed,
                      'eval_input.seed': FLAGS.seed + EVAL_SEED_OFFSET})
  p.Set(**{k: v for k, v in overrides.items() if v is not None})
  try:
    task_lib.BaseTask.CheckParams(
        p.task, batch_sizes={'input.batch_size': p.input.batch_size,
                             'eval_input.batch_size': p.eval_input.batch_size})
    train_loop.CheckParams(p)
  except ValueError as e:
    raise app.UsageError(_Message(e)) from None
  if FLAGS.nan_policy == 'skip' and not hasattr(p.task.cls,
                                                'skip_non_finite_updates'):
    raise app.UsageError(
        f'--nan_policy=skip needs a task that can skip an update inside its '
        f'step; {p.task.cls.__name__} cannot. Use --nan_policy=stop.')
  return p


def ParseBalance(text):
  """--balance: a method name, or layer counts per cell ('2,4' or '[2, 4]')."""
  counts = text.strip().strip('[]()')
  if re.fullmatch(r'\s*\d+\s*(,\s*\d+\s*)*,?\s*', counts):
    return [int(c) for c in counts.split(',') if c.strip()]
  return text


def CheckModel(p, cost_models=True):
  """The model builder of the params; UsageError if its layers cannot be made.

  Every layer's cost model checks its params (e.g. a head count that does
  not divide the width), so a bad model param stops the run here, before
  anything is written to the logdir. With cost_models=False only the
  builder is made: a layer without its own FPropMeta is costed by building
  it, which starts TensorFlow, so that waits until the devices are split.
  """
  try:
    model = p.task.model.Instantiate()
    if cost_models:
      model.NumParams()
  except ValueError as e:
    raise app.UsageError(
        f'task.model of --model={FLAGS.model}: {_Message(e)}') from None
  return model


def CheckPartition(p, cost_models=True):
  """The cells' params; raises UsageError if the model cannot be cut so.

  Uses only the layers' cost models (a layer without its own builds a copy
  off to the side, which starts TensorFlow); balance='time' profiles on
  devices and is checked when the task is built (None is returned then).
  With cost_models=False, only what needs none (enough layers, an explicit
  balance that fits), so it can run before the devices are split.
  """
  from tfpipe.gpipe import partition  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import task as task_lib  # pylint: disable=g-import-not-at-top
  pp = p.task.pipeline
  model = CheckModel(p, cost_models)
  try:
    if isinstance(pp.balance, (list, tuple)) or cost_models and (
        pp.balance != 'time'):
      return task_lib.PartitionCells(p.task, model)
    num_layers = len(partition.FlattenSequentialLayers(model.LayerParamsList()))
    partition.BlockPartition([0.0] * num_layers, pp.num_partitions)
    return None
  except ValueError as e:
    raise app.UsageError(
        f'{_Message(e)} (task.pipeline.num_partitions={pp.num_partitions}, '
        f'balance={pp.balance}: --num_partitions, --balance)') from None


def _Message(e):
  return e.args[0] if e.args else str(e)


def NumDevicesNeeded(p):
  """(logical devices to make, why): --num_devices, else partitions x replicas."""
  if FLAGS.num_devices:
    return FLAGS.num_devices, f'--num_devices={FLAGS.num_devices}'
  needed = p.task.pipeline.num_partitions * p.task.pipeline.num_replicas
  return needed, f'task.pipeline.num_partitions x num_replicas = {needed}'


def ConfigureDevices(p):
  """Chooses CPU or GPU and splits it into the logical devices the run needs.

  Must run before TensorFlow initialises its runtime. On a GPU it prints one
  line saying which GPUs it uses and how it split them; a CPU run prints
  nothing.

  Args:
    p: the experiment params (for the number of partitions).

  Returns:
    The tfpipe.devices.Split applied, or None if TensorFlow had already
    started with enough devices.
  """
  try:
    device_type = devices.ChooseDeviceType(FLAGS.run_locally)
    if device_type == 'CPU' and FLAGS.logical_gpu_memory_mb is not None:
      raise ValueError(
          f'--logical_gpu_memory_mb={FLAGS.logical_gpu_memory_mb} sets the '
          'memory of logical GPUs, but this run is on the CPU '
          f'(--run_locally={FLAGS.run_locally}); leave it unset.')
    needed, why = NumDevicesNeeded(p)
    split, _ = devices.SplitLocalDevices(
        device_type, needed, memory_limit_mb=FLAGS.logical_gpu_memory_mb,
        memory_name='--logical_gpu_memory_mb')
  except ValueError as e:
    raise app.UsageError(_Message(e)) from None
  if split is not None and split.device_type == 'GPU':
    print(split.Describe(why), flush=True)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  if FLAGS.deterministic:
    tf.config.experimental.enable_op_determinism()
  # A capped process is an emulated accelerator: its memory one region,
  # taken before its first tensor, as a GPU's is.
  memory_limit.OpenOneRegion()
  return split


def CheckDevices(p):
  """Raises UsageError if the pipeline needs more devices than there are."""
  from tfpipe.trainer import task as task_lib  # pylint: disable=g-import-not-at-top
  pp = p.task.pipeline
  needed = pp.num_partitions * pp.num_replicas
  if (FLAGS.num_devices and FLAGS.num_devices < needed and pp.devices is None
      and not task_lib.SharesDevices(pp)):
    raise app.UsageError(
        f'--num_devices={FLAGS.num_devices} is below task.pipeline.'
        f'num_partitions x num_replicas = {pp.num_partitions} x '
        f'{pp.num_replicas} = {needed}: each cell needs a device of its own. '
        f'Raise --num_devices to {needed} (or leave it 0: one per cell), or '
        'lower --num_partitions or --num_replicas.')
  try:
    return task_lib.PipelineDevices(p.task.pipeline)
  except ValueError as e:
    raise app.UsageError(_Message(e)) from None


def CheckInputs(p, mode):
  """Raises UsageError if an input the run reads cannot feed the model.

  The eval input too, in a training run: it is read only after training.
  """
  from tfpipe.trainer import train_loop  # pylint: disable=g-import-not-at-top
  names = ('input', 'eval_input') if mode == 'train' else ('eval_input',)
  try:
    train_loop.CheckInputs(p, names)
  except ValueError as e:
    raise app.UsageError(_Message(e)) from None


def PlanIfAsked(p):
  """--plan=auto: chooses the pipeline for --device_memory_mb (or says that
  nothing fits, with exit status EXIT_OUT_OF_MEMORY)."""
  from tfpipe.gpipe import planner  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import out_of_memory  # pylint: disable=g-import-not-at-top
  try:
    memory_budget.PlanIfAsked(p, FLAGS)
  except planner.NoPlanError as e:
    print(f'ERROR: {e} Nothing was run.', file=sys.stderr, flush=True)
    return out_of_memory.EXIT_OUT_OF_MEMORY
  except ValueError as e:
    raise app.UsageError(_Message(e)) from None
  return 0


def InspectModel(p, cells=None):
  """A table of the cells: layers, device, parameter count and cost."""
  from tfpipe.trainer import model_inspect  # pylint: disable=g-import-not-at-top
  return model_inspect.ModelTable(p, cells)


def ListModels():
  """One line per experiment: its --model name and its docstring's first line."""
  from tfpipe import model_registry  # pylint: disable=g-import-not-at-top
  names = model_registry.ListModels()
  width = max(len(n) for n in names)
  return '\n'.join(f'{n:<{width}}  {model_registry.Describe(n)}'.rstrip()
                   for n in names)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {" ".join(argv[1:])}.')
  verbosity = FLAGS.verbosity if FLAGS['verbosity'].present else None
  if verbosity is None:
    # TensorFlow's INFO logs (e.g. per-save sharding timings) would drown the
    # progress lines; --verbosity=0 brings them back.
    logging.set_verbosity(logging.WARNING)
  show_startup_log = quiet.ShowStartupLog(verbosity)
  # Before TensorFlow starts: its out-of-memory records are warnings.
  watch = memory_budget.WatchThisProcess(FLAGS, show_startup_log)
  try:
    return _Main(show_startup_log, watch)
  finally:
    watch.Stop()


def _Main(show_startup_log, watch):
  quiet.ImportTensorFlow(show_startup_log)
  if FLAGS.mode == 'list_models':
    print(ListModels())
    return 0
  try:
    if multihost.MaybeServe(FLAGS):
      return 0
  except (ValueError, RuntimeError) as e:
    raise app.UsageError(_Message(e)) from None
  p = BuildParams()
  if FLAGS.mode == 'inspect_params':
    print(p.ToText(docs=FLAGS.params_docs), end='')
    # From the layers' cost models: no variable is created, so the paper's
    # billion-parameter configurations report their size in a moment.
    print(f'# trainable parameters: {CheckModel(p).NumParams():,}')
    return 0
  if FLAGS.mode in ('train', 'eval') and not FLAGS.logdir:
    raise app.UsageError(f'--logdir is required for --mode={FLAGS.mode}; '
                         'e.g. --logdir=/tmp/tfpipe_lm.')
  status = PlanIfAsked(p)
  if status:
    return status
  CheckPartition(p, cost_models=False)
  with quiet.QuietStderr(show_startup_log):
    split = ConfigureDevices(p)
  # After the devices: a layer without its own FPropMeta is costed by
  # instantiating it, which starts TensorFlow. Still before the logdir is
  # touched: a run refused for its params leaves nothing behind.
  cells = CheckPartition(p)
  if FLAGS.mode == 'train':
    try:
      logdir_lock.PrepareLogdir(FLAGS.logdir)
    except logdir_lock.LogdirError as e:
      raise app.UsageError(str(e)) from None
  try:
    controller = multihost.SetUpController(FLAGS, p)
  except (ValueError, RuntimeError, TimeoutError) as e:
    raise app.UsageError(_Message(e)) from None
  devices_used = CheckDevices(p)
  if FLAGS.mode == 'inspect_model':
    print(InspectModel(p, cells))
    for line in memory_budget.InspectLines(p, FLAGS, devices_used):
      print(line)
    return 0
  CheckInputs(p, FLAGS.mode)

  from tfpipe.trainer import out_of_memory  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import train_loop  # pylint: disable=g-import-not-at-top
  trainers = []
  diagnosis = memory_budget.Diagnosis(
      p, FLAGS, devices_used, controller, watch, split,
      last_good=lambda: out_of_memory.LastGood(
          trainers[0].manager.latest_checkpoint if trainers else None,
          os.path.join(FLAGS.logdir, train_loop.CHECKPOINT_DIR)))
  if controller:
    # A worker that crashed out of memory is said to be out of memory.
    controller.explain_lost = diagnosis.ExplainLostWorker
  try:
    try:
      trainer = train_loop.Trainer(
          p, FLAGS.logdir, nan_policy=FLAGS.nan_policy,
          max_nan_skips=FLAGS.max_nan_skips,
          allow_params_change=FLAGS.allow_params_change)
    except ValueError as e:  # A layer refused its params as it was built.
      raise app.UsageError(
          f'task of --model={FLAGS.model}: {_Message(e)}') from None
    trainers.append(trainer)
    if controller:
      controller.UseControllerIo(trainer)
    if FLAGS.mode == 'eval':
      if not trainer.RestoreForEvaluation():
        raise app.UsageError(f'--mode=eval: no checkpoint in {FLAGS.logdir}; '
                             'train first or point --logdir at a trained '
                             'run.')
      metrics = trainer.Evaluate()
      print(f'eval step {trainer.step}: ' + train_loop.FormatMetrics(metrics))
      return 0
    print(f'Training {FLAGS.model} in {FLAGS.logdir} on '
          f'{p.task.pipeline.num_partitions} partition(s) x '
          f'{p.task.pipeline.num_micro_batches} micro-batch(es).', flush=True)
    if controller:
      controller.Run(trainer.Train)
      process_exit.ExitNow(_ExitStatus(trainer))
    trainer.Train()
    if trainer.stopped_by:
      sys.stdout.flush()
      return _ExitStatus(trainer)
  except app.UsageError:
    raise
  except Exception as error:  # pylint: disable=broad-except
    stop = diagnosis.Stop(error, train_loop.STOP_ERRORS)
    if stop is None:
      raise
    print(f'ERROR: {stop}', file=sys.stderr, flush=True)
    status = getattr(stop, 'exit_status', 1)
    if controller:
      # Tearing down a cluster context can hang; nothing is left to save.
      process_exit.ExitNow(status)
    return status
  sys.stdout.flush()
  return 0


def _ExitStatus(trainer):
  """0, or 128 + the signal that stopped training (train_loop, stop_signal)."""
  return trainer.stopped_by.exit_status if trainer.stopped_by else 0


def run():
  """Console entry point of `tfpipe-train`."""
  command_line.Run(main)


if __name__ == '__main__':
  run()
