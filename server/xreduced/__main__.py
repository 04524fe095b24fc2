"""``python -m xreduced``: run the daemon."""

from xreduced.cli import main

raise SystemExit(main())
