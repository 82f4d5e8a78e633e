"""Warehouse tables, their column types, and the migrations that create them."""
