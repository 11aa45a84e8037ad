"""Tests of tfpipe.trainer.params_file: params.txt is compared before writing.

Protected properties: differences in how a run executes (pipeline layout,
batch split, run length, logging) are accepted with one line naming them,
and each such pipeline field, changed, trains to the same losses; the batch
split is refused for a model with batch norm, for which it changes the
losses; any other difference (model, optimizer, seeds, the pipeline's
random_seed and batch_dim, input, the model name) is refused with the diff
and the flag that accepts it, and nothing is written; so are checkpoints
without a params.txt, and a params.txt that does not read as params; a
params.txt without checkpoints gives way to a corrected run, saying so; an
accepted change keeps the replaced params.txt.
"""

import os

import numpy as np
import pytest

from models import conv_classifier
from models import mlp
from tfpipe import model_registry
from tfpipe.trainer import input_generator
from tfpipe.trainer import params_file
from tfpipe.trainer import task as task_lib


def _Params(**overrides):
  p = model_registry.GetParams('mlp.TinyMlp')
  return p.Set(**overrides)


def _Write(logdir, p):
  (logdir / params_file.PARAMS_FILE).write_text(p.ToText())


@pytest.mark.parametrize('key', [
    'task.pipeline.num_partitions', 'task.pipeline.num_micro_batches',
    'task.pipeline.schedule', 'task.pipeline.remat_policy',
    'task.pipeline.executor', 'task.pipeline.balance',
    'task.pipeline.devices', 'task.pipeline.num_replicas',
    'task.train.max_steps', 'task.train.save_interval_steps',
    'task.train.log_interval_steps', 'task.train.timeline_step',
    'task.eval.interval_steps'])
def test_execution_params_are_accepted(key):
  assert params_file.IsExecutionParam(key)


@pytest.mark.parametrize('key', [
    'model', 'task.model.hidden_dim', 'task.train.learning_rate',
    'task.train.optimizer.type', 'task.random_seed', 'input.seed',
    'input.batch_size', 'input.cls', 'task.train.clip_gradient_norm',
    'task.pipeline.random_seed', 'task.pipeline.batch_dim',
    'task.pipeline.dtype', 'task.pipeline.a_field_added_later'])
def test_training_params_are_not(key):
  # The pipeline's random_seed (dropout masks) and batch_dim (what is split)
  # used to be accepted with every task.pipeline.* field.
  assert not params_file.IsExecutionParam(key)


def test_the_batch_split_changes_training_where_batch_norm_sees_it():
  for key in params_file.BATCH_SPLIT_PARAMS:
    assert params_file.IsExecutionParam(key)
    assert not params_file.IsExecutionParam(key, batch_split_is_exact=False)
    assert params_file.IsLayoutParam(key)


# ---- what each pipeline field accepted as execution-only computes ------------

# Changed values of every field of LAYOUT_PARAMS and BATCH_SPLIT_PARAMS (but
# cell_tpl, which the task sets), several per run to keep the test short.
_EXECUTION_CHANGES = [
    dict(num_partitions=3, balance='params', schedule='1f1b',
         remat_policy='never', executor='threads', name='pipeline',
         devices=['/CPU:5', '/CPU:4', '/CPU:3', '/CPU:2', '/CPU:1', '/CPU:0'],
         num_micro_batches=2, num_replicas=2),
    dict(compile_step=False, round_robin_placement=True, micro_batch_size=8,
         devices=['/CPU:1'])]


def _FirstStep(model_p, batch_p, **pipeline):
  """(loss, grad_norm) of one training step of a fresh task; whether the
  task's batch split changes training."""
  p = task_lib.BaseTask.Params()
  p.model = model_p
  p.pipeline.Set(num_partitions=2, num_micro_batches=4)
  p.pipeline.Set(**pipeline)
  task = p.Instantiate()
  batch = next(iter(batch_p.Instantiate().GetDataset(0)))
  out = task.TrainStep(batch)
  return (np.array([float(out['loss']), float(out['grad_norm'])]),
          task.BatchSplitChangesTraining())


def _Mlp():
  return (mlp.Mlp.Params().Set(input_dim=8, hidden_dim=16, num_hidden_layers=3,
                               num_classes=3, dropout_prob=0.2),
          input_generator.SyntheticClassificationInput.Params().Set(
              batch_size=16, input_dim=8, num_classes=3, seed=3))


