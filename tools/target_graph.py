"""The Bazel targets that tfpipe's Python tree needs, and why each dep.

tools/build_targets.py writes these targets as BUILD files; this module only
reads the workspace: which files are modules and tests, what each imports,
the lazy-export tables of package `__init__` files and the `# bazel:`
directive comments. Keeping it apart from the Starlark text lets a test
compare the BUILD files on disk with this model of them
(tests/build_test.py).
"""

import ast
import dataclasses
import os
import posixpath
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LIBRARY_DIRS = ('tfpipe', 'models', 'params', 'benchmarks', 'tools')
TESTS_DIR = 'tests'
RUNNER = 'tests/bazel_pytest_main.py'
CONFTEST = 'tests/conftest.py'
PYTEST_SUPPORT = '//tests:pytest_support'
SETUP_CFG = 'setup.cfg'
TRAINER = 'tfpipe/trainer/trainer.py'
GENERATOR = 'tools/build_targets.py'
# model_registry imports the configs under params/ by name, so binaries and
# tests that use the registry need them all: the bundle `//params`.
REGISTRY_MODULE = 'tfpipe.model_registry'
REGISTRY_DIR = 'params'
LAZY_EXPORTS = 'Attach'  # tfpipe.lazy_exports.Attach(__name__, {table}).
SKIP_DIRS = {'__pycache__', '.pytest_cache', 'testdata_out'}
TEST_SIZES = ('small', 'medium', 'large', 'enormous')
DIRECTIVES = ('size', 'tags', 'deps', 'data')


class BuildError(Exception):
  """The tree cannot be described by BUILD files; the message says why."""


def WorkspaceFiles(top, root, only):
  """Sorted workspace-relative paths of files under `top` (and in `only`)."""
  out = []
  for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
    dirnames[:] = sorted(d for d in dirnames
                         if d not in SKIP_DIRS and not d.startswith('.'))
    for f in filenames:
      if not f.startswith('.') and not f.endswith('.pyc'):
        out.append(os.path.relpath(os.path.join(dirpath, f),
                                   root).replace(os.sep, '/'))
  return sorted(p for p in out if only is None or p in only)


def ModuleName(path):
  """'tfpipe/layers/core.py' -> 'tfpipe.layers.core'; packages drop __init__."""
  parts = path[:-len('.py')].split('/')
  if parts[-1] == '__init__':
    parts = parts[:-1]
  return '.'.join(parts)


def Label(package, name):
  """'//tfpipe/gpipe:schedule'; a package's namesake is '//tfpipe/gpipe'."""
  if package and posixpath.basename(package) == name:
    return f'//{package}'
  return f'//{package}:{name}'


def _Canonical(label):
  """'//params:params' -> '//params', as Label() writes it."""
  package, _, name = label[2:].partition(':')
  return Label(package, name or posixpath.basename(package))


def IsTestFile(path):
  return path.startswith(TESTS_DIR + '/') and path.endswith('_test.py')


@dataclasses.dataclass
class Target:
  """One rule: where it lives, what it holds and why it depends on others."""
  kind: str
  package: str
  name: str
  srcs: list = dataclasses.field(default_factory=list)  # Workspace paths.
  deps: dict = dataclasses.field(default_factory=dict)  # Label -> reason.
  attrs: dict = dataclasses.field(default_factory=dict)

  @property
  def label(self):
    return Label(self.package, self.name)


