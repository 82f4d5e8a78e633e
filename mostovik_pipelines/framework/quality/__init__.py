"""Data quality: validation before a load, checks after it, quarantine of refused rows."""
