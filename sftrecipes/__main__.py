"""The command line: `python -m sftrecipes VERB` from the repository root, or `python PATH/TO/sftrecipes VERB` from any
directory (nothing to install: run as a folder, the package puts its parent on the import path itself)."""

import sys

if __package__:
    from sftrecipes.core import forks as forkserver
else:  # `python /path/to/sftrecipes ...`: sys.path[0] is this folder; import the package from its parent instead
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    from sftrecipes.core import forks as forkserver

# the test suite, the sweep: run as a fork of a process that has imported torch & co. (its launches' processes too)
forkserver.exit_in_fork(["-m", "sftrecipes", *sys.argv[1:]], keep_env=True)

from sftrecipes.cli import main  # noqa: E402

sys.exit(main())