def test_every_execution_only_pipeline_field_trains_the_same():
  changed_fields = set().union(*_EXECUTION_CHANGES)
  assert changed_fields == {
      k[len('task.pipeline.'):] for k in
      params_file.LAYOUT_PARAMS | params_file.BATCH_SPLIT_PARAMS} - {'cell_tpl'}
  reference, split_matters = _FirstStep(*_Mlp())
  assert not split_matters
  for changes in _EXECUTION_CHANGES:
    changed, _ = _FirstStep(*_Mlp(), **changes)
    np.testing.assert_allclose(changed, reference, rtol=1e-5,
                               err_msg=str(changes))
  # The pipeline's seed draws the dropout masks: it changes training.
  seeded, _ = _FirstStep(*_Mlp(), random_seed=7)
  assert abs(seeded[0] - reference[0]) > 1e-4


def test_the_batch_split_changes_the_losses_of_a_model_with_batch_norm():
  model = conv_classifier.ConvClassifier.Params().Set(
      image_size=8, num_classes=3, base_width=4, blocks_per_stage=[1])
  data = input_generator.SyntheticImageInput.Params().Set(
      batch_size=16, image_size=8, num_classes=3, seed=1)
  reference, split_matters = _FirstStep(model, data)
  assert split_matters
  changed, _ = _FirstStep(model, data, num_micro_batches=2)
  assert abs(changed[0] - reference[0]) > 1e-4


# ---- comparing with the logdir's params.txt ----------------------------------


def test_layout_and_length_changes_pass_with_one_line(tmp_path):
  _Write(tmp_path, _Params())
  new = _Params(**{'task.pipeline.num_partitions': 1,
                   'task.pipeline.balance': [2, 3],
                   'task.train.max_steps': 600})
  logs = []
  comparison = params_file.CheckParams(str(tmp_path), new, log=logs.append)
  assert not comparison.training and len(comparison.execution) == 3
  assert logs == [
      'params.txt differs only in how the run executes (training is '
      "unchanged): task.pipeline.balance 'flops' -> [2, 3], "
      'task.pipeline.num_partitions 2 -> 1, task.train.max_steps 300 -> 600.']


def test_model_and_training_changes_are_refused_with_the_diff(tmp_path):
  old = _Params()
  _Write(tmp_path, old)
  new = _Params(**{'task.model.dropout_prob': 0.5, 'task.random_seed': 9,
                   'task.train.max_steps': 600})
  with pytest.raises(params_file.ParamsChangedError) as e:
    params_file.CheckParams(str(tmp_path), new, log=lambda _: None)
  message = str(e.value)
  # The diff is the one Params.TextDiff gives for the training params.
  want = ''.join(line + '\n' for line in old.TextDiff(new).splitlines()
                 if 'max_steps' not in line)
  assert want in message + '\n'
  assert '--allow_params_change' in message and str(tmp_path) in message
  assert (tmp_path / 'params.txt').read_text() == old.ToText()


def test_every_registered_models_params_txt_reads_as_params():
  for name in model_registry.ListModels():
    text = model_registry.GetParams(name).ToText()
    assert params_file.UnreadableReason(text.encode()) is None, name
  odd = _Params(**{'task.train.learning_rate': float('nan'),
                   'task.train.clip_gradient_norm': float('-inf')})
  assert params_file.UnreadableReason(odd.ToText().encode()) is None


def test_another_model_is_refused(tmp_path):
  _Write(tmp_path, _Params())
  other = model_registry.GetParams('lm.TinyTransformerLm')
  with pytest.raises(params_file.ParamsChangedError,
                     match="- model : 'mlp.TinyMlp'\n\\+ model : "
                     "'lm.TinyTransformerLm'"):
    params_file.CheckParams(str(tmp_path), other, log=lambda _: None)


def test_allowed_change_keeps_the_replaced_params(tmp_path):
  old = _Params()
  _Write(tmp_path, old)
  new = _Params(**{'task.train.learning_rate': 0.1})
  logs = []
  comparison = params_file.CheckParams(str(tmp_path), new, allow_change=True,
                                       log=logs.append)
  assert logs[0].startswith('--allow_params_change: resuming')
  params_file.WriteParams(str(tmp_path), new, comparison, step=40)
  assert (tmp_path / 'params.txt').read_text() == new.ToText()
  assert (tmp_path / 'params.before_step_40.txt').read_text() == old.ToText()


def test_a_new_logdir_has_nothing_to_compare(tmp_path):
  logs = []
  comparison = params_file.CheckParams(str(tmp_path), _Params(),
                                       log=logs.append, has_checkpoints=False)
  assert not comparison.has_params_file and not comparison.training
  assert not logs
  params_file.WriteParams(str(tmp_path), _Params(), comparison)
  assert params_file.ReadParamsText(str(tmp_path)) == _Params().ToText()
  assert os.listdir(tmp_path) == ['params.txt']


