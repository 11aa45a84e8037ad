"""The training and evaluation loops: checkpoints, progress lines, summaries.

Resumption is exact. The checkpoint holds the global step, the model
variables and the optimizer (slots and iteration count); the input is a pure
function of (seed, step) and is restarted at the restored step; dropout is
seeded by the step. So a run killed at any point and restarted produces the
same losses as one that never stopped.

A training run never loses a good checkpoint and never trains on a model it
does not match (tests/trainer/data_safety_test.py injects each fault):
* the logdir is locked for the run (`logdir_lock`): a second trainer on it
  is refused, naming the holder;
* the run's params are compared with the logdir's params.txt before
  anything is written (`params_file`);
* checkpoints are read back before they count, old ones are deleted only
  after that, and a restore takes the newest one that reads back, whatever
  the state file says (`checkpoint_keeper`);
* a non-finite loss or gradient norm stops the run before anything from
  that step is saved, naming the step; with `nan_policy='skip'` the task
  skips such an update inside its step (weights and optimizer untouched) at
  most `max_nan_skips` times. A step whose update was skipped is not saved
  (its checkpoint would only repeat the last update's weights and push out
  older checkpoints), and the newest checkpoint from before the run's first
  skip is kept beyond max_checkpoints_to_keep, so that it survives any
  number of skips. No checkpoint is written while any variable is
  non-finite;
* SIGTERM (a scheduler's or a preemption's) lets the step in progress
  finish, saves it and stops (`stop_signal`): nothing is lost.
Every refusal is a `STOP_ERRORS` exception whose message says what to do.
"""

import math
import os
import time

import tensorflow as tf
from tensorflow.core.framework import summary_pb2
from tensorflow.python.framework import config as tf_config

from tfpipe import base_layer
from tfpipe import timeline as timeline_lib
from tfpipe.trainer import checkpoint_keeper
from tfpipe.trainer import device_memory
from tfpipe.trainer import logdir_lock
from tfpipe.trainer import params_file
from tfpipe.trainer import stop_signal

CHECKPOINT_DIR = 'checkpoints'
NAN_POLICIES = ('stop', 'skip')


class TrainingStopped(Exception):
  """The run stopped to keep the logdir good; the message says what to do."""


# What a training run raises instead of losing or mixing up data.
STOP_ERRORS = (logdir_lock.LogdirError, params_file.ParamsChangedError,
               params_file.ParamsWriteError, checkpoint_keeper.CheckpointError,
               TrainingStopped)

# TensorBoard's scalar plugin reads any float summary tagged with this
# metadata; writing it directly needs no tensorboard package at train time.
_SCALAR_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='scalars'))


def WriteScalars(writer, step, scalars):
  """Writes {tag: float} as TensorBoard scalars at `step` and flushes."""
  with writer.as_default(step=step):
    for tag, value in scalars.items():
      tf.summary.write(tag, tf.constant(value, tf.float32),
                       metadata=_SCALAR_METADATA)
  writer.flush()


def _PrintFlush(line):
  print(line, flush=True)


def FormatMetrics(metrics):
  return ' '.join(f'{k}={v:.6g}' for k, v in sorted(metrics.items()))


def CheckParams(p):
  """Raises ValueError naming a bad param of the loops, before any work."""
  if p.task.eval.interval_steps < 0:
    raise ValueError(
        f'task.eval.interval_steps must be >= 0 (0: evaluate only at the '
        f'end); received {p.task.eval.interval_steps} (--eval_interval_steps).')
  if p.task.eval.num_batches < 1:
    raise ValueError('task.eval.num_batches must be >= 1; received '
                     f'{p.task.eval.num_batches}.')


