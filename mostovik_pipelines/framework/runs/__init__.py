"""Runs as business jobs: claims, the in-flight check, tags, the job view, recovery and alerts."""
