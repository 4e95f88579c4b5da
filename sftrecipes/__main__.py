"""The command line: `python -m sftrecipes VERB` from the repository root, or `python PATH/TO/sftrecipes VERB` from any
directory (nothing to install: run as a folder, the package puts its parent on the import path itself)."""

import sys

if __package__:
    from .cli import main
else:  # `python /path/to/sftrecipes ...`: sys.path[0] is this folder; import the package from its parent instead
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parent.parent)
    from sftrecipes.cli import main

sys.exit(main())
