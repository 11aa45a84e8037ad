"""Keeps the per-package Bazel BUILD files honest as the tree grows.

Runs without Bazel: it runs the BUILD files, and the macros they load from
tools/build_defs.bzl, as Python with a stand-in for Bazel's `native` that
records the rules. If it fails, regenerate with

    python tools/build_targets.py

and commit the BUILD files together with the new or changed files.
"""
# Reads the real source tree (through the runfiles symlinks), so it must never
# be served from Bazel's cache; it imports the generator from there.
# bazel: tags=external
# bazel: deps=//tools:build_targets

import difflib
import os
import posixpath
import subprocess
import sys
import textwrap
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
# tools/ holds scripts, not a package: `python tools/build_targets.py` runs
# with tools/ first on sys.path, which is how the generator's modules find
# each other. Importing them here the same way tests the code as it runs.
sys.path.insert(0, os.path.join(ROOT, 'tools'))
# pylint: disable=g-import-not-at-top,g-bad-import-order,wrong-import-position
import build_files
import build_targets
import target_graph
# pylint: enable=g-import-not-at-top,g-bad-import-order,wrong-import-position

REGENERATE = 'Run `python tools/build_targets.py` and commit the BUILD files.'

_KINDS = ('py_library', 'py_test', 'py_binary')


def _ParseBuild(text, package, path='BUILD'):
  """[(kind, {attr: value})] for every py_* rule of one BUILD file.

  Starlark BUILD and .bzl files of this kind are also Python: run `text`, so
  that the macros it loads (`//tools:build_defs.bzl`) expand as under Bazel.
  """
  rules = []

  def Rule(kind):
    return lambda **attrs: rules.append((kind, attrs))

  native = types.SimpleNamespace(package_name=lambda: package,
                                 **{kind: Rule(kind) for kind in _KINDS})

  def Load(label, *symbols):
    bzl = {'native': native}
    with open(os.path.join(ROOT, _Path('', label)), encoding='utf-8') as f:
      exec(compile(f.read(), label, 'exec'), bzl)  # pylint: disable=exec-used
    scope.update((s, bzl[s]) for s in symbols)

  scope = {'load': Load, 'package': lambda **_: None,
           'exports_files': lambda *_, **__: None}
  scope.update((kind, getattr(native, kind)) for kind in _KINDS)
  exec(compile(text, path, 'exec'), scope)  # pylint: disable=exec-used
  return rules


def _Path(package, src):
  """A srcs/data entry of `package`'s BUILD as a workspace path."""
  if src.startswith('//'):
    directory, _, base = src[2:].partition(':')
    return posixpath.join(directory, base)
  return posixpath.join(package, src)


def _Absolute(package, label):
  """A deps entry of `package`'s BUILD as '//pkg:name'."""
  if label.startswith(':'):
    return f'//{package}{label}'
  if ':' not in label:
    return f'{label}:{posixpath.basename(label)}'
  return label


def _Rules(files):
  """{'//pkg:name': (kind, attrs, package)} over {BUILD path: text}."""
  out = {}
  for path, text in files.items():
    package = posixpath.dirname(path)
    for kind, attrs in _ParseBuild(text, package, path):
      label = f'//{package}:{attrs["name"]}'
      assert label not in out, f'{label} is defined twice. {REGENERATE}'
      out[label] = (kind, attrs, package)
  return out


def _Closure(rules, label):
  """Workspace paths of the sources `label` brings, transitively."""
  seen, stack, srcs = set(), [label], set()
  while stack:
    current = stack.pop()
    if current in seen:
      continue
    seen.add(current)
    _, attrs, package = rules[current]
    srcs.update(_Path(package, s) for s in attrs.get('srcs', []))
    stack += [_Absolute(package, d) for d in attrs.get('deps', [])]
  return srcs


def _WriteTree(root, files):
  for path, text in files.items():
    full = root / path
    full.parent.mkdir(parents=True, exist_ok=True)
    full.write_text(textwrap.dedent(text))


@pytest.fixture(scope='module')
def expected():
  return build_targets.Generate(ROOT)


