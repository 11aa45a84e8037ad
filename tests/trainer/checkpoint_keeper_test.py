"""Tests of tfpipe.trainer.checkpoint_keeper on a two-variable checkpoint.

Protected properties: old checkpoints are deleted only after a newer one
read back, and one the trainer protects is not deleted; a save that does not
read back (or holds a NaN) is removed and the previous ones and the state
file stay; a restore takes the newest checkpoint that reads back whatever
the state file says, warns about and moves aside damaged newer ones, and
refuses (changing nothing) when none reads back; a checkpoint of another
model is a CheckpointMismatchError; leftovers of interrupted saves are
removed. The trainer-level faults are in data_safety_test.py.
"""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf

from tfpipe.trainer import checkpoint_keeper


class _State:
  """Two variables whose values are a function of the step, and a keeper."""

  def __init__(self, directory, max_to_keep=2, shape=(64,)):
    self.w = tf.Variable(tf.zeros(shape))
    self.step = tf.Variable(0, dtype=tf.int64)
    self.logs = []
    self.keeper = checkpoint_keeper.CheckpointKeeper(
        tf.train.Checkpoint(w=self.w, step=self.step), str(directory),
        max_to_keep=max_to_keep, log=self.logs.append)

  def SaveAt(self, step):
    self.w.assign(tf.fill(self.w.shape, float(step)))
    self.step.assign(step)
    return self.keeper.save(checkpoint_number=step)


def _Files(directory):
  return sorted(os.listdir(directory))


def _Snapshot(directory):
  result = {}
  for root, _, names in os.walk(directory):
    for name in names:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        result[os.path.relpath(path, directory)] = f.read()
  return result


def test_a_protected_checkpoint_is_kept_beyond_max_to_keep(tmp_path):
  state = _State(tmp_path, max_to_keep=2)
  state.SaveAt(1)
  state.keeper.Protect(1)
  for step in (2, 3, 4):
    state.SaveAt(step)
  assert state.keeper.numbers == [1, 3, 4]
  state = tf.train.get_checkpoint_state(str(tmp_path))
  assert state.all_model_checkpoint_paths[0].endswith('ckpt-1')
  assert 'ckpt-2.index' not in _Files(tmp_path)


def _FailingWrite(error):
  def Write(*unused_args, **unused_kwargs):
    raise error
  return Write


@pytest.mark.parametrize('error, reason, fix', [
    (tf.errors.ResourceExhaustedError(
        None, None, '{{function_node __wrapped__SaveV2_dtypes_7_device_/job:'
        'localhost/replica:0/task:0/device:CPU:0}} /x/ckpt-3_temp/part-00000-'
        'of-00001.data-00000-of-00001.tempstate123; No space left on device '
        '[Op:SaveV2]'), 'No space left on device', 'Free space in'),
    (tf.errors.PermissionDeniedError(
        None, None, '/x/ckpt-3_temp; Read-only file system'),
     'Read-only file system', 'Make'),
    (OSError(5, 'Input/output error'), 'Input/output error', 'Check')],
                         ids=['disk-full', 'read-only', 'io-error'])
def test_a_failed_write_is_one_line_and_loses_nothing(tmp_path, monkeypatch,
                                                      error, reason, fix):
  # A full disk was a 50-line traceback of TensorFlow's SaveV2.
  state = _State(tmp_path, max_to_keep=1)
  state.SaveAt(2)
  before = _Snapshot(tmp_path)
  checkpoint = state.keeper._checkpoint  # pylint: disable=protected-access
  monkeypatch.setattr(checkpoint, 'write', _FailingWrite(error))
  (tmp_path / 'ckpt-3_temp').mkdir()  # What the failed save left.
  with pytest.raises(checkpoint_keeper.CheckpointError) as e:
    state.SaveAt(3)
  assert str(e.value).startswith(
      f'Cannot write {tmp_path}/ckpt-3: {reason}. Nothing was lost: '
      f'{tmp_path}/ckpt-2 is kept. {fix}')
  assert str(e.value).endswith('and restart: training resumes from the '
                               'newest checkpoint.')
  assert '\n' not in str(e.value)
  assert _Snapshot(tmp_path) == before
  assert state.keeper.numbers == [2]


def test_old_checkpoints_go_only_after_a_newer_one_reads_back(tmp_path):
  state = _State(tmp_path, max_to_keep=2)
  for step in (1, 2, 3):
    state.SaveAt(step)
  assert _Files(tmp_path) == ['checkpoint', 'ckpt-2.data-00000-of-00001',
                              'ckpt-2.index', 'ckpt-3.data-00000-of-00001',
                              'ckpt-3.index']
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith('ckpt-3')
  listed = tf.train.get_checkpoint_state(str(tmp_path))
  assert [os.path.basename(p) for p in listed.all_model_checkpoint_paths] == [
      'ckpt-2', 'ckpt-3']


def test_a_save_that_does_not_read_back_changes_nothing(tmp_path,
                                                         monkeypatch):
  state = _State(tmp_path, max_to_keep=1)
  state.SaveAt(1)
  before = _Snapshot(tmp_path)
  real = checkpoint_keeper.ReadBackProblem
  monkeypatch.setattr(checkpoint_keeper, 'ReadBackProblem',
                      lambda path: 'disk full' if path.endswith('-2') else
                      real(path))
  with pytest.raises(checkpoint_keeper.CheckpointError,
                     match=r'ckpt-2, does not read back \(disk full\).*'
                     r'ckpt-1 is kept'):
    state.SaveAt(2)
  assert _Snapshot(tmp_path) == before


