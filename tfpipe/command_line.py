"""How tfpipe's programs refuse: one `ERROR:` line and exit status 1.

absl's `app.run` answers an `app.UsageError` with the main module's
docstring and its flags, then the reason: for the launcher and the workers
that is some fifty lines above the one that matters, and the reader has to
find it at the bottom. `Run(main)` runs an absl main so that a refusal
prints only `ERROR: <reason>`; `--helpshort` and `--helpfull` still show the
docstring and the flags for whoever asks.
"""

import sys

from absl import app


def Run(main):
  """app.run(main), with an app.UsageError printed as one ERROR line."""

  def MainWithShortErrors(argv):
    try:
      return main(argv)
    except app.UsageError as e:
      print(f'ERROR: {e}', file=sys.stderr, flush=True)
      return e.exitcode

  app.run(MainWithShortErrors)