@pytest.fixture(scope='module')
def committed(expected):
  files = {}
  for path in expected:
    full = os.path.join(ROOT, path)
    if not os.path.exists(full):
      pytest.fail(f'No BUILD file at {path}. {REGENERATE}')
    with open(full, encoding='utf-8') as f:
      files[path] = f.read()
  return files


@pytest.fixture(scope='module')
def rules(committed):
  return _Rules(committed)


@pytest.fixture(scope='module')
def tree():
  return target_graph.Tree(ROOT)


def test_every_package_has_a_build_file_of_python_rules(committed, tree):
  packages = {posixpath.dirname(p) for p in tree.files}
  missing = sorted(p for p in packages if posixpath.join(p, 'BUILD')
                   not in committed)
  assert not missing, f'Packages without a BUILD file: {missing}. {REGENERATE}'
  for path, text in committed.items():
    if path != 'BUILD':
      assert _ParseBuild(text, posixpath.dirname(path), path), (
          f'{path} has no py_* rules. {REGENERATE}')


def test_every_module_is_the_source_of_exactly_one_library(rules, tree):
  owners = {}
  for label, (kind, attrs, package) in rules.items():
    if kind == 'py_library':
      for src in attrs.get('srcs', []):
        owners.setdefault(_Path(package, src), []).append(label)
  missing = [p for p in tree.library_files if p not in owners]
  assert not missing, (
      'These modules are in no py_library:\n  ' + '\n  '.join(missing) +
      f'\n{REGENERATE}')
  shared = {p: ls for p, ls in owners.items()
            if len(ls) > 1 and not p.endswith('_test.py')}
  assert not shared, f'Sources shared between libraries: {shared}'


def test_every_test_file_has_a_py_test_that_runs_it(rules, tree):
  runs = {attrs['args'][0]: label for label, (kind, attrs, _) in rules.items()
          if kind == 'py_test'}
  missing = [p for p in tree.test_files if p not in runs]
  assert not missing, (
      'These test files have no py_test:\n  ' + '\n  '.join(missing) +
      f'\n{REGENERATE}')
  for path, label in runs.items():
    package, base = posixpath.split(path)
    assert label == f'//{package}:{base[:-len(".py")]}', (
        f'{path} is run by {label}, not by the target named after it.')


def test_build_files_name_only_existing_files(rules):
  gone = set()
  for _, attrs, package in rules.values():
    for src in attrs.get('srcs', []) + attrs.get('data', []):
      if not os.path.exists(os.path.join(ROOT, _Path(package, src))):
        gone.add(_Path(package, src))
  assert not gone, ('BUILD files name files that do not exist:\n  ' +
                    '\n  '.join(sorted(gone)) + f'\n{REGENERATE}')


def test_every_dependency_is_a_defined_target(rules):
  undefined = set()
  for label, (_, attrs, package) in rules.items():
    for dep in attrs.get('deps', []):
      if _Absolute(package, dep) not in rules:
        undefined.add(f'{label} -> {dep}')
  assert not undefined, f'Unknown deps: {sorted(undefined)}. {REGENERATE}'


def test_trainer_binary_when_trainer_exists(rules, tree):
  if not tree.has_trainer:
    pytest.skip(f'{target_graph.TRAINER} does not exist yet.')
  kind, attrs, _ = rules['//:trainer']
  assert kind == 'py_binary'
  assert _Path('', attrs['main']) == target_graph.TRAINER
  assert '//params' in attrs['deps'], 'The trainer needs every config.'


def test_build_files_are_up_to_date(committed, expected):
  """Deps follow imports: a stale BUILD gives Bazel-only ImportErrors."""
  diffs = []
  for path, text in expected.items():
    if committed[path] != text:
      diffs += difflib.unified_diff(
          committed[path].splitlines(True), text.splitlines(True),
          f'{path} (committed)', f'{path} (generated)', n=1)
  stale = build_targets.StaleBuildFiles(ROOT, expected)
  assert not diffs and not stale, (
      f'Stale BUILD files {stale}. {REGENERATE}\n' + ''.join(diffs)[:4000])