def test_a_non_finite_value_is_never_kept(tmp_path):
  state = _State(tmp_path, max_to_keep=1)
  state.SaveAt(1)
  before = _Snapshot(tmp_path)
  state.w.assign(tf.fill(state.w.shape, np.nan))
  with pytest.raises(checkpoint_keeper.CheckpointError,
                     match='w/.ATTRIBUTES/VARIABLE_VALUE holds non-finite'):
    state.keeper.save(checkpoint_number=2)
  assert _Snapshot(tmp_path) == before


@pytest.mark.parametrize('state_file', ['missing', 'garbage', 'behind'])
def test_restore_takes_the_newest_that_reads_back(tmp_path, state_file):
  writer = _State(tmp_path, max_to_keep=3)
  for step in (1, 2, 3):
    writer.SaveAt(step)
  path = tmp_path / checkpoint_keeper.STATE_FILE
  if state_file == 'missing':
    path.unlink()
  elif state_file == 'garbage':
    path.write_bytes(b'\x00not a \xff state file')
  else:
    path.write_text('model_checkpoint_path: "ckpt-1"\n')
  reader = _State(tmp_path, max_to_keep=3)
  assert reader.keeper.RestoreNewest().endswith('ckpt-3')
  assert reader.step.numpy() == 3 and reader.w.numpy()[0] == 3.0
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith('ckpt-3')


def _FlipByte(path):
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


def _Truncate(path):
  path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


_DAMAGE = {
    'bit-flipped data': lambda d: _FlipByte(d / 'ckpt-3.data-00000-of-00001'),
    'truncated data': lambda d: _Truncate(d / 'ckpt-3.data-00000-of-00001'),
    'truncated index': lambda d: _Truncate(d / 'ckpt-3.index'),
    'missing data': lambda d: (d / 'ckpt-3.data-00000-of-00001').unlink(),
}


@pytest.mark.parametrize('damage', sorted(_DAMAGE))
def test_damaged_newest_falls_back_with_a_warning(tmp_path, damage):
  writer = _State(tmp_path, max_to_keep=3, shape=(4096,))
  for step in (1, 2, 3):
    writer.SaveAt(step)
  _DAMAGE[damage](tmp_path)
  reader = _State(tmp_path, max_to_keep=3, shape=(4096,))
  assert reader.keeper.RestoreNewest().endswith('ckpt-2')
  assert reader.step.numpy() == 2 and reader.w.numpy()[0] == 2.0
  assert reader.logs[0].startswith(f'WARNING: {tmp_path}/ckpt-3 does not '
                                   'read back')
  assert not (tmp_path / 'ckpt-3.index').exists()
  assert (tmp_path / 'rejected' / 'ckpt-3.index').exists()
  assert tf.train.latest_checkpoint(str(tmp_path)).endswith('ckpt-2')
  # The run goes on and saves over the number again.
  reader.SaveAt(3)
  assert reader.keeper.checkpoints[-1].endswith('ckpt-3')


def test_nothing_reads_back_refuses_and_changes_nothing(tmp_path):
  writer = _State(tmp_path, max_to_keep=2)
  for step in (1, 2):
    writer.SaveAt(step)
  _FlipByte(tmp_path / 'ckpt-1.index')
  _Truncate(tmp_path / 'ckpt-1.index')
  _Truncate(tmp_path / 'ckpt-2.index')
  before = _Snapshot(tmp_path)
  reader = _State(tmp_path)
  with pytest.raises(checkpoint_keeper.CheckpointError,
                     match='No checkpoint in .* reads back: ckpt-2: .*; '
                     'ckpt-1: .*does not start over'):
    reader.keeper.RestoreNewest()
  assert _Snapshot(tmp_path) == before and reader.step.numpy() == 0


def test_read_only_restore_moves_nothing(tmp_path):
  writer = _State(tmp_path, max_to_keep=2)
  for step in (1, 2):
    writer.SaveAt(step)
  _Truncate(tmp_path / 'ckpt-2.data-00000-of-00001')
  before = _Snapshot(tmp_path)
  reader = _State(tmp_path)
  assert reader.keeper.RestoreNewest(read_only=True).endswith('ckpt-1')
  assert _Snapshot(tmp_path) == before


def test_a_checkpoint_of_another_model_is_a_mismatch(tmp_path):
  _State(tmp_path, shape=(64,)).SaveAt(1)
  other = _State(tmp_path, shape=(32,))
  with pytest.raises(checkpoint_keeper.CheckpointMismatchError,
                     match=r'ckpt-1 reads back but does not fit this model: '
                     r'.*shape.*new --logdir'):
    other.keeper.RestoreNewest()


def test_leftovers_of_interrupted_saves_are_removed(tmp_path):
  writer = _State(tmp_path)
  writer.SaveAt(1)
  (tmp_path / 'checkpoint.tmp0123abcd').write_text('partial state')
  (tmp_path / 'ckpt-2.data-00000-of-00001').write_bytes(b'partial')
  (tmp_path / 'ckpt-3_temp').mkdir()
  (tmp_path / 'ckpt-3_temp' / 'part-00000-of-00001.index').write_bytes(b'x')
  removed = writer.keeper.CleanLeftovers()
  assert removed == ['checkpoint.tmp0123abcd', 'ckpt-2.data-00000-of-00001',
                     'ckpt-3_temp']
  assert writer.logs == [f'Removed leftovers of interrupted saves from '
                         f'{tmp_path}: ' + ', '.join(removed) + '.']
  assert _Files(tmp_path) == ['checkpoint', 'ckpt-1.data-00000-of-00001',
                              'ckpt-1.index']
  shutil.rmtree(tmp_path)
  assert _State(tmp_path).keeper.RestoreNewest() is None
