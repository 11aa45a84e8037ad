"""The training and evaluation loops: checkpoints, progress lines, summaries.

Resumption is exact. The checkpoint holds the global step, the model
variables and the optimizer (slots and iteration count); the input is a pure
function of (seed, step) and is restarted at the restored step; dropout is
seeded by the step. So a run killed at any point and restarted produces the
same losses as one that never stopped.

A SIGKILL can interrupt a save. `tf.train.CheckpointManager` writes the data
and index files first and then atomically replaces the `checkpoint` state
file that names the latest checkpoint, so a partial save is never listed and
`latest_checkpoint` is always a complete one.
"""

import os
import time

import tensorflow as tf
from tensorflow.core.framework import summary_pb2
from tensorflow.python.framework import config as tf_config

from tfpipe import timeline as timeline_lib

CHECKPOINT_DIR = 'checkpoints'

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


class Trainer:
  """Runs training and evaluation of an experiment's params in a logdir."""

  def __init__(self, params, logdir, log=_PrintFlush):
    self._params = params
    self._logdir = logdir
    self._log = log
    self.task = params.task.Instantiate()
    self.checkpoint = tf.train.Checkpoint(**self.task.CheckpointObjects())
    tp = params.task.train
    self.manager = tf.train.CheckpointManager(
        self.checkpoint, os.path.join(logdir, CHECKPOINT_DIR),
        max_to_keep=tp.max_checkpoints_to_keep,
        step_counter=self.task.global_step)

  @property
  def step(self):
    return int(self.task.global_step.numpy())

  def RestoreLatest(self):
    """Restores the newest complete checkpoint; returns its path or None."""
    path = self.manager.latest_checkpoint
    if path:
      self.checkpoint.restore(path).assert_existing_objects_matched()
    return path

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

  def Train(self):
    """Trains to `task.train.max_steps`; returns the final eval metrics."""
    p = self._params
    tp = p.task.train
    restored = self.RestoreLatest()
    start = self.step
    if restored:
      self._log(f'Restored {restored} at step {start}.')
    batch_size = p.input.batch_size
    dataset = p.input.Instantiate().GetDataset(start)
    train_writer = self._Writer('train')
    eval_writer = self._Writer('eval')
    eval_interval = p.task.eval.interval_steps
    run_start = time.time()
    interval_start = time.time()
    interval_steps = 0
    metrics = {}
    saved_step = start if restored else None
    for batch in dataset:
      if self.step >= tp.max_steps:
        break
      if tp.timeline_step and self.step + 1 == tp.timeline_step:
        self.RecordTimeline(batch)
      out = self.task.TrainStep(batch)
      step = self.step
      interval_steps += 1
      if step % tp.log_interval_steps == 0 or step == tp.max_steps:
        metrics = {k: float(v) for k, v in out.items()}
        elapsed = time.time() - interval_start
        step_time = elapsed / interval_steps
        metrics['step_time_s'] = step_time
        metrics['examples_per_sec'] = batch_size / max(step_time, 1e-9)
        WriteScalars(train_writer, step, metrics)
        self._log(
            f'step {step}/{tp.max_steps} loss={metrics["loss"]:.6f} '
            f'examples/s={metrics["examples_per_sec"]:.1f} '
            f'step_time={1000 * step_time:.1f}ms ' + FormatMetrics({
                k: v for k, v in metrics.items() if k not in (
                    'loss', 'examples_per_sec', 'step_time_s')}))
        interval_start = time.time()
        interval_steps = 0
      if step % tp.save_interval_steps == 0:
        self.manager.save(checkpoint_number=step)
        saved_step = step
      if eval_interval and step % eval_interval == 0 and step < tp.max_steps:
        self._EvaluateAndLog(eval_writer)
    if saved_step != self.step:
      self.manager.save(checkpoint_number=self.step)
    final = self._EvaluateAndLog(eval_writer)
    self._log(
        f'Final: step={self.step} train_loss={metrics.get("loss", float("nan")):.6f} '
        f'eval: {FormatMetrics(final)} '
        f'train_time={time.time() - run_start:.1f}s')
    return final
