"""``python -m multihead`` runs the command line (see :mod:`multihead.cli`)."""

from .cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
