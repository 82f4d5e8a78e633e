"""What the three ops of every source do when they run (the factory only declares them).

* :mod:`.lifecycle` - around every step: the run's claim, its status tag, the concurrent-run
  policy, retry or set aside;
* :mod:`.extract`, :mod:`.transform`, :mod:`.load` - each op's work, partition by partition;
* :mod:`.reexecution` - what a re-execution takes from the runs it repeats;
* :mod:`.outcomes` - what one step hands to the next, per partition;
* :mod:`.sync_progress` - a paged partition's progress checkpoint (where a sync resumes).

A run process imports these when its first step starts: loading the code location (a code
server, the daemon, a sensor) does not pay for pandas, pyarrow or the database drivers.
"""
