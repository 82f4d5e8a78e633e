"""Keeping storage bounded over months of operation: the retention policy of each store the
project writes to, and the prune that applies it (the ``prune_storage_job`` of the code
location, daily, and ``mostovik prune``). It knows no source.

* :mod:`.policy`: how long each store keeps what, from the environment; what a prune removed.
* :mod:`.runs`: run storage, and the facts about runs every other rule depends on (which runs
  are finished, which a recovery path may still use, which hold a partition's latest state).
* :mod:`.files`: the op-output storage and the landing store.
* :mod:`.prune`: the order the rules are applied in, and why it is safe to kill at any point.
* :mod:`.job`: the Dagster job and schedule.
"""
