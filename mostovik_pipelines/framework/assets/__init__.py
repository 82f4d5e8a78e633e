"""Declaration -> Dagster: each source's asset, job, schedule and sensor, and how they read in
the UI."""