def CheckInputs(p, names=('input', 'eval_input')):
  """Raises ValueError, naming the override key, if an input cannot feed the model.

  Run before the first step, for the eval input too (which otherwise would
  fail only after training): each input's params are valid, its data is
  there (a file glob matches), and its batches' inputs have the shape the
  model takes (`model.InputShape()`, batch dim aside). A message names the
  key a user would override, e.g. `eval_input.file_pattern`.

  Args:
    p: the experiment params.
    names: which inputs of `p` the run will read.
  """
  model = p.task.model.Instantiate()
  want = base_layer.MapShapes(tf.TensorShape, model.InputShape())
  for name in names:
    input_p = p.Get(name)
    check = getattr(input_p.cls, 'CheckParams', None)
    if check is not None:
      check(input_p, name)
    generator = input_p.Instantiate()
    if hasattr(generator, 'CheckData'):
      generator.CheckData(name)
    inputs_spec = generator.GetDataset(0).element_spec[0]
    try:
      tf.nest.assert_same_structure(inputs_spec, want, check_types=False)
      fits = all(
          s.shape[1:].is_compatible_with(w[1:]) for s, w in zip(
              tf.nest.flatten(inputs_spec), tf.nest.flatten(want)))
    except (ValueError, TypeError):
      fits = False
    if not fits:
      got = tf.nest.map_structure(lambda s: tuple(s.shape), inputs_spec)
      raise ValueError(
          f'{name}: its batches\' inputs have shape {got}, but the model '
          f'({type(model).__name__}, task.model) takes '
          f'{model.InputShape()} (the batch dim aside). Make {name} give '
          'inputs of that shape, or change task.model.')


def _NonFiniteVariables(variables):
  """Names of the float variables that hold a NaN or an Inf.

  Each is checked on its own device, so no device gathers another's tensors.
  """
  bad = []
  for v in variables:
    if not tf.as_dtype(v.dtype).is_floating:
      continue
    value = tf.convert_to_tensor(v)  # Read where the variable lives.
    with tf.device(value.device):
      finite = tf.reduce_all(tf.math.is_finite(value))
    if not bool(finite):
      bad.append(getattr(v, 'path', None) or v.name)
  return bad


