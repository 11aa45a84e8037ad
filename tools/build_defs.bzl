"""Macros of tfpipe's generated BUILD files (tools/build_targets.py).

They spell out once what every package or test would otherwise repeat:

    package_init(testonly = True, deps = ["//tests:init"])
    pytest_test(
        name = "schedule_test",
        deps = [":init", "//tfpipe/gpipe:schedule"],
    )

tests/build_test.py runs this file as Python, with a stand-in `native`, to
expand the macros when it checks the BUILD files: keep to what Starlark and
Python share.
"""

PYTEST_MAIN = "//tests:bazel_pytest_main.py"
PYTEST_SUPPORT = "//tests:pytest_support"

def package_init(deps = [], **kwargs):
    """`:init`, the py_library of the package's `__init__.py`."""
    native.py_library(
        name = "init",
        srcs = ["__init__.py"],
        deps = deps,
        **kwargs
    )

def pytest_test(name, deps = [], data = [], library = False, **kwargs):
    """A py_test that runs `<name>.py` of this package under pytest.

    Its main is tests/bazel_pytest_main.py, given the test file's workspace
    path, so tests/conftest.py and setup.cfg apply as under plain pytest.

    Args:
      name: the test file's name without `.py`, e.g. "schedule_test".
      deps: what the test imports; `//tests:pytest_support` is added.
      data: files the test reads.
      library: also make `<name>_lib`, a testonly py_library of the file
        with the same deps and data, for other tests that import it.
      **kwargs: more py_test attributes (size, tags, ...).
    """
    if library:
        native.py_library(
            name = name + "_lib",
            srcs = [name + ".py"],
            data = data,
            testonly = True,
            deps = deps,
        )
    native.py_test(
        name = name,
        srcs = [name + ".py", PYTEST_MAIN],
        main = PYTEST_MAIN,
        args = [native.package_name() + "/" + name + ".py"],
        data = data,
        deps = deps + [PYTEST_SUPPORT],
        **kwargs
    )