def _AssertRulesAre(rules, targets):
  """`rules`, read back from BUILD files, are what `targets` say they are."""
  want, got = {}, {}
  for label, t in targets.items():
    want[_Absolute('', label)] = (
        t.kind, sorted(t.srcs), sorted(_Absolute('', d) for d in t.deps),
        t.attrs.get('main'), t.attrs.get('args'),
        sorted(_Path('', d) for d in t.attrs.get('data', [])))
  for label, (kind, attrs, package) in rules.items():
    main = attrs.get('main')
    got[label] = (
        kind, sorted(_Path(package, s) for s in attrs.get('srcs', [])),
        sorted(_Absolute(package, d) for d in attrs.get('deps', [])),
        main and _Path(package, main), attrs.get('args'),
        sorted(_Path(package, d) for d in attrs.get('data', [])))
  assert set(got) == set(want), (
      f'Only in BUILD files: {sorted(set(got) - set(want))}; only in the '
      f'tree: {sorted(set(want) - set(got))}. {REGENERATE}')
  wrong = {label: (got[label], want[label]) for label in want
           if got[label] != want[label]}
  assert not wrong, f'BUILD rules (made, wanted): {wrong}'


def test_build_files_make_the_generators_targets(rules, tree):
  """The macros of tools/build_defs.bzl expand to the generator's rules."""
  # The generator's own model of the rules, before they are written out.
  _AssertRulesAre(rules, target_graph.Targets(tree).by_label)


def test_build_files_spell_out_what_the_macros_cannot_make():
  """A test library the test's macro cannot make keeps its own rule.

  `pytest_test(library = True)` gives `<name>_lib` the test's deps and
  data; a library that needs other ones must not be folded into it. A
  binary's main in another package is exported by that package.
  """
  Target = target_graph.Target  # pylint: disable=invalid-name
  runner, support = target_graph.RUNNER, target_graph.PYTEST_SUPPORT
  test = 'tests/x/a_test.py'
  targets = {t.label: t for t in [
      Target('py_library', 'tests', 'pytest_support', [runner]),
      Target('py_library', 'tests/x', 'helper', ['tests/x/helper.py']),
      Target('py_test', 'tests/x', 'a_test', [test, runner],
             {support: '', '//tests/x:helper': ''},
             {'main': runner, 'args': [test], 'data': ['//:README.md']}),
      Target('py_library', 'tests/x', 'a_test_lib', [test],
             {'//tests/x:helper': ''}, {'testonly': True}),
      Target('py_library', 'tools', 't', ['tools/t.py']),
      Target('py_binary', '', 't', ['tools/t.py'], {'//tools:t': ''},
             {'main': 'tools/t.py'}),
  ]}
  files = build_files.Render(targets, ['README.md'])
  assert sorted(files) == ['BUILD', 'tests/BUILD', 'tests/x/BUILD',
                           'tools/BUILD']
  _AssertRulesAre(_Rules(files), targets)
  assert 'library = True' not in files['tests/x/BUILD']
  assert 'exports_files(["t.py"])' in files['tools/BUILD']
  assert 'exports_files(["README.md"])' in files['BUILD']
  # With the same data as the test, the library is the macro's to make.
  targets['//tests/x:a_test_lib'].attrs['data'] = ['//:README.md']
  files = build_files.Render(targets, ['README.md'])
  _AssertRulesAre(_Rules(files), targets)
  assert 'library = True' in files['tests/x/BUILD']


def test_generator_is_deterministic(expected):
  assert build_targets.Generate(ROOT) == expected


