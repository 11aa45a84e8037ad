#!/usr/bin/env python3
"""Writes tfpipe's Bazel BUILD files, one per Python package, from the tree.

    python tools/build_targets.py          # rewrite every BUILD file
    python tools/build_targets.py --check  # exit 1 if any is out of date
    python tools/build_targets.py --git    # only git-tracked/staged files
    bazel run //:build_targets             # same as the first, via Bazel

Run it after adding, removing or renaming a module or test, or changing
imports; tests/build_test.py fails when a BUILD file is stale. As in Lingvo,
each directory of Python files under tfpipe/, models/, params/, benchmarks/,
tools/ and tests/ gets a BUILD file with:

* a `py_library` per module, named after it (`//tfpipe/gpipe:schedule`);
  a package's `__init__.py` is `:init`.
* a `py_test` per `*_test.py` (`//tests/gpipe:schedule_test`), which runs the
  file under pytest through tests/bazel_pytest_main.py. A test file that
  others import also gets a `py_library` `<name>_lib`.
* for a package whose `__init__.py` re-exports names lazily
  (tfpipe/lazy_exports.py), a bundle named after the package
  (`//tfpipe/gpipe`) of the modules its table names.

What every test or package would repeat is written once, as the macros of
tools/build_defs.bzl that the BUILD files load: `pytest_test(name = ...,
deps = [...])` is the py_test (srcs, main, args and `//tests:pytest_support`
follow from the name; `library = True` adds `<name>_lib`), and
`package_init(deps = [...])` is `:init`.

Deps follow `import` statements anywhere in a file. Importing a module
(`from tfpipe.gpipe import schedule`) depends on that module's target;
importing a package object (`from tfpipe import gpipe`, `from tfpipe.gpipe
import PipeliningLayer`) on its bundle. Each module also depends on its own
package's lazy `:init`, unless that `__init__.py` imports the module itself
(tfpipe/lazy_exports.py): then the edge back would only be a cycle. A real
import cycle is an error naming the modules and import lines; sources are
never merged. Comment lines add what imports cannot show: in a test,
`# bazel: size=large` and `# bazel: tags=manual`; in any file,
`# bazel: deps=//params,//tfpipe/trainer:__main__` (e.g. for a subprocess)
and `# bazel: data=//:README.md`.

The root BUILD holds `//:trainer` (with `//params`, every config the model
registry may import by name) and `//:build_targets`. benchmarks/ holds a
`py_library` per script, for the tests that import them; the scripts run
with python.

The work is split by concept: tools/target_graph.py reads the tree into
targets and their deps, tools/build_files.py writes them as Starlark, and this
script compares and writes the files. tools/ is a directory of scripts, not a
package, so they import each other by bare name: Python puts a script's
directory first on sys.path (tests/build_test.py does the same), and the
generator resolves such imports to the sibling modules' targets.
"""

import argparse
import os
import posixpath
import sys

import build_files
import target_graph

ROOT = target_graph.ROOT
ROOT_FILES = ('README.md', target_graph.SETUP_CFG)


def GitFiles(root=ROOT):
  """Paths git tracks (committed or staged) under `root`."""
  import subprocess  # pylint: disable=g-import-not-at-top
  out = subprocess.run(['git', 'ls-files', '-z'], cwd=root, check=True,
                       capture_output=True).stdout.decode()
  return set(p for p in out.split('\0') if p)


def Generate(root=ROOT, only=None):
  """{BUILD path: text} for the tree at `root` (files in `only`, if given)."""
  targets = target_graph.Targets(target_graph.Tree(root, only)).by_label
  target_graph.CheckAcyclic(targets)
  return build_files.Render(
      targets,
      [f for f in ROOT_FILES if os.path.exists(os.path.join(root, f))])


def _ReadText(path):
  if not os.path.exists(path):
    return None
  with open(path, encoding='utf-8') as f:
    return f.read()


def StaleBuildFiles(root, generated):
  """Generated BUILD files on disk that the tree no longer needs."""
  return [p for top in target_graph.LIBRARY_DIRS + (target_graph.TESTS_DIR,)
          for p in target_graph.WorkspaceFiles(top, root, None)
          if posixpath.basename(p) == build_files.BUILD and p not in generated
          and build_files.MARKER in _ReadText(os.path.join(root, p))]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--check', action='store_true',
                      help='exit 1 if a BUILD file differs from the '
                      'generated text')
  parser.add_argument('--git', action='store_true',
                      help='only files git tracks (committed or staged): '
                      'for BUILD files that match a commit')
  parser.add_argument('--root', default=None, help='workspace root')
  args = parser.parse_args(argv)
  root = args.root or os.environ.get('BUILD_WORKSPACE_DIRECTORY') or ROOT
  try:
    generated = Generate(root, GitFiles(root) if args.git else None)
  except target_graph.BuildError as e:
    print(f'build_targets: {e}', file=sys.stderr)
    return 1
  changed = []
  for path, text in generated.items():
    full = os.path.join(root, path)
    if _ReadText(full) != text:
      changed.append(path)
      if not args.check:
        with open(full, 'w', encoding='utf-8') as f:
          f.write(text)
  stale = StaleBuildFiles(root, generated)
  if args.check and (changed or stale):
    print('Out of date: ' + ', '.join(changed + stale) +
          '\nRun: python tools/build_targets.py', file=sys.stderr)
    return 1
  if not args.check:
    for path in stale:
      os.remove(os.path.join(root, path))
  print(f'{len(generated)} BUILD files: wrote {len(changed)}, removed '
        f'{len(stale)}.' if changed or stale else
        f'{len(generated)} BUILD files are up to date.')
  return 0


if __name__ == '__main__':
  sys.exit(main())
