"""Tests of the README's params tables (tfpipe.trainer.params_doc).

Protected properties: README.md holds exactly the tables the Define docs
give today (this is the test that fails when a Define changes and the
README does not: run `python -m tfpipe.trainer.params_doc`); every param
of task.train, task.eval and task.pipeline has a row with its default and
its sentence; rewriting touches only the generated block.
"""
# bazel: data=//:README.md

import pytest

from tfpipe.trainer import params_doc
from tfpipe.trainer import task as task_lib


def test_readme_tables_are_up_to_date():
  with open(params_doc.README) as f:
    text = f.read()
  assert params_doc.Rewrite(text) == text, (
      'README.md\'s params tables are stale: run '
      '`python -m tfpipe.trainer.params_doc` and commit README.md.')


def test_every_param_has_a_row_with_its_default_and_sentence():
  tables = params_doc.Tables()
  task = task_lib.BaseTask.Params()
  for group in ('train', 'eval', 'pipeline'):
    for key, _, doc in task.Get(group).Leaves(f'task.{group}.'):
      if not key.endswith('.cls'):
        assert f'| `{key}` | ' in tables, key
        assert doc and doc in tables, key
  assert ('| `task.train.learning_rate` | `0.001` | Peak learning rate, '
          'scaled by lr_schedule. |') in tables
  assert '| `input.file_pattern` | `\'\'` | Glob of the data files' in tables
  assert '| `input.batch_size` | `32` | Number of examples' in tables


def test_rewrite_replaces_only_the_generated_block():
  text = (f'# Title\n\nbefore\n\n{params_doc.BEGIN}\n| stale | row |\n'
          f'{params_doc.END}\n\nafter\n')
  new = params_doc.Rewrite(text)
  assert new.startswith(f'# Title\n\nbefore\n\n{params_doc.BEGIN}\n\n**')
  assert new.endswith(f'|\n\n{params_doc.END}\n\nafter\n')
  assert '| stale | row |' not in new
  assert params_doc.Rewrite(new) == new
  with pytest.raises(ValueError, match='has no'):
    params_doc.Rewrite('no tables here')
