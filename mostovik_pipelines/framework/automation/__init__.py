"""Unattended operation: where each partition stands in run storage, and what the schedules and
sensors ask for again so that the runs nobody launches by hand add up to every period's data."""
