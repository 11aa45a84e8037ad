"""A logdir's params.txt: what trained it, compared before a run resumes it.

A checkpoint holds values, not the config that gave them meaning: the same
variable shapes fit a 4-head and a 2-head attention, and a changed learning
rate or seed restores without a word. So the trainer compares the new run's
params with the logdir's params.txt BEFORE it writes anything, and only
after the checkpoint restored does it write the new params.txt.

Two kinds of difference:
* Execution params change how a run executes, never what it computes. They
  are accepted, with one line listing them:
  - the pipeline's layout and issue order (LAYOUT_PARAMS: K, balance,
    schedule, remat, executor, devices); a test trains each changed field
    and compares the losses;
  - how each batch is split (BATCH_SPLIT_PARAMS: M, micro-batch size,
    replicas), whose micro-batch losses and gradients are weighted back into
    the batch's exactly. Not for a model with batch norm, which normalizes
    each micro-batch with that micro-batch's statistics: there the split
    changes training, and the caller says so (`batch_split_is_exact`);
  - the run's length and logging (RUN_PARAMS).
* Everything else (model, optimizer, seeds, the pipeline's random_seed and
  batch_dim, input, --model itself, and any pipeline field not listed) would
  resume a different experiment from these weights. It is refused with the
  diff, unless --allow_params_change asks for it; the old params.txt is then
  kept as params.before_step_<N>.txt.

The same holds when params.txt cannot tell: checkpoints without a
params.txt, or a params.txt that does not read as params, are refused
unless --allow_params_change. A logdir with a params.txt but no checkpoint
has trained nothing to protect (a first run that stopped early): a
corrected run is accepted there, saying so.
"""

import ast
import os
import re

PARAMS_FILE = 'params.txt'

_PIPELINE = 'task.pipeline.'
LAYOUT_PARAMS = frozenset(_PIPELINE + name for name in (
    'num_partitions', 'balance', 'schedule', 'remat_policy', 'executor',
    'compile_step', 'devices', 'round_robin_placement', 'name', 'cell_tpl'))
BATCH_SPLIT_PARAMS = frozenset(_PIPELINE + name for name in (
    'num_micro_batches', 'micro_batch_size', 'num_replicas'))
RUN_PARAMS = frozenset({
    'task.train.max_steps', 'task.train.save_interval_steps',
    'task.train.log_interval_steps', 'task.train.timeline_step',
    'task.train.max_checkpoints_to_keep', 'task.eval.interval_steps',
    'task.eval.num_batches'})

ALLOW_FLAG = '--allow_params_change'


class ParamsChangedError(Exception):
  """The run's params would change the model or training of a logdir."""


class ParamsWriteError(Exception):
  """params.txt could not be written (a full disk, a read-only logdir)."""


def IsExecutionParam(key, batch_split_is_exact=True):
  """True for params that change how a run executes, not what it computes.

  Args:
    key: a dotted param name.
    batch_split_is_exact: False for a model whose layers normalize over the
      micro-batch (batch norm), for which BATCH_SPLIT_PARAMS change training.
  """
  return (key in LAYOUT_PARAMS or key in RUN_PARAMS or
          (batch_split_is_exact and key in BATCH_SPLIT_PARAMS))


def IsLayoutParam(key):
  """True for the pipeline params that say how the model is laid out."""
  return key in LAYOUT_PARAMS or key in BATCH_SPLIT_PARAMS


def ParseParamsText(text):
  """{dotted name: value text} of `Params.ToText()` output."""
  values = {}
  for line in text.splitlines():
    key, sep, value = line.partition(' : ')
    if sep:
      values[key.strip()] = value.strip()
  return values


def UnreadableReason(data):
  """Why the bytes of a params.txt are not `Params.ToText()` output, or None."""
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as e:
    return f'byte {e.start} is not UTF-8 text'
  lines = text.splitlines()
  if not any(line.strip() for line in lines):
    return 'it is empty'
  for number, line in enumerate(lines, 1):
    key, sep, value = line.partition(' : ')
    if line.strip() and not (sep and _KEY_RE.match(key.strip()) and
                             _IsValueText(value.strip())):
      shown = line if len(line) <= 60 else line[:57] + '...'
      return f'line {number} does not read as "name : value": {shown!r}'
  return None


# What `Params.ToText` writes: a dotted name (list items indexed), then a
# Python literal, or a name (a class, an enum, nan) or a call-like repr.
_KEY_RE = re.compile(r'^[A-Za-z_]\w*(\[\d+\])?(\.[A-Za-z_]\w*(\[\d+\])?)*$')
_NAME_VALUE_RE = re.compile(r'^-?[A-Za-z_][\w.]*(\(.*\))?$')


def _IsValueText(text):
  if _NAME_VALUE_RE.match(text):
    return True
  try:
    ast.literal_eval(text)
  except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
    return False
  return True


def Differences(old_text, new_text):
  """[(key, old value text or None, new value text or None)], sorted."""
  old, new = ParseParamsText(old_text), ParseParamsText(new_text)
  return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
          if old.get(k) != new.get(k)]


def DiffText(differences):
  """The differences in `Params.TextDiff` form: '- old' then '+ new' lines."""
  lines = []
  for key, old, new in differences:
    if old is not None:
      lines.append(f'- {key} : {old}')
    if new is not None:
      lines.append(f'+ {key} : {new}')
  return '\n'.join(lines)


def _Path(logdir, name=PARAMS_FILE):
  return os.path.join(logdir, name)


