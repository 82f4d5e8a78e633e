"""The operator's side of the command line: ``mostovik jobs list / show / rerun``.

An operator's action is a run like any other: ``rerun`` picks the partitions of a range by
their state (:mod:`.selection`), shows them first with ``--dry-run``, submits exactly that set to
the instance's run queue as a backfill the daemon launches (:mod:`.submission`), and signs every
run with who asked for it and why (:mod:`.signature`).
"""
