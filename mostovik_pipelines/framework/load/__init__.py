"""The partition loader: :func:`.partition.load_partition` and what it calls, in one direction
(its SQL in :mod:`.sql`, rows in and out of the server in :mod:`.transfer`, the ledger of partition
loads in :mod:`.ledger`, the business lock in :mod:`.lock`). Nothing is imported here, so that
the ledger or the lock can be used without the loader's libraries."""
