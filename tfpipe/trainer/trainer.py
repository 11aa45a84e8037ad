"""tfpipe-train: trains, evaluates or inspects a registered experiment.

  python -m tfpipe.trainer --model=lm.TinyTransformerLm --logdir=/tmp/lm

The experiment's params come from the model registry, are overridden by
--model_params_override and then by the explicit flags, checked, and written
to <logdir>/params.txt. Every configuration error is reported with the flag
or param to change before TensorFlow starts any work. On CPU the process is
split into logical devices (one per pipeline partition unless --num_devices
says otherwise) before TensorFlow initialises, which must happen first.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging

from tfpipe import multihost

MODES = ('train', 'eval', 'inspect_params', 'inspect_model')

flags.DEFINE_string('model', 'lm.TinyTransformerLm',
                    'Registered name of the experiment, e.g. lm.TinyTransformerLm.')
flags.DEFINE_string('logdir', None,
                    'Directory of checkpoints, summaries and params.txt.')
flags.DEFINE_enum('mode', 'train', MODES, 'What to do.')
flags.DEFINE_integer('max_steps', None, 'Overrides task.train.max_steps.')
flags.DEFINE_integer('seed', None,
                     'Overrides the model seed and the input seeds.')
flags.DEFINE_string('model_params_override', '',
                    'Params overrides, e.g. "task.train.learning_rate: 0.01; '
                    'input.batch_size: 64".')
flags.DEFINE_enum('run_locally', 'auto', ['auto', 'cpu', 'gpu'],
                  'Where to run: cpu, gpu, or auto (gpu when one is visible).')
flags.DEFINE_integer('num_devices', 0,
                     'Devices to use; on CPU, the number of logical devices '
                     '(0: one per pipeline partition).')
flags.DEFINE_integer('num_partitions', None,
                     'Overrides task.pipeline.num_partitions.')
flags.DEFINE_integer('num_micro_batches', None,
                     'Overrides task.pipeline.num_micro_batches.')
flags.DEFINE_string('schedule', None, 'Overrides task.pipeline.schedule.')
flags.DEFINE_string('remat_policy', None,
                    'Overrides task.pipeline.remat_policy.')
flags.DEFINE_string('balance', None, 'Overrides task.pipeline.balance.')
flags.DEFINE_string('executor', None, 'Overrides task.pipeline.executor: '
                    'graph or threads.')
flags.DEFINE_integer('save_interval_steps', None,
                     'Overrides task.train.save_interval_steps.')
flags.DEFINE_integer('log_interval_steps', None,
                     'Overrides task.train.log_interval_steps.')
flags.DEFINE_integer('eval_interval_steps', None,
                     'Overrides task.eval.interval_steps.')
flags.DEFINE_integer('timeline_step', None,
                     'Overrides task.train.timeline_step: record that step\'s '
                     'per-device timeline into the logdir.')
flags.DEFINE_boolean('deterministic', True,
                     'Use deterministic TensorFlow ops, so reruns and resumed '
                     'runs give identical losses.')

multihost.DefineFlags()

FLAGS = flags.FLAGS

# Seed offset of the evaluation input relative to the training input.
EVAL_SEED_OFFSET = 100003


def BuildParams():
  """The experiment params from the registry, overrides and flags; checked."""
  from tfpipe import model_registry  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import task as task_lib  # pylint: disable=g-import-not-at-top
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
      'task.pipeline.balance': FLAGS.balance,
      'task.pipeline.executor': FLAGS.executor,
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
  except ValueError as e:
    raise app.UsageError(_Message(e)) from None
  return p


def _Message(e):
  return e.args[0] if e.args else str(e)


def ConfigureDevices(num_partitions):
  """Chooses CPU or GPU and splits the CPU into logical devices.

  Must run before TensorFlow initialises its runtime.

  Args:
    num_partitions: pipeline partitions, the default number of CPU devices.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  gpus = tf.config.list_physical_devices('GPU')
  use_gpu = FLAGS.run_locally == 'gpu' or (FLAGS.run_locally == 'auto' and
                                           gpus)
  if use_gpu:
    if not gpus:
      raise app.UsageError('--run_locally=gpu but no GPU is visible; use '
                           '--run_locally=cpu.')
    if FLAGS.num_devices > len(gpus):
      raise app.UsageError(f'--num_devices={FLAGS.num_devices} but only '
                           f'{len(gpus)} GPUs are visible; lower it.')
    if FLAGS.num_devices:
      tf.config.set_visible_devices(gpus[:FLAGS.num_devices], 'GPU')
  else:
    if gpus:
      tf.config.set_visible_devices([], 'GPU')
    wanted = FLAGS.num_devices or num_partitions
    cpus = tf.config.list_physical_devices('CPU')
    try:
      tf.config.set_logical_device_configuration(
          cpus[0], [tf.config.LogicalDeviceConfiguration()] * wanted)
    except RuntimeError:
      # Already initialised (e.g. called twice in one process); keep it if
      # there are enough devices.
      have = len(tf.config.list_logical_devices('CPU'))
      if have < wanted:
        raise app.UsageError(
            f'TensorFlow is already initialised with {have} CPU devices; '
            f'{wanted} are needed (--num_devices).') from None
  if FLAGS.deterministic:
    tf.config.experimental.enable_op_determinism()


