"""Excel's day counts: a date typed into a cell as a plain number, in the workbook's 1900 or 1904
date system."""

from __future__ import annotations

import contextlib
from datetime import date, timedelta

# Excel's 1900 date system counts a 29 February 1900 that never was (serial 60), so the serials
# of real dates start from 30 December 1899; nobody delivered anything before March 1900.
EXCEL_EPOCH = date(1899, 12, 30)
EXCEL_1904_EPOCH = date(1904, 1, 1)
FIRST_REAL_1900_SERIAL = 61


def excel_serial_date(serial: float, date_1904: bool) -> date:
    """A date typed as a plain number: Excel's day count (its date cells arrive as dates)."""
    epoch, first = (EXCEL_1904_EPOCH, 0) if date_1904 else (EXCEL_EPOCH, FIRST_REAL_1900_SERIAL)
    with contextlib.suppress(ValueError, OverflowError):  # NaN, infinity, past the year 9999
        days = int(serial)
        if days >= first:
            return epoch + timedelta(days=days)
    raise ValueError("is not an Excel date")
