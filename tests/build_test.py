"""Keeps the Bazel BUILD file honest as the tree grows.

Runs without Bazel: it parses BUILD as text. If it fails, regenerate with

    python tools/build_targets.py

and commit BUILD together with the new or changed files.
"""

import ast
import importlib.util
import os
import re

import pytest

# Under `bazel test` this file is a runfiles symlink; the real tree is where
# it points.
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
BUILD_PATH = os.path.join(ROOT, 'BUILD')
GENERATOR_PATH = os.path.join(ROOT, 'tools', 'build_targets.py')
REGENERATE = 'Run `python tools/build_targets.py` and commit BUILD.'

_RULE_RE = re.compile(r'^(py_library|py_test|py_binary)\(\n(.*?)^\)',
                      re.M | re.S)


def _LoadGenerator():
  spec = importlib.util.spec_from_file_location('build_targets',
                                                GENERATOR_PATH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _ParseBuild(text):
  """[(kind, {attr: value})] for every py_* rule in BUILD."""
  rules = []
  for m in _RULE_RE.finditer(text):
    call = ast.parse(f'f(\n{m.group(2)})', mode='eval').body
    attrs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    rules.append((m.group(1), attrs))
  return rules


@pytest.fixture(scope='module')
def build_text():
  if not os.path.exists(BUILD_PATH):
    pytest.fail(f'No BUILD file at {BUILD_PATH}. {REGENERATE}')
  with open(BUILD_PATH, encoding='utf-8') as f:
    return f.read()


@pytest.fixture(scope='module')
def rules(build_text):
  return _ParseBuild(build_text)


@pytest.fixture(scope='module')
def generator():
  return _LoadGenerator()


@pytest.fixture(scope='module')
def tree(generator):
  return generator.Tree(ROOT)


def test_build_parses_into_python_rules(rules):
  assert rules, 'BUILD has no py_library/py_test/py_binary rules.'
  for kind, attrs in rules:
    assert 'name' in attrs, f'A {kind} in BUILD has no name.'


def test_target_names_are_unique(rules):
  names = [attrs['name'] for _, attrs in rules]
  dupes = sorted({n for n in names if names.count(n) > 1})
  assert not dupes, f'Duplicate BUILD target names: {dupes}. {REGENERATE}'


def test_every_module_has_a_py_library(rules, tree):
  covered = set()
  for kind, attrs in rules:
    if kind == 'py_library':
      covered.update(attrs.get('srcs', []))
  missing = [p for p in tree.library_files if p not in covered]
  assert not missing, (
      'These modules are not in any py_library in BUILD:\n  ' +
      '\n  '.join(missing) + f'\n{REGENERATE}')


def test_every_test_file_has_a_py_test(rules, tree):
  covered = set()
  for kind, attrs in rules:
    if kind == 'py_test':
      covered.update(attrs.get('args', []))
      covered.update(s for s in attrs.get('srcs', [])
                     if s.endswith('_test.py'))
  missing = [p for p in tree.test_files if p not in covered]
  assert not missing, (
      'These test files have no py_test in BUILD:\n  ' + '\n  '.join(missing) +
      f'\n{REGENERATE}')


def test_build_names_only_existing_files(rules):
  gone = set()
  for _, attrs in rules:
    for attr in ('srcs', 'data'):
      for src in attrs.get(attr, []):
        if not os.path.exists(os.path.join(ROOT, src)):
          gone.add(src)
  assert not gone, ('BUILD names files that do not exist:\n  ' +
                    '\n  '.join(sorted(gone)) + f'\n{REGENERATE}')


def test_trainer_binary_when_trainer_exists(rules, tree, generator):
  binaries = {attrs['name']: attrs for kind, attrs in rules
              if kind == 'py_binary'}
  if not tree.has_trainer:
    pytest.skip(f'{generator.TRAINER} does not exist yet.')
  assert 'trainer' in binaries, f'No py_binary //:trainer. {REGENERATE}'
  assert binaries['trainer']['main'] == generator.TRAINER


def test_build_is_up_to_date(build_text, generator):
  """Deps follow imports: a stale BUILD gives Bazel-only ImportErrors."""
  expected = generator.Generate(ROOT)
  if build_text != expected:
    import difflib  # pylint: disable=g-import-not-at-top
    diff = ''.join(difflib.unified_diff(
        build_text.splitlines(True), expected.splitlines(True),
        'BUILD (committed)', 'BUILD (generated)', n=1))
    pytest.fail(f'BUILD is stale. {REGENERATE}\n{diff[:4000]}')


def test_generator_is_deterministic(generator):
  assert generator.Generate(ROOT) == generator.Generate(ROOT)


def test_generator_on_a_small_tree(tmp_path, generator):
  files = {
      'tfpipe/__init__.py': '',
      'tfpipe/a.py': 'import numpy\n',
      'tfpipe/sub/__init__.py': 'from tfpipe.sub.b import *\n',
      'tfpipe/sub/b.py': 'from .. import a\nfrom tfpipe.sub import c\n',
      'tfpipe/sub/c.py': 'def f():\n  import tfpipe.a\n',
      'models/m.py': 'from tfpipe.sub import b\n',
      'tests/__init__.py': '',
      'tests/conftest.py': '',
      'tests/bazel_pytest_main.py': '',
      'tests/sub/b_test.py': '# bazel: size=large\nfrom tfpipe.sub import b\n',
      'tfpipe/trainer/trainer.py': 'from tfpipe import a\n',
  }
  for path, text in files.items():
    full = tmp_path / path
    full.parent.mkdir(parents=True, exist_ok=True)
    full.write_text(text)
  by_name = {a['name']: (k, a)
             for k, a in _ParseBuild(generator.Generate(str(tmp_path)))}
  assert by_name['a'][1]['deps'] == [':tfpipe_init']
  assert by_name['a'][1]['srcs'] == ['tfpipe/a.py']
  # tfpipe/sub/__init__.py imports b, b imports c, and importing c runs
  # tfpipe/sub/__init__.py: a cycle, so the three share their sources.
  cycle = ['tfpipe/sub/__init__.py', 'tfpipe/sub/b.py', 'tfpipe/sub/c.py']
  assert by_name['sub_init'][1]['srcs'] == cycle
  assert by_name['sub_b'][1]['srcs'] == [cycle[1], cycle[0], cycle[2]]
  assert by_name['sub_c'][1]['srcs'] == [cycle[2], cycle[0], cycle[1]]
  for name in ('sub_init', 'sub_b', 'sub_c'):
    assert by_name[name][1]['deps'] == [':a', ':tfpipe_init']
  assert by_name['models_m'][1]['deps'] == [':sub_b']
  kind, test = by_name['sub_b_test']
  assert kind == 'py_test'
  assert test['size'] == 'large'
  assert test['args'] == ['tests/sub/b_test.py']
  assert test['main'] == 'tests/bazel_pytest_main.py'
  assert test['deps'] == [':pytest_support', ':sub_b']
  assert by_name['trainer'][0] == 'py_binary'
  assert by_name['trainer'][1]['deps'] == [':trainer_trainer']
