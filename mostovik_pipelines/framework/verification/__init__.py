"""Proof on demand: does the table still hold exactly what the source says for a period?

For each partition, the rows the source gives, parsed and validated exactly as a load would
(:mod:`.source_rows`), are compared with what the table stores (:mod:`.compare`), writing
nothing anywhere: not the warehouse, not run storage, not the landing store. Against

* ``source``: the source is asked again, through the source's own resource, with the retries of
  its extract step and the page-by-page walk of a sync; nothing it answers is landed;
* ``landed``: the payload the stored rows came from (the ledger names it, the landing store
  keeps it), so no request leaves the machine: what a hand edit changed shows, a correction the
  source made since does not.

A verdict names keys missing from the table, keys it holds that the source does not send,
values that differ (column, stored value, the source's value), and rows the source still sends
that a load quarantines. :mod:`.schedule` runs it over each source's lookback as a job and
records a failed ``matches_source`` check per differing partition, with one alert each.
"""
