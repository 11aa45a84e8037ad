"""Tests of the in-process training loop (tfpipe.trainer.train_loop.Trainer).

Protected properties: a run interrupted after a checkpoint and resumed in a
new Trainer gives exactly the losses of an uninterrupted run; checkpoints
are kept per `save_interval_steps`, always include the final step, and
honour `max_checkpoints_to_keep`; TensorBoard scalars for train and eval
are written to the logdir at the right steps; and the progress lines keep
the format that tools (and tests/trainer/trainer_test.py) parse.
"""

import glob
import importlib.util
import os
import re
import shutil
import signal

import pytest
import tensorflow as tf

from tfpipe import model_registry
from tfpipe.trainer import train_loop

_MAX_STEPS = 5
_STEP_RE = re.compile(
    r'^step (\d+)/5 loss=(\d+\.\d{6}) examples/s=\d+\.\d '
    r'step_time=\d+\.\dms accuracy=\S+ grad_norm=\S+ learning_rate=\S+$')


def _Params():
  p = model_registry.GetParams('mlp.TinyMlp')
  p.input.batch_size = 8
  p.task.model.Set(hidden_dim=8, num_hidden_layers=2)
  p.task.pipeline.Set(num_partitions=2, num_micro_batches=2)
  p.task.train.Set(max_steps=_MAX_STEPS, save_interval_steps=2,
                   log_interval_steps=1, max_checkpoints_to_keep=2)
  p.task.eval.Set(interval_steps=2, num_batches=1)
  return p


class _Crash(Exception):
  pass


def _Train(logdir, crash_after_step=None):
  """Trains in `logdir`; returns the log lines (up to the simulated crash)."""
  lines = []

  def Log(line):
    lines.append(line)
    if crash_after_step and line.startswith(f'step {crash_after_step}/'):
      raise _Crash(line)

  trainer = train_loop.Trainer(_Params(), str(logdir), log=Log)
  try:
    trainer.Train()
  except _Crash:
    pass
  return lines


def _Events(logdir, name):
  """{tag: {step: value}} and the plugin names of `logdir/name`'s scalars."""
  values, plugins = {}, set()
  for path in sorted(glob.glob(os.path.join(logdir, name, 'events.*'))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        values.setdefault(value.tag, {})[event.step] = float(
            tf.make_ndarray(value.tensor))
        plugins.add(value.metadata.plugin_data.plugin_name)
  return values, plugins


@pytest.fixture(name='reference', scope='module')
def _Reference(tmp_path_factory):
  logdir = tmp_path_factory.mktemp('reference')
  return logdir, _Train(logdir)


def test_progress_lines(reference):
  _, lines = reference
  steps = [line for line in lines if line.startswith('step ')]
  assert len(steps) == _MAX_STEPS
  for i, line in enumerate(steps, start=1):
    m = _STEP_RE.match(line)
    assert m, line
    assert int(m.group(1)) == i
  evals = [line for line in lines if line.startswith('eval step')]
  assert [line.split(':')[0] for line in evals] == [
      'eval step 2', 'eval step 4', 'eval step 5']
  assert all(re.match(r'eval step \d: accuracy=\S+ loss=\S+$', line)
             for line in evals), evals
  assert re.match(r'Final: step=5 train_loss=\d+\.\d{6} eval: accuracy=\S+ '
                  r'loss=\S+ train_time=\d+\.\ds$', lines[-1]), lines[-1]
  assert not any(line.startswith('Restored') for line in lines)


def test_summaries_are_written_to_the_logdir(reference):
  logdir, lines = reference
  train, plugins = _Events(logdir, 'train')
  assert plugins == {'scalars'}
  assert set(train) == {'loss', 'accuracy', 'grad_norm', 'learning_rate',
                        'step_time_s', 'examples_per_sec'}
  assert all(sorted(v) == [1, 2, 3, 4, 5] for v in train.values())
  for line in lines:
    m = _STEP_RE.match(line)
    if m:
      assert f'{train["loss"][int(m.group(1))]:.6f}' == m.group(2)
  evaluated, _ = _Events(logdir, 'eval')
  assert set(evaluated) == {'loss', 'accuracy'}
  assert sorted(evaluated['loss']) == [2, 4, 5]


def test_checkpoints_keep_the_newest_and_the_final_step(reference):
  logdir, _ = reference
  ckpt_dir = os.path.join(logdir, train_loop.CHECKPOINT_DIR)
  state = tf.train.get_checkpoint_state(ckpt_dir)
  assert os.path.basename(state.model_checkpoint_path) == 'ckpt-5'
  assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
      'ckpt-4', 'ckpt-5']
  names = [n for n, _ in tf.train.list_variables(state.model_checkpoint_path)]
  assert 'global_step/.ATTRIBUTES/VARIABLE_VALUE' in names


def test_resume_gives_identical_subsequent_losses(reference, tmp_path):
  ref_logdir, _ = reference
  want, _ = _Events(ref_logdir, 'train')
  first = _Train(tmp_path, crash_after_step=3)
  assert first[-1].startswith('step 3/')
  assert tf.train.latest_checkpoint(
      str(tmp_path / train_loop.CHECKPOINT_DIR)).endswith('ckpt-2')
  second = _Train(tmp_path)
  assert re.match(r'Restored \S+ckpt-2 at step 2\.$', second[0]), second[0]
  assert [line.split()[1] for line in second if line.startswith('step ')] == [
      '3/5', '4/5', '5/5']
  got, _ = _Events(tmp_path, 'train')
  for step in (3, 4, 5):
    assert got['loss'][step] == want['loss'][step], step
    assert got['grad_norm'][step] == want['grad_norm'][step], step


