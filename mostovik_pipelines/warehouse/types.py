"""Column types that keep their promise on every backend."""

from __future__ import annotations

from decimal import Decimal

from sqlalchemy import Numeric, String
from sqlalchemy.types import TypeDecorator


class ExactDecimal(TypeDecorator):
    """Money and rates, exact everywhere: ``NUMERIC`` (scale as published) on PostgreSQL; on
    SQLite, which has no exact decimal type, the decimal's text, so a value read back equals the
    value published digit for digit."""

    impl = Numeric
    cache_ok = True

    def load_dialect_impl(self, dialect):
        if dialect.name == "sqlite":
            return dialect.type_descriptor(String())
        return dialect.type_descriptor(Numeric(asdecimal=True))

    def process_bind_param(self, value, dialect):
        if value is None:
            return None
        if dialect.name == "sqlite":
            return format(Decimal(value), "f")
        return Decimal(value)

    def process_result_value(self, value, dialect):
        return None if value is None else Decimal(value)
