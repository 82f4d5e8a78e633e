"""The rules a source used to learn only by failing: each refused at declaration or load time
with the source, the column and the fix, or made to disappear by converting what has one
obvious meaning."""

from __future__ import annotations

import dataclasses
import re
from datetime import date
from decimal import Decimal

import pandas as pd
import pytest
from dagster import DynamicPartitionsDefinition
from sqlalchemy import Column, Date, DateTime, Integer, MetaData, String, Table, create_engine

from mostovik_pipelines.core.errors import (
    ConfigurationError,
    DataValidationError,
    SourceContractError,
)
from mostovik_pipelines.core.load_target import KeyHeldElsewhere
from mostovik_pipelines.framework.load.partition import load_partition
from mostovik_pipelines.framework.quality.validation import validate_partition
from mostovik_pipelines.sources.cbr_metal_prices import SOURCE as METALS
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal
from mostovik_pipelines_tests.support.warehouse import create_tables

DAY = "2026-11-04"
WHERE = re.escape(
    "source cbr_metal_prices (mostovik_pipelines/sources/cbr_metal_prices/source.py)")


def metals_table(*columns, natural_key=("price_date", "metal_code")) -> Table:
    return warehouse_table("metals_variant", *columns, natural_key=natural_key,
                           in_metadata=MetaData())


def prices(**overrides) -> pd.DataFrame:
    return pd.DataFrame({"price_date": [date(2026, 11, 4)] * 2, "metal_code": [1, 2],
                         "buy": [Decimal("5837.39"), Decimal("70.1")],
                         "sell": [Decimal("5837.39"), Decimal("70.1")]} | overrides)


# --- at declaration --------------------------------------------------------------------------


def test_a_partition_column_that_is_neither_a_date_nor_a_string_is_refused():
    table = metals_table(Column("price_date", Integer, nullable=False),
                         Column("metal_code", Integer, nullable=False))
    with pytest.raises(ValueError, match=(
            rf"{WHERE}: partition column 'price_date' is Integer\(\); a partition column is a "
            r"Date \(a daily partition's day\) or a String")):
        dataclasses.replace(METALS, table=table)


def test_a_date_partition_column_with_keys_that_are_not_days_is_refused():
    with pytest.raises(ValueError, match="is a Date but the partition keys are not days"):
        dataclasses.replace(METALS, partitions_def=DynamicPartitionsDefinition(name="x"))


def test_a_natural_key_that_is_not_the_tables_unique_key_is_refused():
    with pytest.raises(ValueError, match=(
            r"natural_key \['metal_code', 'price_date'\] is not a unique constraint of "
            r"cbr_metal_prices \(it has \[\['price_date', 'metal_code'\]\]\)")):
        dataclasses.replace(METALS, natural_key=("metal_code", "price_date"))


def test_a_table_without_the_bookkeeping_is_refused():
    plain = Table("plain", MetaData(), Column("price_date", Date), Column("metal_code", Integer))
    with pytest.raises(ValueError, match=r"lacks the load bookkeeping .* build it with "
                                         r"warehouse_table"):
        dataclasses.replace(METALS, table=plain)


def test_a_key_without_the_partition_column_must_say_what_a_key_held_elsewhere_does():
    table = metals_table(Column("price_date", Date, nullable=False),
                         Column("metal_code", Integer, nullable=False),
                         natural_key=("metal_code",))
    with pytest.raises(ValueError, match=(
            r"the natural key \['metal_code'\] does not include the partition column "
            r"'price_date', so .* every load of metals_variant must run alone\. Add "
            r"'price_date' to the natural key, or declare .* key_held_elsewhere=")):
        dataclasses.replace(METALS, table=table, natural_key=("metal_code",))
    declared = dataclasses.replace(METALS, table=table, natural_key=("metal_code",),
                                   key_held_elsewhere=KeyHeldElsewhere.MOVE)
    assert declared.load_target.key_held_elsewhere is KeyHeldElsewhere.MOVE