def test_sigterm_stops_after_its_step_with_a_checkpoint_that_resumes(
    reference, tmp_path):
  # What a scheduler or a preemption sends: the run finishes the step it is
  # in (3, which save_interval_steps=2 would not save), saves it and stops,
  # with nothing lost; a resume goes on from there with the losses of the
  # run that never stopped.
  ref_logdir, _ = reference
  want, _ = _Events(ref_logdir, 'train')
  lines = []

  def Log(line):
    lines.append(line)
    if line.startswith('step 3/'):
      signal.raise_signal(signal.SIGTERM)

  previous = signal.getsignal(signal.SIGTERM)
  trainer = train_loop.Trainer(_Params(), str(tmp_path), log=Log)
  assert trainer.Train() == {}  # No final evaluation.
  assert signal.getsignal(signal.SIGTERM) is previous
  assert trainer.stopped_by.exit_status == 128 + signal.SIGTERM
  assert [line.split()[1] for line in lines if line.startswith('step ')] == [
      '1/5', '2/5', '3/5']
  assert re.match(r'SIGTERM received: stopped after step 3; \S+ckpt-3 holds '
                  r'it\. The same command resumes from there\.$', lines[-1]
                  ), lines[-1]
  assert tf.train.latest_checkpoint(
      str(tmp_path / train_loop.CHECKPOINT_DIR)).endswith('ckpt-3')
  second = _Train(tmp_path)
  assert re.match(r'Restored \S+ckpt-3 at step 3\.$', second[0]), second[0]
  assert [line.split()[1] for line in second if line.startswith('step ')] == [
      '4/5', '5/5']
  got, _ = _Events(tmp_path, 'train')
  for step in (3, 4, 5):
    assert got['loss'][step] == want['loss'][step], step


def test_eval_of_a_checkpoint_past_max_steps_says_so(reference, tmp_path):
  logdir = tmp_path / 'run'
  shutil.copytree(reference[0], logdir)
  p = _Params()
  p.task.train.max_steps = 3  # The logdir was trained to step 5.
  lines = []
  trainer = train_loop.Trainer(p, str(logdir), log=lines.append)
  assert trainer.RestoreForEvaluation().endswith('ckpt-5')
  notes = [l for l in lines if l.startswith('Note:')]
  assert len(notes) == 1, lines
  assert notes[0].endswith(
      'ckpt-5 is at step 5, past task.train.max_steps=3 (--max_steps): a run '
      'with a larger --max_steps trained it; evaluating it as it is.')
  # At max_steps, or below it, nothing is said.
  lines.clear()
  train_loop.Trainer(_Params(), str(logdir),
                     log=lines.append).RestoreForEvaluation()
  assert not [l for l in lines if l.startswith('Note:')], lines


def test_inputs_that_cannot_feed_the_model_stop_before_the_first_step(
    tmp_path):
  p = _Params()
  p.eval_input.input_dim = 8  # The model takes 16-d inputs.
  with pytest.raises(ValueError, match=(
      r"^eval_input: its batches' inputs have shape \(32, 8\), but the model "
      r'\(Mlp, task.model\) takes \(None, 16\)')):
    train_loop.CheckInputs(p)
  train_loop.CheckInputs(p, ['input'])  # The training input fits.
  p.input.batch_size = 0
  with pytest.raises(ValueError, match='^input.batch_size must be > 0'):
    train_loop.CheckInputs(p, ['input'])
  # Trainer.Train checks both, before it writes anything.
  p = _Params()
  p.eval_input.input_dim = 8
  trainer = train_loop.Trainer(p, str(tmp_path / 'run'), log=lambda _: None)
  with pytest.raises(ValueError, match='^eval_input: '):
    trainer.Train()
  assert not (tmp_path / 'run').exists()


def test_write_scalars_and_format_metrics(tmp_path):
  writer = tf.summary.create_file_writer(str(tmp_path / 'w'))
  train_loop.WriteScalars(writer, 7, {'a': 1.5, 'b': -2.0})
  values, plugins = _Events(tmp_path, 'w')
  assert values == {'a': {7: 1.5}, 'b': {7: -2.0}} and plugins == {'scalars'}
  assert train_loop.FormatMetrics({'z': 1.0, 'a': 0.1234567891}) == (
      'a=0.123457 z=1')


def test_timeline_step_writes_the_timeline_and_leaves_training_unchanged(
    reference, tmp_path):
  _, reference_lines = reference
  lines = []
  p = _Params()
  p.task.train.timeline_step = 3
  train_loop.Trainer(p, str(tmp_path), log=lines.append).Train()
  # Same losses as the run without a timeline: recording changes nothing.
  assert ([l for l in lines if _STEP_RE.match(l)] and
          [_STEP_RE.match(l).group(2) for l in lines if _STEP_RE.match(l)] ==
          [_STEP_RE.match(l).group(2) for l in reference_lines
           if _STEP_RE.match(l)])
  text = (tmp_path / 'timeline.txt').read_text()
  assert 'bubble     measured' in text and 'dev1' in text
  assert (tmp_path / 'timeline.json').stat().st_size > 0
  assert any(l.startswith('timeline written to') for l in lines)
  if importlib.util.find_spec('matplotlib') is None:
    # The picture needs the optional [timeline] extra; without it the run
    # says so and still writes the text and JSON forms.
    assert not (tmp_path / 'timeline.png').exists()
    assert any(l.startswith('timeline: no picture') for l in lines)
  else:
    assert (tmp_path / 'timeline.png').stat().st_size > 1000
