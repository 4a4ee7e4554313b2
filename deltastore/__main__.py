"""``python -m deltastore``: the command line."""

from deltastore.cli import main

raise SystemExit(main())