def test_checkpoints_without_params_txt_are_refused_unless_allowed(tmp_path):
  # A deleted params.txt let a 2-head model train on a 4-head checkpoint.
  with pytest.raises(params_file.ParamsChangedError) as e:
    params_file.CheckParams(str(tmp_path), _Params(), log=lambda _: None)
  assert str(e.value).startswith(
      f'--logdir={tmp_path} has checkpoints but no params.txt, so nothing '
      'tells which params trained them.\n')
  assert '--allow_params_change' in str(e.value)
  logs = []
  params_file.CheckParams(str(tmp_path), _Params(), allow_change=True,
                          log=logs.append)
  assert logs[0].startswith('--allow_params_change: resuming with this run')


@pytest.mark.parametrize('content, why', [
    (b'\x89\xfe\x00garbage\xff' * 20, 'byte 0 is not UTF-8 text'),
    (b'', 'it is empty'),
    (b'task.train.max_steps : 300\nthis line was overwritten\n',
     'line 2 does not read as "name : value"'),
    (b"model : 'mlp.TinyMlp'\ninput.seed : 100003!!x##\n",
     'line 2 does not read as "name : value"'),
    (b"model : 'mlp.TinyMlp'\ninput.file_pattern : '/data/tr", 'line 2')],
                         ids=['random-bytes', 'empty', 'garbled', 'bad-value',
                              'truncated'])
def test_an_unreadable_params_txt_is_named_as_such(tmp_path, content, why):
  # It was refused as "differs only in how the run executes", or raised a
  # UnicodeDecodeError.
  (tmp_path / 'params.txt').write_bytes(content)
  logs = []
  with pytest.raises(params_file.ParamsChangedError) as e:
    params_file.CheckParams(str(tmp_path), _Params(), log=logs.append)
  assert str(e.value).startswith(f'{tmp_path}/params.txt is unreadable ({why}')
  assert not logs  # No "differs only in how the run executes" line.
  comparison = params_file.CheckParams(str(tmp_path), _Params(),
                                       allow_change=True, log=logs.append)
  params_file.WriteParams(str(tmp_path), _Params(), comparison, step=8)
  assert (tmp_path / 'params.before_step_8.txt').read_bytes() == content


def test_params_txt_without_checkpoints_gives_way_to_a_corrected_run(tmp_path):
  # A first run that stopped before its first checkpoint left params.txt;
  # the corrected rerun was refused as "trained with other params".
  old = _Params()
  _Write(tmp_path, old)
  new = _Params(**{'task.model.hidden_dim': 8})
  logs = []
  comparison = params_file.CheckParams(str(tmp_path), new, log=logs.append,
                                       has_checkpoints=False)
  assert len(logs) == 1 and logs[0].startswith(
      f"{tmp_path}/params.txt differs from this run's params; the differences "
      'change the model or the training')
  assert logs[0].endswith(
      f'{tmp_path} has no checkpoint yet, so nothing was trained with that '
      'params.txt: this run starts from step 0 with its own params (the old '
      'params.txt is kept as params.before_step_0.txt).')
  assert '- task.model.hidden_dim : 32\n+ task.model.hidden_dim : 8' in logs[0]
  params_file.WriteParams(str(tmp_path), new, comparison)
  assert (tmp_path / 'params.txt').read_text() == new.ToText()
  assert (tmp_path / 'params.before_step_0.txt').read_text() == old.ToText()


def test_a_batch_norm_model_is_told_why_its_split_is_refused(tmp_path):
  _Write(tmp_path, _Params())
  new = _Params(**{'task.pipeline.num_micro_batches': 2})
  with pytest.raises(params_file.ParamsChangedError,
                     match=r'task.pipeline.num_micro_batches: this model has '
                     'batch norm, which normalizes each micro-batch'):
    params_file.CheckParams(str(tmp_path), new, log=lambda _: None,
                            batch_split_is_exact=False)


def test_a_params_txt_that_cannot_be_written_is_one_line(tmp_path):
  gone = tmp_path / 'removed_logdir'
  with pytest.raises(params_file.ParamsWriteError) as e:
    params_file.WriteParams(str(gone), _Params())
  assert str(e.value).startswith(f'Cannot write {gone}/params.txt: ')
  assert '\n' not in str(e.value) and 'restart' in str(e.value)