class Tree:
  """The Python files of the workspace, their imports and lazy exports."""

  def __init__(self, root=ROOT, only=None):
    self.root = root
    self.files = []
    for top in LIBRARY_DIRS + (TESTS_DIR,):
      self.files += [p for p in WorkspaceFiles(top, root, only)
                     if p.endswith('.py')]
    self.modules = {ModuleName(p): p for p in self.files}
    self.test_files = [p for p in self.files if IsTestFile(p)]
    self.library_files = [p for p in self.files
                          if not IsTestFile(p) and p not in (RUNNER, CONFTEST)]
    self.has_trainer = TRAINER in self.files
    self.has_generator = GENERATOR in self.files
    self._text = {}
    self._imports = {}

  def Read(self, path):
    if path not in self._text:
      with open(os.path.join(self.root, path), encoding='utf-8') as f:
        self._text[path] = f.read()
    return self._text[path]

  def Parse(self, path):
    try:
      return ast.parse(self.Read(path), filename=path)
    except SyntaxError as e:
      raise BuildError(f'{path}:{e.lineno}: cannot parse: {e.msg}.') from None

  def _Nearest(self, module):
    """`module` or its closest enclosing module/package in the tree."""
    while module and module not in self.modules:
      module = module.rpartition('.')[0]
    return module or None

  def Imports(self, path):
    """{workspace module name: first line} of what `path` imports."""
    if path not in self._imports:
      self._imports[path] = self._FindImports(path)
    return self._imports[path]

  def _ModuleImportedBy(self, path, name):
    """The module that an absolute `import name` in `path` means.

    A directory without `__init__.py` (tools/) holds scripts, not a package:
    Python runs `python tools/build_targets.py` with tools/ first on
    sys.path, so there `import target_graph` is tools/target_graph.py.
    """
    directory = posixpath.dirname(path)
    scripts = directory.replace('/', '.')
    if (f'{directory}/__init__.py' not in self.files and
        f'{scripts}.{name.partition(".")[0]}' in self.modules):
      return f'{scripts}.{name}'
    return name

  def _FindImports(self, path):
    package = ModuleName(path)
    if not path.endswith('__init__.py'):
      package = package.rpartition('.')[0]
    found = {}

    def Add(module, node):
      if module and module != ModuleName(path):
        found.setdefault(module, node.lineno)

    for node in ast.walk(self.Parse(path)):
      if isinstance(node, ast.Import):
        for alias in node.names:
          Add(self._Nearest(self._ModuleImportedBy(path, alias.name)), node)
      elif isinstance(node, ast.ImportFrom):
        module = node.module or ''
        if node.level:
          base = package.split('.') if package else []
          base = base[:len(base) - (node.level - 1)]
          module = '.'.join(base + ([module] if module else []))
        else:
          module = self._ModuleImportedBy(path, module)
        for alias in node.names:
          sub = f'{module}.{alias.name}'
          Add(sub if sub in self.modules else self._Nearest(module), node)
    return found

  def LazyTable(self, init):
    """Submodule names of `init`'s lazy_exports table ([] if it has none)."""
    for node in ast.walk(self.Parse(init)):
      if not (isinstance(node, ast.Call) and
              getattr(node.func, 'attr', getattr(node.func, 'id', None)) ==
              LAZY_EXPORTS):
        continue
      try:
        table = ast.literal_eval(node.args[1])
      except (IndexError, ValueError):
        raise BuildError(
            f'{init}:{node.lineno}: the lazy_exports.{LAZY_EXPORTS} table '
            'must be a literal dict, {submodule: [names]}, the 2nd argument, '
            'so that this generator can read it.') from None
      package = ModuleName(init)
      for sub in table:
        if f'{package}.{sub}' not in self.modules:
          raise BuildError(
              f'{init}:{node.lineno}: lazy export table names submodule '
              f'{sub!r}, but there is no {package}.{sub} module; fix the '
              'table.')
      return sorted(table)
    return []

  def Directives(self, path):
    out = {}
    for m in re.finditer(r'^#\s*bazel:\s*(\w+)\s*=\s*(\S+)\s*$',
                         self.Read(path), re.M):
      key, value = m.group(1), m.group(2)
      if key not in DIRECTIVES:
        raise BuildError(f'{path}: unknown directive `# bazel: {key}=`; '
                         f'use one of {", ".join(DIRECTIVES)}.')
      if key in ('size', 'tags') and not IsTestFile(path):
        raise BuildError(f'{path}: `# bazel: {key}=` applies to test files '
                         '(*_test.py) only.')
      if key == 'size' and value not in TEST_SIZES:
        raise BuildError(f'{path}: `# bazel: size={value}`: size must be one '
                         f'of {", ".join(TEST_SIZES)}.')
      out[key] = value if key == 'size' else sorted(
          v for v in value.split(',') if v)
    return out


