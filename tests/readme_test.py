"""The README's code runs, so that it cannot go stale.

* Every ```python block runs, in order, in one namespace, in a fresh
  directory on `sys.path`, as a reader would paste them. A block whose first
  line is a file name (`# my_project/layers.py`) is written to that file
  instead, which later blocks and the trainer import.
* Every ``` block of `>>>` examples runs as a doctest.
* The tutorial's trainer commands (`python -m tfpipe.trainer
  --model=my_project...`) run from that directory on the files the blocks
  wrote: the training run in a fresh process, as a user would start it, on
  an experiment outside tfpipe named by its import path; the others in
  this process.

A Python block that cannot run here is listed in NOT_RUN with the reason,
where a reviewer sees it; a listed block missing from the README fails too.
Other shell blocks (installs, long runs, other hosts) are not run.
"""
# bazel: data=//:README.md
# bazel: deps=//params,//tfpipe/trainer:__main__

import contextlib
import doctest
import os
import re
import shlex
import subprocess
import sys

import pytest

from tests import quiet_test
from tfpipe.trainer import trainer

ROOT = quiet_test.ROOT
README = os.path.join(ROOT, 'README.md')

# First line of each Python block that is not run, and why.
NOT_RUN = {
    'import tfpipe': 'a fragment of a Keras workflow: `model` and `dataset` '
                     'are the reader\'s own model and data.',
}
_FILE_LINE = re.compile(r'# ([\w/]+\.py)$')
_TUTORIAL_COMMAND = 'python -m tfpipe.trainer --model=my_project.'


def Blocks(text):
  """(info string, code, line number) of each fenced block of `text`."""
  blocks = []
  for m in re.finditer(r'^```(\w*)\n(.*?)^```$', text, re.M | re.S):
    blocks.append((m.group(1), m.group(2),
                   text.count('\n', 0, m.start()) + 1))
  return blocks


@contextlib.contextmanager
def _InDirectory(path):
  old_cwd = os.getcwd()
  sys.path.insert(0, str(path))
  os.chdir(path)
  try:
    yield
  finally:
    os.chdir(old_cwd)
    sys.path.remove(str(path))


@pytest.fixture(name='readme', scope='module')
def fixture_readme():
  with open(README) as f:
    return f.read()


@pytest.fixture(name='workdir', scope='module')
def fixture_workdir(readme, tmp_path_factory):
  """A directory where every Python block of the README has run."""
  workdir = tmp_path_factory.mktemp('reader')
  namespace = {'__name__': '__readme__'}
  with _InDirectory(workdir):
    try:
      for info, code, line in Blocks(readme):
        first = code.splitlines()[0] if code else ''
        if info != 'python' or first in NOT_RUN:
          continue
        m = _FILE_LINE.match(first)
        if m:
          path = workdir / m.group(1)
          path.parent.mkdir(parents=True, exist_ok=True)
          for parent in path.relative_to(workdir).parents:
            if str(parent) != '.':
              (workdir / parent / '__init__.py').touch()
          path.write_text(code)
          continue
        try:
          exec(compile(code, f'README.md:{line}', 'exec'), namespace)  # pylint: disable=exec-used
        except Exception as e:
          raise AssertionError(
              f'The Python block at README.md:{line} fails: '
              f'{type(e).__name__}: {e}') from e
    finally:
      for name in [n for n in sys.modules if n.split('.')[0] == 'my_project']:
        del sys.modules[name]
  return workdir


def test_every_python_block_runs_and_the_skipped_ones_are_reviewed(readme,
                                                                 workdir):
  firsts = [code.splitlines()[0] for info, code, _ in Blocks(readme)
            if info == 'python' and code]
  assert set(NOT_RUN) <= set(firsts), sorted(set(NOT_RUN) - set(firsts))
  for name in ('layers', 'model', 'experiments'):
    assert (workdir / 'my_project' / f'{name}.py').exists(), name
  assert sorted(os.listdir(workdir / 'data')) == [
      'eval-00000.tfrecord', 'train-00000.tfrecord']


def test_doctest_examples(readme):
  parser = doctest.DocTestParser()
  runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
  examples = 0
  session = {}  # One session: a later block uses an earlier one's imports.
  for info, code, line in Blocks(readme):
    if info or '>>> ' not in code:
      continue
    test = parser.get_doctest(code, session, f'README.md:{line}', README,
                              line)
    examples += len(test.examples)
    runner.run(test, clear_globs=False)
    session.update(test.globs)
  assert examples >= 3
  assert runner.summarize(verbose=False).failed == 0


def _TutorialCommands(readme, logdir):
  """The tutorial's trainer commands, as argument lists, in a fresh logdir."""
  commands = []
  for info, code, _ in Blocks(readme):
    for command in code.splitlines():
      if not info and command.startswith(_TUTORIAL_COMMAND):
        args = shlex.split(command)[3:]
        commands.append([re.sub(r'^--logdir=.*', f'--logdir={logdir}', a)
                         for a in args])
  return commands


def test_tutorial_trains_its_own_package_with_the_trainer(readme, workdir):
  logdir = workdir / 'run'
  commands = _TutorialCommands(readme, logdir)
  modes = [next((a for a in c if a.startswith('--mode=')), '--mode=train')
           for c in commands]
  assert modes == ['--mode=inspect_model', '--mode=train', '--mode=eval']
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL='3')
  train = subprocess.run(
      [sys.executable, '-m', 'tfpipe.trainer', *commands[1]], cwd=workdir,
      env=env, capture_output=True, text=True, timeout=600, check=False)
  assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
  final = train.stdout.strip().splitlines()[-1]
  m = re.match(r'Final: step=60 .*eval: accuracy=(\S+)', final)
  assert m, train.stdout[-2000:]
  assert float(m.group(1)) >= 0.8, final  # The README says about 0.9.
  with _InDirectory(workdir):
    try:
      for args in (commands[0], commands[2]):
        trainer.FLAGS.unparse_flags()
        trainer.FLAGS(['tfpipe-train', *args, '--nodeterministic'])
        assert trainer.main(['tfpipe-train']) == 0
    finally:
      trainer.FLAGS.unparse_flags()
      for name in [n for n in sys.modules if n.split('.')[0] == 'my_project']:
        del sys.modules[name]
