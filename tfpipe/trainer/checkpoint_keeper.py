"""Checkpoints that are never lost: verified saves, verified restores.

`tf.train.CheckpointManager` trusts its state file (`checkpoints/checkpoint`)
and deletes old checkpoints as soon as a new one is written. Both lose work:
a garbled state file makes a run start over at step 0 on top of intact
checkpoints, and a bad write (a full disk, or weights gone to NaN) replaces
the last good one. The keeper manages the same files under these rules:

* A save is read back in full (every tensor, whose CRC the reader checks,
  and every float finite) before the state file lists it; only then are
  checkpoints beyond `max_to_keep` deleted, oldest first, but for the ones
  the trainer `Protect`s. This costs one read of the checkpoint per save.
* A restore ignores what the state file says: it takes the newest `ckpt-N`
  that reads back and restores. A damaged newer one (truncated, bit-flipped,
  data missing, non-finite) is skipped with a warning, and moved to
  `checkpoints/rejected/` once an older one has restored.
* If checkpoints exist but none reads back, it raises CheckpointError and
  leaves them all in place: a run never starts over on top of them.
* Leftovers of interrupted saves (`checkpoint.tmp*` from the state file's
  atomic rename, `ckpt-N_temp/` shard directories, data files without an
  index, which cannot be restored) are removed at start, with a message.

The state file keeps the format `tf.train.latest_checkpoint` reads.
"""

import os
import re
import time
import uuid

import numpy as np
import tensorflow as tf

PREFIX = 'ckpt'
STATE_FILE = 'checkpoint'
REJECTED_DIR = 'rejected'

_INDEX_RE = re.compile(r'^ckpt-(\d+)\.index$')
_DATA_RE = re.compile(r'^ckpt-(\d+)\.data-(\d+)-of-(\d+)$')
_TEMP_DIR_RE = re.compile(r'^ckpt-\d+_temp')
_STATE_TMP_RE = re.compile(r'^checkpoint\.tmp')


class CheckpointError(Exception):
  """No checkpoint can be restored or written safely; nothing was lost."""


class CheckpointMismatchError(CheckpointError):
  """A checkpoint reads back but does not fit the model being restored.

  Attributes:
    path: the checkpoint.
    detail: the first sentence of TensorFlow's error.
  """

  def __init__(self, path, detail):
    super().__init__(
        f'{path} reads back but does not fit this model: {detail} The logdir '
        'was trained with other model params; run with the params of its '
        'params.txt, or give a new --logdir.')
    self.path = path
    self.detail = detail


def _FirstLine(e):
  """The first sentence of an error: TensorFlow's go on to dump values."""
  text = getattr(e, 'message', None) or str(e) or type(e).__name__
  line = text.strip().splitlines()[0]
  sentence = re.match(r'.*?[.;](?=\s+[A-Z(\[]|$)', line)
  return (sentence.group(0) if sentence else line)[:300]


def WriteErrorReason(e):
  """The system's reason in an error of a failed write, e.g. 'No space left
  on device', without TensorFlow's function and temp-file names."""
  text = getattr(e, 'message', None) or getattr(e, 'strerror', None) or str(e)
  text = re.sub(r'\{\{function_node [^}]*\}\}\s*', '', text)
  text = re.sub(r'\s*\[Op:\w+\]', '', text).strip()
  return text.rsplit(';', 1)[-1].strip() or text


def ReadBackProblem(path):
  """None if every tensor of checkpoint `path` reads back finite, else why.

  The reader checks each tensor's CRC32C as it reads it, so a bit flip or a
  truncation anywhere in the data shows up here; a damaged or missing index
  fails to open.
  """
  try:
    reader = tf.train.load_checkpoint(path)
    for name, dtype in sorted(reader.get_variable_to_dtype_map().items()):
      value = reader.get_tensor(name)
      if dtype.is_floating and not np.all(np.isfinite(value)):
        return f'{name} holds non-finite values'
  except Exception as e:  # pylint: disable=broad-except
    # Whatever the reader raises (OpError, IndexError on a short read, ...),
    # a checkpoint that does not read back cannot be trusted.
    return _FirstLine(e)
  return None


