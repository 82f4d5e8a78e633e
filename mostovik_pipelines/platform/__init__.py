"""A run's life on a deployment: its claims (the fence every store checks before it
writes), its steps in flight, its ADR status and the tracker that reads it, recovery,
the executor and the instance's storage. Imports only the vocabulary."""
