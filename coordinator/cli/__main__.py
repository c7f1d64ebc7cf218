"""``python -m coordinator.cli`` runs the ``specfleet`` command line."""

from coordinator.cli import main

main()
