"""Fault injection: the trainer never loses a good checkpoint or mixes runs.

Each test breaks one thing the way a user or a machine would (a NaN, a
second trainer, a garbled state file, a damaged or missing checkpoint file,
leftovers of a killed save, other params, a too-small --max_steps) and then
checks three things: the run stops or carries on as documented, with one
message naming the cause and the fix; every good checkpoint is still there;
and resuming from what is left gives exactly the losses of a run that never
broke. (Killing a trainer at random moments is tested in trainer_test.py.)

All runs are in-process, most on a 3-layer MLP (K=2, M=2, batch 8).
"""

import os
import re
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tfpipe import model_registry
from tfpipe.trainer import checkpoint_keeper
from tfpipe.trainer import input_generator
from tfpipe.trainer import logdir_lock
from tfpipe.trainer import params_file
from tfpipe.trainer import train_loop
from tfpipe.trainer import trainer as trainer_main

_CKPT = train_loop.CHECKPOINT_DIR
_STEP_RE = re.compile(r'^step (\d+)/\d+ loss=(\S+) ')


class NanAtStepsInput(input_generator.SyntheticClassificationInput):
  """The MLP's input, with NaN inputs at chosen training steps."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('nan_steps', [], 'Training steps (1-based) whose inputs are NaN.')
    return p

  def GetDataset(self, start_step=0):
    # Batch b trains step b + 1.
    bad = tf.constant([s - 1 for s in self.p.nan_steps] or [-1], tf.int64)

    def Poison(index, batch):
      inputs, targets = batch
      nan = tf.fill(tf.shape(inputs), float('nan'))
      return tf.where(tf.reduce_any(tf.equal(index, bad)), nan,
                      inputs), targets

    return super().GetDataset(start_step).enumerate(start_step).map(Poison)


def _Params(max_steps=8, nan_steps=(), **overrides):
  p = model_registry.GetParams('mlp.TinyMlp')
  p.input = NanAtStepsInput.Params().Set(
      name='train', batch_size=8, seed=0, input_dim=16, num_classes=4,
      nan_steps=list(nan_steps))
  p.task.model.Set(hidden_dim=8, num_hidden_layers=2)
  p.task.pipeline.Set(num_partitions=2, num_micro_batches=2)
  p.task.train.Set(max_steps=max_steps, save_interval_steps=2,
                   log_interval_steps=1, max_checkpoints_to_keep=3)
  p.task.eval.Set(num_batches=1)
  return p.Set(**overrides)


def _Train(logdir, p=None, **kwargs):
  """Trains in-process; returns (log lines, the Trainer)."""
  lines = []
  trainer = train_loop.Trainer(p or _Params(), str(logdir), log=lines.append,
                               **kwargs)
  trainer.Train()
  return lines, trainer


def _Losses(lines):
  """{step: printed loss} of the progress lines."""
  matches = (_STEP_RE.match(l) for l in lines)
  return {int(m.group(1)): m.group(2) for m in matches if m}


def _Snapshot(logdir):
  """{path: bytes} of every file but the lock (which each run rewrites)."""
  result = {}
  for root, _, names in os.walk(logdir):
    for name in names:
      if name != logdir_lock.LOCK_FILE:
        path = os.path.join(root, name)
        with open(path, 'rb') as f:
          result[os.path.relpath(path, logdir)] = f.read()
  return result


def _Checkpoints(logdir):
  return sorted(n[:-len('.index')] for n in os.listdir(logdir / _CKPT)
                if n.endswith('.index'))


def _Values(path):
  reader = tf.train.load_checkpoint(str(path))
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}


@pytest.fixture(name='reference', scope='module')
def _Reference(tmp_path_factory):
  """{step: loss} of an uninterrupted 8-step run."""
  lines, _ = _Train(tmp_path_factory.mktemp('reference'))
  losses = _Losses(lines)
  assert sorted(losses) == list(range(1, 9))
  return losses


@pytest.fixture(name='trained_to_6', scope='module')
def _TrainedTo6(tmp_path_factory):
  logdir = tmp_path_factory.mktemp('trained_to_6')
  _Train(logdir, _Params(max_steps=6))
  assert _Checkpoints(logdir) == ['ckpt-2', 'ckpt-4', 'ckpt-6']
  return logdir


@pytest.fixture(name='logdir')
def _Logdir(trained_to_6, tmp_path):
  """A fresh copy of a logdir trained to step 6 (ckpt-2, ckpt-4, ckpt-6)."""
  copy = tmp_path / 'logdir'
  shutil.copytree(trained_to_6, copy)
  return copy


def _AssertResumedExactly(lines, reference, step):
  assert any(l.startswith('Restored ') and l.endswith(f'ckpt-{step} at step '
                                                      f'{step}.')
             for l in lines), lines
  losses = _Losses(lines)
  assert sorted(losses) == list(range(step + 1, 9)), lines
  assert losses == {s: reference[s] for s in losses}


# ---- non-finite losses ------------------------------------------------------


def test_nan_stops_naming_the_step_and_keeps_the_good_checkpoint(
    tmp_path, reference):
  p = _Params(nan_steps=[5])
  p.task.train.max_checkpoints_to_keep = 1  # A NaN save would delete ckpt-4.
  with pytest.raises(train_loop.TrainingStopped) as e:
    _Train(tmp_path, p)
  message = str(e.value)
  # A traced ReLU (a fused MatMul) may turn a NaN input into 0, so the loss
  # of the poisoned step may be finite; its gradient is not.
  assert re.match(r'Step 5: loss=\S+ grad_norm=nan is not finite; stopped '
                  r'before saving anything from it\.', message), message
  assert f'The last good checkpoint, {tmp_path / _CKPT}/ckpt-4, is kept' in (
      message)
  assert '--nan_policy=skip' in message and '\n' not in message
  assert _Checkpoints(tmp_path) == ['ckpt-4']
  floats = [v for v in _Values(tmp_path / _CKPT / 'ckpt-4').values()
            if isinstance(v, np.ndarray) and v.dtype.kind == 'f']
  assert floats and all(np.all(np.isfinite(v)) for v in floats)
  # What is left resumes to exactly the losses of a run without the NaN.
  lines, _ = _Train(tmp_path, _Params(), allow_params_change=True)
  _AssertResumedExactly(lines, reference, 4)


def test_skip_policy_leaves_the_model_untouched_a_bounded_number_of_times(
    tmp_path):
  with pytest.raises(train_loop.TrainingStopped) as e:
    _Train(tmp_path, _Params(nan_steps=[3, 6, 7, 8]), nan_policy='skip',
           max_nan_skips=3)
  # The checkpoint to go back to is the one from before the first skip, not
  # the newest: it came after a skipped update.
  # In a traced step a fused ReLU may turn the NaN input into 0, so the loss
  # can be finite; the gradient norm is not (a plain Keras step does the same).
  assert re.match(
      re.escape('Step 8: loss=') + r'\S+' + re.escape(
          ' grad_norm=nan is not finite after 3 skipped '
          'update(s) (--max_nan_skips=3); stopped before saving anything from '
          f'it. {tmp_path / _CKPT}/ckpt-2, saved before the first skipped '
          f'update (step 3), is kept; {tmp_path / _CKPT}/ckpt-4 came after '
          'skipped updates. '), str(e.value))
  assert 'last good checkpoint' not in str(e.value)
  assert _Checkpoints(tmp_path) == ['ckpt-2', 'ckpt-4']  # Not step 6.
  lines, trainer = _Train(tmp_path / 'untouched',
                          _Params(max_steps=4, nan_steps=[3, 4]),
                          nan_policy='skip')
  # Steps 3 and 4 were skipped: weights, optimizer slots and the optimizer's
  # iteration count are those of step 2; no checkpoint holds step 4.
  assert _Checkpoints(tmp_path / 'untouched') == ['ckpt-2']
  assert (f'step 4: no checkpoint, since its update was skipped. '
          f'{tmp_path / "untouched" / _CKPT}/ckpt-2, saved before the first '
          'skipped update (step 3), is kept.') in lines
  at2 = _Values(tmp_path / 'untouched' / _CKPT / 'ckpt-2')
  now = _Values(trainer.checkpoint.write(str(tmp_path / 'now')))
  changed = sorted(k for k in at2 if not np.array_equal(at2[k], now[k]))
  assert changed == ['global_step/.ATTRIBUTES/VARIABLE_VALUE']


def test_skipped_steps_never_rotate_out_the_checkpoint_from_before_them(
    tmp_path):
  # After a divergence every update is skipped: each save wrote the same
  # weights again and pushed out the last checkpoint from before it.
  lines, trainer = _Train(tmp_path, _Params(max_steps=12,
                                            nan_steps=range(5, 13)),
                          nan_policy='skip', max_nan_skips=100)
  assert trainer.nan_skips == 8 and trainer.step == 12
  assert _Checkpoints(tmp_path) == ['ckpt-2', 'ckpt-4']
  # With updates between the skips, saves go on, and the checkpoint from
  # before the first skip stays beyond max_checkpoints_to_keep=3.
  _Train(tmp_path / 'once', _Params(max_steps=12, nan_steps=[3]),
         nan_policy='skip')
  assert set(_Checkpoints(tmp_path / 'once')) == {'ckpt-2', 'ckpt-8',
                                                  'ckpt-10', 'ckpt-12'}


def test_skip_policy_trains_on_after_a_skipped_update(tmp_path):
  lines, trainer = _Train(tmp_path, _Params(max_steps=4, nan_steps=[3]),
                          nan_policy='skip')
  assert trainer.nan_skips == 1 and trainer.step == 4
  assert any(re.fullmatch(
      r'step 3: loss=\S+ grad_norm=nan is not finite; the update was '
      r'skipped \(1 of at most 10, --max_nan_skips\)\.', l) for l in lines)
  assert sorted(_Losses(lines)) == [1, 2, 3, 4]
  assert np.isfinite(float(_Losses(lines)[4]))


def test_command_line_nan_is_one_error_line_and_status_1(tmp_path, capsys):
  # The recipe: it used to print loss=nan and exit 0.
  logdir = tmp_path / 'mlp'
  trainer_main.FLAGS.unparse_flags()
  trainer_main.FLAGS([
      'tfpipe-train', f'--logdir={logdir}', '--model=mlp.TinyMlp',
      '--max_steps=10', '--save_interval_steps=1', '--log_interval_steps=1',
      '--run_locally=cpu', '--nodeterministic',
      '--model_params_override=task.train.learning_rate: 1e8; '
      'task.train.clip_gradient_norm: 0; task.eval.num_batches: 1'])
  try:
    assert trainer_main.main(['tfpipe-train']) == 1
  finally:
    trainer_main.FLAGS.unparse_flags()
  errors = capsys.readouterr().err.strip().splitlines()
  assert len(errors) == 1 and errors[0].startswith('ERROR: Step '), errors
  assert 'loss=nan' in errors[0]
  step = int(errors[0].split()[2].rstrip(':'))
  assert _Checkpoints(logdir) == [f'ckpt-{step - 1}']


# ---- one trainer per logdir -------------------------------------------------


def test_second_trainer_is_refused_and_writes_nothing(logdir):
  before = _Snapshot(logdir)
  with logdir_lock.LogdirLock(str(logdir)):  # A trainer that holds it.
    with pytest.raises(logdir_lock.LogdirError,
                       match=f'is in use by another trainer: pid {os.getpid()}'
                       ' on host '):
      _Train(logdir)
  assert _Snapshot(logdir) == before


# ---- the checkpoint state file and damaged checkpoints ----------------------


@pytest.mark.parametrize('state_file', ['garbage', 'missing'])
def test_broken_state_file_resumes_from_the_newest_checkpoint(
    logdir, reference, state_file):
  state = logdir / _CKPT / 'checkpoint'
  if state_file == 'garbage':
    state.write_text('garbage \x00\n')
  else:
    state.unlink()
  lines, _ = _Train(logdir)
  _AssertResumedExactly(lines, reference, 6)
  assert tf.train.latest_checkpoint(str(logdir / _CKPT)).endswith('ckpt-8')


def _FlipData(directory):
  path = directory / 'ckpt-6.data-00000-of-00001'
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  path.write_bytes(bytes(data))


def _TruncateIndex(directory):
  path = directory / 'ckpt-6.index'
  path.write_bytes(path.read_bytes()[:40])


def _DeleteData(directory):
  (directory / 'ckpt-6.data-00000-of-00001').unlink()


@pytest.mark.parametrize('damage', [_FlipData, _TruncateIndex, _DeleteData],
                         ids=['bit-flipped', 'truncated', 'data-missing'])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(
    logdir, reference, damage):
  damage(logdir / _CKPT)
  lines, _ = _Train(logdir)
  warnings = [l for l in lines if l.startswith('WARNING:')]
  assert len(warnings) == 1 and 'ckpt-6 does not read back' in warnings[0]
  _AssertResumedExactly(lines, reference, 4)
  assert (logdir / _CKPT / 'rejected' / 'ckpt-6.index').exists()
  assert _Checkpoints(logdir) == ['ckpt-4', 'ckpt-6', 'ckpt-8']


def test_leftovers_and_an_index_missing_are_cleaned_with_a_message(
    logdir, reference):
  ckpt = logdir / _CKPT
  (ckpt / 'ckpt-6.index').unlink()  # Its data is now an orphan.
  (ckpt / 'checkpoint.tmp5f3a').write_text('half a state file')
  (ckpt / 'ckpt-8_temp').mkdir()
  (ckpt / 'ckpt-8_temp' / 'part-00000-of-00001.data-00000-of-00001').write_text(
      'half a save')
  lines, _ = _Train(logdir)
  assert (f'Removed leftovers of interrupted saves from {ckpt}: '
          'checkpoint.tmp5f3a, ckpt-6.data-00000-of-00001, ckpt-8_temp.'
          ) in lines
  _AssertResumedExactly(lines, reference, 4)


def test_evaluation_next_to_a_damaged_checkpoint_changes_nothing(logdir):
  _FlipData(logdir / _CKPT)
  before = _Snapshot(logdir)
  lines = []
  trainer = train_loop.Trainer(_Params(max_steps=6), str(logdir),
                               log=lines.append)
  assert trainer.RestoreForEvaluation().endswith('ckpt-4')
  assert trainer.step == 4 and set(trainer.Evaluate()) == {'loss', 'accuracy'}
  assert len(lines) == 1 and lines[0].startswith('WARNING: ')
  assert _Snapshot(logdir) == before


def test_no_readable_checkpoint_stops_instead_of_starting_over(logdir):
  for name in ('ckpt-2', 'ckpt-4', 'ckpt-6'):
    path = logdir / _CKPT / f'{name}.index'
    path.write_bytes(path.read_bytes()[:40])
  before = _Snapshot(logdir)
  with pytest.raises(checkpoint_keeper.CheckpointError,
                     match=r'No checkpoint in .* reads back: ckpt-6: .*; '
                     r'ckpt-4: .*; ckpt-2: .*does not start over'):
    _Train(logdir)
  assert _Snapshot(logdir) == before


def test_no_checkpoint_is_deleted_before_a_newer_one_reads_back(
    logdir, monkeypatch):
  real = checkpoint_keeper.ReadBackProblem
  monkeypatch.setattr(
      checkpoint_keeper, 'ReadBackProblem',
      lambda path: 'injected' if path.endswith('ckpt-8') else real(path))
  with pytest.raises(checkpoint_keeper.CheckpointError,
                     match=r'ckpt-8, does not read back \(injected\)'):
    _Train(logdir)
  assert _Checkpoints(logdir) == ['ckpt-2', 'ckpt-4', 'ckpt-6']
  assert tf.train.latest_checkpoint(str(logdir / _CKPT)).endswith('ckpt-6')


# ---- params -----------------------------------------------------------------


def test_other_model_params_are_refused_before_anything_is_written(logdir):
  before = _Snapshot(logdir)
  # Same variable shapes: this used to restore and train on silently.
  p = _Params(**{'task.model.dropout_prob': 0.5})
  with pytest.raises(params_file.ParamsChangedError) as e:
    _Train(logdir, p)
  assert '- task.model.dropout_prob : 0.0\n+ task.model.dropout_prob : 0.5' in (
      str(e.value))
  assert '--allow_params_change' in str(e.value)
  assert _Snapshot(logdir) == before


def test_allowed_shape_change_is_one_line_and_keeps_params_txt(logdir):
  before = _Snapshot(logdir)
  p = _Params(**{'task.model.hidden_dim': 16})
  with pytest.raises(checkpoint_keeper.CheckpointMismatchError) as e:
    _Train(logdir, p, allow_params_change=True)
  message = str(e.value)
  assert '\n' not in message and 'does not fit this model' in message
  assert str(logdir) in message and '--logdir' in message
  assert _Snapshot(logdir) == before


def test_pipeline_layout_change_resumes_to_the_same_losses(logdir, reference):
  p = _Params(**{'task.pipeline.num_partitions': 1})
  lines, _ = _Train(logdir, p)
  assert ('params.txt differs only in how the run executes (training is '
          'unchanged): task.pipeline.num_partitions 2 -> 1, '
          'task.train.max_steps 6 -> 8.') in lines
  _AssertResumedExactly(lines, reference, 6)
  assert 'task.pipeline.num_partitions : 1' in (logdir / 'params.txt'
                                                ).read_text()


def test_a_pipeline_seed_change_is_refused_on_resume(logdir):
  # The pipeline's random_seed draws the dropout masks: it was accepted as
  # "training is unchanged", and the losses then differed.
  before = _Snapshot(logdir)
  p = _Params(**{'task.pipeline.random_seed': 7})
  with pytest.raises(params_file.ParamsChangedError,
                     match=r'\+ task.pipeline.random_seed : 7'):
    _Train(logdir, p)
  assert _Snapshot(logdir) == before


def test_checkpoints_without_params_txt_are_not_resumed_silently(
    logdir, reference):
  # A deleted params.txt let other params train on the checkpoints.
  (logdir / 'params.txt').unlink()
  before = _Snapshot(logdir)
  with pytest.raises(params_file.ParamsChangedError,
                     match='has checkpoints but no params.txt'):
    _Train(logdir, _Params(**{'task.model.dropout_prob': 0.5}))
  assert _Snapshot(logdir) == before
  lines, _ = _Train(logdir, allow_params_change=True)
  assert any(l.startswith('--allow_params_change: resuming') for l in lines)
  _AssertResumedExactly(lines, reference, 6)
  assert (logdir / 'params.txt').read_text() == _Params().ToText()


def test_a_run_that_stopped_before_its_first_checkpoint_gives_way(tmp_path):
  # Its params.txt used to refuse the corrected rerun.
  with pytest.raises(train_loop.TrainingStopped):
    _Train(tmp_path, _Params(nan_steps=[1]))
  assert (tmp_path / 'params.txt').exists()
  assert not (tmp_path / _CKPT).exists()
  fixed = _Params(**{'task.train.learning_rate': 1e-4})
  lines, trainer = _Train(tmp_path, fixed)
  assert any(l.endswith('has no checkpoint yet, so nothing was trained with '
                        'that params.txt: this run starts from step 0 with its '
                        'own params (the old params.txt is kept as '
                        'params.before_step_0.txt).') for l in lines), lines
  assert trainer.step == 8
  assert (tmp_path / 'params.txt').read_text() == fixed.ToText()


def test_max_steps_below_the_restored_step_is_refused(logdir):
  before = _Snapshot(logdir)
  with pytest.raises(train_loop.TrainingStopped,
                     match=r'task.train.max_steps=4 \(--max_steps\) is below '
                     r'step 6, restored from .*ckpt-6: there is nothing to '
                     r'train. Raise --max_steps above 6'):
    _Train(logdir, _Params(max_steps=4))
  assert _Snapshot(logdir) == before
  lines, _ = _Train(logdir, _Params(max_steps=6))
  assert ('Step 6 is already task.train.max_steps; nothing to train (raise '
          '--max_steps to train on).') in lines
  assert lines[-1].startswith('Final: step=6 eval: ')
  assert _Checkpoints(logdir) == ['ckpt-2', 'ckpt-4', 'ckpt-6']


def test_batch_norm_checkpoint_resumes_under_another_k(tmp_path):
  """Layers are saved by name, not by cell, so a new K restores everything.

  Batch-norm moving statistics are not trainable, so no optimizer slot keeps
  them; under cell-indexed names they did not restore after a re-cut.
  """
  def Conv(num_partitions, max_steps):
    p = model_registry.GetParams('image.TinyConvClassifier')
    p.input.Set(batch_size=4, image_size=8)
    p.eval_input.Set(batch_size=4, image_size=8)
    p.task.model.image_size = 8
    p.task.pipeline.Set(num_partitions=num_partitions, num_micro_batches=2)
    p.task.train.Set(max_steps=max_steps, save_interval_steps=1,
                     log_interval_steps=1)
    p.task.eval.num_batches = 1
    return p

  reference, _ = _Train(tmp_path / 'reference', Conv(2, 3))
  _Train(tmp_path / 'recut', Conv(2, 1))
  lines, _ = _Train(tmp_path / 'recut', Conv(1, 3))
  assert any('task.pipeline.num_partitions 2 -> 1' in l for l in lines)
  want = _Losses(reference)
  got = _Losses(lines)
  assert sorted(got) == [2, 3]
  # K=1 sums the batch in another order than K=2: equal to float rounding
  # (a variable that failed to restore moves the loss by far more).
  np.testing.assert_allclose([float(got[s]) for s in (2, 3)],
                             [float(want[s]) for s in (2, 3)], rtol=2e-6)
