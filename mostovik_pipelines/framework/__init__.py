"""The machinery every source shares; it knows no particular source."""
