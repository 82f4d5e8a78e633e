"""The vocabulary every layer speaks: errors and their classification, the stores' outage
budgets, retry policies, run tags, settings, the load target, and the one module of
private Dagster names. Imports only the warehouse's tables."""
