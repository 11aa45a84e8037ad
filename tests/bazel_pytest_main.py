"""Runs one test file under pytest: the `main` of every Bazel `py_test`.

Bazel runs a test's main module directly, but tfpipe's tests are pytest
tests that rely on `tests/conftest.py` (8 logical CPUs, quiet logs) and on
setup.cfg's pytest settings. Each `py_test` therefore uses this file as
`main`, with the test file's workspace-relative path as its argument: the
BUILD files' `pytest_test(name = "schedule_test", deps = [...])`
(tools/build_defs.bzl) in tests/gpipe/ is

    py_test(
        name = "schedule_test",
        srcs = ["schedule_test.py", "//tests:bazel_pytest_main.py"],
        main = "//tests:bazel_pytest_main.py",
        args = ["tests/gpipe/schedule_test.py"],
        deps = [..., "//tests:pytest_support"],
    )

Extra arguments are passed on to pytest, e.g.
`bazel test //tests:hyperparams_test --test_arg=-k --test_arg=Freeze`.
"""

import os
import sys

# Python put this file's real directory, the source tree's tests/, first on
# sys.path. Drop it: tests/keras would shadow the keras package, and the
# source tree would leak into the sandbox. Tests import as `tests.x`.
_HERE = os.path.dirname(os.path.realpath(__file__))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or '.') != _HERE]

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


def main(argv):
  if len(argv) < 2:
    sys.stderr.write('usage: bazel_pytest_main.py TEST_FILE [PYTEST_ARGS...]\n')
    return 2
  # Bazel starts tests in the runfiles copy of the workspace root; under
  # `bazel run` it may not, so anchor paths at this file's workspace root.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  os.chdir(root)
  if root not in sys.path:
    sys.path.insert(0, root)
  # One file per Bazel test: no pytest-xdist workers (setup.cfg asks for them).
  args = [argv[1], '-p', 'no:cacheprovider', '--rootdir', root, '-n', '0']
  if os.path.exists(os.path.join(root, 'setup.cfg')):
    args += ['-c', os.path.join(root, 'setup.cfg')]
  # Bazel collects JUnit XML from here when it is set.
  xml = os.environ.get('XML_OUTPUT_FILE')
  if xml:
    args.append('--junitxml=' + xml)
  return int(pytest.main(args + argv[2:]))


if __name__ == '__main__':
  sys.exit(main(sys.argv))