def test_max_rejected_share_must_be_declared():
    with pytest.raises(ValueError, match=rf"{WHERE}: declare max_rejected_share, .* 0\.0 means "
                                         "one unreadable row fails the run"):
        dataclasses.replace(METALS, max_rejected_share=None)


def test_one_bad_row_at_a_zero_share_says_how_to_allow_a_few():
    frame = prices(metal_code=[1, None])
    with pytest.raises(DataValidationError, match="max_rejected_share is 0: raise it"):
        validate_partition(frame, METALS.load_target, DAY, 0.0)


# --- at load time ----------------------------------------------------------------------------


def test_pandas_timestamps_in_a_date_column_become_dates_and_count_in_their_partition():
    validated = validate_partition(prices(price_date=pd.to_datetime([DAY, DAY])),
                                   METALS.load_target, DAY, 0.25)
    assert validated.rejected == ()
    assert list(validated.frame["price_date"]) == [date(2026, 11, 4)] * 2


def test_times_of_day_in_a_date_column_are_refused_naming_the_column():
    with pytest.raises(SourceContractError, match=(
            r"column price_date of cbr_metal_prices is a Date but holds times of day .* "
            r"datetime\.date values")):
        timestamps = pd.to_datetime([f"{DAY} 15:30", DAY], format="ISO8601")
        validate_partition(prices(price_date=timestamps), METALS.load_target, DAY, 0.25)


def test_text_in_a_date_column_is_refused_naming_the_column():
    with pytest.raises(SourceContractError, match=r"column price_date .* holds string values"):
        validate_partition(prices(price_date=[DAY, DAY]), METALS.load_target, DAY, 0.25)


def test_floats_in_an_exact_decimal_column_become_decimals_of_their_shortest_text():
    validated = validate_partition(prices(buy=[5837.39, 70.1], sell=[5837, 70]),
                                   METALS.load_target, DAY, 0.25)
    assert list(validated.frame["buy"]) == [Decimal("5837.39"), Decimal("70.1")]
    assert list(validated.frame["sell"]) == [Decimal("5837"), Decimal("70")]


def test_text_in_an_exact_decimal_column_is_refused_naming_the_column_and_the_fix():
    with pytest.raises(SourceContractError, match=(
            r"column buy of cbr_metal_prices is an exact decimal but holds string values "
            r"\(e\.g\. '5837,39'\): give it decimal\.Decimal values")):
        validate_partition(prices(buy=["5837,39", "70,1"]), METALS.load_target, DAY, 0.25)


def test_an_empty_payload_is_refused_unless_the_source_declares_it_legitimate():
    empty = prices().iloc[0:0]
    strict = dataclasses.replace(METALS, empty_payload_is_valid=False)
    with pytest.raises(SourceContractError, match=(
            r"the payload holds no rows: loaded, it would delete every row of partition "
            r"2026-11-04 in cbr_metal_prices\. .* declare empty_payload_is_valid=True")):
        validate_partition(empty, strict.load_target, DAY, 0.25)
    assert validate_partition(empty, METALS.load_target, DAY, 0.25).frame.empty


def test_a_table_whose_migration_skipped_the_conventions_names_the_fix(pg_warehouse_url):
    bare = Table("no_conventions", MetaData(),
                 Column("price_date", Date, nullable=False),
                 Column("metal_code", Integer, nullable=False),
                 Column("buy", ExactDecimal(), nullable=False),
                 Column("sell", ExactDecimal(), nullable=False),
                 *(Column(name, String(64), nullable=False)
                   for name in ("loaded_by_run", "changed_by_run")),
                 *(Column(name, DateTime(timezone=True), nullable=False)
                   for name in ("loaded_at", "changed_at")))
    create_tables(pg_warehouse_url, bare.metadata)
    target = dataclasses.replace(METALS.load_target, table=bare)
    engine = create_engine(pg_warehouse_url)
    try:
        with pytest.raises(ConfigurationError, match=(
                r"table no_conventions has no default for loaded_by_run: its migration did not "
                r"apply the PostgreSQL conventions .*mostovik new-source NAME --migration-only")):
            load_partition(engine, target, prices(), DAY, "run-1")
    finally:
        engine.dispose()