def test_schedule_target_and_import_carry_no_tensorflow(rules):
  """The issue's promise: the pure-Python schedule imports without TF."""
  assert _Closure(rules, '//tfpipe/gpipe:schedule') == {
      'tfpipe/gpipe/schedule.py', 'tfpipe/gpipe/__init__.py',
      'tfpipe/__init__.py', 'tfpipe/lazy_exports.py'}
  code = ('import sys, tfpipe.gpipe.schedule; '
          'print([m for m in ("tensorflow", "keras") if m in sys.modules])')
  proc = subprocess.run(
      [sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
      env=dict(os.environ, PYTHONPATH=ROOT), timeout=120, check=True)
  assert proc.stdout.strip() == '[]'


SMALL_TREE = {
    'tfpipe/__init__.py': '''
        from tfpipe import lazy_exports
        __getattr__, __dir__, __all__ = lazy_exports.Attach(
            __name__, {'sub': []})
    ''',
    'tfpipe/lazy_exports.py': 'import importlib\n',
    'tfpipe/a.py': 'import numpy\n',
    'tfpipe/model_registry.py': 'from tfpipe import a\n',
    'tfpipe/sub/__init__.py': '''
        from tfpipe import lazy_exports
        __getattr__, __dir__, __all__ = lazy_exports.Attach(
            __name__, {'b': ['B'], 'c': []})
    ''',
    'tfpipe/sub/b.py': 'from .. import a\nfrom tfpipe.sub import c\nB = 1\n',
    'tfpipe/sub/c.py': 'def F():\n  import tfpipe.a\n',
    'models/__init__.py': 'from tfpipe import a\n',
    'models/m.py': 'import models\nfrom tfpipe.sub import B\n',
    'params/__init__.py': '',
    'params/p.py': 'from models import m\nfrom tfpipe import model_registry\n',
    'tests/__init__.py': '',
    'tests/conftest.py': 'import pytest\n',
    'tests/bazel_pytest_main.py': 'import pytest\n',
    'tests/sub/__init__.py': '',
    'tests/sub/runs_trainer.py': '''
        # bazel: deps=//tfpipe/trainer:trainer,//params:params
        # bazel: data=//:setup.cfg
        import subprocess
    ''',
    'tests/sub/b_test.py': '''
        # bazel: size=large
        # bazel: tags=manual,gpu
        from tfpipe.sub import b
    ''',
    'tests/sub/c_test.py': '''
        from tests.sub import b_test
        from tfpipe import model_registry
    ''',
    'tfpipe/trainer/__init__.py': '',
    'tfpipe/trainer/trainer.py': 'from tfpipe import a\n',
    # tools/ has no __init__.py: a script there imports its siblings by name.
    'tools/script.py': 'import json\nimport script_lib\nfrom tfpipe import a\n',
    'tools/script_lib.py': 'from script_parts import Part\n',
    'tools/script_parts.py': 'Part = 1\n',
}


def test_generator_on_a_small_tree(tmp_path):
  _WriteTree(tmp_path, SMALL_TREE)
  files = build_targets.Generate(str(tmp_path))
  assert sorted(files) == [
      'BUILD', 'models/BUILD', 'params/BUILD', 'tests/BUILD',
      'tests/sub/BUILD', 'tfpipe/BUILD', 'tfpipe/sub/BUILD',
      'tfpipe/trainer/BUILD', 'tools/BUILD']
  rules = _Rules(files)

  def Deps(label):
    _, attrs, package = rules[label]
    return sorted(_Absolute(package, d) for d in attrs.get('deps', []))

  # A module depends on its package's lazy __init__ and on what it imports.
  assert Deps('//tfpipe:a') == ['//tfpipe:init']
  assert Deps('//tfpipe/sub:b') == [
      '//tfpipe/sub:c', '//tfpipe/sub:init', '//tfpipe:a']
  assert Deps('//tfpipe/sub:c') == ['//tfpipe/sub:init', '//tfpipe:a']
  assert Deps('//tfpipe/sub:init') == ['//tfpipe:init', '//tfpipe:lazy_exports']
  # The root __init__ loads lazy_exports itself: no edge back.
  assert Deps('//tfpipe:lazy_exports') == []
  # The package object's bundle holds what its names come from...
  assert Deps('//tfpipe/sub:sub') == [
      '//tfpipe/sub:b', '//tfpipe/sub:c', '//tfpipe/sub:init']
  assert rules['//tfpipe/sub:sub'][1].get('srcs') is None
  # ...and importing a name from the package depends on the bundle, while a
  # package without a lazy table is just its __init__.
  assert Deps('//models:m') == ['//models:init', '//tfpipe/sub:sub']
  assert Deps('//params:params') == ['//params:p']
  kind, test, _ = rules['//tests/sub:b_test']
  assert kind == 'py_test'
  assert test['size'] == 'large'
  assert test['tags'] == ['gpu', 'manual']
  assert test['args'] == ['tests/sub/b_test.py']
  assert test['main'] == '//tests:bazel_pytest_main.py'
  assert Deps('//tests/sub:b_test') == [
      '//tests/sub:init', '//tests:pytest_support', '//tfpipe/sub:b']
  # A test imported by another test is also a library; a test that uses the
  # model registry gets every registered config.
  assert Deps('//tests/sub:c_test') == [
      '//params:params', '//tests/sub:b_test_lib', '//tests/sub:init',
      '//tests:pytest_support', '//tfpipe:model_registry']
  assert rules['//tests/sub:b_test_lib'][1]['testonly'] is True
  assert Deps('//tests/sub:b_test_lib') == [
      '//tests/sub:init', '//tfpipe/sub:b']
  # The runner and the shared deps are spelled once, in the macros.
  assert 'py_test(' not in files['tests/sub/BUILD']
  assert 'bazel_pytest_main' not in files['tests/sub/BUILD']
  # What imports do not show (a subprocess) is declared in comments.
  assert Deps('//tests/sub:runs_trainer') == [
      '//params:params', '//tests/sub:init', '//tfpipe/trainer:trainer']
  assert rules['//tests/sub:runs_trainer'][1]['data'] == ['//:setup.cfg']
  # Python runs a script with its directory first on sys.path.
  assert Deps('//tools:script') == ['//tfpipe:a', '//tools:script_lib']
  assert Deps('//tools:script_lib') == ['//tools:script_parts']
  kind, trainer, _ = rules['//:trainer']
  assert kind == 'py_binary'
  assert trainer['deps'] == ['//params', '//tfpipe/trainer']
  # Every source is in exactly one library: nothing is merged.
  srcs = [_Path(p, s) for k, a, p in rules.values() if k == 'py_library'
          for s in a.get('srcs', [])]
  assert len(srcs) == len(set(srcs))


def test_generator_refuses_a_real_cycle_naming_the_modules(tmp_path):
  files = dict(SMALL_TREE)
  files['tfpipe/a.py'] = 'from tfpipe.sub import b\n'  # b imports a.
  files['tfpipe/sub/c.py'] = ''  # Else a -> b -> c -> a is found first.
  _WriteTree(tmp_path, files)
  with pytest.raises(target_graph.BuildError) as error:
    build_targets.Generate(str(tmp_path))
  message = str(error.value)
  assert 'Import cycle among tfpipe/a.py, tfpipe/sub/b.py' in message
  assert 'imports tfpipe.sub.b (tfpipe/a.py:1)' in message
  assert 'imports tfpipe.a (tfpipe/sub/b.py:1)' in message
  # The command line says so and writes nothing.
  assert build_targets.main(['--root', str(tmp_path)]) == 1
  assert not (tmp_path / 'BUILD').exists()


def test_generator_refuses_bad_directives_and_tables(tmp_path):
  files = dict(SMALL_TREE)
  files['tests/sub/b_test.py'] = '# bazel: size=huge\n'
  _WriteTree(tmp_path, files)
  with pytest.raises(target_graph.BuildError, match='size must be one of'):
    build_targets.Generate(str(tmp_path))
  files['tests/sub/b_test.py'] = '# bazel: deps=//tfpipe:missing\n'
  _WriteTree(tmp_path, files)
  with pytest.raises(target_graph.BuildError,
                     match='no BUILD file defines //tfpipe:missing'):
    build_targets.Generate(str(tmp_path))
  files['tests/sub/b_test.py'] = ''
  files['tfpipe/sub/__init__.py'] = '''
      from tfpipe import lazy_exports
      __getattr__, __dir__, __all__ = lazy_exports.Attach(
          __name__, {'missing': ['X']})
  '''
  _WriteTree(tmp_path, files)
  with pytest.raises(target_graph.BuildError,
                     match="names submodule 'missing'.*fix the table"):
    build_targets.Generate(str(tmp_path))
