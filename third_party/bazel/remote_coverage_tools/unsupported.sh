#!/bin/sh
echo "tfpipe: bazel coverage is not supported (offline stand-in for @remote_coverage_tools)." >&2
exit 1