def ReadParamsBytes(logdir):
  """The bytes of the logdir's params.txt, or None if it has none."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  path = _Path(logdir)
  if not tf.io.gfile.exists(path):
    return None
  with tf.io.gfile.GFile(path, 'rb') as f:
    return f.read()


def ReadParamsText(logdir):
  """The logdir's params.txt as text, or None if it has none."""
  data = ReadParamsBytes(logdir)
  return None if data is None else data.decode('utf-8', 'replace')


class Comparison:
  """How a run's params differ from those that trained its logdir.

  Attributes:
    execution: differences in execution params (accepted).
    training: differences that change the model or training.
    has_params_file: whether the logdir had a params.txt.
    unreadable: why its params.txt does not read as params, or None.
    batch_split_is_exact: see IsExecutionParam.
  """

  def __init__(self, old_data, new_text, batch_split_is_exact=True):
    self.has_params_file = old_data is not None
    self.unreadable = None if old_data is None else UnreadableReason(old_data)
    self.batch_split_is_exact = batch_split_is_exact
    diffs = []
    if self.has_params_file and not self.unreadable:
      diffs = Differences(old_data.decode('utf-8'), new_text)
    self.execution = [d for d in diffs
                      if IsExecutionParam(d[0], batch_split_is_exact)]
    self.training = [d for d in diffs
                     if not IsExecutionParam(d[0], batch_split_is_exact)]

  @property
  def replaces_file(self):
    """Whether writing this run's params replaces a file worth keeping."""
    return bool(self.training or self.unreadable)

  def ExecutionLine(self):
    """One line naming the accepted execution changes, or None."""
    if not self.execution:
      return None
    return ('params.txt differs only in how the run executes (training is '
            'unchanged): ' + ', '.join(
                f'{k} {o} -> {n}' for k, o, n in self.execution) + '.')

  def Problem(self, logdir, has_checkpoints=True):
    """Why the params.txt does not vouch for this run's params, or None."""
    path = _Path(logdir)
    if self.unreadable:
      return f'{path} is unreadable ({self.unreadable})' + (
          ', so nothing tells which params trained its checkpoints.'
          if has_checkpoints else '.')
    if not self.has_params_file:
      return (f'--logdir={logdir} has checkpoints but no {PARAMS_FILE}, so '
              'nothing tells which params trained them.')
    if self.training:
      split = [k for k, _, _ in self.training if k in BATCH_SPLIT_PARAMS]
      why = (f' ({", ".join(split)}: this model has batch norm, which '
             'normalizes each micro-batch with its own statistics, so how '
             'the batch is split changes training.)' if split else '')
      what = (f'--logdir={logdir} was trained with other params; these '
              'differences' if has_checkpoints else
              f'{path} differs from this run\'s params; the differences')
      return (f'{what} change the model or the training (- its params.txt, '
              f'+ this run):\n{DiffText(self.training)}{why}')
    return None


def CheckParams(logdir, params, allow_change=False, log=print,
                has_checkpoints=True, batch_split_is_exact=True):
  """Compares `params` with the logdir's params.txt; writes nothing.

  Args:
    logdir: the run's logdir.
    params: the run's experiment params.
    allow_change: accept differences that change the model or training, a
      missing params.txt and an unreadable one.
    log: prints a line.
    has_checkpoints: whether the logdir holds checkpoints. Without any, a
      params.txt has nothing to protect and this run's params replace it.
    batch_split_is_exact: see IsExecutionParam.

  Returns:
    The Comparison.

  Raises:
    ParamsChangedError: the params.txt does not vouch for `params`, there
      are checkpoints, and not `allow_change`.
  """
  comparison = Comparison(ReadParamsBytes(logdir), params.ToText(),
                          batch_split_is_exact)
  if not comparison.has_params_file and not has_checkpoints:
    return comparison  # A new logdir.
  problem = comparison.Problem(logdir, has_checkpoints)
  if problem is None:
    line = comparison.ExecutionLine()
    if line:
      log(line)
    return comparison
  if not has_checkpoints:
    log(f'{problem}\n{logdir} has no checkpoint yet, so nothing was trained '
        f'with that {PARAMS_FILE}: this run starts from step 0 with its own '
        f'params (the old {PARAMS_FILE} is kept as params.before_step_0.txt).')
  elif allow_change:
    log(f'{ALLOW_FLAG}: resuming with this run\'s params. {problem}')
  else:
    raise ParamsChangedError(
        f'{problem}\nRun with the params of its {PARAMS_FILE}, give a new '
        f'--logdir, or pass {ALLOW_FLAG} to resume it with this run\'s params '
        'on purpose.')
  return comparison


def WriteParams(logdir, params, comparison=None, step=0):
  """Writes params.txt atomically; keeps a replaced training config.

  Args:
    logdir: the run's logdir.
    params: the run's experiment params.
    comparison: the Comparison from CheckParams, if any.
    step: the step the run starts at, which names a kept old params.txt.

  Raises:
    ParamsWriteError: naming the file and the system's reason; the old
      params.txt, if any, is unchanged.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from tfpipe.trainer import checkpoint_keeper  # pylint: disable=g-import-not-at-top
  tmp = _Path(logdir, PARAMS_FILE + '.tmp')
  try:
    if (comparison is not None and comparison.replaces_file and
        tf.io.gfile.exists(_Path(logdir))):
      tf.io.gfile.copy(_Path(logdir), _Path(
          logdir, f'params.before_step_{step}.txt'), overwrite=True)
    with tf.io.gfile.GFile(tmp, 'w') as f:
      f.write(params.ToText())
    tf.io.gfile.rename(tmp, _Path(logdir), overwrite=True)
  except (tf.errors.OpError, OSError) as e:
    raise ParamsWriteError(
        f'Cannot write {_Path(logdir)}: '
        f'{checkpoint_keeper.WriteErrorReason(e)}. Free space in (or make '
        f'writable) {logdir} and restart.') from None