class Trainer:
  """Runs training and evaluation of an experiment's params in a logdir."""

  def __init__(self, params, logdir, log=_PrintFlush, nan_policy='stop',
               max_nan_skips=10, allow_params_change=False):
    """Builds the task; touches nothing on disk.

    Args:
      params: the experiment params.
      logdir: checkpoints, summaries and params.txt go here.
      log: prints one line.
      nan_policy: on a non-finite loss or gradient norm, 'stop' the run, or
        'skip' that update (the step still counts).
      max_nan_skips: with 'skip', the run stops at the skip after this many.
      allow_params_change: resume a logdir whose params.txt differs in the
        model or training.
    """
    CheckParams(params)
    if nan_policy not in NAN_POLICIES:
      raise ValueError(f'nan_policy={nan_policy!r}; use one of '
                       f'{NAN_POLICIES} (--nan_policy).')
    if max_nan_skips < 0:
      raise ValueError(f'max_nan_skips must be >= 0; received {max_nan_skips}'
                       ' (--max_nan_skips).')
    self._params = params
    self._logdir = logdir
    self._log = log
    self._nan_policy = nan_policy
    self._max_nan_skips = max_nan_skips
    self._allow_params_change = allow_params_change
    self.nan_skips = 0
    # The StopRequest whose signal ended the last Train(), or None.
    self.stopped_by = None
    # (step, (number, path) of the newest checkpoint then, or None) of the
    # run's first skipped update.
    self._first_skip = None
    self._params_to_write = None  # (comparison, step) until the first save.
    self.task = params.task.Instantiate()
    if nan_policy == 'skip':
      if not hasattr(self.task, 'skip_non_finite_updates'):
        raise ValueError(
            f"nan_policy='skip' needs a task that can skip an update inside "
            f'its step; {type(self.task).__name__} has no '
            'skip_non_finite_updates. Use --nan_policy=stop.')
      self.task.skip_non_finite_updates = True
    self.checkpoint = tf.train.Checkpoint(**self.task.CheckpointObjects())
    self.manager = checkpoint_keeper.CheckpointKeeper(
        self.checkpoint, os.path.join(logdir, CHECKPOINT_DIR),
        max_to_keep=params.task.train.max_checkpoints_to_keep, log=log)

  @property
  def step(self):
    return int(self.task.global_step.numpy())

  def RestoreLatest(self, read_only=True):
    """Restores the newest checkpoint that reads back; its path or None.

    Raises:
      checkpoint_keeper.CheckpointError: checkpoints exist but none reads
        back, or the newest one does not fit the model.
    """
    return self.manager.RestoreNewest(read_only=read_only)

  def RestoreForEvaluation(self):
    """Checks params.txt and restores, writing nothing (a trainer may run).

    A checkpoint past `task.train.max_steps` (trained by a run with a larger
    --max_steps) is evaluated as it is, with a line saying so.
    """
    self._CheckParamsFile()
    restored = self.RestoreLatest(read_only=True)
    max_steps = self._params.task.train.max_steps
    if restored and self.step > max_steps:
      self._log(
          f'Note: {restored} is at step {self.step}, past '
          f'task.train.max_steps={max_steps} (--max_steps): a run with a '
          'larger --max_steps trained it; evaluating it as it is.')
    return restored

  def _CheckParamsFile(self):
    """params_file.CheckParams, knowing the checkpoints and the model."""
    numbers, _ = checkpoint_keeper.ScanDirectory(self.manager.directory)
    return params_file.CheckParams(
        self._logdir, self._params, self._allow_params_change, self._log,
        has_checkpoints=bool(numbers),
        batch_split_is_exact=not self.task.BatchSplitChangesTraining())

  def _Writer(self, name):
    return tf.summary.create_file_writer(os.path.join(self._logdir, name))

  def Evaluate(self):
    """Eval metrics over `task.eval.num_batches` batches of the eval input."""
    eval_input = self._params.eval_input.Instantiate()
    return self.task.Evaluate(eval_input.GetDataset(0),
                              self._params.task.eval.num_batches)

  def _EvaluateAndLog(self, writer):
    metrics = self.Evaluate()
    WriteScalars(writer, self.step, metrics)
    self._log(f'eval step {self.step}: {FormatMetrics(metrics)}')
    return metrics

  def RecordTimeline(self, batch):
    """Times each action of one step on `batch`, leaving the model unchanged.

    The recorded steps compute gradients without applying them; the state a
    training forward touches (batch-norm moving statistics, the pipeline's
    counters) is put back afterwards, so a run with a timeline trains exactly
    like one without.
    """
    pipe = self.task.pipe
    saved = [(v, v.numpy()) for v in pipe.non_trainable_variables]
    inputs, targets = batch
    # tf.timestamp() refuses to run under op determinism; the timed steps'
    # results are thrown away, so lifting it for them changes nothing. TF
    # exposes the query and the switch-off only in its framework module.
    deterministic = tf_config.is_op_determinism_enabled()
    if deterministic:
      tf_config.disable_op_determinism()
    try:
      recorded = timeline_lib.RecordStep(
          pipe, inputs, targets, self.task.model.Loss,
          step=self.task.global_step)
    finally:
      if deterministic:
        tf_config.enable_op_determinism()
      for v, value in saved:
        v.assign(value)
    base = os.path.join(self._logdir, 'timeline')
    with open(base + '.txt', 'w') as f:
      f.write(recorded.Summary() + '\n' + recorded.Text() + '\n')
    with open(base + '.json', 'w') as f:
      f.write(recorded.ToJson())
    written = [base + '.txt', base + '.json']
    try:
      recorded.SavePng(base + '.png',
                       title=f'step {self.step + 1}: one timed step')
      written.append(base + '.png')
    except ImportError as e:
      self._log(f'timeline: no picture ({e})')
    self._log(recorded.Summary())
    self._log('timeline written to ' + ', '.join(written))
    return recorded

  def _Variables(self):
    return list(self.task.pipe.variables) + list(self.task.optimizer.variables)

  def _Save(self, step):
    """Saves a checkpoint of `step` if every variable is finite."""
    bad = _NonFiniteVariables(self._Variables())
    if bad:
      others = f' (and {len(bad) - 1} more variables)' if len(bad) > 1 else ''
      raise TrainingStopped(
          f'Step {step}: {bad[0]}{others} holds non-finite values, so no '
          'checkpoint was written. ' + self._LastGood() + self._NanAdvice())
    self.manager.save(checkpoint_number=step)
    if self._params_to_write is not None:
      params_file.WriteParams(self._logdir, self._params,
                              *self._params_to_write)
      self._params_to_write = None

  def _LastGood(self):
    """The sentence naming the checkpoint to go back to."""
    if self._first_skip is None:
      last = self.manager.latest_checkpoint
      if last:
        return f'The last good checkpoint, {last}, is kept. '
      return 'There is no checkpoint yet. '
    step, before = self._first_skip
    after = [c for c, n in zip(self.manager.checkpoints, self.manager.numbers)
             if before is None or n > before[0]]
    text = (f'There is no checkpoint from before the first skipped update '
            f'(step {step})' if before is None else
            f'{before[1]}, saved before the first skipped update (step '
            f'{step}), is kept')
    if after:
      text += f'; {", ".join(after)} came after skipped updates'
    return text + '. '

  def _NanAdvice(self):
    skip = ('raise --max_nan_skips to skip more such updates'
            if self._nan_policy == 'skip' else
            'pass --nan_policy=skip to skip such updates')
    return ('Lower task.train.learning_rate, keep '
            f'task.train.clip_gradient_norm > 0, or {skip}; resume with '
            '--allow_params_change if you change params.')

  def _SaveUnlessSkipped(self, step, skipped):
    """Saves `step` unless its update was skipped; whether it saved."""
    if skipped:
      self._log(f'step {step}: no checkpoint, since its update was skipped. '
                + self._LastGood().strip())
      return False
    self._Save(step)
    return True

  def _OnNonFinite(self, step, loss, grad_norm, writer):
    """Counts a skipped update, or raises TrainingStopped."""
    what = f'loss={loss:g} grad_norm={grad_norm:g}'
    if self._nan_policy == 'skip' and self.nan_skips < self._max_nan_skips:
      if self._first_skip is None:
        before = None
        if self.manager.numbers:
          before = (self.manager.numbers[-1], self.manager.latest_checkpoint)
          self.manager.Protect(before[0])
        self._first_skip = (step, before)
      self.nan_skips += 1
      self._log(f'step {step}: {what} is not finite; the update was skipped '
                f'({self.nan_skips} of at most {self._max_nan_skips}, '
                '--max_nan_skips).')
      WriteScalars(writer, step, {'nan_skips': float(self.nan_skips)})
      return
    if self._nan_policy == 'skip':
      why = (f'{what} is not finite after {self.nan_skips} skipped update(s) '
             f'(--max_nan_skips={self._max_nan_skips})')
    else:
      why = f'{what} is not finite'
    raise TrainingStopped(
        f'Step {step}: {why}; stopped before saving anything from it. '
        + self._LastGood() + self._NanAdvice())

  def Train(self):
    """Trains to `task.train.max_steps`; returns the final eval metrics.

    Raises:
      ValueError: an input cannot feed the model (CheckInputs), before
        anything is written.
      One of STOP_ERRORS when the run cannot go on without losing or mixing
      up data; nothing good in the logdir has been changed then.
    """
    CheckInputs(self._params)
    logdir_lock.PrepareLogdir(self._logdir)
    with logdir_lock.LogdirLock(self._logdir, self._log):
      return self._Train()

  def _Restore(self, comparison):
    try:
      return self.RestoreLatest(read_only=False)
    except checkpoint_keeper.CheckpointMismatchError as e:
      layout = [d for d in comparison.execution
                if params_file.IsLayoutParam(d[0])]
      if not layout or comparison.training:
        raise
      changed = ', '.join(f'{k} {o} -> {n}' for k, o, n in layout)
      e.args = (
          f'{e.path} reads back but does not fit this model: {e.detail} This '
          f'run changed only the pipeline layout ({changed}), and this '
          'model\'s checkpoint depends on it (e.g. batch-norm statistics '
          'are saved per cell): resume with the layout of its params.txt, or '
          'give a new --logdir.',)
      raise

  def _Resume(self):
    """Checks params.txt, cleans up and restores; returns the restored path."""
    p = self._params
    tp = p.task.train
    comparison = self._CheckParamsFile()
    self.manager.CleanLeftovers()
    restored = self._Restore(comparison)
    start = self.step
    if restored:
      self._log(f'Restored {restored} at step {start}.')
    if start > tp.max_steps:
      raise TrainingStopped(
          f'task.train.max_steps={tp.max_steps} (--max_steps) is below step '
          f'{start}, restored from {restored}: there is nothing to train. '
          f'Raise --max_steps above {start} to train on, or use --mode=eval '
          'to evaluate it.')
    # params.txt describes the params that trained the logdir's checkpoints:
    # a resumed run rewrites it with its first checkpoint, so a run that
    # stops before one leaves it as it was.
    self._params_to_write = (comparison, start)
    if not restored:
      params_file.WriteParams(self._logdir, p, comparison, start)
      self._params_to_write = None
    if start == tp.max_steps:
      self._log(f'Step {start} is already task.train.max_steps; nothing to '
                'train (raise --max_steps to train on).')
    return restored

  def _Train(self):
    p = self._params
    tp = p.task.train
    restored = self._Resume()
    start = self.step
    batch_size = p.input.batch_size
    dataset = p.input.Instantiate().GetDataset(start)
    train_writer = self._Writer('train')
    eval_writer = self._Writer('eval')
    eval_interval = p.task.eval.interval_steps
    memory = device_memory.PeakMemory(self.task.devices)
    run_start = time.time()
    interval_start = time.time()
    interval_steps = 0
    metrics = {}
    saved_step = start if restored else None
    skipped = False
    with stop_signal.StopRequest() as stop:
      for batch in dataset:
        if self.step >= tp.max_steps or stop.signum:
          break
        if tp.timeline_step and self.step + 1 == tp.timeline_step:
          self.RecordTimeline(batch)
        out = self.task.TrainStep(batch)
        step = self.step
        loss, grad_norm = float(out['loss']), float(out['grad_norm'])
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if skipped:
          self._OnNonFinite(step, loss, grad_norm, train_writer)
        interval_steps += 1
        if step % tp.log_interval_steps == 0 or step == tp.max_steps:
          metrics = {k: float(v) for k, v in out.items()}
          elapsed = time.time() - interval_start
          step_time = elapsed / interval_steps
          metrics['step_time_s'] = step_time
          metrics['examples_per_sec'] = batch_size / max(step_time, 1e-9)
          peaks = memory.PeaksAndReset()
          WriteScalars(train_writer, step,
                       {**metrics, **device_memory.SummaryScalars(peaks)})
          self._log(
              f'step {step}/{tp.max_steps} loss={metrics["loss"]:.6f} '
              f'examples/s={metrics["examples_per_sec"]:.1f} '
              f'step_time={1000 * step_time:.1f}ms ' + ' '.join(filter(None, [
                  FormatMetrics({k: v for k, v in metrics.items() if k not in (
                      'loss', 'examples_per_sec', 'step_time_s')}),
                  device_memory.FormatPeaks(peaks)])))
          interval_start = time.time()
          interval_steps = 0
        if step % tp.save_interval_steps == 0:
          self._SaveUnlessSkipped(step, skipped)
          saved_step = step
        if (eval_interval and step % eval_interval == 0 and
            step < tp.max_steps and not stop.signum):
          self._EvaluateAndLog(eval_writer)
      if saved_step != self.step:
        self._SaveUnlessSkipped(self.step, skipped)
      if stop.signum:
        return self._StoppedBySignal(stop)
    final = self._EvaluateAndLog(eval_writer)
    trained = (f'train_loss={metrics["loss"]:.6f} ' if 'loss' in metrics
               else '')
    self._log(
        f'Final: step={self.step} {trained}eval: {FormatMetrics(final)} '
        f'train_time={time.time() - run_start:.1f}s')
    return final

  def _StoppedBySignal(self, stop):
    """Logs where a run that `stop` ended resumes; returns no metrics (the
    final evaluation is skipped: the grace period is for the checkpoint)."""
    self.stopped_by = stop
    if self.manager.numbers and self.manager.numbers[-1] == self.step:
      where = f'{self.manager.latest_checkpoint} holds it'
    else:
      where = self._LastGood().strip().rstrip('.')
    self._log(f'{stop.name} received: stopped after step {self.step}; '
              f'{where}. The same command resumes from there.')
    return {}