class Targets:
  """Builds every Target of a Tree; `by_label` holds them."""

  def __init__(self, tree):
    self.tree = tree
    self.by_label = {}
    self.imported_tests = set()
    self.lazy = {p: tree.LazyTable(p) for p in tree.files
                 if p.endswith('/__init__.py')}
    self.init_imports = {p: set(tree.Imports(p)) for p in self.lazy}
    for p in tree.library_files:
      self._Library(p)
    for p in tree.files:
      if p.endswith('/__init__.py') and self.lazy[p]:
        self._Bundle(p)
    if any(p.startswith(REGISTRY_DIR + '/') for p in tree.library_files):
      self._RegistryBundle()
    if RUNNER in tree.files:
      self._PytestSupport()
    for p in tree.test_files:
      self._Test(p)
    done = set()
    while self.imported_tests - done:  # A test library may import a test.
      for p in sorted(self.imported_tests - done):
        done.add(p)
        self._TestLibrary(p)
    self._Binaries()
    self._CheckDepsExist()

  def Add(self, target):
    if target.label in self.by_label:
      raise BuildError(
          f'Bazel target {target.label} would hold both '
          f'{self.by_label[target.label].srcs or "a bundle"} and '
          f'{target.srcs or "a bundle"}; rename one of them.')
    self.by_label[target.label] = target
    return target

  def ModuleLabel(self, module):
    """The label that provides workspace module `module` to an importer."""
    path = self.tree.modules[module]
    package = posixpath.dirname(path)
    if path.endswith('/__init__.py'):
      name = posixpath.basename(package) if self.lazy[path] else 'init'
      return Label(package, name)
    name = posixpath.basename(path)[:-len('.py')]
    if IsTestFile(path):
      self.imported_tests.add(path)
      name += '_lib'
    return Label(package, name)

  def _PackageDeps(self, path):
    """{label: reason} of the __init__.py that Python runs before `path`."""
    package = posixpath.dirname(path)
    if path.endswith('/__init__.py'):
      package = posixpath.dirname(package)
    init = f'{package}/__init__.py' if package else None
    if init not in self.lazy or ModuleName(path) in self.init_imports[init]:
      return {}  # No package, or its __init__ loads `path` itself.
    return {Label(package, 'init'): f'is in package {package}'}

  def _ImportDeps(self, path):
    deps = {}
    for module, line in self.tree.Imports(path).items():
      deps.setdefault(self.ModuleLabel(module),
                      f'imports {module} ({path}:{line})')
    return deps

  def _Declared(self, path, deps):
    """Adds `# bazel: deps=` to `deps`; the `# bazel: data=` labels."""
    directives = self.tree.Directives(path)
    for label in directives.get('deps', []):
      deps[_Canonical(label)] = f'is named by `# bazel: deps=` in {path}'
    return directives.get('data', [])

  def _Library(self, path):
    package, base = posixpath.split(path)
    name = 'init' if base == '__init__.py' else base[:-len('.py')]
    deps = self._PackageDeps(path)
    deps.update(self._ImportDeps(path))
    attrs = {'data': self._Declared(path, deps)}
    if path.startswith(TESTS_DIR + '/'):
      attrs['testonly'] = True
    self.Add(Target('py_library', package, name, [path], deps, attrs))

  def _Bundle(self, init):
    package = posixpath.dirname(init)
    deps = {Label(package, 'init'): 'is the package'}
    for sub in self.lazy[init]:
      module = f'{ModuleName(init)}.{sub}'
      deps[self.ModuleLabel(module)] = f're-exports {module} lazily ({init})'
    self.Add(Target('py_library', package, posixpath.basename(package), [],
                    deps))

  def _RegistryBundle(self):
    deps = {}
    for p in self.tree.library_files:
      if p.startswith(REGISTRY_DIR + '/') and not p.endswith('__init__.py'):
        deps[self.ModuleLabel(ModuleName(p))] = 'is a registered config'
    self.Add(Target('py_library', REGISTRY_DIR, REGISTRY_DIR, [], deps))

  def _PytestSupport(self):
    srcs = [p for p in (RUNNER, CONFTEST) if p in self.tree.files]
    deps = {}
    for p in srcs:
      deps.update(self._PackageDeps(p))
      deps.update(self._ImportDeps(p))
    package, name = PYTEST_SUPPORT[2:].split(':')
    self.Add(Target('py_library', package, name, srcs, deps,
                    {'data': ['//:' + SETUP_CFG], 'testonly': True}))

  def _TestDeps(self, path):
    deps = self._PackageDeps(path)
    deps.update(self._ImportDeps(path))
    directory = posixpath.dirname(path)
    while directory.startswith(TESTS_DIR + '/'):  # pytest loads these too.
      conftest = f'{directory}/conftest.py'
      if conftest in self.tree.files:
        deps[Label(directory, 'conftest')] = f'{conftest} applies'
      directory = posixpath.dirname(directory)
    if REGISTRY_MODULE in self.tree.Imports(path):
      deps[Label(REGISTRY_DIR, REGISTRY_DIR)] = 'uses the model registry'
    return deps

  def _Test(self, path):
    package, base = posixpath.split(path)
    directives = self.tree.Directives(path)
    deps = {PYTEST_SUPPORT: 'runs under pytest'}
    deps.update(self._TestDeps(path))
    attrs = {
        'size': directives.get('size'),
        'main': RUNNER,
        'args': [path],
        'data': self._Declared(path, deps),
        'tags': directives.get('tags', []),
    }
    self.Add(Target('py_test', package, base[:-len('.py')], [path, RUNNER],
                    deps, attrs))

  def _TestLibrary(self, path):
    package, base = posixpath.split(path)
    deps = self._TestDeps(path)
    attrs = {'data': self._Declared(path, deps), 'testonly': True}
    self.Add(Target('py_library', package, base[:-len('.py')] + '_lib', [path],
                    deps, attrs))

  def _Binaries(self):
    if self.tree.has_trainer:
      deps = {self.ModuleLabel(ModuleName(TRAINER)): 'is the trainer'}
      if f'//{REGISTRY_DIR}' in self.by_label:
        deps[f'//{REGISTRY_DIR}'] = 'trains registered configs'
      self.Add(Target('py_binary', '', 'trainer', [TRAINER], deps,
                      {'main': TRAINER}))
    if self.tree.has_generator:
      self.Add(Target('py_binary', '', 'build_targets', [GENERATOR],
                      {self.ModuleLabel(ModuleName(GENERATOR)): 'is it'},
                      {'main': GENERATOR}))

  def _CheckDepsExist(self):
    packages = {t.package for t in self.by_label.values()}
    for target in self.by_label.values():
      for label, why in target.deps.items():
        if (label[2:].partition(':')[0] in packages and
            label not in self.by_label):
          raise BuildError(f'{target.label} {why}, but no BUILD file '
                           f'defines {label}.')