def CheckDevices(p):
  """Raises UsageError if the pipeline needs more devices than there are."""
  from tfpipe.trainer import task as task_lib  # pylint: disable=g-import-not-at-top
  try:
    return task_lib.ResolveDevices(p.task.pipeline)
  except ValueError as e:
    raise app.UsageError(_Message(e)) from None


def InspectModel(p):
  """A table of the cells: layers, device, parameter count and cost."""
  from tfpipe.trainer import model_inspect  # pylint: disable=g-import-not-at-top
  return model_inspect.ModelTable(p)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {" ".join(argv[1:])}.')
  if not FLAGS['verbosity'].present:
    # TensorFlow's INFO logs (e.g. per-save sharding timings) would drown the
    # progress lines; --verbosity=0 brings them back.
    logging.set_verbosity(logging.WARNING)
  try:
    if multihost.MaybeServe(FLAGS):
      return 0
  except (ValueError, RuntimeError) as e:
    raise app.UsageError(_Message(e)) from None
  p = BuildParams()
  if FLAGS.mode == 'inspect_params':
    print(p.ToText(), end='')
    return 0
  if FLAGS.mode in ('train', 'eval') and not FLAGS.logdir:
    raise app.UsageError(f'--logdir is required for --mode={FLAGS.mode}; '
                         'e.g. --logdir=/tmp/tfpipe_lm.')
  ConfigureDevices(p.task.pipeline.num_partitions)
  try:
    controller = multihost.SetUpController(FLAGS, p)
  except (ValueError, RuntimeError, TimeoutError) as e:
    raise app.UsageError(_Message(e)) from None
  CheckDevices(p)
  if FLAGS.mode == 'inspect_model':
    print(InspectModel(p))
    return 0

  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import train_loop  # pylint: disable=g-import-not-at-top
  tf.io.gfile.makedirs(FLAGS.logdir)
  trainer = train_loop.Trainer(p, FLAGS.logdir)
  if controller:
    controller.UseControllerIo(trainer)
  if FLAGS.mode == 'eval':
    if not trainer.RestoreLatest():
      raise app.UsageError(f'--mode=eval: no checkpoint in {FLAGS.logdir}; '
                           'train first or point --logdir at a trained run.')
    metrics = trainer.Evaluate()
    print(f'eval step {trainer.step}: ' + train_loop.FormatMetrics(metrics))
    return 0
  with tf.io.gfile.GFile(os.path.join(FLAGS.logdir, 'params.txt'), 'w') as f:
    f.write(p.ToText())
  print(f'Training {FLAGS.model} in {FLAGS.logdir} on '
        f'{p.task.pipeline.num_partitions} partition(s) x '
        f'{p.task.pipeline.num_micro_batches} micro-batch(es).', flush=True)
  if controller:
    controller.Run(trainer.Train)
    sys.stdout.flush()
    os._exit(0)  # pylint: disable=protected-access
  trainer.Train()
  sys.stdout.flush()
  return 0


def run():
  """Console entry point of `tfpipe-train`."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  app.run(main)


if __name__ == '__main__':
  run()
