"""Material delivery reports from construction sites (a file job): what each site received, one
row per waybill line, keyed by waybill number and line number.

The reports are read by :mod:`mostovik_pipelines.sources.material_deliveries.report` (their
format, and what is refused unread), imported by the transform step.
"""

from __future__ import annotations

from dagster import BackfillPolicy, DynamicPartitionsDefinition
from sqlalchemy import Column, Date, Index, Integer, String

from mostovik_pipelines.core.load_target import KeyHeldElsewhere, LoadMode
from mostovik_pipelines.core.retries import RetryPolicy
from mostovik_pipelines.core.settings import data_dir, setting
from mostovik_pipelines.framework.assets.inbox_sensor import new_file_versions_sensor
from mostovik_pipelines.framework.quality.shape import NUMBER, SourceShape, ValueKind, expect
from mostovik_pipelines.framework.spec import CatchUpPolicy, JobType, LoadedPartition, SourceSpec
from mostovik_pipelines.resources.inbox import InboxResource, file_name_of
from mostovik_pipelines.sources.material_deliveries.parse import MAX_FILE_BYTES, extract, transform
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal

material_deliveries_file_versions = DynamicPartitionsDefinition(
    name="material_deliveries_file_versions")
"""One partition per delivery report file version, ``<name>@<hash>``, added by the sensor."""

material_deliveries = warehouse_table(
    "material_deliveries",
    Column("delivery_date", Date, nullable=False),
    Column("object_code", String(64), nullable=False, comment="construction site or bridge"),
    Column("waybill", String(64), nullable=False,
           comment="waybill number as written (leading zeros kept)"),
    Column("line_no", Integer, nullable=False, comment="line of the waybill"),
    Column("material", String(500), nullable=False),
    Column("unit", String(32), nullable=False),
    Column("quantity", ExactDecimal(), nullable=False, comment="exact, as reported"),
    Column("price", ExactDecimal(), nullable=False, comment="roubles per unit, exact"),
    Column("supplier", String(500), nullable=False),
    Column("source_file", String(255), nullable=False,
           comment="the report's file name as it was in the inbox"),
    Column("file_version", String(300), nullable=False,
           comment="<file name>@<content hash>: the version the row came from"),
    Index("ix_material_deliveries_source_file", "source_file"),
    natural_key=("waybill", "line_no"),
)

TEXT = ValueKind.TEXT
SHAPE = SourceShape((
    # Text dates, date cells, or Excel day counts.
    expect("Дата поставки", ValueKind.DATE_DMY, ValueKind.DATE_ISO, ValueKind.DATETIME,
           ValueKind.INTEGER),
    expect("Объект", TEXT, ValueKind.INTEGER),
    expect("Накладная", TEXT, ValueKind.INTEGER),
    expect("Строка", ValueKind.INTEGER),
    expect("Материал", TEXT),
    expect("Ед. изм.", TEXT),
    expect("Количество", NUMBER),
    expect("Цена", NUMBER),
    expect("Поставщик", TEXT),
))
"""The report template's columns, by header (matched whatever its case and spacing; their
order does not count). A column a site adds loads as usual and warns (a file's default,
``warn``): sites add notes beside the table."""


def archive_loaded_file(loaded: LoadedPartition) -> None:
    loaded.resource.archive(loaded.partition_key, loaded.outcome, loaded.run_id)


SOURCE = SourceSpec(
    name="material_deliveries",
    job_type=JobType.FILE,
    description=__doc__.split("\n\n")[0].replace("\n", " "),
    partitions_def=material_deliveries_file_versions,
    table=material_deliveries,
    natural_key=("waybill", "line_no"),
    partition_column="source_file",
    partition_value=file_name_of,
    key_held_elsewhere=KeyHeldElsewhere.REJECT,
    load_mode=LoadMode.REPLACE_PARTITION,
    extract=extract,
    transform=transform,
    resource=InboxResource(
        inbox_dir=setting("MOSTOVIK_INBOX_DIR", str(data_dir() / "inbox")),
        archive_dir=setting("MOSTOVIK_ARCHIVE_DIR", str(data_dir() / "archive")),
        max_file_bytes=MAX_FILE_BYTES,
    ),
    sensor=new_file_versions_sensor,
    # A version whose run failed on a transient error is asked for again for a week.
    catch_up=CatchUpPolicy.from_settings("MOSTOVIK_DELIVERIES", lookback_days=7),
    after_load=archive_loaded_file,
    extract_retry=RetryPolicy(max_attempts=3, base_delay_seconds=1.0),
    max_rejected_share=0.2,
    backfill_policy=BackfillPolicy.single_run(),
    max_runtime_seconds=30 * 60,
    # Files arrive when sites send them: no freshness policy, every new version is a run.
    protocol="file",
    shape=SHAPE,
)