def ScanDirectory(directory):
  """What a checkpoint directory holds.

  Returns:
    (numbers, leftovers): the N of every `ckpt-N.index`, ascending, and the
    names of leftovers of interrupted saves.
  """
  if not tf.io.gfile.isdir(directory):
    return [], []
  names = tf.io.gfile.listdir(directory)
  names = [n.rstrip('/') for n in names]
  indexed = {int(m.group(1)) for m in map(_INDEX_RE.match, names) if m}
  leftovers = []
  for name in names:
    m = _DATA_RE.match(name)
    if (m and int(m.group(1)) not in indexed) or _TEMP_DIR_RE.match(
        name) or _STATE_TMP_RE.match(name):
      leftovers.append(name)
  return sorted(indexed), sorted(leftovers)


class CheckpointKeeper:
  """Saves and restores `checkpoint` as `<directory>/ckpt-<step>`.

  `save(checkpoint_number, options=None)` keeps the signature of
  `tf.train.CheckpointManager.save`, so callers that bind options to it (the
  multi-host controller's I/O device) work unchanged.
  """

  def __init__(self, checkpoint, directory, max_to_keep, log=print):
    if max_to_keep < 1:
      raise ValueError(f'max_to_keep must be >= 1; received {max_to_keep}.')
    self._checkpoint = checkpoint
    self.directory = directory
    self.max_to_keep = max_to_keep
    self._log = log
    self._kept = []  # Checkpoint numbers, ascending; the last is verified.
    self._protected = set()  # Numbers kept beyond max_to_keep (Protect).
    # Created before any save or restore, so every checkpoint has it and
    # every restore matches it.
    _ = checkpoint.save_counter

  def _Path(self, number, directory=None):
    return os.path.join(directory or self.directory, f'{PREFIX}-{number}')

  @property
  def latest_checkpoint(self):
    """The newest checkpoint this keeper restored or saved, or None."""
    return self._Path(self._kept[-1]) if self._kept else None

  @property
  def checkpoints(self):
    return [self._Path(n) for n in self._kept]

  @property
  def numbers(self):
    """The N of each kept ckpt-N, ascending (as `checkpoints`)."""
    return list(self._kept)

  def Protect(self, number):
    """Keeps ckpt-<number> beyond max_to_keep for as long as this keeper saves.

    The trainer protects its last checkpoint from before a skipped update,
    so that checkpoints saved afterwards never rotate it out.
    """
    self._protected.add(number)

  # ---- start ------------------------------------------------------------

  def CleanLeftovers(self):
    """Removes leftovers of interrupted saves; returns their names."""
    _, leftovers = ScanDirectory(self.directory)
    for name in leftovers:
      path = os.path.join(self.directory, name)
      if tf.io.gfile.isdir(path):
        tf.io.gfile.rmtree(path)
      else:
        tf.io.gfile.remove(path)
    if leftovers:
      self._log(f'Removed leftovers of interrupted saves from '
                f'{self.directory}: {", ".join(leftovers)}.')
    return leftovers

  def RestoreNewest(self, read_only=False):
    """Restores the newest checkpoint that reads back and restores.

    Args:
      read_only: change nothing on disk (for evaluation next to a trainer).

    Returns:
      The restored path, or None if the directory holds no checkpoint.

    Raises:
      CheckpointError: checkpoints exist but none reads back, or the newest
        that reads back does not fit the model.
    """
    numbers, _ = ScanDirectory(self.directory)
    rejected = []
    for number in reversed(numbers):
      path = self._Path(number)
      problem = ReadBackProblem(path)
      if problem:
        rejected.append((number, problem))
        self._log(f'WARNING: {path} does not read back ({problem}); trying '
                  'the previous checkpoint.')
        continue
      status = None
      try:
        status = self._checkpoint.restore(path)
        status.assert_consumed()
      except (ValueError, AssertionError, tf.errors.OpError) as e:
        if status is not None:
          status.expect_partial()  # The error says it; TF would say it again.
        # Chained: the cause may be a device out of memory, not a misfit
        # (the trainer's out-of-memory diagnosis reads it).
        raise CheckpointMismatchError(path, _FirstLine(e)) from e
      self._kept = [n for n in numbers if n <= number]
      if not read_only:
        for bad, _ in rejected:
          self._MoveAside(bad)
        self._WriteState()
      return path
    if rejected:
      raise CheckpointError(
          f'No checkpoint in {self.directory} reads back: ' + '; '.join(
              f'{PREFIX}-{n}: {p}' for n, p in rejected) +
          '. Nothing was changed and training does not start over on top of '
          'them: put a good copy back, or give a new --logdir to start from '
          'step 0.')
    return None

  def _MoveAside(self, number):
    """Moves ckpt-N's files to rejected/ (kept for inspection, not listed)."""
    rejected = os.path.join(self.directory, REJECTED_DIR)
    tf.io.gfile.makedirs(rejected)
    target = self._Path(number, rejected)
    if tf.io.gfile.glob(target + '.*'):
      target += time.strftime('.%Y%m%d-%H%M%S')
    for path in tf.io.gfile.glob(self._Path(number) + '.*'):
      suffix = path[len(self._Path(number)):]
      tf.io.gfile.rename(path, target + suffix, overwrite=True)
    self._log(f'Moved the damaged {PREFIX}-{number} to {target}.*')

  # ---- saving -----------------------------------------------------------

  def save(self, checkpoint_number, options=None):
    """Writes, reads back and lists ckpt-<number>; then drops the oldest.

    Raises:
      CheckpointError: the new checkpoint does not read back; it is removed
        and the previous ones are kept.
    """
    path = self._Path(checkpoint_number)
    self._checkpoint.save_counter.assign_add(1)
    try:
      written = self._checkpoint.write(path, options=options)
    except (tf.errors.OpError, OSError) as e:
      # A full disk, a read-only or vanished directory: TensorFlow names its
      # temp file, then the system's reason.
      self._checkpoint.save_counter.assign_sub(1)
      self._RemovePartial(checkpoint_number)
      raise self._WriteError(path, e) from None
    problem = ReadBackProblem(written)
    if problem:
      self._Delete(checkpoint_number)
      raise CheckpointError(
          f'The checkpoint just written, {written}, does not read back '
          f'({problem}); it was removed and '
          f'{self.latest_checkpoint or "no earlier checkpoint"} is kept. '
          'Check the disk (space, errors) and restart: training resumes '
          'from the kept checkpoint.')
    self._kept = sorted(set(self._kept) | {checkpoint_number})
    rotating = [n for n in self._kept if n not in self._protected]
    dropped = rotating[:-self.max_to_keep]
    self._kept = [n for n in self._kept if n not in dropped]
    self._WriteState()
    for number in dropped:
      self._Delete(number)
    return written

  def _WriteError(self, path, e):
    """The CheckpointError of a failed write of `path`: why, what is kept."""
    reason = WriteErrorReason(e)
    if 'space' in reason.lower():
      fix = f'Free space in {self.directory}'
    elif 'read-only' in reason.lower() or 'permission' in reason.lower():
      fix = f'Make {self.directory} writable'
    else:
      fix = f'Check {self.directory} (space, permissions, errors)'
    kept = (f'{self.latest_checkpoint} is kept' if self.latest_checkpoint
            else 'there was no earlier checkpoint')
    return CheckpointError(
        f'Cannot write {path}: {reason}. Nothing was lost: {kept}. {fix} and '
        'restart: training resumes from the newest checkpoint.')

  def _RemovePartial(self, number):
    """Removes what a failed save of ckpt-<number> left, as far as it can.

    What it cannot remove (a read-only directory) is a leftover that the
    next start removes.
    """
    for path in tf.io.gfile.glob(self._Path(number) + '_temp*') + (
        tf.io.gfile.glob(self._Path(number) + '.*')):
      try:
        if tf.io.gfile.isdir(path):
          tf.io.gfile.rmtree(path)
        else:
          tf.io.gfile.remove(path)
      except (tf.errors.OpError, OSError):
        pass

  def _Delete(self, number):
    # The index goes first: data without an index is a leftover that the
    # next start removes; an index without its data would be a checkpoint
    # that no longer reads back.
    path = self._Path(number)
    for name in [path + '.index'] + sorted(tf.io.gfile.glob(path + '.data-*')):
      if tf.io.gfile.exists(name):
        tf.io.gfile.remove(name)

  def _WriteState(self):
    """Writes the state file atomically (a temp file, then a rename)."""
    if not self._kept:
      return
    names = [f'{PREFIX}-{n}' for n in self._kept]
    text = f'model_checkpoint_path: "{names[-1]}"\n' + ''.join(
        f'all_model_checkpoint_paths: "{n}"\n' for n in names)
    state = os.path.join(self.directory, STATE_FILE)
    if tf.io.gfile.exists(state):
      with tf.io.gfile.GFile(state, 'rb') as f:
        if f.read() == text.encode():
          return
    tmp = f'{state}.tmp{uuid.uuid4().hex}'
    try:
      with tf.io.gfile.GFile(tmp, 'w') as f:
        f.write(text)
      tf.io.gfile.rename(tmp, state, overwrite=True)
    except (tf.errors.OpError, OSError) as e:
      # The checkpoints are all there; a restore does not need this file.
      raise self._WriteError(state, e) from None