def _FindCycle(graph):
  """One cycle [a, b, ..., a] of `graph` ({node: [nodes]}), or None."""
  state = {}  # 1: on the current depth-first path; 2: explored.
  for start in sorted(graph):
    if start in state:
      continue
    path, children = [start], [iter(graph[start])]
    state[start] = 1
    while path:
      w = next(children[-1], None)
      if w is None:
        state[path.pop()] = 2
        children.pop()
      elif state.get(w) == 1:
        return path[path.index(w):] + [w]
      elif w not in state:
        state[w] = 1
        path.append(w)
        children.append(iter(graph[w]))
  return None


def CheckAcyclic(targets):
  """Raises BuildError naming the modules and imports of an import cycle."""
  cycle = _FindCycle({label: sorted(set(t.deps) & set(targets))
                      for label, t in targets.items()})
  if cycle:
    files = sorted({s for label in cycle for s in targets[label].srcs})
    raise BuildError('\n'.join(
        ['Import cycle among ' + ', '.join(files) + ':'] +
        [f'  {a} -> {b}: {targets[a].deps[b]}'
         for a, b in zip(cycle, cycle[1:])] +
        ['Bazel cannot build modules that import each other. Break the '
         'cycle, e.g. by moving what both need into a third module. '
         'Importing a module (`from tfpipe.gpipe import schedule`) rather '
         'than its package (`from tfpipe import gpipe`) depends on less.']))
