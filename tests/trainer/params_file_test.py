"""Tests of tfpipe.trainer.params_file: params.txt is compared before writing.

Protected properties: differences in how a run executes (pipeline layout,
run length, logging) are accepted with one line naming them; any other
difference (model, optimizer, seeds, input, the model name) is refused with
the diff and the flag that accepts it, and nothing is written; an accepted
change keeps the replaced params.txt.
"""

import pytest

from tfpipe import model_registry
from tfpipe.trainer import params_file


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
    'input.batch_size', 'input.cls', 'task.train.clip_gradient_norm'])
def test_training_params_are_not(key):
  assert not params_file.IsExecutionParam(key)


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


def test_a_logdir_without_params_txt_has_nothing_to_compare(tmp_path):
  comparison = params_file.CheckParams(str(tmp_path), _Params(),
                                       log=lambda _: None)
  assert not comparison.has_params_file and not comparison.training
  params_file.WriteParams(str(tmp_path), _Params(), comparison)
  assert params_file.ReadParamsText(str(tmp_path)) == _Params().ToText()
